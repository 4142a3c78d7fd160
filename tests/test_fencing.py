"""Lease fencing in one worker (in a thread, real PostgreSQL): a worker never runs two
attempts of a run at once, never keeps an attempt whose lease could have expired, gives
back claims it never received, and starts nothing a cancel already stopped.

Jobs write a journal (``fencefuncs``) with wall-clock times, so the tests order what a
job did against what the database recorded, instead of measuring durations."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from engine import WorkerThread, add_job, attempts, enqueue, run_row, start_dag, wait_for
from fencefuncs import journal
from psycopg.rows import dict_row

from pgflow import reaper
from pgflow.queries import q
from pgflow.queue import NO_OFFER

Conn = psycopg.Connection[dict[str, Any]]
T0 = datetime(2026, 1, 1, tzinfo=UTC)
NOW_RETRY = {"max_attempts": 3, "backoff": "0s", "jitter": False}


@pytest.fixture
def handles() -> Iterator[list[WorkerThread]]:
    started: list[WorkerThread] = []
    yield started
    for handle in started:
        handle.stop(grace=1)


def books(handle: WorkerThread) -> set[tuple[int, int]]:
    """The (run, attempt) pairs the worker executes."""
    return set(handle.call(lambda: dict(handle.worker.active)))  # type: ignore[union-attr]


def events(path: Path, run_id: int) -> list[tuple[str, int]]:
    return [(event, attempt) for event, run, attempt, _ in journal(path) if run == run_id]


def when(path: Path, event: str, run_id: int, attempt: int) -> float:
    return next(t for e, r, a, t in journal(path) if (e, r, a) == (event, run_id, attempt))


def expire_and_reap(conn: Conn, db_url: str, run_id: int) -> None:
    """The lease runs out without the worker noticing (as if it froze); the reaper takes it.
    The worker's heartbeat may renew between the two statements: then expire it again."""

    async def reap() -> int:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            await c.execute("UPDATE pgflow.runs SET lease_expires_at = now() - interval '1s'"
                            " WHERE id = %s", (run_id,))
            return (await reaper.run_once(c)).reaped

    wait_for(lambda: asyncio.run(reap()) == 1, timeout=10)


# ---------------------------------------------------------------- defect 7


def test_a_claim_whose_reply_never_arrived_does_not_stay_running(
        conn: Conn, db_url: str, tmp_path: Path, handles: list[WorkerThread]) -> None:
    log = tmp_path / "journal"
    add_job(conn, "orphan", entrypoint="fencefuncs:async_stamp", params={"journal": str(log)})
    handles.append(WorkerThread(db_url, concurrency=2, lease_ttl=1.5, worker_id="w7"))
    # A claim for w7 commits, but its rows never reach w7 (the connection died first).
    with conn.transaction():
        run_id = enqueue(conn, "orphan", at=T0)
        [row] = conn.execute(q("claim_runs"), {**NO_OFFER, "worker": "w7", "limit": 5, "ttl": 1.5})
    assert (row["id"], run_row(conn, run_id)["lease_owner"]) == (run_id, "w7")
    # w7's heartbeat gives it back (no attempt used up) and w7 then claims and runs it.
    wait_for(lambda: run_row(conn, run_id)["state"] == "succeeded", timeout=20)
    assert events(log, run_id) == [("ran", 2)]
    assert [(a["attempt"], a["outcome"], a["worker_id"]) for a in attempts(conn, run_id)] == [
        (2, "succeeded", "w7")]
    assert run_row(conn, run_id)["max_attempts"] == 2  # the lost claim cost nothing


def test_a_claim_in_flight_is_not_taken_for_a_lost_one(
        conn: Conn, db_url: str, tmp_path: Path, handles: list[WorkerThread]) -> None:
    log = tmp_path / "journal"
    add_job(conn, "holder", entrypoint="fencefuncs:first_attempt_sleeps",
            params={"journal": str(log)})
    add_job(conn, "late", entrypoint="fencefuncs:async_stamp", params={"journal": str(log)})
    handle = WorkerThread(db_url, concurrency=4, lease_ttl=1.5, worker_id="w7")
    handles.append(handle)
    holder = enqueue(conn, "holder", at=T0)
    wait_for(lambda: events(log, holder) == [("start", 1)])
    # A claim of w7 is in flight: it holds the claim gate, and its rows are committed
    # but not in the books yet. Heartbeats go on meanwhile, and must not give them back.
    gate = asyncio.run_coroutine_threadsafe(
        handle.worker._claim_gate.acquire(), handle.loop)  # type: ignore[union-attr]
    assert gate.result(10)
    with conn.transaction():
        late = enqueue(conn, "late", at=T0)
        conn.execute(q("claim_runs"), {**NO_OFFER, "worker": "w7", "limit": 5, "ttl": 30})
    seen = [run_row(conn, holder)["lease_expires_at"]]

    def renewed_twice() -> bool:
        expiry = run_row(conn, holder)["lease_expires_at"]
        if expiry != seen[-1]:
            seen.append(expiry)
        return len(seen) >= 3

    wait_for(renewed_twice, timeout=20)
    assert run_row(conn, late)["state"] == "running"  # still w7's: not given back
    handle.loop.call_soon_threadsafe(handle.worker._claim_gate.release)  # type: ignore[union-attr]
    wait_for(lambda: run_row(conn, late)["state"] == "succeeded", timeout=20)
    assert events(log, late) == [("ran", 2)]


# ---------------------------------------------------------------- defect 8


def test_a_run_claimed_again_stops_its_older_attempt_first(
        conn: Conn, db_url: str, tmp_path: Path, handles: list[WorkerThread]) -> None:
    log = tmp_path / "journal"
    add_job(conn, "again", entrypoint="fencefuncs:first_attempt_sleeps",
            params={"journal": str(log)}, retry=NOW_RETRY)
    add_job(conn, "long", entrypoint="fencefuncs:first_attempt_sleeps",
            params={"journal": str(log)})
    # TTL 30 s: the heartbeat is 10 s away, so the worker has not noticed the lost lease
    # when the run comes back to it.
    handle = WorkerThread(db_url, concurrency=3, lease_ttl=30, worker_id="w8")
    handles.append(handle)
    run_id = enqueue(conn, "again", at=T0)
    other = enqueue(conn, "long", at=T0)
    wait_for(lambda: events(log, run_id) == [("start", 1)] and events(log, other))
    expire_and_reap(conn, db_url, run_id)  # retrying, available at once: w8 claims attempt 2
    wait_for(lambda: ("start", 2) in events(log, run_id), timeout=10)
    assert events(log, run_id) == [("start", 1), ("cancelled", 1), ("start", 2)]
    wait_for(lambda: run_row(conn, run_id)["state"] == "succeeded")
    assert [(a["attempt"], a["outcome"]) for a in attempts(conn, run_id)] == [
        (1, "lost"), (2, "succeeded")]
    assert books(handle) == {(other, 1)}  # attempt 1 ending took nothing else off the books


def test_attempt_one_ending_keeps_attempt_two_on_the_books(
        conn: Conn, db_url: str, tmp_path: Path, handles: list[WorkerThread]) -> None:
    log = tmp_path / "journal"
    add_job(conn, "again", entrypoint="fencefuncs:sleeps_every_attempt",
            params={"journal": str(log)}, retry=NOW_RETRY)
    handle = WorkerThread(db_url, concurrency=2, lease_ttl=30, worker_id="w8")
    handles.append(handle)
    run_id = enqueue(conn, "again", at=T0)
    wait_for(lambda: events(log, run_id) == [("start", 1)])
    expire_and_reap(conn, db_url, run_id)
    wait_for(lambda: ("start", 2) in events(log, run_id), timeout=10)
    assert ("cancelled", 1) in events(log, run_id)
    assert books(handle) == {(run_id, 2)}
    assert handle.call(handle.worker.free_slots) == 1  # type: ignore[union-attr]
    assert run_row(conn, run_id)["state"] == "running"


# ---------------------------------------------------------------- defect 9 (in one worker)


def test_an_attempt_stops_itself_before_its_unrenewed_lease_expires(
        conn: Conn, db_url: str, tmp_path: Path, handles: list[WorkerThread]) -> None:
    log = tmp_path / "journal"
    add_job(conn, "held", entrypoint="fencefuncs:first_attempt_sleeps",
            params={"journal": str(log)}, retry=NOW_RETRY)
    handles.append(WorkerThread(db_url, concurrency=2, lease_ttl=2, worker_id="w9"))
    run_id = enqueue(conn, "held", at=T0)
    wait_for(lambda: events(log, run_id) == [("start", 1)])
    # Renewals hang: the test holds the run's row lock, so renew_leases waits on it (as on
    # a database that stopped answering). No reaper runs here.
    with conn.transaction():
        conn.execute("SELECT 1 FROM pgflow.runs WHERE id = %s FOR UPDATE", (run_id,))
        with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as other:
            def expiry() -> float:
                return float(run_row(other, run_id)["lease_expires_at"].timestamp())

            wait_for(lambda: ("cancelled", 1) in events(log, run_id), timeout=15)
            # The job was stopped while the database still counted the lease as ours.
            assert when(log, "cancelled", run_id, 1) < expiry()
            assert run_row(other, run_id)["state"] == "running"
    # Once the database answers again, the worker records its own verdict: lost.
    wait_for(lambda: run_row(conn, run_id)["state"] == "succeeded", timeout=20)
    tried = attempts(conn, run_id)
    assert [(a["attempt"], a["outcome"], a["worker_id"]) for a in tried] == [
        (1, "lost", "w9"), (2, "succeeded", "w9")]
    assert "lease not renewed in time" in tried[0]["error"]


# ---------------------------------------------------------------- defect 6 (in the worker)


@pytest.mark.parametrize("entry", ["fencefuncs:stamp", "fencefuncs:async_stamp", "command"])
def test_a_run_claimed_with_a_cancel_requested_never_starts(
        conn: Conn, db_url: str, tmp_path: Path, handles: list[WorkerThread],
        entry: str) -> None:
    log = tmp_path / "journal"
    keys: dict[str, Any] = ({"command": f"echo ran >> {log}"} if entry == "command"
                            else {"entrypoint": entry, "params": {"journal": str(log)}})
    add_job(conn, "doomed", schedule="0 * * * *", **keys)
    add_job(conn, "after", entrypoint="fencefuncs:stamp", params={"journal": str(log)},
            depends_on=["doomed"])
    with conn.transaction():  # queued with a cancel already requested
        ids = start_dag(conn, ["doomed"], T0)
        conn.execute("UPDATE pgflow.runs SET cancel_requested = true WHERE id = %s",
                     (ids["doomed"],))
    handles.append(WorkerThread(db_url, concurrency=2, worker_id="w6"))
    wait_for(lambda: run_row(conn, ids["doomed"])["state"] == "cancelled")
    assert not log.exists()  # its code never ran
    [tried] = attempts(conn, ids["doomed"])
    assert tried["outcome"] == "cancelled" and "before the attempt started" in tried["error"]
    assert run_row(conn, ids["after"])["state"] == "upstream_failed"


def test_a_cancel_landing_as_the_attempt_fails_is_not_retried(
        conn: Conn, db_url: str, tmp_path: Path, handles: list[WorkerThread]) -> None:
    go, started = tmp_path / "go", tmp_path / "started"
    add_job(conn, "racy", command=f"touch {started}; while [ ! -e {go} ]; do sleep 0.02; done;"
                                  " exit 3", retry=NOW_RETRY)
    handles.append(WorkerThread(db_url, concurrency=2, lease_ttl=30, worker_id="w6"))
    run_id = enqueue(conn, "racy", at=T0)
    wait_for(started.exists)
    # The cancel commits; its notification has not reached the worker when the command
    # fails, so the worker decides "retrying": the database must end the run cancelled.
    conn.execute("UPDATE pgflow.runs SET cancel_requested = true WHERE id = %s", (run_id,))
    go.touch()
    wait_for(lambda: run_row(conn, run_id)["state"] not in ("running", "queued"), timeout=10)
    assert run_row(conn, run_id)["state"] == "cancelled"
    assert len(attempts(conn, run_id)) == 1  # no second attempt was started


# ---------------------------------------------------------------- defect 12


def test_sync_jobs_that_ignore_their_timeout_keep_their_slots(
        conn: Conn, db_url: str, tmp_path: Path, handles: list[WorkerThread]) -> None:
    log = tmp_path / "journal"
    add_job(conn, "stubborn", entrypoint="fencefuncs:stubborn", timeout="0.3s",
            params={"journal": str(log), "seconds": 4})
    add_job(conn, "next", entrypoint="fencefuncs:stamp", params={"journal": str(log)})
    handle = WorkerThread(db_url, concurrency=2, worker_id="w12")
    handles.append(handle)
    stubborn = [enqueue(conn, "stubborn", at=T0), enqueue(conn, "stubborn", at=T0.replace(hour=1))]
    wait_for(lambda: all(run_row(conn, r)["state"] == "failed" for r in stubborn))
    for run_id in stubborn:
        assert [a["outcome"] for a in attempts(conn, run_id)] == ["timed_out"]
    nxt = enqueue(conn, "next", at=T0)
    assert not [e for e in journal(log) if e[0] == "returned"]  # both threads still busy
    assert handle.call(handle.worker.free_slots) == 0  # type: ignore[union-attr]
    wait_for(lambda: run_row(conn, nxt)["state"] == "succeeded", timeout=20)
    # The third run was claimed only once a thread was free to run it.
    claimed = attempts(conn, nxt)[0]["started_at"].timestamp()
    first_free = min(when(log, "returned", r, 1) for r in stubborn)
    assert claimed >= first_free
