"""The dependency engine against real PostgreSQL: DAG runs, ordering, races, failures."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from engine import WorkerThread, add_job, attempts, run_row, start_dag, states, wait_for
from psycopg.rows import dict_row

from pgflow import deps, queue
from pgflow.queries import q
from pgflow.queue import Finish

Conn = psycopg.Connection[dict[str, Any]]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def diamond(conn: Conn, path: Path | None = None, **top: Any) -> None:
    params = {"path": str(path)} if path else {}
    entry = "jobfuncs:record" if path else "jobfuncs:noop"
    add_job(conn, "top", entrypoint=entry, params=params, schedule="0 * * * *", **top)
    add_job(conn, "left", entrypoint=entry, params=params, depends_on=["top"])
    add_job(conn, "right", entrypoint=entry, params=params, depends_on=["top"])
    add_job(conn, "bottom", entrypoint=entry, params=params, depends_on=["left", "right"])


@pytest.fixture
def worker(db_url: str) -> Iterator[WorkerThread]:
    handle = WorkerThread(db_url, concurrency=8)
    yield handle
    handle.stop(grace=1)


def test_dag_run_is_created_whole_and_pending(conn: Conn) -> None:
    diamond(conn)
    created = start_dag(conn, ["top"], T0)
    assert set(created) == {"top", "left", "right", "bottom"}
    assert states(conn, T0) == {"top": "queued", "left": "pending", "right": "pending",
                                "bottom": "pending"}
    triggers = {r["job"]: r["trigger"] for r in conn.execute(
        "SELECT job, trigger FROM pgflow.runs")}
    assert triggers["top"] == "manual" and triggers["bottom"] == "dependency"


def test_no_downstream_runs_only_the_job(conn: Conn) -> None:
    diamond(conn)
    assert set(start_dag(conn, ["top"], T0, downstream=False)) == {"top"}


def test_diamond_runs_in_dependency_order(conn: Conn, worker: WorkerThread,
                                          tmp_path: Path) -> None:
    path = tmp_path / "order"
    diamond(conn, path)
    ids = start_dag(conn, ["top"], T0)
    wait_for(lambda: states(conn, T0)["bottom"] == "succeeded")
    order = [int(line.split()[0]) for line in path.read_text().splitlines()]
    by_id = {v: k for k, v in ids.items()}
    jobs = [by_id[i] for i in order]
    assert jobs[0] == "top" and jobs[-1] == "bottom" and sorted(jobs[1:3]) == ["left", "right"]
    starts = {a: run_row(conn, ids[a])["started_at"] for a in ids}
    ends = {a: run_row(conn, ids[a])["finished_at"] for a in ids}
    assert starts["bottom"] >= max(ends["left"], ends["right"])


def test_other_roots_of_the_dag_join_the_run(conn: Conn) -> None:
    add_job(conn, "r1", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "r2", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "paused_root", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    conn.execute("UPDATE pgflow.jobs SET paused = true WHERE name = 'paused_root'")
    add_job(conn, "join", entrypoint="jobfuncs:noop", depends_on=["r1", "r2", "paused_root"])
    assert set(start_dag(conn, ["r1"], T0)) == {"r1", "r2", "join"}


def test_triggering_a_non_root_does_not_wait_for_its_upstreams(conn: Conn,
                                                               worker: WorkerThread) -> None:
    diamond(conn)
    created = start_dag(conn, ["left"], T0)
    assert set(created) == {"left", "bottom"}
    wait_for(lambda: states(conn, T0) == {"left": "succeeded", "bottom": "succeeded"})


def test_simultaneous_upstream_completions_queue_the_downstream_once(
        conn: Conn, db_url: str) -> None:
    """Deterministic interleaving: B's finish waits on the downstream lock A's finish holds,
    then sees A's commit."""
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "b", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "d", entrypoint="jobfuncs:noop", depends_on=["a", "b"])
    ids = start_dag(conn, ["a"], T0)
    for job in ("a", "b"):
        conn.execute("UPDATE pgflow.runs SET state = 'running', attempt = 1, lease_owner = %s,"
                     " lease_expires_at = now() + interval '1 minute', attempt_started_at = now()"
                     " WHERE id = %s", (f"w-{job}", ids[job]))

    def done(job: str) -> Finish:
        return Finish(ids[job], 1, f"w-{job}", "succeeded", "succeeded", T0)

    async def scenario() -> None:
        first = await psycopg.AsyncConnection.connect(db_url, autocommit=True)
        second = await psycopg.AsyncConnection.connect(db_url, autocommit=True)
        async with first.transaction():
            cur = first.cursor(row_factory=dict_row)
            await cur.execute(q("finish_attempts"), queue.finish_params([done("a")]))
            rows = await cur.fetchall()
            assert rows[0]["candidates"] == [ids["d"]]
            # Second finisher starts now and must block on d's row lock.
            racing = asyncio.create_task(queue.finish(second, [done("b")]))
            await _blocked_on_a_lock(db_url, second.info.backend_pid)
            assert not racing.done()
            await cur.execute(q("queue_ready_runs"), {"ids": rows[0]["candidates"]})
            assert cur.rowcount == 0  # b not finished yet from a's point of view
        assert await racing == {ids["b"]: "succeeded"}
        await first.close()
        await second.close()

    asyncio.run(scenario())
    assert states(conn, T0)["d"] == "queued"


def test_completion_race_repeated_across_two_workers(conn: Conn, db_url: str) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "b", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "d", entrypoint="jobfuncs:noop", depends_on=["a", "b"])
    workers = [WorkerThread(db_url, concurrency=1, worker_id=f"w{i}") for i in range(2)]
    try:
        times = [T0 + timedelta(hours=i) for i in range(150)]
        for at in times:
            start_dag(conn, ["a"], at)
        wait_for(lambda: conn.execute(
            "SELECT count(*) AS n FROM pgflow.runs WHERE job = 'd' AND state = 'succeeded'"
        ).fetchone()["n"] == len(times), timeout=120)  # type: ignore[index]
    finally:
        for w in workers:
            w.stop(grace=1)
    assert conn.execute("SELECT count(*) AS n FROM pgflow.attempts a JOIN pgflow.runs r"
                        " ON r.id = a.run_id WHERE r.job = 'd'").fetchone() == {"n": len(times)}
    overlap = conn.execute(
        "SELECT count(DISTINCT ra.logical_time) AS n FROM pgflow.attempts a1"
        " JOIN pgflow.runs ra ON ra.id = a1.run_id AND ra.job = 'a'"
        " JOIN pgflow.runs rb ON rb.logical_time = ra.logical_time AND rb.job = 'b'"
        " JOIN pgflow.attempts a2 ON a2.run_id = rb.id AND a1.worker_id <> a2.worker_id"
    ).fetchone()
    assert overlap is not None and overlap["n"] > 0  # the two upstreams did run on both workers


def test_failure_marks_the_closure_and_retry_recovers(conn: Conn, worker: WorkerThread) -> None:
    add_job(conn, "top", entrypoint="jobfuncs:fail_once", schedule="0 * * * *")
    add_job(conn, "mid", entrypoint="jobfuncs:noop", depends_on=["top"])
    add_job(conn, "leaf", entrypoint="jobfuncs:noop", depends_on=["mid"])
    ids = start_dag(conn, ["top"], T0)
    wait_for(lambda: states(conn, T0)["top"] == "failed")
    wait_for(lambda: states(conn, T0) == {"top": "failed", "mid": "upstream_failed",
                                          "leaf": "upstream_failed"})
    assert deps.failed_upstreams(conn, ids["leaf"]) == [
        {"id": ids["top"], "job": "top", "state": "failed"}]
    with conn.transaction():
        conn.execute("UPDATE pgflow.runs SET state = 'queued', finished_at = NULL,"
                     " max_attempts = attempt + 1 WHERE id = %s", (ids["top"],))
        assert deps.restore_after_retry(conn, ids["top"]) == 2
        conn.execute(q("notify_queue"))
    wait_for(lambda: set(states(conn, T0).values()) == {"succeeded"})
    assert [a["outcome"] for a in attempts(conn, ids["top"])] == ["failed", "succeeded"]


def test_restore_keeps_runs_with_another_failed_upstream(conn: Conn) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "b", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "d", entrypoint="jobfuncs:noop", depends_on=["a", "b"])
    ids = start_dag(conn, ["a"], T0)
    conn.execute("UPDATE pgflow.runs SET state = 'failed', finished_at = now()"
                 " WHERE id = ANY(%s)", ([ids["a"], ids["b"]],))
    deps.fail_downstreams(conn, [ids["a"], ids["b"]])
    assert states(conn, T0)["d"] == "upstream_failed"
    with conn.transaction():
        conn.execute("UPDATE pgflow.runs SET state = 'queued', finished_at = NULL WHERE id = %s",
                     (ids["a"],))
        deps.restore_after_retry(conn, ids["a"])
    assert states(conn, T0)["d"] == "upstream_failed"


def test_cycle_free_while_runs_are_pending(conn: Conn) -> None:
    from pgflow.registry import RegistrationError

    diamond(conn)
    start_dag(conn, ["top"], T0)
    with pytest.raises(RegistrationError, match="cycle"):
        add_job(conn, "top", entrypoint="jobfuncs:noop", depends_on=["bottom"])
    # Re-pointing a pending job keeps runs consistent: its old pending run waits on the new
    # upstream set, and a missing upstream run does not hold it back.
    add_job(conn, "bottom", entrypoint="jobfuncs:noop", depends_on=["left"])
    assert states(conn, T0)["bottom"] == "pending"


def test_threads_finishing_many_upstreams_do_not_deadlock(conn: Conn, db_url: str) -> None:
    add_job(conn, "r", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    for i in range(20):
        add_job(conn, f"m{i}", entrypoint="jobfuncs:noop", depends_on=["r"])
    add_job(conn, "fan_in", entrypoint="jobfuncs:noop", depends_on=[f"m{i}" for i in range(20)])
    deadlocks_before = _deadlocks(conn)
    workers = [WorkerThread(db_url, concurrency=10, worker_id=f"w{i}") for i in range(2)]
    try:
        for h in range(5):
            start_dag(conn, ["r"], T0 + timedelta(hours=h))
        wait_for(lambda: conn.execute("SELECT count(*) AS n FROM pgflow.runs WHERE job='fan_in'"
                                      " AND state = 'succeeded'").fetchone()["n"] == 5,  # type: ignore[index]
                 timeout=60)
    finally:
        for w in workers:
            w.stop(grace=1)
    # Finishers lock pending downstream runs in id order: PostgreSQL saw no deadlock, and
    # every run took exactly one attempt (none was retried after a failed flush).
    wait_for(lambda: _deadlocks(conn) is not None)
    assert _deadlocks(conn) == deadlocks_before
    assert conn.execute("SELECT count(*) AS n FROM pgflow.runs r WHERE (SELECT count(*)"
                        " FROM pgflow.attempts a WHERE a.run_id = r.id) <> 1").fetchone() == {
        "n": 0}


def _deadlocks(conn: Conn) -> int | None:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute("SELECT deadlocks FROM pg_stat_database"
                       " WHERE datname = current_database()").fetchone()
    return None if row is None else int(row["deadlocks"])


async def _blocked_on_a_lock(db_url: str, pid: int) -> None:
    """Wait until backend ``pid`` is waiting for a lock (the race's second finisher). Polled
    from a connection of its own, in autocommit: a transaction would keep one snapshot."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as watcher:
        for _ in range(200):
            cur = await watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,))
            row = await cur.fetchone()
            if row is not None and row[0] == "Lock":
                return
            await asyncio.sleep(0.025)
    raise AssertionError(f"backend {pid} never waited for a lock")
