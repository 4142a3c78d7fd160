"""Turning cron ticks into runs.

Every root job (one with a schedule) persists the instant of its next tick in
``pgflow.jobs.next_fire_at``. A scheduling pass locks the due jobs, decides in
Python which logical times to create (``plan_fires``, pure), creates all their runs
with one ``create_plain_runs`` (or ``create_runs`` for DAG roots), advances their
fire times with one UPDATE and commits: the runs and the fire times move together,
so a tick fires once whatever happens (the unique ``(job, logical_time)`` of
``run_keys`` makes a repeated insert a no-op besides). Because the fire time is
persisted, ticks missed while no scheduler ran are seen on restart and handled by
the job's ``catchup`` policy.

Ahead of the tick. With ``ahead`` (the leader passes ``AHEAD``), a job without
downstream jobs has the runs of its ticks within ``ahead`` of now created early,
``queued`` with ``available_at`` at the tick: no claim takes them before it, and at
the tick the leader wakes the workers (``release_ticks``: the server sleeps until
its clock reaches the tick, then NOTIFYs). A tick of 10,000 jobs therefore costs
its creation before the tick, not after it, and scheduling does not compete with
execution for the CPU at that moment (issue 16). Should the leader die in between,
the workers' poll (``worker.POLL_S``) finds the runs a little later; nothing is lost.
A run created ahead is *withdrawn* (deleted, its job's fire time moved back to its
tick) by whatever would have changed it had it not existed yet: a pause, a
registration that changes the job or makes it a DAG root, a delete
(``withdraw_ahead_runs``). DAG roots are not created ahead: withdrawing a DAG run
whose downstream runs other roots share is not worth the early start.

Time is the database's: ``now()`` of the pass's transaction, or a pinned
``now`` in tests.

Bounded work. One pass (one transaction) creates at most about
``MAX_RUNS_PER_PASS`` runs: each due job's ticks are weighted by the size of the
DAG run they start, and jobs beyond the budget stay due, untouched, for the next
pass. A large ``catchup = "all"`` backlog is therefore many short transactions,
and ``run_once`` calls ``before_pass`` (the leader's heartbeat) before each one,
so a leader busy with a backlog keeps its term. The leader also paces its passes
(``PassPace``): from the time its last pass took per run, it sizes the next one to
last a fraction of its lease TTL, so a short TTL on a loaded machine is not outlasted
by one pass either.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import lru_cache
from itertools import islice
from typing import Any

from psycopg import AsyncConnection, Connection
from psycopg.rows import dict_row

from pgflow import deps
from pgflow.cron import CronError, CronSchedule, parse_cron
from pgflow.db import array_literal
from pgflow.queries import q

# Under catchup = "none", a tick this close to the pass's time is on time and fires;
# older missed ticks are skipped. One minute absorbs a leader change or a slow pass
# without turning an outage into a burst of stale runs.
MISFIRE_GRACE = timedelta(seconds=60)

# Ticks created for one job in one pass under catchup = "all"; the rest of a backlog
# follows in later passes.
MAX_TICKS_PER_PASS = 1000

# Runs one pass (one transaction) creates at most, give or take one job's ticks: a
# pass stays well under a second (10,000 plain runs: about 0.3-0.5 s of a loaded 2-core
# machine), so the leader heartbeats often enough. One pass for a whole 10,000-job tick:
# its runs become visible together, and the workers of this replica, idle until then,
# do not compete with the remaining passes for the CPU (issue 16).
MAX_RUNS_PER_PASS = 10_000

# Passes one run_once call makes while passes come back full; the leader calls again
# right away if work is left, heartbeating between passes.
MAX_PASSES = 50

# How far ahead the leader creates the runs of jobs without downstream jobs: enough
# for a tick of 10,000 jobs (about 0.3-0.5 s of a loaded 2-core machine) to be in place
# before it comes.
AHEAD = timedelta(seconds=2)

# The smallest pass a PassPace sizes: below it, a pass's fixed cost dominates.
MIN_RUNS_PER_PASS = 100

_ONE_MICROSECOND = timedelta(microseconds=1)


@dataclass
class PassPace:
    """Sizes scheduling passes to last about ``target_s`` each, from the time the last
    sizeable pass took per run it created. The first estimate is a loaded 2-core
    machine's (about 10,000 plain runs a second)."""

    target_s: float
    seconds_per_run: float = 100e-6

    def budget(self) -> int:
        runs = int(self.target_s / self.seconds_per_run)
        return max(MIN_RUNS_PER_PASS, min(MAX_RUNS_PER_PASS, runs))

    def observe(self, runs: int, seconds: float) -> None:
        if runs >= MIN_RUNS_PER_PASS:  # a small pass measures its fixed cost, not its runs
            self.seconds_per_run = seconds / runs


@lru_cache(maxsize=1024)
def schedule_for(expr: str, timezone: str) -> CronSchedule:
    """The parsed schedule; thousands of jobs usually share a handful of them."""
    return parse_cron(expr, timezone)


def withdraw_ahead(conn: Connection[Any], names: Sequence[str],
                   rewind: Sequence[str] = ()) -> int:
    """Withdraw the runs of ``names`` created ahead of their tick (the module's note);
    the jobs in ``rewind`` get that tick back as their fire time. Call it inside the
    transaction that changes the jobs, after the statements that update their rows.
    Returns how many runs were withdrawn."""
    if not names:
        return 0
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(q("lock_jobs_for_withdrawal"), {"names": list(names)})
        cur.execute(q("withdraw_ahead_runs"), {"names": list(names), "rewind": list(rewind)})
        row = cur.fetchone()
    assert row is not None  # an aggregate returns one row
    return int(row["withdrawn"])


def plan_fires(
    schedule: str,
    timezone: str,
    next_fire_at: datetime,
    catchup: str,
    now: datetime,
    max_ticks: int = MAX_TICKS_PER_PASS,
) -> tuple[list[datetime], datetime]:
    """The logical times to create now and the job's new ``next_fire_at``.

    ``next_fire_at`` is the first tick not yet created; ticks in
    ``[next_fire_at, now]`` are due. ``catchup`` decides which of them fire:

    * ``latest``: only the newest; the fire time moves past ``now``.
    * ``all``: every one, oldest first, at most ``max_ticks``; the fire time
      becomes the first tick not created (still due if the backlog is longer).
    * ``none``: only those within ``MISFIRE_GRACE`` of ``now``; the fire time
      moves past ``now``.

    A job due exactly at ``now`` creates that one tick under every policy. A job
    not due yet creates nothing and keeps its fire time.
    """
    if next_fire_at > now:
        return [], next_fire_at
    cron = schedule_for(schedule, timezone)
    if catchup == "all":
        fires = list(islice(_ticks_through(cron, next_fire_at, now), max_ticks))
        return fires, cron.next_after(fires[-1] if fires else now)
    if catchup == "none":
        start = max(next_fire_at, now - MISFIRE_GRACE)
        fires = list(islice(_ticks_through(cron, start, now), max_ticks))
        return fires, cron.next_after(now)
    if catchup == "latest":
        latest = _latest_tick(cron, next_fire_at, now)
        return ([] if latest is None else [latest]), cron.next_after(now)
    raise ValueError(f"unknown catchup policy {catchup!r}: expected latest, all or none")


def _ticks_through(cron: CronSchedule, start: datetime, end: datetime) -> Iterator[datetime]:
    """Ticks ``t`` with ``start <= t <= end``."""
    return cron.ticks_between(start, end + _ONE_MICROSECOND)


def _latest_tick(cron: CronSchedule, start: datetime, end: datetime) -> datetime | None:
    latest = cron.last_at_or_before(end)
    if latest is None:
        # The backward search looks about a year back; a rarer schedule (29 February)
        # is walked forward instead, which is cheap precisely because it is rare.
        for tick in _ticks_through(cron, start, end):
            latest = tick
    return latest if latest is not None and latest >= start else None


@dataclass
class SchedulePass:
    """What one ``run_once`` call did."""

    passes: int = 0
    jobs_due: int = 0
    jobs_fired: int = 0
    runs_created: int = 0
    # Jobs whose schedule could not be evaluated: their fire time was cleared.
    broken: list[str] = field(default_factory=list)
    # The last pass was full: more due jobs may be waiting.
    more: bool = False
    # The database time the first pass that found due jobs planned for (logged: a pass
    # logged late, by a process frozen right after it, says when it really ran).
    as_of: datetime | None = None
    # Ticks still to come whose runs were created ahead: at each, the workers are woken.
    releases: list[datetime] = field(default_factory=list)


@dataclass
class _Plan:
    run_jobs: list[str] = field(default_factory=list)
    run_times: list[datetime] = field(default_factory=list)
    # Ticks of jobs with downstream jobs: they create whole DAG runs (a slower statement).
    dag_jobs: list[str] = field(default_factory=list)
    dag_times: list[datetime] = field(default_factory=list)
    ahead: set[datetime] = field(default_factory=set)  # ticks still to come among run_times
    names: list[str] = field(default_factory=list)
    planned_from: list[datetime] = field(default_factory=list)  # their fire times as read
    next_times: list[datetime | None] = field(default_factory=list)
    fired: int = 0
    broken: list[str] = field(default_factory=list)
    # Work remains: due jobs past the budget, or a backlog that is still due.
    left_out: bool = False
    still_due: bool = False


def ahead_fires(schedule: str, timezone: str, next_fire_at: datetime, horizon: datetime,
                max_ticks: int = MAX_TICKS_PER_PASS) -> tuple[list[datetime], datetime]:
    """The ticks from ``next_fire_at`` through ``horizon`` (at most ``max_ticks``), to be
    created ahead, and the fire time after them."""
    if next_fire_at > horizon:
        return [], next_fire_at
    cron = schedule_for(schedule, timezone)
    fires = list(islice(_ticks_through(cron, next_fire_at, horizon), max_ticks))
    return fires, cron.next_after(fires[-1]) if fires else next_fire_at


def _plan_job(row: dict[str, Any], now: datetime, horizon: datetime,
              cap: int) -> tuple[list[datetime], datetime]:
    """The ticks of one due job (``plan_fires``), then, for a job without downstream
    jobs that is not behind, those up to ``horizon``, created ahead."""
    fires, next_fire_at = plan_fires(row["schedule"], row["timezone"], row["next_fire_at"],
                                     row["catchup"], now, cap)
    if row["in_dag"] or horizon <= now or next_fire_at <= now:
        return fires, next_fire_at
    early, next_fire_at = ahead_fires(row["schedule"], row["timezone"], next_fire_at, horizon,
                                      max(0, cap - len(fires)))
    return fires + early, next_fire_at


def _plan_batch(rows: Sequence[dict[str, Any]], now: datetime,
                budget: int = MAX_RUNS_PER_PASS, horizon: datetime | None = None) -> _Plan:
    """Plan a batch of due job rows, creating about ``budget`` runs at most (a tick of a
    job weighs the runs of the DAG run it starts); identical schedules are planned once.
    Jobs past the budget are left out: they stay due, untouched, for the next pass.
    Ticks of jobs without downstream jobs up to ``horizon`` are planned too (ahead)."""
    plan = _Plan()
    horizon = now if horizon is None else horizon
    memo: dict[tuple[str, str, datetime, str, int, bool], tuple[list[datetime], datetime]] = {}
    for row in rows:
        if budget <= 0:
            plan.left_out = True
            break
        weight = max(1, row.get("dag_runs", 1))
        # Only catchup = "all" can resume a backlog where it stopped; the other policies
        # fire few ticks and move past now, so they always get their full share.
        cap = (max(1, min(MAX_TICKS_PER_PASS, budget // weight)) if row["catchup"] == "all"
               else MAX_TICKS_PER_PASS)
        key = (row["schedule"], row["timezone"], row["next_fire_at"], row["catchup"], cap,
               row["in_dag"])
        try:
            if key not in memo:
                memo[key] = _plan_job(row, now, horizon, cap)
            fires, next_fire_at = memo[key]
        except (CronError, ValueError):
            plan.broken.append(row["name"])
            plan.names.append(row["name"])
            plan.planned_from.append(row["next_fire_at"])
            plan.next_times.append(None)
            continue
        plan.names.append(row["name"])
        plan.planned_from.append(row["next_fire_at"])
        plan.next_times.append(next_fire_at)
        budget -= len(fires) * weight
        plan.still_due = plan.still_due or next_fire_at <= now
        if row["in_dag"]:
            plan.dag_jobs += [row["name"]] * len(fires)
            plan.dag_times += fires
        else:
            plan.run_jobs += [row["name"]] * len(fires)
            plan.run_times += fires
            plan.ahead.update(fire for fire in fires if fire > now)
        plan.fired += bool(fires)
    return plan


async def run_once(
    conn: AsyncConnection[Any], now: datetime | None = None, batch: int = MAX_RUNS_PER_PASS, *,
    before_pass: Callable[[], Awaitable[None]] | None = None,
    ahead: timedelta = timedelta(0), pace: PassPace | None = None,
) -> SchedulePass:
    """Create the runs of every due tick, ``batch`` jobs and about ``MAX_RUNS_PER_PASS``
    runs per transaction, and with ``ahead`` those of jobs without downstream jobs whose
    ticks come within it (claimable at their tick).

    Passes repeat while work remains (up to ``MAX_PASSES``), so a burst of 10,000 jobs
    due at the same instant is handled within one call; ``before_pass`` is awaited
    before each pass (the leader's heartbeat: it raises to stop). ``now`` pins the
    clock (tests); by default each pass uses the database's ``now()``. ``pace`` sizes
    each pass (and learns from it) instead of ``MAX_RUNS_PER_PASS``.
    """
    result = SchedulePass()
    releases: set[datetime] = set()
    while result.passes < MAX_PASSES:
        if before_pass is not None:
            await before_pass()
        budget = MAX_RUNS_PER_PASS if pace is None else pace.budget()
        created, started = result.runs_created, time.monotonic()
        result.more = await _one_pass(conn, now, min(batch, budget), budget, ahead, result,
                                      releases)
        if pace is not None:
            pace.observe(result.runs_created - created, time.monotonic() - started)
        result.passes += 1
        if not result.more:
            break
    result.releases = sorted(releases)
    return result


async def _one_pass(
    conn: AsyncConnection[Any], now: datetime | None, batch: int, budget: int,
    ahead: timedelta, result: SchedulePass, releases: set[datetime],
) -> bool:
    """One transaction that creates runs and advances the fire times; returns whether
    due work remains."""
    async with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(q("scheduler_now"), {"now": now})
        clock = await cur.fetchone()
        assert clock is not None  # a SELECT without FROM returns one row
        pass_now: datetime = clock["now"]
        result.as_of = result.as_of or pass_now
        await cur.execute(q("due_jobs"), {"now": pass_now, "horizon": pass_now + ahead,
                                          "batch": batch})
        rows = await cur.fetchall()
        if not rows:
            return False
        plan = _plan_batch(rows, pass_now, budget, horizon=pass_now + ahead)
        created = 0
        if plan.run_jobs:
            # Arrays as their text (pgflow.db.array_literal): psycopg's dumping of
            # 10,000-element lists took longer than the insert.
            await cur.execute(q("create_plain_runs"), {
                "jobs": array_literal(plan.run_jobs), "times": array_literal(plan.run_times),
                "trigger": "schedule", "params": None, "only_lone": False})
            created += cur.rowcount
        if plan.dag_jobs:
            await cur.execute(q("create_runs"), {
                "jobs": array_literal(plan.dag_jobs), "times": array_literal(plan.dag_times),
                "trigger": "schedule",
                "params": None, "downstream": True, "state": "queued", "priority_offset": 0,
                "backfill_id": None})
            dag_runs = await cur.fetchall()
            created += len(dag_runs)
            # Downstream runs whose upstreams already ran at that tick (a trigger with
            # --no-downstream, another root's backfill) go ahead in this transaction.
            await deps.settle_async(conn, [r["id"] for r in dag_runs if r["state"] == "pending"],
                                    fresh=[r["id"] for r in dag_runs])
        await cur.execute(q("advance_jobs"), {
            "names": array_literal(plan.names), "planned": array_literal(plan.planned_from),
            "times": array_literal(plan.next_times)})
    releases.update(plan.ahead)
    result.jobs_due += len(plan.names)
    result.jobs_fired += plan.fired
    result.runs_created += created
    result.broken += plan.broken
    return len(rows) >= batch or plan.left_out or plan.still_due
