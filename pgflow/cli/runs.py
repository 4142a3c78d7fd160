"""``pgflow runs``: list and show runs, and retry, cancel or acknowledge one."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import click

from pgflow import datasets, runs
from pgflow.cli._base import Ctx, emit_json, emit_table, json_option, pass_ctx
from pgflow.errors import NotFound


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


@runs_group.command("rerun")
@RUN_ID
@click.option("--downstream", is_flag=True,
              help="Also run its downstream runs at the same logical time again, after it.")
@pass_ctx
def runs_rerun(ctx: Ctx, run_id: int, downstream: bool) -> None:
    """Run a finished run again as its next attempt, from a clean start (no checkpoint)."""
    from pgflow import rerun

    click.echo(rerun.rerun_message(run_id, rerun.rerun(ctx.conn(), run_id,
                                                       downstream=downstream)))


@runs_group.command("logs")
@RUN_ID
@click.option("--attempt", type=click.IntRange(1, 2**31 - 1),
              help="Which attempt (default: the latest).")
@click.option("--follow", "-f", is_flag=True,
              help="Keep printing new output until the attempt ends (like tail -f).")
@pass_ctx
def runs_logs(ctx: Ctx, run_id: int, attempt: int | None, follow: bool) -> None:
    """Print an attempt's output (stdout, stderr and pgflow's notes), live while it runs."""
    import sys
    import time

    from pgflow import live

    conn = ctx.conn()
    offset = 0
    out = sys.stdout.buffer
    while True:
        try:
            page = live.read_output(conn, run_id, attempt, offset)
        except NotFound:
            if not (follow and attempt is None and _waiting(conn, run_id)):
                raise
            time.sleep(1.0)  # --follow of a run that has not started yet: wait for it
            continue
        attempt = page.attempt
        if page.data:
            out.write(page.data)
            out.flush()
        if page.next_offset > offset:
            offset = page.next_offset
            continue  # more may be stored already
        if not follow or not page.running:
            return
        time.sleep(1.0)


def _waiting(conn: Any, run_id: int) -> bool:
    row = conn.execute("SELECT state FROM pgflow.runs WHERE id = %s", (run_id,)).fetchone()
    return row is not None and row["state"] in ("pending", "queued", "retrying")


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
