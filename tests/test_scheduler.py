import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from drive import check_nothing_stuck
from psycopg import AsyncConnection

from pgflow import queue, registry
from pgflow.queries import q
from pgflow.scheduler import (
    MAX_RUNS_PER_PASS,
    MIN_RUNS_PER_PASS,
    MISFIRE_GRACE,
    PassPace,
    SchedulePass,
    _plan_batch,
    plan_fires,
    run_once,
)
from pgflow.spec import JobSpec

Conn = psycopg.Connection[dict[str, Any]]
NOW = datetime(2024, 6, 3, 12, 0, tzinfo=UTC)
POLICIES = ("latest", "all", "none")


@pytest.fixture(autouse=True)
def _nothing_stuck(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from check_nothing_stuck(request)


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=UTC)


# ---------------------------------------------------------------- plan_fires (pure)


@pytest.mark.parametrize("catchup", POLICIES)
def test_a_job_due_exactly_now_fires_that_tick(catchup: str) -> None:
    assert plan_fires("0 * * * *", "UTC", NOW, catchup, NOW) == ([NOW], NOW + timedelta(hours=1))


@pytest.mark.parametrize("catchup", POLICIES)
def test_a_job_not_due_keeps_its_fire_time(catchup: str) -> None:
    later = NOW + timedelta(minutes=5)
    assert plan_fires("*/5 * * * *", "UTC", later, catchup, NOW) == ([], later)


def test_latest_fires_only_the_newest_missed_tick() -> None:
    fires, next_fire = plan_fires("0 * * * *", "UTC", utc(2024, 6, 3, 8), "latest",
                                  utc(2024, 6, 3, 11, 30))
    assert fires == [utc(2024, 6, 3, 11)]
    assert next_fire == utc(2024, 6, 3, 12)


def test_all_fires_every_missed_tick_in_order() -> None:
    fires, next_fire = plan_fires("0 * * * *", "UTC", utc(2024, 6, 3, 8), "all",
                                  utc(2024, 6, 3, 11, 30))
    assert fires == [utc(2024, 6, 3, h) for h in (8, 9, 10, 11)]
    assert next_fire == utc(2024, 6, 3, 12)


def test_all_caps_a_backlog_and_continues_from_the_first_tick_not_created() -> None:
    fires, next_fire = plan_fires("0 * * * *", "UTC", utc(2024, 6, 3, 8), "all",
                                  utc(2024, 6, 3, 11, 30), max_ticks=2)
    assert fires == [utc(2024, 6, 3, 8), utc(2024, 6, 3, 9)]
    assert next_fire == utc(2024, 6, 3, 10)
    more, after = plan_fires("0 * * * *", "UTC", next_fire, "all", utc(2024, 6, 3, 11, 30),
                             max_ticks=2)
    assert more == [utc(2024, 6, 3, 10), utc(2024, 6, 3, 11)]
    assert after == utc(2024, 6, 3, 12)


def test_none_skips_missed_ticks_but_fires_one_within_the_grace() -> None:
    late = utc(2024, 6, 3, 11) + MISFIRE_GRACE - timedelta(seconds=1)
    assert plan_fires("0 * * * *", "UTC", utc(2024, 6, 3, 8), "none", late) == (
        [utc(2024, 6, 3, 11)], utc(2024, 6, 3, 12))
    too_late = utc(2024, 6, 3, 11) + MISFIRE_GRACE + timedelta(seconds=1)
    assert plan_fires("0 * * * *", "UTC", utc(2024, 6, 3, 8), "none", too_late) == (
        [], utc(2024, 6, 3, 12))


def test_six_field_cron_under_each_policy() -> None:
    every_15s = "*/15 * * * * *"
    start = NOW - timedelta(minutes=2)
    latest = plan_fires(every_15s, "UTC", start, "latest", NOW)
    assert latest == ([NOW], NOW + timedelta(seconds=15))
    fires, _ = plan_fires(every_15s, "UTC", start, "all", NOW)
    assert len(fires) == 9 and fires[0] == start and fires[-1] == NOW
    fires, next_fire = plan_fires(every_15s, "UTC", start, "none", NOW)
    assert fires == [NOW - timedelta(seconds=s) for s in (60, 45, 30, 15, 0)]
    assert next_fire == NOW + timedelta(seconds=15)


def test_spring_forward_fires_the_skipped_time_at_the_end_of_the_gap() -> None:
    # Berlin, 2024-03-31: 02:00 CET jumps to 03:00 CEST (01:00 UTC).
    fires, next_fire = plan_fires("30 2 * * *", "Europe/Berlin", utc(2024, 3, 30, 1, 30),
                                  "all", utc(2024, 3, 31, 12))
    assert fires == [utc(2024, 3, 30, 1, 30), utc(2024, 3, 31, 1)]
    assert next_fire == utc(2024, 4, 1, 0, 30)


def test_fall_back_fires_a_fixed_hour_once() -> None:
    # Berlin, 2024-10-27: 02:30 happens at 00:30 UTC (CEST) and again at 01:30 UTC (CET).
    for catchup in POLICIES:
        fires, next_fire = plan_fires("30 2 * * *", "Europe/Berlin", utc(2024, 10, 27, 0, 30),
                                      catchup, utc(2024, 10, 27, 1, 30))
        assert next_fire == utc(2024, 10, 28, 1, 30), catchup
        assert fires == ([] if catchup == "none" else [utc(2024, 10, 27, 0, 30)]), catchup


def test_fall_back_fires_a_wildcard_hour_in_both_repeated_hours() -> None:
    fires, next_fire = plan_fires("30 * * * *", "America/New_York", utc(2024, 11, 3, 4),
                                  "all", utc(2024, 11, 3, 7))
    # 00:30 EDT, 01:30 EDT, 01:30 EST, 02:30 EST
    assert fires == [utc(2024, 11, 3, h, 30) for h in (4, 5, 6)]
    assert next_fire == utc(2024, 11, 3, 7, 30)


def test_unknown_catchup_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown catchup policy 'some'"):
        plan_fires("0 * * * *", "UTC", NOW, "some", NOW)


# ---------------------------------------------------------------- run_once (PostgreSQL)


def spec(name: str, **keys: Any) -> JobSpec:
    keys.setdefault("command", "true")
    return JobSpec.model_validate({"name": name, **keys})


def add_jobs(conn: Conn, specs: list[JobSpec], next_fire_at: datetime | None = None) -> None:
    registry.apply(conn, specs)
    if next_fire_at is not None:
        conn.execute("UPDATE pgflow.jobs SET next_fire_at = %s WHERE schedule IS NOT NULL"
                      " AND name = ANY(%s)", (next_fire_at, [s.name for s in specs]))


def schedule_once(url: str, now: datetime | None = NOW, batch: int = 1000) -> SchedulePass:
    async def scenario() -> SchedulePass:
        async with await AsyncConnection.connect(url, autocommit=True) as aconn:
            return await run_once(aconn, now, batch)
    return asyncio.run(scenario())


def runs(conn: Conn) -> list[tuple[str, datetime]]:
    rows = conn.execute("SELECT job, logical_time FROM pgflow.runs WHERE trigger = 'schedule'"
                        " ORDER BY job, logical_time").fetchall()
    return [(r["job"], r["logical_time"]) for r in rows]


def fire_times(conn: Conn) -> dict[str, datetime | None]:
    rows = conn.execute("SELECT name, next_fire_at FROM pgflow.jobs").fetchall()
    return {r["name"]: r["next_fire_at"] for r in rows}


def test_run_once_creates_one_run_per_due_job_and_advances_it(conn: Conn, db_url: str) -> None:
    add_jobs(conn, [spec("a", schedule="0 * * * *"), spec("b", schedule="*/30 * * * *"),
                    spec("child", depends_on=["a"])], NOW)
    add_jobs(conn, [spec("later", schedule="0 * * * *")], NOW + timedelta(hours=1))
    result = schedule_once(db_url)
    # The tick of 'a' starts its DAG run: 'child' gets a pending run at the same time.
    assert (result.jobs_fired, result.runs_created) == (2, 3)
    assert runs(conn) == [("a", NOW), ("b", NOW)]
    assert fire_times(conn) == {"a": NOW + timedelta(hours=1),
                                "b": NOW + timedelta(minutes=30), "child": None,
                                "later": NOW + timedelta(hours=1)}
    row = conn.execute("SELECT state, tenant, attempt FROM pgflow.runs WHERE job = 'a'").fetchone()
    assert row == {"state": "queued", "tenant": "default", "attempt": 0}
    assert schedule_once(db_url).runs_created == 0


def test_paused_jobs_fire_nothing_and_catchup_decides_after_resume(
    conn: Conn, db_url: str
) -> None:
    add_jobs(conn, [spec(p, schedule="0 * * * *", catchup=p) for p in POLICIES],
             NOW - timedelta(hours=3))
    conn.execute("UPDATE pgflow.jobs SET paused = true")
    assert schedule_once(db_url).runs_created == 0
    assert runs(conn) == []
    conn.execute("UPDATE pgflow.jobs SET paused = false")
    later = NOW + timedelta(minutes=30)  # resumed half an hour after the last tick
    schedule_once(db_url, later)
    assert runs(conn) == [("all", NOW - timedelta(hours=h)) for h in (3, 2, 1, 0)] + [
        ("latest", NOW)]
    assert set(fire_times(conn).values()) == {NOW + timedelta(hours=1)}


def test_concurrent_schedulers_create_each_tick_once(conn: Conn, db_url: str) -> None:
    add_jobs(conn, [spec(f"j{i}", schedule="*/10 * * * *", catchup="all")
                    for i in range(1_500)], NOW - timedelta(minutes=30))

    async def scenario() -> list[SchedulePass]:
        async with await AsyncConnection.connect(db_url, autocommit=True) as one, \
                await AsyncConnection.connect(db_url, autocommit=True) as two:
            return list(await asyncio.gather(run_once(one, NOW, 100), run_once(two, NOW, 100)))

    results = asyncio.run(scenario())
    assert sum(r.runs_created for r in results) == 1_500 * 4
    assert all(r.runs_created > 0 for r in results)  # both worked, neither doubled a tick
    created = runs(conn)
    assert len(created) == len(set(created)) == 1_500 * 4


def test_a_stale_fire_time_cannot_double_a_tick(conn: Conn, db_url: str) -> None:
    # What a deposed leader could hold: a fire time another scheduler already consumed.
    add_jobs(conn, [spec("a", schedule="0 * * * *")], NOW)
    assert schedule_once(db_url).runs_created == 1
    conn.execute("UPDATE pgflow.jobs SET next_fire_at = %s", (NOW,))
    again = schedule_once(db_url)
    assert (again.jobs_fired, again.runs_created) == (1, 0)
    assert runs(conn) == [("a", NOW)]
    assert fire_times(conn)["a"] == NOW + timedelta(hours=1)


def test_a_job_registered_again_after_its_runs_keeps_its_new_fire_time(
        conn: Conn, db_url: str) -> None:
    """The fire times move just after the runs commit, guarded by the times the pass read:
    an apply that lands in between (here: the advance replayed after it) wins."""
    add_jobs(conn, [spec("a", schedule="0 * * * *")], NOW)
    registered = NOW + timedelta(days=1)
    conn.execute("UPDATE pgflow.jobs SET next_fire_at = %s", (registered,))
    conn.execute(q("advance_jobs"), {"names": ["a"], "planned": [NOW],
                                     "times": [NOW + timedelta(hours=1)]})
    assert fire_times(conn)["a"] == registered
    conn.execute(q("advance_jobs"), {"names": ["a"], "planned": [registered],
                                     "times": [registered + timedelta(hours=1)]})
    assert fire_times(conn)["a"] == registered + timedelta(hours=1)


def test_an_unevaluable_schedule_is_stopped_not_retried_forever(conn: Conn, db_url: str) -> None:
    add_jobs(conn, [spec("ok", schedule="0 * * * *"), spec("bad", schedule="0 * * * *")], NOW)
    conn.execute("UPDATE pgflow.jobs SET timezone = 'Mars/Olympus' WHERE name = 'bad'")
    result = schedule_once(db_url)
    assert result.broken == ["bad"] and result.runs_created == 1
    assert fire_times(conn)["bad"] is None


def test_ten_thousand_due_jobs_get_their_runs_and_wake_the_workers(
    conn: Conn, db_url: str
) -> None:
    add_jobs(conn, [spec(f"job_{i:05}", schedule="*/5 * * * *") for i in range(10_000)], NOW)
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute("LISTEN pgflow_queue")
        started = time.perf_counter()
        result = schedule_once(db_url, batch=MAX_RUNS_PER_PASS)  # the leader's batch
        elapsed = time.perf_counter() - started
        print(f"\n10,000 due jobs scheduled in {elapsed:.3f}s ({result.passes} passes)")
        notified = {n.channel for n in listener.notifies(timeout=5, stop_after=1)}
    assert notified == {"pgflow_queue"}
    assert (result.jobs_fired, result.runs_created, result.more) == (10_000, 10_000, False)
    counts = conn.execute("SELECT count(*) AS runs, count(DISTINCT job) AS jobs,"
                          " min(logical_time) AS first, max(logical_time) AS last"
                          " FROM pgflow.runs").fetchone()
    assert counts == {"runs": 10_000, "jobs": 10_000, "first": NOW, "last": NOW}
    # One tick of 10,000 plain jobs is one pass: its runs become visible together, and
    # workers do not execute the first of them while the leader still creates the rest.
    transactions = conn.execute("SELECT count(DISTINCT xmin::text) AS n FROM pgflow.runs"
                                ).fetchone()
    assert transactions == {"n": 1} and result.runs_created <= MAX_RUNS_PER_PASS


def test_the_due_jobs_query_uses_jobs_due_idx(conn: Conn) -> None:
    specs = [spec(f"job_{i:05}", schedule="0 * * * *") for i in range(5_000)]
    add_jobs(conn, specs)
    conn.execute("UPDATE pgflow.jobs SET next_fire_at = %s::timestamptz"
                 " + make_interval(secs => substr(name, 5)::int)", (NOW,))
    conn.execute("ANALYZE pgflow.jobs")
    plan = conn.execute("EXPLAIN (FORMAT JSON) " + q("due_jobs"),
                        {"now": NOW + timedelta(seconds=30), "horizon": NOW + timedelta(seconds=32),
                         "batch": 1000}).fetchone()
    assert plan is not None
    assert "jobs_due_idx" in str(plan)


# ---------------------------------------------------------------- bounded passes


def due_row(name: str, catchup: str = "all", dag_runs: int = 1,
            since: timedelta = timedelta(minutes=3000)) -> dict[str, Any]:
    return {"name": name, "schedule": "* * * * *", "timezone": "UTC", "catchup": catchup,
            "next_fire_at": NOW - since, "in_dag": dag_runs > 1, "dag_runs": dag_runs}


def test_a_pass_plans_at_most_its_budget_and_leaves_the_rest_due() -> None:
    plan = _plan_batch([due_row("a"), due_row("b"), due_row("c")], NOW, budget=1500)
    assert len(plan.run_jobs) == 1500  # 1000 of a, 500 of b, none of c
    assert plan.names == ["a", "b"] and plan.left_out and plan.still_due
    assert plan.next_times[1] == NOW - timedelta(minutes=3000) + timedelta(minutes=500)


def test_a_dag_tick_weighs_the_runs_of_its_dag_run() -> None:
    plan = _plan_batch([due_row("root", dag_runs=10)], NOW, budget=1000)
    assert len(plan.dag_jobs) == 100


def test_other_catchup_policies_are_never_cut_short() -> None:
    # catchup = "none" fires every tick within the grace and moves past now: cutting it
    # would lose ticks, so it takes its share even beyond the budget.
    seconds = [due_row(f"s{i}", catchup="none", since=timedelta(minutes=5)) for i in range(2)]
    for row in seconds:
        row["schedule"] = "* * * * * *"
    plan = _plan_batch(seconds, NOW, budget=30)
    assert plan.run_jobs == ["s0"] * 61 and plan.left_out


def test_a_backlog_is_created_in_bounded_transactions(conn: Conn, db_url: str) -> None:
    add_jobs(conn, [spec(f"b{i}", schedule="* * * * *", catchup="all") for i in range(3)],
             NOW - timedelta(minutes=2999))
    beats: list[int] = []

    async def scenario() -> SchedulePass:
        async with await AsyncConnection.connect(db_url, autocommit=True) as aconn:
            async def heartbeat() -> None:
                beats.append(1)
            return await run_once(aconn, NOW, before_pass=heartbeat)

    result = asyncio.run(scenario())
    assert result.runs_created == 9000 and not result.more
    assert len(beats) == result.passes >= 2  # a heartbeat before every pass
    per_transaction = conn.execute(
        "SELECT max(n) AS biggest FROM (SELECT xmin, count(*) AS n FROM pgflow.runs"
        " GROUP BY xmin) t").fetchone()
    assert per_transaction is not None and per_transaction["biggest"] <= MAX_RUNS_PER_PASS
    created = runs(conn)
    assert len(created) == len(set(created)) == 9000


def test_a_pace_sizes_passes_from_the_last_sizeable_one() -> None:
    pace = PassPace(target_s=0.5)
    assert pace.budget() == 5000  # the first estimate: 100 us a run
    pace.observe(2500, 0.5)  # a loaded machine: 200 us a run
    assert pace.budget() == 2500
    pace.observe(10, 5.0)  # too small to measure the runs: ignored
    assert pace.budget() == 2500
    pace.observe(1000, 0.01)  # fast: up to the cap, never past it
    assert pace.budget() == MAX_RUNS_PER_PASS
    pace.observe(200, 60.0)  # very slow: never below the floor
    assert pace.budget() == MIN_RUNS_PER_PASS


def test_a_paced_backlog_keeps_each_transaction_to_the_pace_budget(
        conn: Conn, db_url: str) -> None:
    add_jobs(conn, [spec(f"p{i}", schedule="* * * * *", catchup="all") for i in range(3)],
             NOW - timedelta(minutes=2999))
    pace = PassPace(target_s=0.1, seconds_per_run=1e-4)  # 1,000 runs a pass to start

    async def scenario() -> SchedulePass:
        async with await AsyncConnection.connect(db_url, autocommit=True) as aconn:
            return await run_once(aconn, NOW, pace=pace)

    first_budget = pace.budget()
    result = asyncio.run(scenario())
    assert result.runs_created == 9000 and result.passes >= 2
    sizes = conn.execute("SELECT count(*) AS n FROM pgflow.runs GROUP BY xmin"
                         " ORDER BY min(id)").fetchall()
    assert sizes[0]["n"] <= first_budget
    assert max(r["n"] for r in sizes) <= MAX_RUNS_PER_PASS
    assert pace.seconds_per_run != 1e-4  # it learnt from the passes
    created = runs(conn)
    assert len(created) == len(set(created)) == 9000


# ---------------------------------------------------------------- runs created ahead

AHEAD = timedelta(seconds=2)


def test_ticks_within_the_horizon_are_planned_ahead_for_lone_jobs_only() -> None:
    lone = due_row("lone", catchup="none", since=timedelta(0))
    lone["schedule"] = "* * * * * *"
    root = {**lone, "name": "root", "in_dag": True, "dag_runs": 2}
    plan = _plan_batch([lone, root], NOW, horizon=NOW + AHEAD)
    assert plan.run_times == [NOW + timedelta(seconds=s) for s in (0, 1, 2)]
    assert plan.dag_times == [NOW]  # a DAG root fires at its tick only
    assert plan.ahead == {NOW + timedelta(seconds=1), NOW + timedelta(seconds=2)}
    assert plan.next_times == [NOW + timedelta(seconds=3), NOW + timedelta(seconds=1)]
    late = {**lone, "next_fire_at": NOW + timedelta(seconds=1)}  # not due: ahead only
    assert _plan_batch([late], NOW, horizon=NOW + AHEAD).run_times == [
        NOW + timedelta(seconds=1), NOW + timedelta(seconds=2)]
    behind = due_row("behind", catchup="all", since=timedelta(hours=30))  # a backlog
    assert all(t <= NOW for t in _plan_batch([behind], NOW, horizon=NOW + AHEAD).run_times)


def future_tick(conn: Conn) -> datetime:
    """An hourly tick an hour or two from the database's now (a run created ahead for
    it is not claimable during the test)."""
    row = conn.execute("SELECT date_trunc('hour', now()) + interval '2 hours' AS t").fetchone()
    assert row is not None
    return row["t"]  # type: ignore[no-any-return]


def schedule_ahead(url: str, tick: datetime) -> SchedulePass:
    """The leader's pass a second before ``tick``, with the leader's horizon."""
    async def scenario() -> SchedulePass:
        async with await AsyncConnection.connect(url, autocommit=True) as aconn:
            return await run_once(aconn, tick - timedelta(seconds=1), ahead=AHEAD)
    return asyncio.run(scenario())


def ahead_runs(conn: Conn) -> list[dict[str, Any]]:
    return conn.execute("SELECT job, logical_time, state, available_at, priority"
                        " FROM pgflow.runs ORDER BY job").fetchall()


def test_a_run_created_ahead_is_claimable_only_from_its_tick(conn: Conn, db_url: str) -> None:
    tick = future_tick(conn)
    add_jobs(conn, [spec("lone", schedule="0 * * * *"), spec("root", schedule="0 * * * *"),
                    spec("child", depends_on=["root"])], tick)
    result = schedule_ahead(db_url, tick)
    assert (result.runs_created, result.releases) == (1, [tick])
    assert ahead_runs(conn) == [{"job": "lone", "logical_time": tick, "state": "queued",
                                 "available_at": tick, "priority": 0}]
    assert fire_times(conn)["lone"] == tick + timedelta(hours=1)
    assert fire_times(conn)["root"] == tick  # a DAG root waits for its tick
    assert claim_now(db_url) == []


def claim_now(url: str) -> list[dict[str, Any]]:
    async def scenario() -> list[dict[str, Any]]:
        async with await AsyncConnection.connect(url, autocommit=True) as aconn:
            return await queue.claim(aconn, "w1", 10, 30.0)
    return asyncio.run(scenario())


def test_the_leader_wakes_the_workers_when_a_tick_created_ahead_comes(
        conn: Conn, db_url: str) -> None:
    registry.apply(conn, [spec("every_second", schedule="* * * * * *", catchup="none")])

    async def scenario() -> tuple[float, list[str]]:
        async with await AsyncConnection.connect(db_url, autocommit=True) as aconn, \
                await AsyncConnection.connect(db_url, autocommit=True) as listener:
            result = await run_once(aconn, ahead=AHEAD)
            assert result.releases, "a per-second job has ticks within the horizon"
            await listener.execute("LISTEN pgflow_queue")
            await aconn.execute(q("release_ticks"), {"at": result.releases[0]})
            woke = [n.channel async for n in listener.notifies(timeout=1, stop_after=1)]
            cur = await aconn.execute("SELECT extract(epoch FROM clock_timestamp() - %s)"
                                      "::float8", (result.releases[0],))
            row = await cur.fetchone()
            assert row is not None
            return row[0], woke

    after_tick_s, woke = asyncio.run(scenario())
    assert woke == ["pgflow_queue"] and after_tick_s >= 0  # never before the tick


def test_a_pause_withdraws_the_run_created_ahead_and_a_resume_creates_it_again(
        conn: Conn, db_url: str) -> None:
    tick = future_tick(conn)
    add_jobs(conn, [spec("lone", schedule="0 * * * *")], tick)
    schedule_ahead(db_url, tick)
    registry.set_paused(conn, "lone", True)
    assert ahead_runs(conn) == [] and fire_times(conn)["lone"] == tick
    assert schedule_ahead(db_url, tick).runs_created == 0  # paused
    registry.set_paused(conn, "lone", False)
    assert schedule_ahead(db_url, tick).runs_created == 1
    assert [r["logical_time"] for r in ahead_runs(conn)] == [tick]


def test_a_pause_made_with_plain_sql_withdraws_the_run_created_ahead_too(
        conn: Conn, db_url: str) -> None:
    tick = future_tick(conn)
    add_jobs(conn, [spec("lone", schedule="0 * * * *"), spec("other", schedule="0 * * * *")],
             tick)
    schedule_ahead(db_url, tick)
    conn.execute("UPDATE pgflow.runs SET available_at = now() WHERE job = 'other'")
    assert [r["job"] for r in claim_now(db_url)] == ["other"]
    conn.execute("UPDATE pgflow.jobs SET paused = true")  # no pgflow code involved
    assert [r["job"] for r in ahead_runs(conn)] == ["other"]  # a started run stays
    assert fire_times(conn)["lone"] == tick
    conn.execute("UPDATE pgflow.jobs SET paused = true")  # already paused: nothing moves
    assert fire_times(conn)["lone"] == tick
    conn.execute("UPDATE pgflow.jobs SET paused = false")
    assert schedule_ahead(db_url, tick).runs_created == 1
    assert [r["logical_time"] for r in ahead_runs(conn) if r["job"] == "lone"] == [tick]


def test_the_pause_trigger_and_withdraw_ahead_runs_take_the_same_runs(
        conn: Conn, db_url: str) -> None:
    """The pause's trigger (migration 0019) repeats withdraw_ahead_runs' choice of runs in
    the migration's own SQL: both must keep taking exactly the same runs and fire times."""
    tick = future_tick(conn)
    names = ["ahead", "started", "manual"]
    add_jobs(conn, [spec(n, schedule="0 * * * *") for n in names], tick)
    schedule_ahead(db_url, tick)
    conn.execute("UPDATE pgflow.runs SET available_at = now() WHERE job = 'started'")
    assert [r["job"] for r in claim_now(db_url)] == ["started"]
    conn.execute("DELETE FROM pgflow.runs WHERE job = 'manual'")
    conn.execute(q("create_plain_run"), {"job": "manual", "logical_time": tick,
                                         "handoff": False, "params": None,
                                         "only_lone": False})
    # only its trigger tells it from a tick created ahead
    conn.execute("UPDATE pgflow.runs SET available_at = %s WHERE job = 'manual'", (tick,))

    def after(change: str, params: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
        with conn.transaction(force_rollback=True):
            conn.execute(change, params)
            left = [r["job"] for r in ahead_runs(conn)]
            return left, fire_times(conn)

    by_trigger = after("UPDATE pgflow.jobs SET paused = true", {})
    by_query = after(q("withdraw_ahead_runs"), {"names": names, "rewind": names})
    assert by_trigger == by_query
    assert by_trigger[0] == ["manual", "started"] and by_trigger[1]["ahead"] == tick


def test_a_registration_withdraws_the_runs_created_ahead_of_the_jobs_it_changes(
        conn: Conn, db_url: str) -> None:
    tick = future_tick(conn)
    add_jobs(conn, [spec(n, schedule="0 * * * *") for n in ("same", "faster", "moved", "root")],
             tick)
    assert schedule_ahead(db_url, tick).runs_created == 4
    registry.apply(conn, [spec("same", schedule="0 * * * *"),  # unchanged: kept
                          spec("faster", schedule="0 * * * *", priority=5),
                          spec("moved", schedule="30 * * * *"),
                          spec("root", schedule="0 * * * *"),
                          spec("child", depends_on=["root"])])  # root becomes a DAG root
    assert [r["job"] for r in ahead_runs(conn)] == ["same"]
    times = fire_times(conn)
    assert times["faster"] == times["root"] == tick  # the tick comes back, as they now are
    assert times["moved"] is not None and times["moved"].minute == 30
    schedule_ahead(db_url, tick)
    at_tick = [(r["job"], r["priority"]) for r in ahead_runs(conn) if r["logical_time"] == tick]
    assert at_tick == [("faster", 5), ("same", 0)]  # root's tick: a DAG run, at the tick
    registry.delete(conn, "same")
    assert "same" not in {r["job"] for r in ahead_runs(conn)}  # withdrawn, not cancelled


def test_a_run_claimed_at_its_tick_is_not_withdrawn(conn: Conn, db_url: str) -> None:
    tick = future_tick(conn)
    add_jobs(conn, [spec("lone", schedule="0 * * * *")], tick)
    schedule_ahead(db_url, tick)
    conn.execute("UPDATE pgflow.runs SET available_at = now()")  # as if its tick had come
    [claimed] = claim_now(db_url)
    registry.set_paused(conn, "lone", True)
    assert [r["state"] for r in ahead_runs(conn)] == ["running"]
    assert fire_times(conn)["lone"] == tick + timedelta(hours=1)
    conn.execute("UPDATE pgflow.runs SET state = 'succeeded', finished_at = now(),"
                 " lease_owner = NULL, lease_expires_at = NULL WHERE id = %s", (claimed["id"],))
