"""``pgflow backfill``: re-run a job over a time range, and list, show or cancel backfills."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

import click

from pgflow.cli._base import (
    Ctx,
    emit_json,
    emit_table,
    fetch_job,
    json_option,
    parse_logical_time,
    pass_ctx,
)

BACKFILL_COLUMNS = ["id", "job", "range_start", "range_end", "max_concurrency", "state",
                    "ticks", "skipped", "progress"]


@click.command("backfill")
@click.argument("target", metavar="NAME|list|show|cancel")
@click.argument("backfill_id", metavar="[ID]", required=False, type=int)
@click.option("--start", callback=parse_logical_time, help="First logical time (inclusive).")
@click.option("--end", callback=parse_logical_time, help="Last logical time (exclusive).")
@click.option("--max-concurrency", type=click.IntRange(1, 10_000), default=2, show_default=True,
              help="Runs of this backfill running at once.")
@click.option("--downstream", is_flag=True, help="Also run the job's downstream jobs.")
@click.option("--reprocess", type=click.Choice(["none", "failed", "all"]), default="none",
              show_default=True,
              help="Existing ticks: skip them (none), re-run the failed ones, or re-run all.")
@json_option
@pass_ctx
def backfill_command(ctx: Ctx, target: str, backfill_id: int | None, start: datetime | None,
                     end: datetime | None, max_concurrency: int, downstream: bool,
                     reprocess: str, as_json: bool) -> None:
    """Re-run job NAME for every tick in [--start, --end); or list, show ID, cancel ID.

    With --start/--end the first argument is always a job name (even a job named 'list').
    """
    creating = start is not None or end is not None
    if not creating and target in ("list", "show", "cancel"):
        _backfill_action(ctx, target, backfill_id, as_json)
        return
    if start is None or end is None:
        raise click.UsageError("backfill needs NAME --start ISO --end ISO"
                               " (or: backfill list | show ID | cancel ID)")
    if backfill_id is not None:
        raise click.UsageError(f"unexpected argument {backfill_id} after the job name")
    _backfill_create(ctx, target, start, end, max_concurrency, downstream, reprocess, as_json)


def _backfill_create(ctx: Ctx, name: str, start: datetime, end: datetime,
                     max_concurrency: int, downstream: bool, reprocess: str,
                     as_json: bool) -> None:
    from pgflow import backfill

    conn = ctx.conn()
    job = fetch_job(ctx, name)
    ticks = (backfill.plan_ticks(job["schedule"], job["timezone"], start, end)
             if job["schedule"] else [])
    with click.progressbar(length=max(len(ticks), 1), label=f"backfilling {name}",
                           file=sys.stderr, show_pos=True) as bar:
        made = backfill.create(conn, name, start, end, max_concurrency=max_concurrency,
                               downstream=downstream, reprocess=reprocess,
                               progress=bar.update)
    if as_json:
        emit_json(made)
    else:
        again = f" {made['reprocessed']} re-run," if made["reprocessed"] else ""
        click.echo(f"backfill {made['id']}: {made['created']} run(s) created,{again}"
                   f" {made['skipped']} tick(s) skipped (already had a run)")


def _backfill_action(ctx: Ctx, action: str, backfill_id: int | None, as_json: bool) -> None:
    from pgflow import backfill

    if action == "list":
        rows = [_with_progress(r) for r in backfill.list_backfills(ctx.conn())]
        if as_json:
            emit_json(rows)
        else:
            emit_table(rows, BACKFILL_COLUMNS)
        return
    if backfill_id is None:
        raise click.UsageError(f"backfill {action} needs an ID (see 'pgflow backfill list')")
    if action == "cancel":
        result = backfill.cancel(ctx.conn(), backfill_id)
        click.echo(f"backfill {backfill_id} cancelled: {result['cancelled']} run(s) cancelled,"
                   f" {result['stopping']} running run(s) asked to stop")
        return
    row = _with_progress(backfill.show(ctx.conn(), backfill_id))
    if as_json:
        emit_json(row)
        return
    for key in [*BACKFILL_COLUMNS, "downstream", "created_at", "finished_at"]:
        click.echo(f"{key + ':':<16} {row[key] if row[key] is not None else '-'}")
    click.echo("runs:           " + (", ".join(
        f"{k} {v}" for k, v in sorted(row["counts"].items())) or "-"))


def _with_progress(row: dict[str, Any]) -> dict[str, Any]:
    counts = row["counts"]
    done = sum(counts.get(s, 0) for s in ("succeeded", "failed", "cancelled", "upstream_failed"))
    return {**row, "progress": f"{done}/{sum(counts.values())}"}
