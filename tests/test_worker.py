"""The worker role in-process against a real database: execution, retries, fencing."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import structlog
from engine import WorkerThread, add_job, attempts, enqueue, run_row, wait_for
from psycopg import sql

from pgflow import queue, reaper, registry
from pgflow.queries import q
from pgflow.queue import NO_OFFER, Finish
from pgflow.spec import JobSpec

Conn = psycopg.Connection[dict[str, Any]]


@pytest.fixture
def worker(db_url: str) -> Iterator[WorkerThread]:
    handle = WorkerThread(db_url, concurrency=4, lease_ttl=30)
    yield handle
    handle.stop(grace=1)


def finished(conn: Conn, run_id: int, state: str = "succeeded") -> bool:
    return bool(run_row(conn, run_id)["state"] == state)


def test_async_and_sync_entrypoints_succeed(conn: Conn, worker: WorkerThread) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop")
    add_job(conn, "s", entrypoint="jobfuncs:sync_noop")
    runs = [enqueue(conn, "a"), enqueue(conn, "s")]
    wait_for(lambda: all(finished(conn, r) for r in runs))
    for run_id in runs:
        [attempt] = attempts(conn, run_id)
        assert attempt["outcome"] == "succeeded" and attempt["worker_id"] == "test-worker"
        row = run_row(conn, run_id)
        assert row["lease_owner"] is None and row["finished_at"] and row["attempt"] == 1


def test_command_gets_the_environment_and_its_output_is_kept(conn: Conn,
                                                             worker: WorkerThread) -> None:
    script = ("import os, sys; print(os.environ['PGFLOW_JOB'], os.environ['PGFLOW_ATTEMPT'],"
              " os.environ['PGFLOW_RUN_ID'], os.environ['PGFLOW_LOGICAL_TIME'],"
              " os.environ['PGFLOW_PARAMS']); print('warn', file=sys.stderr)")
    add_job(conn, "cmd", command=[sys.executable, "-c", script], params={"region": "eu"})
    run_id = enqueue(conn, "cmd", params={"day": 3})
    wait_for(lambda: finished(conn, run_id))
    [attempt] = attempts(conn, run_id)
    job, number, rid, logical, params = attempt["stdout_tail"].split(" ", 4)
    assert (job, number, rid) == ("cmd", "1", str(run_id))
    assert logical.endswith("+00:00")
    assert json.loads(params) == {"region": "eu", "day": 3}
    assert attempt["stderr_tail"] == "warn\n" and attempt["exit_code"] == 0


def test_output_tail_is_bounded(conn: Conn, worker: WorkerThread) -> None:
    add_job(conn, "loud", command="yes x | head -c 300000; echo END")
    run_id = enqueue(conn, "loud")
    wait_for(lambda: finished(conn, run_id))
    tail = attempts(conn, run_id)[0]["stdout_tail"]
    assert len(tail.encode()) == 64 * 1024 and tail.endswith("END\n")


def test_failures_retry_with_backoff_then_dead_letter(conn: Conn, worker: WorkerThread) -> None:
    add_job(conn, "flaky", command="exit 3",
            retry={"max_attempts": 3, "backoff": "0.2s", "max_backoff": "1s", "jitter": False})
    run_id = enqueue(conn, "flaky")
    wait_for(lambda: finished(conn, run_id, "failed"))
    tries = attempts(conn, run_id)
    assert [(a["attempt"], a["outcome"], a["exit_code"]) for a in tries] == [
        (1, "failed", 3), (2, "failed", 3), (3, "failed", 3)]
    gap = (tries[2]["started_at"] - tries[1]["finished_at"]).total_seconds()
    assert gap >= 0.4 - 0.05  # second retry waits 2 x 0.2 s


def test_retry_succeeds_on_second_attempt(conn: Conn, worker: WorkerThread) -> None:
    add_job(conn, "once", entrypoint="jobfuncs:fail_once",
            retry={"max_attempts": 3, "backoff": "0s"})
    run_id = enqueue(conn, "once")
    wait_for(lambda: finished(conn, run_id))
    assert [a["outcome"] for a in attempts(conn, run_id)] == ["failed", "succeeded"]
    assert "RuntimeError: first attempt fails" in attempts(conn, run_id)[0]["error"]


@pytest.mark.parametrize(("keys", "error"), [
    ({"command": "exit 2", "retry": {"max_attempts": 5, "no_retry_exit_codes": [2]}},
     "exited with code 2"),
    ({"entrypoint": "jobfuncs:permanent", "retry": {"max_attempts": 5}}, "PermanentError"),
])
def test_permanent_failures_skip_retries(conn: Conn, worker: WorkerThread, keys: dict[str, Any],
                                         error: str) -> None:
    add_job(conn, "perm", **keys)
    run_id = enqueue(conn, "perm")
    wait_for(lambda: finished(conn, run_id, "failed"))
    [attempt] = attempts(conn, run_id)
    assert error in attempt["error"]


def test_source_unavailable_is_exit_75(conn: Conn, worker: WorkerThread) -> None:
    add_job(conn, "src", entrypoint="jobfuncs:unavailable")
    run_id = enqueue(conn, "src")
    wait_for(lambda: finished(conn, run_id, "failed"))
    assert attempts(conn, run_id)[0]["exit_code"] == 75


@pytest.mark.parametrize("keys", [{"command": "sleep 60"}, {"entrypoint": "jobfuncs:sleep"},
                                  {"entrypoint": "jobfuncs:sync_sleep"}])
def test_timeout_ends_the_attempt(conn: Conn, worker: WorkerThread, keys: dict[str, Any]) -> None:
    add_job(conn, "slow", timeout="0.5s", **keys)
    run_id = enqueue(conn, "slow")
    wait_for(lambda: finished(conn, run_id, "failed"))
    [attempt] = attempts(conn, run_id)
    assert attempt["outcome"] == "timed_out" and "timed out after 0.5s" in attempt["error"]


@pytest.mark.parametrize("keys", [{"command": "sleep 60"}, {"entrypoint": "jobfuncs:sleep"}])
def test_cancel_stops_a_running_attempt(conn: Conn, worker: WorkerThread,
                                        keys: dict[str, Any]) -> None:
    add_job(conn, "long", **keys)
    run_id = enqueue(conn, "long")
    wait_for(lambda: run_row(conn, run_id)["state"] == "running")
    conn.execute("UPDATE pgflow.runs SET cancel_requested = true WHERE id = %s", (run_id,))
    conn.execute("SELECT pg_notify('pgflow_cancel', %s)", (str(run_id),))
    wait_for(lambda: finished(conn, run_id, "cancelled"), timeout=10)
    assert attempts(conn, run_id)[0]["outcome"] == "cancelled"


def test_lost_lease_stops_the_attempt_and_discards_its_result(conn: Conn, db_url: str) -> None:
    handle = WorkerThread(db_url, concurrency=2, lease_ttl=1.5, worker_id="slowpoke")
    try:
        add_job(conn, "held", entrypoint="jobfuncs:sleep", params={"seconds": 2},
                retry={"max_attempts": 2, "backoff": "30s", "jitter": False})
        run_id = enqueue(conn, "held")
        wait_for(lambda: run_row(conn, run_id)["state"] == "running")
        # The lease runs out as if the worker had frozen; the reaper takes the run.
        conn.execute("UPDATE pgflow.runs SET lease_expires_at = now() - interval '1s'"
                     " WHERE id = %s", (run_id,))
        async def reap() -> int:
            async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
                return (await reaper.run_once(c)).reaped

        assert asyncio.run(reap()) == 1
        row = run_row(conn, run_id)
        assert row["state"] == "retrying" and row["lease_owner"] is None
        [lost] = attempts(conn, run_id)
        assert lost["outcome"] == "lost" and lost["worker_id"] == "slowpoke"
        # The worker's next heartbeat finds the run gone, stops the attempt, drops its result.
        wait_for(lambda: not handle.call(lambda: handle.worker.active), timeout=5)  # type: ignore[union-attr]
        assert run_row(conn, run_id)["state"] == "retrying"
        assert len(attempts(conn, run_id)) == 1
    finally:
        handle.stop(grace=1)


def test_graceful_drain_requeues_without_using_an_attempt(conn: Conn, db_url: str,
                                                          tmp_path: Path) -> None:
    handle = WorkerThread(db_url, concurrency=2)
    add_job(conn, "busy", entrypoint="jobfuncs:marker_then_sleep",
            params={"marker": str(tmp_path / "m"), "seconds": 60})
    run_id = enqueue(conn, "busy")
    wait_for(lambda: (tmp_path / "m").exists())
    handle.stop(grace=0.2)
    row = run_row(conn, run_id)
    assert row["state"] == "queued" and row["max_attempts"] == 2 and row["attempt"] == 1
    assert attempts(conn, run_id)[0]["outcome"] == "interrupted"


def test_claim_respects_priority(conn: Conn, db_url: str, tmp_path: Path) -> None:
    path = tmp_path / "order"
    add_job(conn, "low", entrypoint="jobfuncs:record", priority=0, params={"path": str(path)})
    add_job(conn, "high", entrypoint="jobfuncs:record", priority=10, params={"path": str(path)})
    low = enqueue(conn, "low")
    high = enqueue(conn, "high")
    handle = WorkerThread(db_url, concurrency=1)
    try:
        wait_for(lambda: finished(conn, low) and finished(conn, high))
    finally:
        handle.stop()
    assert [int(line.split()[0]) for line in path.read_text().splitlines()] == [high, low]


def test_a_job_sees_its_logical_time_in_utc_whatever_the_servers_zone(
        conn: Conn, db_url: str, tmp_path: Path) -> None:
    """Worker sessions set TimeZone to UTC (sql/queries/sessions.sql): ctx.logical_time
    is a UTC datetime, as PGFLOW_LOGICAL_TIME is, on a server whose sessions default to
    another zone."""
    name = conn.execute("SELECT current_database() AS d").fetchone()["d"]  # type: ignore[index]
    conn.execute(sql.SQL("ALTER DATABASE {} SET timezone = 'America/New_York'").format(
        sql.Identifier(name)))
    path = tmp_path / "seen"
    add_job(conn, "t", entrypoint="jobfuncs:record", params={"path": str(path)})
    run_id = enqueue(conn, "t")
    handle = WorkerThread(db_url, concurrency=1)
    try:
        wait_for(lambda: finished(conn, run_id))
    finally:
        handle.stop()
    [line] = path.read_text().splitlines()
    seen = line.split()[2]
    assert seen.endswith("+00:00"), seen
    assert datetime.fromisoformat(seen) == run_row(conn, run_id)["logical_time"]


def test_claim_query_is_an_index_scan_with_many_finished_runs(conn: Conn) -> None:
    conn.execute(
        "INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant,"
        " finished_at) SELECT 'old', to_timestamp(g), 'succeeded', 1, 'schedule', 'default',"
        " now() FROM generate_series(1, 200000) g")
    conn.execute("ANALYZE pgflow.runs")
    plan = conn.execute("EXPLAIN " + q("claim_runs"),
                        {**NO_OFFER, "worker": "w", "limit": 10, "ttl": 30}).fetchall()
    text = "\n".join(row["QUERY PLAN"] for row in plan)
    assert "runs_claimable_idx" in text and "Seq Scan on runs" not in text


def test_open_breaker_holds_back_runs_of_jobs_using_its_source(conn: Conn,
                                                               worker: WorkerThread) -> None:
    add_job(conn, "uses_wh", entrypoint="jobfuncs:noop", sources=["warehouse"])
    add_job(conn, "other", entrypoint="jobfuncs:noop")
    conn.execute("INSERT INTO pgflow.breakers (source, state) VALUES ('warehouse', 'open')")
    held = enqueue(conn, "uses_wh")
    free = enqueue(conn, "other")
    wait_for(lambda: finished(conn, free))
    assert run_row(conn, held)["state"] == "queued"
    conn.execute("UPDATE pgflow.breakers SET state = 'closed' WHERE source = 'warehouse'")
    conn.execute("SELECT pg_notify('pgflow_queue', '')")
    wait_for(lambda: finished(conn, held))


def test_max_active_runs_holds_across_workers(conn: Conn, db_url: str) -> None:
    add_job(conn, "capped", entrypoint="jobfuncs:sleep", params={"seconds": 0.3},
            max_active_runs=2)
    runs = [enqueue(conn, "capped", at=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=i))
            for i in range(10)]
    workers = [WorkerThread(db_url, concurrency=5, worker_id=f"w{i}") for i in range(2)]
    try:
        wait_for(lambda: all(finished(conn, r) for r in runs), timeout=60)
    finally:
        for w in workers:
            w.stop(grace=1)
    peak = conn.execute("""
        SELECT max((SELECT count(*) FROM pgflow.attempts b
                    WHERE b.started_at <= a.started_at AND b.finished_at > a.started_at)) AS n
        FROM pgflow.attempts a""").fetchone()
    assert peak is not None and peak["n"] <= 2
    assert len({a["worker_id"] for r in runs for a in attempts(conn, r)}) == 2


# ---------------------------------------------------------------- capped claims (defect 16)


def test_a_capped_run_of_high_priority_goes_before_uncapped_work_of_lower_priority(
        conn: Conn, db_url: str, tmp_path: Path) -> None:
    path = tmp_path / "order"
    add_job(conn, "bulk", entrypoint="jobfuncs:record", priority=-10, params={"path": str(path)})
    add_job(conn, "urgent", entrypoint="jobfuncs:record", priority=100, max_active_runs=1,
            params={"path": str(path)})
    bulk = [enqueue(conn, "bulk", at=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=i))
            for i in range(3)]
    urgent = enqueue(conn, "urgent")
    handle = WorkerThread(db_url, concurrency=1)  # one slot: what is claimed first runs first
    try:
        wait_for(lambda: all(finished(conn, r) for r in [*bulk, urgent]))
    finally:
        handle.stop()
    first = path.read_text().splitlines()[0]
    assert int(first.split()[0]) == urgent


def test_capped_jobs_at_their_cap_do_not_starve_the_others(conn: Conn, db_url: str) -> None:
    names = [f"c{i:03d}" for i in range(150)]
    registry.apply(conn, [JobSpec.model_validate({"name": n, "entrypoint": "jobfuncs:noop",
                                                  "max_active_runs": 1}) for n in names])
    at = datetime(2026, 1, 1, tzinfo=UTC)
    for name in names[:100]:  # the alphabetically first 100 are at their cap, with a backlog
        for moment in (at, at.replace(hour=1)):
            enqueue(conn, name, at=moment)
    conn.execute("UPDATE pgflow.runs SET state = 'running', attempt = 1, lease_owner = 'busy',"
                 " lease_expires_at = now() + interval '1h', attempt_started_at = now()"
                 " WHERE logical_time = %s", (at,))
    others = [enqueue(conn, name, at=at) for name in names[100:]]
    handle = WorkerThread(db_url, concurrency=8)
    try:
        wait_for(lambda: all(finished(conn, r) for r in others), timeout=30)
    finally:
        handle.stop()
    assert conn.execute("SELECT count(*) AS n FROM pgflow.runs WHERE state = 'queued'"
                        ).fetchone() == {"n": 100}  # the capped backlog still waits


# ---------------------------------------------------------------- completion batches (15)


def test_completion_batches_are_bounded_by_size() -> None:
    from pgflow.log import get_logger
    from pgflow.worker import MAX_FLUSH_CHARS, Worker

    worker = Worker("postgresql:///unused", "w", 4, 30, get_logger(test=True))
    big = "x" * (128 * 1024)
    for i in range(200):
        worker._record(Finish(run_id=i + 1, attempt=1, owner="w", state="succeeded",
                              outcome="succeeded", started_at=None, stdout_tail=big))
    batches = []
    while worker._results:
        batches.append(worker._next_batch())
    assert sum(len(b) for b in batches) == 200 and len(batches) > 1
    assert all(sum(queue.result_size(f) for f in b) <= MAX_FLUSH_CHARS for b in batches)


@pytest.mark.parametrize(("level", "logged"), [(logging.DEBUG, ["succeeded", "failed"]),
                                               (logging.INFO, ["failed"])])
def test_recorded_successes_are_logged_only_at_debug_level(level: int,
                                                           logged: list[str]) -> None:
    from pgflow.worker import Worker

    capture = structlog.testing.LogCapture()
    log = structlog.wrap_logger(None, processors=[capture],
                                wrapper_class=structlog.make_filtering_bound_logger(level))
    worker = Worker("postgresql:///unused", "w", 4, 30, log)
    for run_id, outcome in enumerate(("succeeded", "failed"), start=1):
        worker._report(Finish(run_id, 1, "w", outcome, outcome, None), outcome)
    assert [(e["event"], e["outcome"]) for e in capture.entries] == [
        ("attempt finished", outcome) for outcome in logged]


def test_a_worker_loop_ended_by_a_bug_closes_its_session(
        conn: Conn, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that fails with anything but a database error is restarted (_supervise);
    the session it held is closed first. Left open, a claim loop failing once a second
    took a session a second until the server refused every client (too many clients)."""
    from pgflow.log import get_logger
    from pgflow.worker import Worker

    claims = 0

    async def bug(*args: Any, **kwargs: Any) -> Any:
        nonlocal claims
        claims += 1
        raise RuntimeError("a bug in the claim")

    monkeypatch.setattr(queue, "claim", bug)
    sessions = ("SELECT count(*) AS n FROM pg_stat_activity"
                " WHERE application_name = 'pgflow-worker' AND datname = current_database()")

    async def scenario() -> int:
        worker = Worker(db_url, "w18", 4, 60, get_logger(test=True))
        worker.start()
        while claims < 4:  # the claim loop failed and was restarted three times
            await asyncio.sleep(0.05)
        open_now = int(conn.execute(sessions).fetchone()["n"])
        await worker.drain(0.1)
        return open_now

    # claim, completion and heartbeat sessions, no more (three more without the fix)
    assert asyncio.run(scenario()) <= 3
    wait_for(lambda: conn.execute(sessions).fetchone()["n"] == 0, timeout=5)


def test_a_result_the_database_refuses_does_not_hold_back_the_others(conn: Conn,
                                                                      db_url: str) -> None:
    from pgflow.log import get_logger
    from pgflow.worker import Worker

    add_job(conn, "j", entrypoint="jobfuncs:noop")
    runs = [enqueue(conn, "j", at=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=i))
            for i in range(5)]
    claimed = conn.execute(q("claim_runs"), {**NO_OFFER, "worker": "w15", "limit": 10,
                                             "ttl": 60}).fetchall()
    assert len(claimed) == 5
    # This database cannot hold a tail this long (as a batch can outgrow what one
    # parameter holds): the statement carrying it fails whole.
    conn.execute("ALTER TABLE pgflow.attempts ADD CONSTRAINT small_tails"
                 " CHECK (length(stdout_tail) < 50000)")
    poison = max(runs)

    async def flush() -> None:
        worker = Worker(db_url, "w15", 4, 60, get_logger(test=True))
        for row in claimed:
            tail = "y" * 65536 if row["id"] == poison else "ok\n"
            worker._record(Finish(run_id=row["id"], attempt=1, owner="w15", state="succeeded",
                                  outcome="succeeded", started_at=row["attempt_started_at"],
                                  stdout_tail=tail))
        conn_ = await worker._connect()
        try:
            await worker._flush_once(conn_)
        finally:
            await conn_.close()
        assert worker._results == [] and worker._unrecorded == set()

    asyncio.run(flush())
    for run_id in runs:
        assert finished(conn, run_id)
    tails = {r: attempts(conn, r)[0]["stdout_tail"] for r in runs}
    assert all(tails[r] == "ok\n" for r in runs if r != poison)
    assert tails[poison].startswith("[pgflow: output cut") and tails[poison].endswith("y" * 4096)


def test_a_finish_refused_by_a_stale_server_is_recorded_when_the_lease_is_still_ours(
        conn: Conn, db_url: str) -> None:
    """A former primary woken from a freeze answers a finish from rows as they were before
    the failover: it matches nothing. The result is disputed, not dropped: the renewal,
    answered by the real primary, says whose lease it is."""
    from pgflow.log import get_logger
    from pgflow.worker import Worker

    add_job(conn, "j", entrypoint="jobfuncs:noop")
    ours, lost = [enqueue(conn, "j", at=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=i))
                  for i in range(2)]
    claimed = conn.execute(q("claim_runs"), {**NO_OFFER, "worker": "w16", "limit": 10,
                                             "ttl": 60}).fetchall()
    assert {r["id"] for r in claimed} == {ours, lost}
    stale = "UPDATE pgflow.runs SET lease_owner = %s WHERE id = %s"

    async def scenario() -> None:
        worker = Worker(db_url, "w16", 4, 60, get_logger(test=True))
        for row in claimed:
            worker._record(Finish(run_id=row["id"], attempt=1, owner="w16", state="succeeded",
                                  outcome="succeeded", started_at=row["attempt_started_at"]))
        aconn = await worker._connect()
        try:
            conn.execute(stale, ("the-old-view", ours))  # what the stale server holds
            conn.execute(stale, ("the-old-view", lost))
            await worker._flush_once(aconn)
            assert set(worker._disputed) == {(ours, 1), (lost, 1)}
            conn.execute(stale, ("w16", ours))  # the real primary: still ours
            conn.execute(stale, ("another-worker", lost))  # really lost
            await worker._beat(aconn)
            assert worker._disputed == {} and [f.run_id for f in worker._results] == [ours]
            await worker._flush_once(aconn)
        finally:
            await aconn.close()

    asyncio.run(scenario())
    assert finished(conn, ours) and len(attempts(conn, ours)) == 1
    assert run_row(conn, lost)["state"] == "running" and attempts(conn, lost) == []
    conn.execute("UPDATE pgflow.runs SET state = 'cancelled', finished_at = now(),"
                 " lease_owner = NULL, lease_expires_at = NULL WHERE id = %s", (lost,))


def test_a_renewal_waits_for_the_finish_batch_in_flight(conn: Conn, db_url: str) -> None:
    """A renewal covers the results not written yet, which the finish batch in flight
    updates from another session: run at once, the two deadlocked (a second's stall, one
    statement lost). The renewal waits for the batch, then renews."""
    from pgflow.log import get_logger
    from pgflow.worker import Worker

    add_job(conn, "j", entrypoint="jobfuncs:noop")
    ids = [enqueue(conn, "j", at=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=i))
           for i in range(3)]
    claimed = conn.execute(q("claim_runs"), {**NO_OFFER, "worker": "w17", "limit": 10,
                                             "ttl": 60}).fetchall()
    assert {r["id"] for r in claimed} == set(ids)
    expiry = "SELECT id, lease_expires_at FROM pgflow.runs WHERE id = ANY(%s) ORDER BY id"

    async def scenario() -> None:
        worker = Worker(db_url, "w17", 4, 60, get_logger(test=True))
        for row in reversed(claimed):
            worker._unrecorded.add((row["id"], 1))  # ended, result not written yet
        aconn = await worker._connect()
        try:
            before = conn.execute(expiry, (ids,)).fetchall()
            await worker._flushing.acquire()  # a finish batch in flight
            beat = asyncio.create_task(worker._beat(aconn))
            for _ in range(100):  # until the renewal queues for the lock (it then waits 1 s)
                if worker._flushing._waiters:  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.01)
            assert worker._flushing._waiters and not beat.done()  # type: ignore[attr-defined]
            assert conn.execute(expiry, (ids,)).fetchall() == before  # nothing renewed yet
            worker._flushing.release()
            await asyncio.wait_for(beat, 5)
        finally:
            await aconn.close()
        after = conn.execute(expiry, (ids,)).fetchall()
        assert all(a["lease_expires_at"] > b["lease_expires_at"]
                   for a, b in zip(after, before, strict=True))

    asyncio.run(scenario())
    conn.execute("UPDATE pgflow.runs SET state = 'cancelled', finished_at = now(),"
                 " lease_owner = NULL, lease_expires_at = NULL WHERE id = ANY(%s)", (ids,))


def test_an_error_postgresql_cannot_store_is_still_recorded(conn: Conn,
                                                            worker: WorkerThread) -> None:
    add_job(conn, "odd", entrypoint="fencefuncs:surrogate_error")
    run_id = enqueue(conn, "odd")
    wait_for(lambda: finished(conn, run_id, "failed"))
    [attempt] = attempts(conn, run_id)
    assert "no such file: report-" in attempt["error"] and attempt["error"].endswith(".csv")


def test_a_backlog_has_the_claim_session_plan_its_statements_again(
        conn: Conn, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans made while the queue was empty would read the whole runs table on every
    claim once it fills (Worker._replan_if_stale): a full claim drops them, and the
    session goes on claiming (psycopg and the server agree on what is prepared)."""
    from pgflow import worker as worker_module
    monkeypatch.setattr(worker_module, "REPLAN_S", 0.0)
    add_job(conn, "backlog", entrypoint="jobfuncs:noop")
    handle = WorkerThread(db_url, concurrency=2, lease_ttl=30)
    try:
        runs = [enqueue(conn, "backlog", datetime(2024, 1, 1, tzinfo=UTC) + timedelta(seconds=i))
                for i in range(30)]
        wait_for(lambda: all(finished(conn, r) for r in runs), timeout=30)
        # more than psycopg's prepare threshold: the DEALLOCATE itself is never prepared
        assert handle.worker is not None and handle.worker.replans >= 6
    finally:
        handle.stop(grace=1)


def test_the_claim_sessions_plans_are_made_again_after_a_while_without_a_backlog(
        conn: Conn, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pgflow import worker as worker_module
    monkeypatch.setattr(worker_module, "REPLAN_S", 3600.0)
    monkeypatch.setattr(worker_module, "REPLAN_MAX_S", 0.0)
    add_job(conn, "trickle", entrypoint="jobfuncs:noop")
    handle = WorkerThread(db_url, concurrency=8, lease_ttl=30)
    try:
        for i in range(3):  # one at a time: no claim comes back full
            run_id = enqueue(conn, "trickle", datetime(2024, 1, 1, tzinfo=UTC)
                             + timedelta(seconds=i))
            wait_for(functools.partial(finished, conn, run_id), timeout=20)
        assert handle.worker is not None and handle.worker.replans >= 1
    finally:
        handle.stop(grace=1)
