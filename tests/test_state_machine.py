"""A randomised state machine over the real engine statements and real PostgreSQL.

Hypothesis drives random sequences of what operators, the scheduler, workers and the
reaper do to a small set of jobs (five jobs, a few fixed DAG shapes, three logical
times): triggers with and without downstream, backfills with and without downstream
and their release, claims by fake workers, attempt endings of every outcome (late
ones of a lost lease included), lease expiry and the reaper, cancel, retry, ack,
pause, re-registration of the DAG (edges and jobs added and removed) and scheduler
ticks. After every step: the safety net finds nothing to repair, no attempt number is
reused, every run has at most one live lease, ``finished_at`` is set exactly on final
states, and each (job, logical time) has one run. At the end everything is driven to
quiescence (every claimable run finished, backfills released) and nothing may be left
pending, queued, running or retrying.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from psycopg import AsyncConnection
from psycopg.rows import dict_row

from pgflow import backfill, queue, reaper, registry, retry, runs, safety_net, scheduler
from pgflow.errors import PgflowError
from pgflow.queue import Finish
from pgflow.spec import JobSpec

Conn = psycopg.Connection[dict[str, Any]]
T0 = datetime(2026, 1, 1, tzinfo=UTC)
TIMES = [T0 + timedelta(hours=h) for h in range(3)]
JOBS = ("a", "b", "c", "d", "e")
# Job -> upstreams; a job missing from a shape is pruned when that shape is applied.
SHAPES: list[dict[str, list[str]]] = [
    {"a": [], "b": [], "c": ["a"], "d": ["a", "b"], "e": ["c", "d"]},
    {"a": [], "b": [], "c": ["a", "b"], "d": ["c"], "e": ["a"]},
    {"a": [], "b": [], "c": ["b"], "d": ["c"], "e": ["d", "a"]},
    {"a": [], "b": [], "c": ["a"], "d": ["c"]},
    {"a": [], "c": ["a"], "e": ["c"]},
]
OUTCOMES = (retry.SUCCEEDED, retry.FAILED, retry.TIMED_OUT, retry.CANCELLED, retry.INTERRUPTED)
ACTIVE = ("pending", "queued", "running", "retrying")
TTL = 3600.0  # fake workers are not replicas: keep their leases clear of the safety net
RESET = ("TRUNCATE pgflow.attempts, pgflow.runs, pgflow.backfills, pgflow.job_deps,"
         " pgflow.jobs, pgflow.repairs RESTART IDENTITY CASCADE")


def specs(shape: dict[str, list[str]]) -> list[JobSpec]:
    return [JobSpec.model_validate({
        "name": name, "entrypoint": "jobfuncs:noop",
        **({"depends_on": ups} if ups else {"schedule": "0 * * * *"}),
        "retry": {"max_attempts": 2, "backoff": 0, "jitter": False},
    }) for name, ups in shape.items()]


@dataclass
class Handle:
    """An attempt a fake worker believes it holds (it may have lost it since)."""

    row: dict[str, Any]
    worker: str


class Engine(RuleBasedStateMachine):
    url: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.conn: Conn = psycopg.connect(self.url, autocommit=True, row_factory=dict_row)
        self.conn.execute(RESET)
        self.loop = asyncio.new_event_loop()
        self.aconn = self.loop.run_until_complete(
            AsyncConnection.connect(self.url, autocommit=True))
        self.handles: list[Handle] = []
        self.seen: dict[int, str] = {}  # run id -> state after the previous step

    def teardown(self) -> None:
        try:
            self.drive_to_quiescence()
        finally:
            self.loop.run_until_complete(self.aconn.close())
            self.loop.close()
            self.conn.close()

    # ------------------------------------------------------------ helpers

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def ids(self, *states: str) -> list[int]:
        rows = self.conn.execute("SELECT id FROM pgflow.runs WHERE state = ANY(%s) ORDER BY id",
                                 (list(states),)).fetchall()
        return [row["id"] for row in rows]

    def job_names(self) -> list[str]:
        return [r["name"] for r in self.conn.execute("SELECT name FROM pgflow.jobs ORDER BY 1")]

    def roots(self) -> list[str]:
        return [r["name"] for r in self.conn.execute(
            "SELECT name FROM pgflow.jobs WHERE schedule IS NOT NULL ORDER BY 1")]

    def finish(self, handle: Handle, outcome: str, permanent: bool = False) -> None:
        row = handle.row
        policy = retry.Policy(row["max_attempts"], row["backoff_s"], row["max_backoff_s"],
                              row["jitter"]) if row["backoff_s"] is not None else None
        decision = retry.decide(outcome, row["attempt"], row["max_attempts"], policy,
                                permanent=permanent)
        self.run(queue.finish(self.aconn, [Finish(
            run_id=row["id"], attempt=row["attempt"], owner=handle.worker,
            state=decision.state, delay_s=0.0, outcome=outcome,
            started_at=row["attempt_started_at"])]))

    def claim_all(self, worker: str, limit: int) -> None:
        rows = self.run(queue.claim(self.aconn, worker, limit, TTL))
        self.handles += [Handle(row, worker) for row in rows]

    # ------------------------------------------------------------ rules

    @initialize(shape=st.sampled_from(range(len(SHAPES))))
    def register(self, shape: int) -> None:
        registry.apply(self.conn, specs(SHAPES[shape]))

    @rule(job=st.sampled_from(JOBS), at=st.sampled_from(TIMES), downstream=st.booleans())
    def trigger(self, job: str, at: datetime, downstream: bool) -> None:
        with contextlib.suppress(PgflowError):  # unknown job or the pair already has a run
            runs.trigger(self.conn, job, at, downstream=downstream)

    @rule(job=st.sampled_from(("a", "b")), downstream=st.booleans(), start=st.integers(0, 2),
          cap=st.integers(1, 3))
    def backfill_range(self, job: str, downstream: bool, start: int, cap: int) -> None:
        with contextlib.suppress(PgflowError):
            backfill.create(self.conn, job, TIMES[start], TIMES[-1] + timedelta(hours=1),
                            max_concurrency=cap, downstream=downstream)

    @rule()
    def release(self) -> None:
        self.run(backfill.release(self.aconn))

    @rule(k=st.sampled_from(range(len(TIMES))))
    def tick(self, k: int) -> None:
        """The leader's pass at TIMES[k], as if it had fallen behind to that tick."""
        self.conn.execute("UPDATE pgflow.jobs SET next_fire_at = least(next_fire_at, %s)"
                          " WHERE schedule IS NOT NULL", (TIMES[k],))
        self.run(scheduler.run_once(self.aconn, TIMES[k]))

    @rule(limit=st.integers(1, 4), worker=st.sampled_from(("w1", "w2")))
    def claim(self, limit: int, worker: str) -> None:
        self.claim_all(worker, limit)

    @precondition(lambda self: self.handles)
    @rule(pick=st.integers(0, 100), outcome=st.sampled_from(OUTCOMES),
          permanent=st.booleans())
    def end_attempt(self, pick: int, outcome: str, permanent: bool) -> None:
        handle = self.handles.pop(pick % len(self.handles))
        self.finish(handle, outcome, permanent)

    @precondition(lambda self: self.handles)
    @rule(pick=st.integers(0, 100))
    def lose_lease(self, pick: int) -> None:
        """The worker froze: its lease expires and the reaper takes the run. The handle is
        kept, so a late result of that attempt can be tried (and must be fenced off)."""
        handle = self.handles[pick % len(self.handles)]
        self.conn.execute("UPDATE pgflow.runs SET lease_expires_at = now() - interval '1 s'"
                          " WHERE id = %s AND state = 'running' AND attempt = %s",
                          (handle.row["id"], handle.row["attempt"]))
        self.run(reaper.run_once(self.aconn))

    @precondition(lambda self: self.ids(*ACTIVE))
    @rule(pick=st.integers(0, 100))
    def cancel(self, pick: int) -> None:
        active = self.ids(*ACTIVE)
        with contextlib.suppress(PgflowError):
            runs.cancel(self.conn, active[pick % len(active)])

    @precondition(lambda self: self.ids("failed", "cancelled", "upstream_failed"))
    @rule(pick=st.integers(0, 100))
    def retry_run(self, pick: int) -> None:
        ended = self.ids("failed", "cancelled", "upstream_failed")
        # refused: running, upstream_failed, an upstream not succeeded, the job gone
        with contextlib.suppress(PgflowError):
            runs.retry(self.conn, ended[pick % len(ended)])

    @precondition(lambda self: self.ids("failed"))
    @rule(pick=st.integers(0, 100))
    def ack(self, pick: int) -> None:
        failed = self.ids("failed")
        with contextlib.suppress(PgflowError):
            runs.ack(self.conn, failed[pick % len(failed)])

    @rule(job=st.sampled_from(("a", "b")), paused=st.booleans())
    def pause(self, job: str, paused: bool) -> None:
        with contextlib.suppress(PgflowError):
            registry.set_paused(self.conn, job, paused)

    @rule(shape=st.sampled_from(range(len(SHAPES))))
    def reshape(self, shape: int) -> None:
        registry.apply(self.conn, specs(SHAPES[shape]), prune=True)

    # ------------------------------------------------------------ invariants

    @invariant()
    def nothing_is_stuck(self) -> None:
        found = safety_net.run_once(self.conn, lease_ttl=TTL, backfill_grace_s=0)
        assert found.repaired == [], found.repaired

    @invariant()
    def attempts_are_never_reused(self) -> None:
        bad = self.conn.execute("""
            SELECT r.id, r.state, r.attempt, max(a.attempt) AS recorded, count(a.*) AS n,
                   count(DISTINCT a.attempt) AS distinct_attempts
            FROM pgflow.runs r JOIN pgflow.attempts a ON a.run_id = r.id
            GROUP BY r.id
            HAVING max(a.attempt) > r.attempt
                OR (r.state = 'running' AND max(a.attempt) >= r.attempt)
                OR count(a.*) <> count(DISTINCT a.attempt)""").fetchall()
        assert bad == []

    @invariant()
    def leases_and_final_states_are_consistent(self) -> None:
        bad = self.conn.execute("""
            SELECT id, state FROM pgflow.runs
            WHERE (state = 'running') <> (lease_owner IS NOT NULL)
               OR (state IN ('succeeded', 'failed', 'cancelled', 'upstream_failed'))
                  <> (finished_at IS NOT NULL)""").fetchall()
        assert bad == []
        live = {}
        for row in self.conn.execute("SELECT id, attempt, lease_owner FROM pgflow.runs"
                                     " WHERE state = 'running'"):
            live[row["id"]] = (row["attempt"], row["lease_owner"])
        holders = [h for h in self.handles
                   if live.get(h.row["id"]) == (h.row["attempt"], h.worker)]
        assert len(holders) == len({h.row["id"] for h in holders})  # one live lease per run

    @invariant()
    def runs_wait_for_their_upstreams(self) -> None:
        """A run that was waiting (pending) or ended (and was retried) is only queued once
        every upstream run at its logical time has succeeded, by the current edges."""
        rows = self.conn.execute("""
            SELECT r.id, r.state,
                   coalesce(bool_and(u.state = 'succeeded'), true) AS upstreams_done
            FROM pgflow.runs r
            LEFT JOIN pgflow.job_deps d ON d.job = r.job
            LEFT JOIN pgflow.runs u ON u.job = d.upstream AND u.logical_time = r.logical_time
            GROUP BY r.id""").fetchall()
        waited = ("pending", "failed", "cancelled", "upstream_failed")
        early = [row["id"] for row in rows if row["state"] == "queued"
                 and self.seen.get(row["id"]) in waited and not row["upstreams_done"]]
        assert early == [], f"queued before their upstreams succeeded: {early}"
        self.seen = {row["id"]: row["state"] for row in rows}

    @invariant()
    def one_run_per_job_and_time(self) -> None:
        dupes = self.conn.execute("SELECT job, logical_time FROM pgflow.runs"
                                  " GROUP BY 1, 2 HAVING count(*) > 1").fetchall()
        assert dupes == []

    # ------------------------------------------------------------ the end

    def drive_to_quiescence(self, rounds: int = 60) -> None:
        """Finish everything that can run (late handles first, fenced or not), until
        no run is pending, queued, running or retrying."""
        for handle in self.handles:
            self.finish(handle, retry.SUCCEEDED)
        self.handles = []
        for _ in range(rounds):
            self.run(backfill.release(self.aconn))
            self.conn.execute("UPDATE pgflow.runs SET available_at = now()"
                              " WHERE state = 'retrying'")
            self.claim_all("finisher", 100)
            if not self.handles and not self.ids(*ACTIVE):
                break
            for handle in self.handles:
                self.finish(handle, retry.SUCCEEDED)
            self.handles = []
            self.nothing_is_stuck()
        left = self.conn.execute("SELECT id, job, logical_time, state, trigger, backfill_id"
                                 " FROM pgflow.runs WHERE state = ANY(%s)",
                                 (list(ACTIVE),)).fetchall()
        assert left == [], f"stranded: {left}"
        stuck = self.conn.execute("SELECT id FROM pgflow.backfills WHERE state = 'running'"
                                  ).fetchall()
        assert stuck == [], f"backfills never completed: {stuck}"
        self.nothing_is_stuck()


def test_the_engine_never_strands_a_run(db_url: str) -> None:
    Engine.url = db_url
    run_state_machine_as_test(Engine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
