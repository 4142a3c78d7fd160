"""The dependency engine against real PostgreSQL: DAG runs, ordering, races, failures."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from drive import check_nothing_stuck, end_attempt, finish_run, hand_to_worker, run_of
from engine import WorkerThread, add_job, attempts, run_row, start_dag, states, wait_for
from psycopg import AsyncConnection
from psycopg.rows import dict_row

from pgflow import backfill, deps, queue, registry, runs, scheduler
from pgflow.errors import Conflict
from pgflow.queries import q
from pgflow.queue import Finish
from pgflow.spec import JobSpec

Conn = psycopg.Connection[dict[str, Any]]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _nothing_stuck(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from check_nothing_stuck(request)


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
            await cur.execute(q("queue_ready_runs"), {"ids": rows[0]["candidates"],
                                                      "finished": [ids["a"]]})
            # b not finished yet from a's point of view; d was no late-comer
            assert await cur.fetchone() == {"queued": [], "late": [], "backfills": []}
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


# ---------------------------------------------------------------- every way into pending


def chain(conn: Conn, *edges: tuple[str, list[str]], roots: tuple[str, ...] = ("a",)) -> None:
    for root in roots:
        add_job(conn, root, entrypoint="jobfuncs:noop", schedule="0 * * * *")
    for job, upstreams in edges:
        add_job(conn, job, entrypoint="jobfuncs:noop", depends_on=upstreams)


def schedule_at(url: str, now: datetime) -> scheduler.SchedulePass:
    async def go() -> scheduler.SchedulePass:
        async with await AsyncConnection.connect(url, autocommit=True) as aconn:
            return await scheduler.run_once(aconn, now)
    return asyncio.run(go())


def release(url: str) -> int:
    async def go() -> int:
        async with await AsyncConnection.connect(url, autocommit=True) as aconn:
            return await backfill.release(aconn)
    return asyncio.run(go())


def test_a_tick_after_a_no_downstream_trigger_queues_the_downstream_at_once(
        conn: Conn, db_url: str) -> None:
    """Defect 2, second way in: the upstream's run already succeeded when the DAG run
    at its time is created, so no completion will ever look at the new pending run."""
    chain(conn, ("b", ["a"]))
    a = runs.trigger(conn, "a", T0, downstream=False)
    assert finish_run(db_url, conn, a) == "succeeded"
    conn.execute("UPDATE pgflow.jobs SET next_fire_at = %s WHERE name = 'a'", (T0,))
    assert schedule_at(db_url, T0).runs_created == 1  # b only: a's tick already has its run
    assert states(conn, T0) == {"a": "succeeded", "b": "queued"}


def test_a_trigger_of_another_root_settles_runs_behind_finished_upstreams(
        conn: Conn, db_url: str) -> None:
    chain(conn, ("c", ["a", "r"]), ("x", ["a"]), roots=("a", "r"))
    a = runs.trigger(conn, "a", T0, downstream=False)
    finish_run(db_url, conn, a)
    runs.trigger(conn, "r", T0)  # brings the DAG run; a already succeeded at T0
    assert states(conn, T0) == {"a": "succeeded", "r": "queued", "c": "pending", "x": "queued"}
    finish_run(db_url, conn, run_of(conn, "r", T0)["id"])
    assert states(conn, T0)["c"] == "queued"


def test_a_new_pending_run_behind_a_failed_upstream_fails_at_once(conn: Conn,
                                                                  db_url: str) -> None:
    chain(conn, ("b", ["a"]), ("c", ["b"]))
    a = runs.trigger(conn, "a", T0, downstream=False)
    assert finish_run(db_url, conn, a, "failed") == "failed"
    conn.execute("UPDATE pgflow.jobs SET next_fire_at = %s WHERE name = 'a'", (T0,))
    schedule_at(db_url, T0)
    assert states(conn, T0) == {"a": "failed", "b": "upstream_failed", "c": "upstream_failed"}
    runs.retry(conn, a)  # and they resume when it is retried
    assert states(conn, T0) == {"a": "queued", "b": "pending", "c": "pending"}
    finish_run(db_url, conn, a)
    assert states(conn, T0)["b"] == "queued"


def test_a_refused_trigger_creates_no_downstream_runs(conn: Conn) -> None:
    chain(conn, ("b", ["a"]))
    runs.trigger(conn, "a", T0, downstream=False)
    with pytest.raises(Conflict, match="already has run"):
        runs.trigger(conn, "a", T0)
    assert states(conn, T0) == {"a": "queued"}


# ---------------------------------------------------------------- DAG edits (defect 3)


def test_removing_an_edge_queues_a_run_that_now_has_all_it_needs(conn: Conn,
                                                                  db_url: str) -> None:
    chain(conn, ("c", ["a", "b"]), roots=("a", "b"))
    ids = start_dag(conn, ["a"], T0)
    finish_run(db_url, conn, ids["a"])
    hand_to_worker(conn, ids["b"])  # b is running when c is re-wired
    assert states(conn, T0)["c"] == "pending"
    registry.apply(conn, [JobSpec.model_validate(
        {"name": "c", "entrypoint": "jobfuncs:noop", "depends_on": ["a"], "retry":
         {"max_attempts": 1}})])
    assert states(conn, T0)["c"] == "queued"
    # b finishing later changes nothing for c (no longer its downstream)
    assert end_attempt(db_url, conn, ids["b"]) == "succeeded"
    assert states(conn, T0) == {"a": "succeeded", "b": "succeeded", "c": "queued"}


def test_a_re_added_edge_to_a_failed_upstream_fails_the_pending_run(conn: Conn,
                                                                     db_url: str) -> None:
    chain(conn, ("c", ["a"]), roots=("a", "b"))
    ids = start_dag(conn, ["a"], T0)
    b = runs.trigger(conn, "b", T0, downstream=False)
    finish_run(db_url, conn, b, "failed")
    add_job(conn, "c", entrypoint="jobfuncs:noop", depends_on=["a", "b"])
    assert states(conn, T0) == {"a": "queued", "b": "failed", "c": "upstream_failed"}
    runs.retry(conn, b)
    assert states(conn, T0)["c"] == "pending"
    finish_run(db_url, conn, b)
    assert states(conn, T0)["c"] == "pending"  # a has not run yet
    finish_run(db_url, conn, ids["a"])
    assert states(conn, T0)["c"] == "queued"


def test_prune_of_an_upstream_settles_its_former_downstream(conn: Conn, db_url: str) -> None:
    chain(conn, ("c", ["a", "b"]), roots=("a", "b"))
    ids = start_dag(conn, ["a"], T0)
    finish_run(db_url, conn, ids["a"])
    keep = [JobSpec.model_validate({"name": "a", "entrypoint": "jobfuncs:noop",
                                    "schedule": "0 * * * *", "retry": {"max_attempts": 1}}),
            JobSpec.model_validate({"name": "c", "entrypoint": "jobfuncs:noop",
                                    "depends_on": ["a"], "retry": {"max_attempts": 1}})]
    result = registry.apply(conn, keep, prune=True)
    assert result.pruned == ["b"]
    assert states(conn, T0) == {"a": "succeeded", "b": "cancelled", "c": "queued"}


# ---------------------------------------------------------------- retries (defects 4, 5)


def test_retrying_one_failed_upstream_keeps_the_run_behind_another_dead_branch(
        conn: Conn, db_url: str) -> None:
    """X -> B -> C and A -> C; X and A fail. Retrying A must not put C back to pending
    while B is upstream_failed; retrying X then runs B, and C once B succeeded."""
    chain(conn, ("b", ["x"]), ("c", ["b", "a"]), roots=("a", "x"))
    ids = start_dag(conn, ["a"], T0)
    finish_run(db_url, conn, ids["x"], "failed")
    finish_run(db_url, conn, ids["a"], "failed")
    assert states(conn, T0) == {"a": "failed", "x": "failed", "b": "upstream_failed",
                                "c": "upstream_failed"}
    runs.retry(conn, ids["a"])
    assert states(conn, T0) == {"a": "queued", "x": "failed", "b": "upstream_failed",
                                "c": "upstream_failed"}
    finish_run(db_url, conn, ids["a"])
    runs.retry(conn, ids["x"])
    assert states(conn, T0) == {"a": "succeeded", "x": "queued", "b": "pending",
                                "c": "pending"}
    finish_run(db_url, conn, ids["x"])
    assert states(conn, T0)["b"] == "queued" and states(conn, T0)["c"] == "pending"
    finish_run(db_url, conn, ids["b"])
    assert states(conn, T0)["c"] == "queued"


def test_retrying_a_cancelled_pending_downstream_waits_for_its_upstreams(
        conn: Conn, db_url: str) -> None:
    chain(conn, ("b", ["a"]))
    ids = start_dag(conn, ["a"], T0)
    runs.cancel(conn, ids["b"])
    assert runs.retry(conn, ids["b"])["state"] == "pending"
    assert states(conn, T0) == {"a": "queued", "b": "pending"}
    finish_run(db_url, conn, ids["a"])
    assert states(conn, T0)["b"] == "queued"


def test_retrying_a_downstream_whose_upstreams_succeeded_queues_it(conn: Conn,
                                                                   db_url: str) -> None:
    chain(conn, ("b", ["a"]))
    ids = start_dag(conn, ["a"], T0)
    runs.cancel(conn, ids["b"])
    finish_run(db_url, conn, ids["a"])
    assert runs.retry(conn, ids["b"])["state"] == "queued"
    assert states(conn, T0) == {"a": "succeeded", "b": "queued"}


def test_retrying_a_downstream_behind_a_failed_upstream_is_refused(conn: Conn,
                                                                   db_url: str) -> None:
    chain(conn, ("b", ["a"]))
    ids = start_dag(conn, ["a"], T0)
    runs.cancel(conn, ids["b"])
    finish_run(db_url, conn, ids["a"], "failed")
    with pytest.raises(Conflict, match=rf"run {ids['a']} \(a, failed\).*retry that run first"):
        runs.retry(conn, ids["b"])
    assert states(conn, T0) == {"a": "failed", "b": "cancelled"}


# ---------------------------------------------------------------- creation racing a finish


def _running(conn: Conn, run_id: int) -> Finish:
    attempt = hand_to_worker(conn, run_id)
    return Finish(run_id, attempt, "fake-worker", "succeeded", "succeeded", T0)


def test_a_finish_blocked_by_a_creator_still_queues_the_new_run(conn: Conn,
                                                                db_url: str) -> None:
    """The creator share-locks the running upstream first; the finisher's UPDATE waits
    for it, so finish_attempts' snapshot (taken before the wait) cannot see the new
    pending run. queue_ready_runs, the next statement, must find it: d waits for a
    alone, so nothing else would ever queue it."""
    chain(conn, ("c", ["a", "r"]), ("d", ["a"]), roots=("a", "r"))
    a = runs.trigger(conn, "a", T0, downstream=False)
    done = _running(conn, a)

    async def scenario() -> None:
        creator = await AsyncConnection.connect(db_url, autocommit=True)
        finisher = await AsyncConnection.connect(db_url, autocommit=True)
        async with creator.transaction():
            cur = creator.cursor(row_factory=dict_row)
            await cur.execute(q("create_runs"), {
                "jobs": ["r"], "times": [T0], "trigger": "manual", "params": None,
                "downstream": True, "state": "queued", "priority_offset": 0,
                "backfill_id": None})
            created = await cur.fetchall()
            flow = deps.settle_flow([r["id"] for r in created if r["state"] == "pending"],
                                    fresh=[r["id"] for r in created])
            query, params = next(flow)
            assert query == "lock_upstream_runs"
            await cur.execute(q(query), params)  # a is share-locked by the creator
            racing = asyncio.create_task(queue.finish(finisher, [done]))
            await _blocked_on_a_lock(db_url, finisher.info.backend_pid)
            query, params = flow.send(await cur.fetchall())
            assert query == "settle_pending"
            await cur.execute(q(query), params)
            assert (await cur.fetchone())["queued"] == []  # type: ignore[index]
        assert await racing == {a: "succeeded"}
        await creator.close()
        await finisher.close()

    asyncio.run(scenario())
    assert states(conn, T0) == {"a": "succeeded", "r": "queued", "c": "pending", "d": "queued"}
    finish_run(db_url, conn, run_of(conn, "r", T0)["id"])
    assert states(conn, T0)["c"] == "queued"


def test_a_retry_blocked_by_a_finish_sees_the_upstream_succeeded(conn: Conn,
                                                                 db_url: str) -> None:
    """The finisher updated the upstream first: the retried downstream's settling waits
    for its commit on the upstream's row lock, then sees it succeeded (the finisher
    itself could not see the downstream pending)."""
    chain(conn, ("b", ["a"]))
    ids = start_dag(conn, ["a"], T0)
    runs.cancel(conn, ids["b"])
    done = _running(conn, ids["a"])

    async def scenario() -> None:
        finisher = await AsyncConnection.connect(db_url, autocommit=True)
        async with finisher.transaction():
            cur = finisher.cursor(row_factory=queue.finished_rows)
            await cur.execute(q("finish_attempts"), queue.finish_params([done]), binary=True)
            rows = await cur.fetchall()
            assert rows[0].candidates is None  # b is cancelled
            retrying = asyncio.create_task(asyncio.to_thread(_retry, db_url, ids["b"]))
            await _blocked_on_a_lock(db_url, await _creator_pid(db_url))
            await deps.after_finish(finisher, rows)
        assert await retrying == "queued"  # it waited for a, then found it succeeded
        await finisher.close()

    asyncio.run(scenario())
    assert states(conn, T0) == {"a": "succeeded", "b": "queued"}


def _retry(url: str, run_id: int) -> str:
    with psycopg.connect(url, autocommit=True, row_factory=dict_row,
                         application_name="creator") as c:
        state: str = runs.retry(c, run_id)["state"]
        return state


async def _creator_pid(url: str) -> int:
    async with await AsyncConnection.connect(url, autocommit=True) as watcher:
        for _ in range(200):
            cur = await watcher.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'creator'")
            row = await cur.fetchone()
            if row is not None:
                return int(row[0])
            await asyncio.sleep(0.025)
    raise AssertionError("the creator never connected")


@pytest.mark.parametrize("plain", [False, True])
def test_a_finish_waiting_on_a_rewiring_sees_its_new_downstream(
        conn: Conn, db_url: str, plain: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registration re-wires d onto u while u runs: it share-locks u's run, finds it
    running (d waits for it), and commits while u's finish waits for that lock. That
    finish reads job_deps in the snapshot its statement began with, so it does not look
    for d: the registration settles d again once every older transaction has ended, and
    d is queued (after the transactional finish, and after the plain one)."""
    add_job(conn, "x", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "u", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "d", entrypoint="jobfuncs:noop", depends_on=["x"])
    ids = start_dag(conn, ["x", "u"], T0)
    for job in ("x", "u"):
        conn.execute("UPDATE pgflow.runs SET state = 'running', attempt = 1, lease_owner = 'w',"
                     " lease_expires_at = now() + interval '1 minute', attempt_started_at = now()"
                     " WHERE id = %s", (ids[job],))
    done = Finish(ids["u"], 1, "w", "succeeded", "succeeded", T0, plain=plain)
    rewired = JobSpec.model_validate({"name": "d", "entrypoint": "jobfuncs:noop",
                                      "depends_on": ["u"], "retry": {"max_attempts": 1}})
    settled_once, go_on = threading.Event(), threading.Event()
    resettle = registry._resettle

    def pausing(c: psycopg.Connection[Any],
                jobs: list[str]) -> tuple[deps.Settled, list[int]]:
        settled = resettle(c, jobs)
        if not settled_once.is_set():  # the first settle: u's run is locked, still running
            settled_once.set()
            assert go_on.wait(30)
        return settled

    monkeypatch.setattr(registry, "_resettle", pausing)

    async def finish(finisher: AsyncConnection[Any]) -> dict[int, str]:
        return (await queue.finish_plain(finisher, [done])
                or await queue.finish(finisher, [done]))

    async def scenario() -> None:
        async with await AsyncConnection.connect(db_url, autocommit=True) as finisher:
            with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as registration:
                applying = asyncio.create_task(
                    asyncio.to_thread(registry.apply, registration, [rewired]))
                assert await asyncio.to_thread(settled_once.wait, 30)
                racing = asyncio.create_task(finish(finisher))
                await _blocked_on_a_lock(db_url, finisher.info.backend_pid)
                go_on.set()
                await applying
            assert await racing == {ids["u"]: "succeeded"}

    asyncio.run(scenario())
    assert states(conn, T0)["d"] == "queued"
