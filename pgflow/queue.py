"""The run lifecycle statements, shaped for batches: claim, renew, finish.

These are the only writers of ``running`` and of attempt endings; the SQL is in
``sql/queries/queue.sql``. Each call is one statement whatever the batch size.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pgflow import backfill
from pgflow.queries import q


@dataclass(frozen=True)
class Finish:
    """How one attempt ended and what its run becomes."""

    run_id: int
    attempt: int
    owner: str
    state: str
    outcome: str
    started_at: datetime | None
    delay_s: float = 0.0
    exit_code: int | None = None
    error: str | None = None
    stdout_tail: str | None = None
    stderr_tail: str | None = None


def finish_params(finishes: Sequence[Finish]) -> dict[str, str]:
    """The ``finish_attempts`` parameter: one JSON document for the whole batch."""
    return {"results": json.dumps([{
        "id": f.run_id, "attempt": f.attempt, "owner": f.owner, "state": f.state,
        "delay_s": f.delay_s, "outcome": f.outcome,
        "started_at": None if f.started_at is None else f.started_at.isoformat(),
        "exit_code": f.exit_code, "error": _clean(f.error),
        "stdout_tail": _clean(f.stdout_tail), "stderr_tail": _clean(f.stderr_tail),
    } for f in finishes])}


def _clean(text: str | None) -> str | None:
    # PostgreSQL text cannot hold NUL; job output can.
    return None if text is None else text.replace("\x00", "\ufffd")


async def claim(conn: psycopg.AsyncConnection[Any], worker: str, limit: int,
                ttl: float) -> list[dict[str, Any]]:
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(q("claim_runs"), {"worker": worker, "limit": limit, "ttl": ttl})
    return await cur.fetchall()


async def claim_capped(conn: psycopg.AsyncConnection[Any], worker: str, limit: int,
                       ttl: float) -> list[dict[str, Any]]:
    """Claim runs of jobs with a max_active_runs cap, never exceeding it cluster-wide."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(q("capped_jobs_waiting"))
    jobs = [row["job"] for row in await cur.fetchall()]
    if not jobs:
        return []
    async with conn.transaction():
        await cur.execute(q("lock_capped_jobs"), {"jobs": jobs})
        await cur.execute(q("claim_capped_runs"),
                          {"jobs": jobs, "worker": worker, "limit": limit, "ttl": ttl})
        return await cur.fetchall()


async def renew(conn: psycopg.AsyncConnection[Any], worker: str,
                ttl: float) -> list[dict[str, Any]]:
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(q("renew_leases"), {"worker": worker, "ttl": ttl})
    return await cur.fetchall()


async def finish(conn: psycopg.AsyncConnection[Any],
                 finishes: Sequence[Finish]) -> dict[int, str]:
    """End attempts and evaluate what depends on them; returns {run_id: new state} for the
    attempts that were still ours (the others were fenced off and change nothing)."""
    async with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(q("finish_attempts"), finish_params(finishes))
        rows = await cur.fetchall()
        done = {row["id"]: row["state"] for row in rows}
        wake = any(state in ("queued", "retrying") for state in done.values())
        candidates = rows[0]["candidates"] if rows else None
        if candidates:
            await cur.execute(q("queue_ready_runs"), {"ids": candidates})
            wake = wake or cur.rowcount > 0
        ended = [run_id for run_id, state in done.items() if state in ("failed", "cancelled")]
        if ended:
            await cur.execute(q("fail_downstreams"), {"ids": ended})
        if wake:
            await cur.execute(q("notify_queue"))
    backfills = sorted({row["backfill_id"] for row in rows if row["backfill_id"] is not None})
    if backfills:  # a finished backfill run frees a slot of its backfill: refill it now
        await backfill.release(conn, backfills)
    return done
