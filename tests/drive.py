"""Drive runs through the real statements without a worker, and check nothing is stuck.

``finish_run`` puts a queued run in the hands of a fake worker (the claim itself is
not what these tests are about) and ends it with the same ``queue.finish`` workers
and the reaper use, so dependency evaluation is the real one. ``nothing_stuck`` runs
the safety net and asserts it found nothing to repair: tests of the dependency
engine call it (or use ``check_nothing_stuck`` as an autouse fixture) so that a
repair where none should be needed fails them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from pgflow import queue, safety_net
from pgflow.queue import Finish

Conn = psycopg.Connection[dict[str, Any]]
WORKER = "fake-worker"


def hand_to_worker(conn: Conn, run_id: int, worker: str = WORKER) -> int:
    """Claim one specific queued (or retrying) run for ``worker``; returns its attempt."""
    row = conn.execute(
        "UPDATE pgflow.runs SET state = 'running', attempt = attempt + 1, lease_owner = %s,"
        " lease_expires_at = now() + interval '30 s', attempt_started_at = now(),"
        " started_at = coalesce(started_at, now())"
        " WHERE id = %s AND state IN ('queued', 'retrying') RETURNING attempt",
        (worker, run_id)).fetchone()
    assert row is not None, f"run {run_id} is not claimable"
    return int(row["attempt"])


def end_attempt(url: str, conn: Conn, run_id: int, state: str = "succeeded",
                outcome: str | None = None, worker: str = WORKER) -> str | None:
    """End the running attempt of ``run_id`` as ``state`` through ``queue.finish``."""
    run = conn.execute("SELECT attempt, attempt_started_at FROM pgflow.runs WHERE id = %s",
                       (run_id,)).fetchone()
    assert run is not None
    finish = Finish(run_id, run["attempt"], worker, state, outcome or state,
                    run["attempt_started_at"])

    async def go() -> dict[int, str]:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as aconn:
            return await queue.finish(aconn, [finish])

    return asyncio.run(go()).get(run_id)


def finish_run(url: str, conn: Conn, run_id: int, state: str = "succeeded") -> str | None:
    """Claim ``run_id`` and end its attempt as ``state``; returns the run's new state."""
    hand_to_worker(conn, run_id)
    return end_attempt(url, conn, run_id, state)


def run_of(conn: Conn, job: str, at: Any) -> dict[str, Any]:
    row = conn.execute("SELECT * FROM pgflow.runs WHERE job = %s AND logical_time = %s",
                       (job, at)).fetchone()
    assert row is not None, f"no run of {job} at {at}"
    return row


def nothing_stuck(url: str) -> None:
    """The safety net finds nothing to repair, and has never repaired anything."""
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
        found = safety_net.run_once(conn, backfill_grace_s=0)
        assert found.repaired == [], found.repaired
        assert set(safety_net.totals(conn).values()) == {0}


def check_nothing_stuck(request: pytest.FixtureRequest) -> Iterator[None]:
    """Body of an autouse fixture: after every test with a database (unless it asks for
    ``stuck_ok``, as tests that build inconsistent rows by hand do), nothing is stuck."""
    if "db_url" not in request.fixturenames or "stuck_ok" in request.fixturenames:
        yield
        return
    url = request.getfixturevalue("db_url")  # set up now, so it is torn down after us
    yield
    nothing_stuck(url)
