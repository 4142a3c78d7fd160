"""The lifecycle statements (claim, renew, finish, reap) against real PostgreSQL, called
the way workers and the reaper call them: cancels that race an ending, renewals of exact
(run, attempt) pairs, claims whose reply never arrived, fair capped claims."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple, TypeVar

import psycopg
import pytest
from engine import add_job, attempts, enqueue, run_row, start_dag
from psycopg import sql
from psycopg.rows import dict_row

from pgflow import queue, reaper, registry, retry
from pgflow.claimed import named_rows
from pgflow.queries import q
from pgflow.queue import NO_OFFER, Finish
from pgflow.spec import JobSpec

Conn = psycopg.Connection[dict[str, Any]]
AConn = psycopg.AsyncConnection[Any]
T = TypeVar("T")
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def on(db_url: str, work: Callable[[AConn], Awaitable[T]]) -> T:
    """Run ``work`` on a fresh async connection (as a worker's loop would)."""
    async def main() -> T:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as aconn:
            return await work(aconn)
    return asyncio.run(main())


def claim(conn: Conn, worker: str, limit: int = 100, ttl: float = 30) -> list[dict[str, Any]]:
    return conn.execute(q("claim_runs"), {**NO_OFFER, "worker": worker, "limit": limit,
                                          "ttl": ttl}).fetchall()


def ending(row: dict[str, Any], state: str, outcome: str, worker: str = "w") -> Finish:
    return Finish(run_id=row["id"], attempt=row["attempt"], owner=worker, state=state,
                  outcome=outcome, started_at=row["attempt_started_at"])


def request_cancel(conn: Conn, run_id: int) -> None:
    """A cancel that committed while the attempt ran (its notification not yet seen)."""
    conn.execute("UPDATE pgflow.runs SET cancel_requested = true WHERE id = %s", (run_id,))


# ---------------------------------------------------------------- defect 6: cancels


@pytest.mark.parametrize(("state", "outcome", "final"), [
    ("retrying", retry.FAILED, "cancelled"),
    ("retrying", retry.TIMED_OUT, "cancelled"),
    ("queued", retry.INTERRUPTED, "cancelled"),
    ("failed", retry.FAILED, "cancelled"),
    ("succeeded", retry.SUCCEEDED, "succeeded"),  # the work is done: a late cancel is moot
])
def test_finish_honours_a_cancel_requested_while_the_attempt_ran(
        conn: Conn, db_url: str, state: str, outcome: str, final: str) -> None:
    add_job(conn, "up", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "down", entrypoint="jobfuncs:noop", depends_on=["up"])
    ids = start_dag(conn, ["up"], T0)
    [row] = claim(conn, "w")
    request_cancel(conn, row["id"])
    done = on(db_url, lambda c: queue.finish(c, [ending(row, state, outcome)]))
    assert done == {row["id"]: final}
    run = run_row(conn, row["id"])
    assert (run["state"], run["lease_owner"]) == (final, None)
    assert run["finished_at"] is not None
    assert [(a["attempt"], a["outcome"]) for a in attempts(conn, row["id"])] == [(1, outcome)]
    # A cancelled run's pending downstream can no longer run; a succeeded one's can.
    expected = "upstream_failed" if final == "cancelled" else "queued"
    assert run_row(conn, ids["down"])["state"] == expected


def test_a_lost_lease_with_a_cancel_requested_ends_cancelled(conn: Conn, db_url: str) -> None:
    add_job(conn, "up", entrypoint="jobfuncs:noop", schedule="0 * * * *",
            retry={"max_attempts": 5, "backoff": "0s"})
    add_job(conn, "down", entrypoint="jobfuncs:noop", depends_on=["up"])
    ids = start_dag(conn, ["up"], T0)
    [row] = claim(conn, "w")
    request_cancel(conn, row["id"])
    conn.execute("UPDATE pgflow.runs SET lease_expires_at = now() - interval '1s'"
                 " WHERE id = %s", (row["id"],))
    assert on(db_url, reaper.run_once).reaped == 1
    assert run_row(conn, row["id"])["state"] == "cancelled"  # not retrying, though 4 remain
    assert [a["outcome"] for a in attempts(conn, row["id"])] == ["lost"]
    assert run_row(conn, ids["down"])["state"] == "upstream_failed"


# ---------------------------------------------------------------- defect 7: renewals


def test_renewal_renews_exactly_the_pairs_held(conn: Conn, db_url: str) -> None:
    add_job(conn, "j", entrypoint="jobfuncs:noop")
    mine = [enqueue(conn, "j", at=T0 + timedelta(minutes=i)) for i in range(3)]
    rows = {r["id"]: r for r in claim(conn, "w", ttl=1)}
    other = enqueue(conn, "j", at=T0 + timedelta(hours=1))
    claim(conn, "someone-else", ttl=1)
    held = [(mine[0], 1), (mine[1], 2)]  # mine[1] is on attempt 1: a stale pair
    renewal = on(db_url, lambda c: queue.renew(c, "w", 60, held, release=False))
    assert [(r["id"], r["attempt"]) for r in renewal.renewed] == [(mine[0], 1)]
    assert renewal.released == []
    expiry = {i: run_row(conn, i)["lease_expires_at"] for i in (*mine, other)}
    assert expiry[mine[0]] > rows[mine[0]]["attempt_started_at"] + timedelta(seconds=30)
    for unchanged in (mine[1], mine[2], other):  # not held, or not ours: left alone
        assert expiry[unchanged] < rows[mine[0]]["attempt_started_at"] + timedelta(seconds=2)
        assert run_row(conn, unchanged)["state"] == "running"


def test_a_claim_whose_reply_never_arrived_is_given_back(conn: Conn, db_url: str) -> None:
    add_job(conn, "j", entrypoint="jobfuncs:noop", retry={"max_attempts": 1})
    add_job(conn, "up", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "down", entrypoint="jobfuncs:noop", depends_on=["up"])
    kept = enqueue(conn, "j", at=T0)
    dag = start_dag(conn, ["up"], T0 + timedelta(hours=1))
    # Committed for worker "w", but (as if its connection died) "w" never saw the rows.
    claimed = {r["id"]: r for r in claim(conn, "w")}
    assert set(claimed) == {kept, dag["up"]}
    request_cancel(conn, dag["up"])
    renewal = on(db_url, lambda c: queue.renew(c, "w", 30, [], release=True))
    assert renewal.renewed == []
    assert sorted((r["id"], r["released"]) for r in renewal.released) == sorted(
        [(kept, "queued"), (dag["up"], "cancelled")])
    back = run_row(conn, kept)
    # Claimable again at once; its attempt number stays used (a fencing token is never
    # handed out twice) but the budget grows by one: that attempt never ran...
    assert (back["state"], back["attempt"], back["max_attempts"], back["lease_owner"]) == \
        ("queued", 1, 2, None)
    assert back["available_at"] <= back["created_at"] + timedelta(minutes=1)
    assert attempts(conn, kept) == []  # ...so no attempt row claims it did
    # Given back with a cancel requested: cancelled, and what waited on it can't run.
    assert run_row(conn, dag["up"])["state"] == "cancelled"
    assert run_row(conn, dag["down"])["state"] == "upstream_failed"
    [again] = claim(conn, "w2")
    assert (again["id"], again["attempt"]) == (kept, 2)


def test_a_renewal_without_release_leaves_unheld_runs_to_the_reaper(conn: Conn,
                                                                    db_url: str) -> None:
    add_job(conn, "j", entrypoint="jobfuncs:noop")
    run_id = enqueue(conn, "j", at=T0)
    claim(conn, "w")
    renewal = on(db_url, lambda c: queue.renew(c, "w", 30, [], release=False))
    assert renewal.renewed == [] and renewal.released == []
    assert run_row(conn, run_id)["state"] == "running"


# ---------------------------------------------------------------- defect 16: capped claims


def capped_jobs(conn: Conn, names: list[str], **keys: Any) -> None:
    registry.apply(conn, [JobSpec.model_validate({"name": n, "entrypoint": "jobfuncs:noop",
                                                  "max_active_runs": 1, **keys})
                          for n in names])


def test_capped_jobs_at_their_cap_do_not_hide_the_others(conn: Conn, db_url: str) -> None:
    names = [f"c{i:03d}" for i in range(150)]
    capped_jobs(conn, names)
    for name in names:
        enqueue(conn, name, at=T0)
    for name in names[:100]:  # the alphabetically first 100 are at their cap
        enqueue(conn, name, at=T0 + timedelta(hours=1))
    running = conn.execute(
        "UPDATE pgflow.runs SET state = 'running', attempt = 1, lease_owner = 'busy',"
        " lease_expires_at = now() + interval '1h', attempt_started_at = now()"
        " WHERE job = ANY(%s) AND logical_time = %s RETURNING id",
        (names[:100], T0)).fetchall()
    assert len(running) == 100
    waiting = on(db_url, queue.capped_waiting)
    assert sorted(job for job, _ in waiting.jobs) == names[100:]
    rows = on(db_url, lambda c: queue.claim_capped(c, "w", [job for job, _ in waiting.jobs],
                                                   500, 30))
    assert sorted(r["job"] for r in rows) == names[100:]


def test_capped_jobs_come_best_priority_first(conn: Conn, db_url: str) -> None:
    capped_jobs(conn, ["a_low"], priority=-5)
    capped_jobs(conn, ["b_high"], priority=100)
    capped_jobs(conn, ["c_mid"], priority=7)
    add_job(conn, "plain", entrypoint="jobfuncs:noop", priority=7)
    for name in ("a_low", "b_high", "c_mid", "plain"):
        enqueue(conn, name, at=T0)
    waiting = on(db_url, queue.capped_waiting)
    assert waiting.jobs == [("b_high", 100), ("c_mid", 7), ("a_low", -5)]
    assert waiting.uncapped_priority == 7
    assert waiting.before_uncapped() == ["b_high", "c_mid"]
    rows = on(db_url, lambda c: queue.claim_capped(c, "w", ["b_high", "c_mid", "a_low"], 5, 30,
                                                   min_priority=7))
    assert sorted(r["job"] for r in rows) == ["b_high", "c_mid"]


def test_an_open_breaker_holds_back_capped_runs_too(conn: Conn, db_url: str) -> None:
    capped_jobs(conn, ["uses_wh"], sources=["warehouse"])
    capped_jobs(conn, ["other"])
    for name in ("uses_wh", "other"):
        enqueue(conn, name, at=T0)
    conn.execute("INSERT INTO pgflow.breakers (source, state) VALUES ('warehouse', 'open')")
    rows = on(db_url, lambda c: queue.claim_capped(c, "w", ["uses_wh", "other"], 5, 30))
    assert [r["job"] for r in rows] == ["other"]
    conn.execute("UPDATE pgflow.breakers SET state = 'closed'")
    rows = on(db_url, lambda c: queue.claim_capped(c, "w", ["uses_wh", "other"], 5, 30))
    assert [r["job"] for r in rows] == ["uses_wh"]


def test_a_finish_reads_no_job_rows_when_no_job_produces_a_dataset(conn: Conn) -> None:
    """Jobs just registered have no statistics; the planner then expected most of them
    to produce a dataset and read the whole jobs table for the first one, on every
    finish (10,000 jobs: 2.6 ms a statement). The probe goes through jobs_producing_idx."""
    registry.apply(conn, [JobSpec.model_validate({"name": f"many_{i:04d}", "command": "true"})
                          for i in range(3000)])
    enqueue(conn, "many_0001")
    [row] = claim(conn, "w", limit=1)
    plan = conn.execute("EXPLAIN (FORMAT JSON) " + q("finish_attempts"),
                        queue.finish_params([ending(row, "succeeded", "succeeded")])).fetchone()
    assert plan is not None
    found = _nodes(plan["QUERY PLAN"][0]["Plan"])
    assert not [n for n in found if n["Node Type"] == "Seq Scan"
                and n.get("Relation Name") == "jobs"]
    assert "jobs_producing_idx" in {n.get("Index Name") for n in found}


@pytest.mark.parametrize("shape", [
    {},  # an entrypoint's plain success
    {"exit_code": 0},  # a command's
    {"exit_code": 0, "stdout_tail": "ok\x00"},
    {"state": "retrying", "outcome": "failed", "delay_s": 1.5, "exit_code": 3, "error": "boom"},
    {"state": "retrying", "outcome": "failed", "refund": True},
])
def test_a_result_ends_its_attempt_alike_sent_in_arrays_or_as_json(
        conn: Conn, db_url: str, shape: dict[str, Any]) -> None:
    """finish_params sends plain successes as arrays and the rest as JSON: either way
    the run and its attempt row come out the same."""
    add_job(conn, "alike", entrypoint="jobfuncs:noop")
    for i in range(4):
        enqueue(conn, "alike", at=T0 + timedelta(seconds=i))
    rows = sorted(claim(conn, 'replica "a"\\w'), key=lambda r: r["id"])
    finishes = [dataclasses.replace(ending(row, "succeeded", "succeeded", 'replica "a"\\w'),
                                    **shape) for row in rows]
    by_arrays = queue.finish_params(finishes[:2])
    assert len(by_arrays["ok_ids"]) == (0 if shape.keys() - {"exit_code"} else 2)
    for params in (by_arrays, queue.finish_params(finishes[2:], arrays=False)):
        assert len(conn.execute(q("finish_attempts"), params).fetchall()) == 2

    def ended(run_id: int) -> dict[str, Any]:
        run = run_row(conn, run_id)
        [attempt] = attempts(conn, run_id)
        return {"state": run["state"], "finished": run["finished_at"] is not None,
                "max_attempts": run["max_attempts"], "held": run["held"],
                **{k: v for k, v in attempt.items() if k not in ("run_id", "finished_at")}}

    first = ended(rows[0]["id"])
    assert first["outcome"] == shape.get("outcome", "succeeded")
    assert [ended(row["id"]) for row in rows[1:]] == [first] * 3


def test_a_claim_plan_made_on_an_empty_queue_is_replaced_after_a_replan(db_url: str) -> None:
    """What Worker._replan_if_stale mends: in the claim session (generic plans), a claim
    prepared while runs was empty keeps reading runs whole once it fills; after the
    replan, psycopg prepares it again and the new plan reads runs through its indexes."""
    session = psycopg.connect(db_url, autocommit=True, row_factory=dict_row)
    with session:
        session.execute(q("generic_plans"))
        text, params = queue._claim_sql(8), {**NO_OFFER, "worker": "w", "ttl": 30.0}

        def plan_scans() -> set[tuple[str, str]]:
            [name] = [r["name"] for r in session.execute(
                "SELECT name FROM pg_prepared_statements WHERE statement LIKE %s",
                ("%Claim up to 8 runs%",))]
            # worker, seq, ttl, listen_pid, offer_s: the placeholders in text order
            row = session.execute(sql.SQL(
                "EXPLAIN (FORMAT JSON) EXECUTE {}('w', NULL, 30, NULL, NULL)").format(
                sql.Identifier(name))).fetchone()
            assert row is not None
            return {(n["Node Type"], n.get("Index Name", "")) for n in
                    _nodes(row["QUERY PLAN"][0]["Plan"]) if n.get("Relation Name") == "runs"}

        for _ in range(6):  # past psycopg's prepare threshold: prepared, planned empty
            assert session.execute(text, params).fetchall() == []
        registry.apply(session, [JobSpec.model_validate({"name": f"fill_{i}", "command": "true"})
                                 for i in range(20)])
        session.execute(q("create_plain_runs"), {
            "jobs": [f"fill_{i % 20}" for i in range(5000)],
            "times": [datetime(2024, 1, 1, tzinfo=UTC) + timedelta(seconds=i)
                      for i in range(5000)],
            "trigger": "manual", "params": None, "only_lone": False})
        assert ("Seq Scan", "") in plan_scans()  # the stale plan
        session.execute(q("replan"), prepare=False)
        for _ in range(6):
            assert len(session.execute(text, params).fetchall()) == 8
        scans = plan_scans()
        assert ("Seq Scan", "") not in scans, scans


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node] + [n for child in node.get("Plans", []) for n in _nodes(child)]


class _Pair(NamedTuple):
    id: int
    state: str


def test_named_rows_load_tuples_and_refuse_columns_out_of_order(conn: Conn) -> None:
    cur = conn.cursor(row_factory=named_rows(_Pair))
    rows = cur.execute("SELECT g AS id, 'x' || g AS state FROM generate_series(1, 2) g"
                       ).fetchall()
    assert rows == [_Pair(1, "x1"), _Pair(2, "x2")] and rows[1].state == "x2"
    cur.execute("UPDATE pgflow.jobs SET priority = 0 WHERE false")  # no result: nothing to check
    with pytest.raises(RuntimeError, match=r"columns \('state', 'id'\) are not _Pair's"):
        cur.execute("SELECT 'x' AS state, 1 AS id").fetchall()


# ---------------------------------------------------------------- successes without a transaction


def test_the_claim_hints_which_successes_need_nothing_after_them(conn: Conn) -> None:
    """A run with neither a downstream job nor a backfill may be recorded alone
    (queue.finish_plain); the others need the transactional finish."""
    add_job(conn, "solo", entrypoint="jobfuncs:noop")
    add_job(conn, "up", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "down", entrypoint="jobfuncs:noop", depends_on=["up"])
    enqueue(conn, "solo", at=T0)
    start_dag(conn, ["up"], T0)
    assert {row["job"]: row["plain"] for row in claim(conn, "w")} == {"solo": True,
                                                                     "up": False}


def plain_ending(row: dict[str, Any]) -> Finish:
    return dataclasses.replace(ending(row, "succeeded", "succeeded"), plain=True)


def test_a_plain_success_is_recorded_alone_and_a_stale_hint_falls_back(
        conn: Conn, db_url: str) -> None:
    """finish_plain ends the runs that need nothing after them, in one statement; a run
    whose job gained a downstream job since its claim (the hint is stale) stays running
    for queue.finish, which queues its downstream run; a result whose lease is gone ends
    nothing either way."""
    add_job(conn, "solo", entrypoint="jobfuncs:noop")
    add_job(conn, "up", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "lost", entrypoint="jobfuncs:noop")
    enqueue(conn, "solo", at=T0)
    enqueue(conn, "lost", at=T0)
    start_dag(conn, ["up"], T0)
    rows = {row["job"]: row for row in claim(conn, "w")}
    assert all(row["plain"] for row in rows.values())
    # The DAG is edited while the runs execute: up gains a downstream run waiting for it.
    add_job(conn, "down", entrypoint="jobfuncs:noop", depends_on=["up"])
    [down] = start_dag(conn, ["down"], T0, downstream=False).values()
    conn.execute("UPDATE pgflow.runs SET state = 'pending' WHERE id = %s", (down,))
    conn.execute("UPDATE pgflow.runs SET lease_owner = 'other' WHERE id = %s",
                 (rows["lost"]["id"],))
    finishes = [plain_ending(rows[job]) for job in ("solo", "up", "lost")]

    alone = on(db_url, lambda c: queue.finish_plain(c, finishes))
    assert alone == {rows["solo"]["id"]: "succeeded"}
    assert run_row(conn, rows["up"]["id"])["state"] == "running"
    assert [a["outcome"] for a in attempts(conn, rows["solo"]["id"])] == ["succeeded"]

    rest = on(db_url, lambda c: queue.finish(c, finishes[1:]))
    assert rest == {rows["up"]["id"]: "succeeded"}
    assert run_row(conn, down)["state"] == "queued"
    assert run_row(conn, rows["lost"]["id"])["state"] == "running"
    conn.execute("UPDATE pgflow.runs SET lease_owner = 'w' WHERE id = %s",
                 (rows["lost"]["id"],))  # let the end-of-test check find it unstuck
    assert on(db_url, lambda c: queue.finish(c, [finishes[2]])) == {
        rows["lost"]["id"]: "succeeded"}


@pytest.mark.parametrize("change", [
    {"state": "retrying", "outcome": retry.FAILED},
    {"sources": ("warehouse",)},
    {"unavailable": ("warehouse",), "state": "retrying", "outcome": retry.FAILED},
    {"plain": False},
])
def test_only_successes_that_need_nothing_after_them_are_recorded_alone(
        change: dict[str, Any]) -> None:
    finish = Finish(1, 1, "w", "succeeded", "succeeded", T0, plain=True)
    assert queue.needs_nothing_after(finish)
    assert not queue.needs_nothing_after(dataclasses.replace(finish, **change))
