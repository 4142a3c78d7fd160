"""Backfills: re-process history without hurting the production schedule.

A backfill creates one run per cron tick of a job in ``[start, end)`` (ticks that
already have a run are skipped and counted), all ``pending`` with
``trigger = 'backfill'`` and a priority far below scheduled work. The leader
releases them into the queue ``max_concurrency`` at a time, so a 10,000-tick
backfill never holds more than that many worker slots, and production runs,
which sort first in the claim, start on time even while it drains.

With ``--downstream`` each tick starts a DAG run: the other roots of the DAG are
held and released like the job's own ticks (they count against the same cap),
and the downstream runs are ``pending`` on their upstreams. A downstream run
whose upstreams already ran at that tick (the job's tick was skipped) is ready at
once; it is held and released like a tick (trigger ``backfill``), so the cap
also covers a backfill of jobs added downstream later.

The held runs of a backfill are those ``pending`` with trigger ``backfill``
while the backfill is running; dependency evaluation leaves them to the release.
A backfill completes in the transaction that ends its last run (worker, reaper,
cancel, registration); the safety net completes any that were missed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pgflow import deps
from pgflow.cron import parse_cron
from pgflow.errors import Conflict, NotFound, PgflowError
from pgflow.queries import q

# Below any job priority (those are within ±1,000,000).
BACKFILL_PRIORITY_OFFSET = -2_000_001
CHUNK = 1000
MAX_TICKS = 1_000_000


def plan_ticks(schedule: str, timezone: str, start: datetime, end: datetime) -> list[datetime]:
    if start >= end:
        raise PgflowError("--start must be before --end")
    ticks = []
    for tick in parse_cron(schedule, timezone).ticks_between(start, end):
        ticks.append(tick)
        if len(ticks) > MAX_TICKS:
            raise PgflowError(f"more than {MAX_TICKS:,} ticks in that range: split it up")
    return ticks


def create(
    conn: psycopg.Connection[Any], job: str, start: datetime, end: datetime, *,
    max_concurrency: int = 2, downstream: bool = False, reprocess: str = "none",
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Create a backfill and all its runs in one transaction; ``progress(n)`` is called
    after each chunk of ``n`` ticks. ``reprocess`` (none|failed|all): existing ticks that
    failed, or all finished ones, are re-run by this backfill too (its cap, its
    priority; pgflow/rerun.py); active ones are always skipped."""
    from pgflow.rerun import REPROCESS

    if reprocess not in REPROCESS:
        raise PgflowError(f"reprocess must be one of none, failed, all; got {reprocess!r}")
    row = conn.execute("SELECT name, schedule, timezone FROM pgflow.jobs WHERE name = %s",
                       (job,)).fetchone()
    if row is None:
        raise NotFound(f"no job named {job!r} (see 'pgflow jobs list')")
    if row["schedule"] is None:
        raise PgflowError(f"job {job!r} has no schedule: backfill the root job it depends on"
                          " (with --downstream)")
    ticks = plan_ticks(row["schedule"], row["timezone"], start, end)
    created = reprocessed = 0
    with conn.transaction():
        backfill_id = conn.execute(q("insert_backfill"), {
            "job": job, "start": start, "end": end, "max_concurrency": max_concurrency,
            "downstream": downstream}).fetchone()["id"]  # type: ignore[index]
        for offset in range(0, len(ticks), CHUNK):
            chunk = ticks[offset : offset + CHUNK]
            rows = conn.execute(q("create_runs"), {
                "jobs": [job] * len(chunk), "times": chunk, "trigger": "backfill",
                "params": json.dumps({}), "downstream": downstream, "state": "pending",
                "priority_offset": BACKFILL_PRIORITY_OFFSET, "backfill_id": backfill_id,
            }).fetchall()
            created += sum(1 for r in rows if r["job"] == job)
            if reprocess != "none":
                reprocessed += _reprocess(conn, job, chunk, backfill_id, reprocess, downstream)
            if progress:
                progress(len(chunk))
        skipped = len(ticks) - created - reprocessed
        conn.execute(q("count_backfill_ticks"), {"id": backfill_id, "ticks": len(ticks),
                                                 "skipped": skipped})
        if downstream:  # downstream runs of ticks whose upstreams already ran
            deps.settle(conn, [], backfill=backfill_id, hold=True)
        complete(conn, [backfill_id])  # every tick skipped (or failed at once)
        conn.execute("SELECT pg_notify('pgflow_jobs', '')")
    return {"id": backfill_id, "job": job, "ticks": len(ticks), "created": created,
            "reprocessed": reprocessed, "skipped": skipped}


def _reprocess(conn: psycopg.Connection[Any], job: str, ticks: list[datetime], backfill_id: int,
               reprocess: str, downstream: bool) -> int:
    """Existing ticks of ``job`` among ``ticks`` in the states ``reprocess`` names become
    this backfill's held runs; with ``downstream`` their finished downstream runs wait for
    them again (those active refuse the backfill)."""
    from pgflow.rerun import REPROCESS, pend_downstream

    ids = [row["id"] for row in conn.execute(q("backfill_reprocess"), {
        "job": job, "times": ticks, "states": list(REPROCESS[reprocess]),
        "backfill_id": backfill_id, "priority_offset": BACKFILL_PRIORITY_OFFSET})]
    if ids and downstream:
        pend_downstream(conn, ids, backfill_id)
    elif ids:
        for run_id in ids:  # their upstream_failed downstreams wait for them again
            deps.restore_after_retry(conn, run_id)
    return len(ids)


def list_backfills(conn: psycopg.Connection[Any], limit: int = 100) -> list[dict[str, Any]]:
    return conn.execute(q("list_backfills"), {"id": None, "limit": limit}).fetchall()


def show(conn: psycopg.Connection[Any], backfill_id: int) -> dict[str, Any]:
    row = conn.execute(q("list_backfills"), {"id": backfill_id, "limit": 1}).fetchone()
    if row is None:
        raise NotFound(f"no backfill {backfill_id} (see 'pgflow backfill list')")
    return dict(row)


def cancel(conn: psycopg.Connection[Any], backfill_id: int) -> dict[str, Any]:
    with conn.transaction():
        row = conn.execute(q("cancel_backfill"), {"id": backfill_id}).fetchone()
        assert row is not None
        if not row["stopped"]:
            state = show(conn, backfill_id)["state"]
            raise Conflict(f"backfill {backfill_id} is already {state}")
        if row["cancelled"]:  # their downstreams may belong to other backfills
            complete(conn, deps.fail_downstreams(conn, row["cancelled"]).backfills)
        for run_id in row["stopping"]:
            conn.execute("SELECT pg_notify('pgflow_cancel', %s)", (str(run_id),))
    return {"id": backfill_id, "cancelled": len(row["cancelled"]),
            "stopping": len(row["stopping"])}


async def release(conn: psycopg.AsyncConnection[Any], ids: list[int] | None = None) -> int:
    """Top running backfills (all, or ``ids``) up to their caps, and complete those of
    ``ids`` that have nothing left to run. Workers call it with the backfills of the runs
    they finished; the leader calls it for all every loop (completing is left to the
    transactions that end runs, so the safety net notices one that did not)."""
    async with conn.transaction():
        locked = await (await conn.execute(q("lock_backfills"), {"ids": ids})).fetchall()
        if not locked:
            return 0
        cur = await conn.execute(q("release_backfill_runs"), {"ids": [row[0] for row in locked]})
        released = cur.rowcount
        if released:
            await conn.execute(q("notify_queue"))
        if ids is not None:
            await conn.execute(q("complete_backfills"), {"ids": ids})
    return released


def complete(conn: psycopg.Connection[Any], ids: Iterable[int]) -> list[int]:
    """Complete the backfills of ``ids`` that have nothing left to run (call in the
    transaction that ended their runs)."""
    wanted = sorted(set(ids))
    if not wanted:
        return []
    cur = conn.cursor(row_factory=dict_row)
    return [row["id"] for row in cur.execute(q("complete_backfills"), {"ids": wanted})]
