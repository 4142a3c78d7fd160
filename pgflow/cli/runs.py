"""``pgflow runs``: list and show runs, and retry, cancel or acknowledge one."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import click

from pgflow import datasets, runs
from pgflow.cli._base import Ctx, emit_json, emit_table, json_option, pass_ctx


@click.group("runs")
def runs_group() -> None:
    """Inspect runs and act on them (retry, cancel, acknowledge)."""


RUN_ID = click.argument("run_id", metavar="ID", type=int)
RUN_COLUMNS = ["id", "job", "logical_time", "state", "attempt", "trigger", "tenant",
               "started_at", "finished_at"]


@runs_group.command("list")
@click.option("--job", help="Only this job's runs.")
@click.option("--state", help="Only runs in this state.")
@click.option("--tenant", help="Only this tenant's runs.")
@click.option("--limit", type=click.IntRange(1, 100_000), default=100, show_default=True)
@json_option
@pass_ctx
def runs_list(ctx: Ctx, job: str | None, state: str | None, tenant: str | None, limit: int,
              as_json: bool) -> None:
    """List runs, newest first."""
    rows = runs.list_runs(ctx.conn(), job=job, state=state, tenant=tenant, limit=limit)
    if as_json:
        emit_json(rows)
    else:
        emit_table(rows, RUN_COLUMNS)


@runs_group.command("show")
@RUN_ID
@json_option
@pass_ctx
def runs_show(ctx: Ctx, run_id: int, as_json: bool) -> None:
    """Show one run and its attempts."""
    run = runs.show_run(ctx.conn(), run_id)
    events = (datasets.run_events(ctx.conn(), run_id)[0] if run.get("trigger") == "dataset"
              else [])
    if as_json:
        emit_json({**run, "trigger_events": events})
        return
    attempts = run.pop("attempts")
    params = run.pop("params")
    for key, value in run.items():
        click.echo(f"{key + ':':<18} {_human(value)}")
    click.echo(f"{'params:':<18} {json.dumps(params)}")
    click.echo("attempts:")
    for attempt in attempts:
        attempt["error"] = (attempt["error"] or "").strip().split("\n")[0] or None
    emit_table(attempts, ["attempt", "worker_id", "started_at", "finished_at", "outcome",
                          "exit_code", "error"])
    if events:  # why a dataset-triggered run fired
        click.echo("trigger events:")
        emit_table(events, ["id", "dataset", "key", "producer_run_id", "created_at"])


def _human(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S%z")
    return str(value)


@runs_group.command("retry")
@RUN_ID
@pass_ctx
def runs_retry(ctx: Ctx, run_id: int) -> None:
    """Queue a failed or cancelled run again, with a fresh attempt budget."""
    click.echo(runs.retry_message(run_id, runs.retry(ctx.conn(), run_id)))


@runs_group.command("cancel")
@RUN_ID
@pass_ctx
def runs_cancel(ctx: Ctx, run_id: int) -> None:
    """Cancel a run; a running one is stopped by its worker within seconds."""
    result = runs.cancel(ctx.conn(), run_id)
    if result["outcome"] == "cancelled":
        click.echo(f"run {run_id} cancelled")
    else:
        click.echo(f"run {run_id} cancel requested; worker {result['lease_owner']} stops it")


@runs_group.command("ack")
@RUN_ID
@pass_ctx
def runs_ack(ctx: Ctx, run_id: int) -> None:
    """Acknowledge a failed run (it leaves the dead-letter list)."""
    runs.ack(ctx.conn(), run_id)
    click.echo(f"run {run_id} acknowledged")
