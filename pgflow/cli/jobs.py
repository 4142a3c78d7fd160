"""``pgflow jobs``: list, show, pause, resume and delete registered jobs."""

from __future__ import annotations

import json

import click

from pgflow.cli._base import Ctx, emit_json, emit_table, fetch_job, json_option, pass_ctx


@click.group("jobs")
def jobs_group() -> None:
    """Inspect and control registered jobs."""


@jobs_group.command("list")
@click.option("--tenant", help="Only this tenant's jobs.")
@click.option("--limit", type=click.IntRange(1, 1_000_000), default=100_000, show_default=True)
@json_option
@pass_ctx
def jobs_list(ctx: Ctx, tenant: str | None, limit: int, as_json: bool) -> None:
    """List jobs."""
    rows = ctx.rows("list_jobs", {"tenant": tenant, "limit": limit})
    if as_json:
        emit_json(rows)
    else:
        emit_table(rows, ["name", "tenant", "schedule", "timezone", "paused", "next_fire_at",
                          "depends_on"])


@jobs_group.command("show")
@click.argument("name")
@json_option
@pass_ctx
def jobs_show(ctx: Ctx, name: str, as_json: bool) -> None:
    """Show one job's definition and state."""
    row = fetch_job(ctx, name)
    if as_json:
        emit_json(row)
        return
    definition = row.pop("definition")
    for key, value in row.items():
        click.echo(f"{key + ':':<14} {value if value not in (None, []) else '-'}")
    click.echo("definition:")
    click.echo(json.dumps(definition, indent=2))


def _set_paused(ctx: Ctx, name: str, paused: bool) -> None:
    from pgflow import registry  # pydantic and croniter: not for `jobs list`

    registry.set_paused(ctx.conn(), name, paused)
    click.echo(f"{name} {'paused' if paused else 'resumed'}")


@jobs_group.command("pause")
@click.argument("name")
@pass_ctx
def jobs_pause(ctx: Ctx, name: str) -> None:
    """Stop creating scheduled runs of a job."""
    _set_paused(ctx, name, True)


@jobs_group.command("resume")
@click.argument("name")
@pass_ctx
def jobs_resume(ctx: Ctx, name: str) -> None:
    """Resume a paused job (missed ticks follow its catchup setting)."""
    _set_paused(ctx, name, False)


@jobs_group.command("delete")
@click.argument("name")
@pass_ctx
def jobs_delete(ctx: Ctx, name: str) -> None:
    """Delete a job; its run history stays, its unstarted runs are cancelled."""
    from pgflow import registry

    registry.delete(ctx.conn(), name)
    click.echo(f"{name} deleted")
