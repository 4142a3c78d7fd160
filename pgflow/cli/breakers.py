"""``pgflow breakers``: list circuit breakers, open and close them by hand."""

from __future__ import annotations

import click

from pgflow import breakers
from pgflow.cli._base import Ctx, emit_json, emit_table, json_option, pass_ctx


@click.group("breakers")
def breakers_group() -> None:
    """Circuit breakers, one per source."""


@breakers_group.command("list")
@json_option
@pass_ctx
def breakers_list(ctx: Ctx, as_json: bool) -> None:
    """Every known source's breaker, not-closed ones first."""
    rows = breakers.list_breakers(ctx.conn())
    if as_json:
        emit_json(rows)
    else:
        emit_table(rows, ["source", "state", "failures", "failure_threshold", "cooldown_s",
                          "half_open_at", "manual", "held_runs", "jobs", "reason"])


@breakers_group.command("open")
@click.argument("source")
@click.option("--reason", help="Why (shown in the UI and status).")
@json_option
@pass_ctx
def breakers_open(ctx: Ctx, source: str, reason: str | None, as_json: bool) -> None:
    """Open SOURCE's breaker by hand: its jobs' runs are held until it is closed."""
    row = breakers.open_breaker(ctx.conn(), source, reason, "cli")
    emit_json(row) if as_json else click.echo(f"breaker of {source} opened")


@breakers_group.command("close")
@click.argument("source")
@click.option("--reason", help="Why (shown in the UI and status).")
@json_option
@pass_ctx
def breakers_close(ctx: Ctx, source: str, reason: str | None, as_json: bool) -> None:
    """Close SOURCE's breaker: its held runs are released."""
    row = breakers.close_breaker(ctx.conn(), source, reason, "cli")
    emit_json(row) if as_json else click.echo(f"breaker of {source} closed")
