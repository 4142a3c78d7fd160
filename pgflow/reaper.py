"""The reaper: runs whose lease expired (their worker died or froze) are ended as
``lost`` and retried or dead-lettered by their job's retry policy.

Safe on many replicas: expired rows are locked with SKIP LOCKED and the same
guarded ``finish_attempts`` statement that workers use ends them, so an expired
run is reaped once, and a worker that comes back late finds its lease gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pgflow import queue, retry
from pgflow.db import bounded, close_async, connect_async
from pgflow.queries import q
from pgflow.queue import Finish

DEAD_REPLICA_AFTER_S = 3600.0


@dataclass(frozen=True)
class ReapPass:
    reaped: int
    retried: int
    failed: int


async def run_once(conn: psycopg.AsyncConnection[Any], limit: int = 500) -> ReapPass:
    async with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)
        rows = await (await cur.execute(q("expired_leases"), {"limit": limit})).fetchall()
        if not rows:
            return ReapPass(0, 0, 0)
        done = await queue.finish(conn, [_lost(row) for row in rows])
    states = list(done.values())
    return ReapPass(len(done), states.count("retrying"), states.count("failed"))


def _lost(row: dict[str, Any]) -> Finish:
    policy = None
    if row["backoff_s"] is not None:
        policy = retry.Policy(row["max_attempts"], row["backoff_s"], row["max_backoff_s"],
                              row["jitter"])
    decision = retry.decide(retry.LOST, row["attempt"], row["max_attempts"], policy,
                            cancel_requested=row["cancel_requested"])
    return Finish(
        run_id=row["id"], attempt=row["attempt"], owner=row["lease_owner"],
        state=decision.state, delay_s=decision.delay_s, outcome=retry.LOST,
        started_at=row["attempt_started_at"],
        error=f"lease expired: worker {row['lease_owner']} stopped renewing it",
    )


async def forget_dead_replicas(conn: psycopg.AsyncConnection[Any]) -> int:
    cur = await conn.execute(q("forget_dead_replicas"), {"after_s": DEAD_REPLICA_AFTER_S})
    return len(await cur.fetchall())


async def run_reaper(url: str, lease_ttl: float, stop: asyncio.Event, log: Any, *,
                     pooled: bool = False) -> None:
    """Reap every ~TTL/3 until ``stop``; database errors are logged and retried
    (``pooled``: ``url`` is PgBouncer's)."""
    interval = max(0.5, min(lease_ttl / 3, 10.0))
    statement_s = max(1.0, lease_ttl)  # a reap pass is worthless once it outlasts a lease
    conn: psycopg.AsyncConnection[Any] | None = None
    failures = 0
    try:
        while not stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = await connect_async(url, "reaper", statement_timeout=statement_s,
                                               pooled=pooled)
                while (found := await bounded(conn, run_once(conn), statement_s + 2,
                                              "reap")).reaped:
                    log.info("reaped expired leases", reaped=found.reaped,
                             retried=found.retried, failed=found.failed)
                await bounded(conn, forget_dead_replicas(conn), statement_s + 2, "reap")
                failures = 0
            except psycopg.Error as exc:
                failures += 1
                log.warning("reaper: database error, retrying", error=str(exc).strip())
                await close_async(conn)
                conn = None
            delay = interval if not failures else min(5.0, 0.2 * 2**failures)
            await _sleep_until(stop, delay * random.uniform(0.8, 1.2))
    finally:
        await close_async(conn)  # also when a bug ends the role (serve restarts it)


async def _sleep_until(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
