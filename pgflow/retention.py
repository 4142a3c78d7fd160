"""Retention: finished runs older than ``PGFLOW_RETENTION`` are deleted, with their
attempts, in short batches by the scheduler leader.

What goes (``sql/queries/retention.sql`` has the exact rules)
===========================================================

Runs that finished before ``now() - retention`` in a terminal state — succeeded,
cancelled, upstream_failed, or failed *and acknowledged* — go, and their attempts go
with them in the same statement (attempts carry no foreign key: it cost a query per
finished attempt on the hot path, migration 0016); tables hung off a run by an ``ON
DELETE CASCADE`` key, such as log chunks, go through it. Dead letters (failed, not
acknowledged) stay until ``pgflow runs ack``. Pending, queued, running and retrying
runs never go: they have no ``finished_at``. Two dependency rules keep a DAG run's meaning intact:

* a run stays while a run of one of its direct downstream jobs at the same logical
  time is not finished: a pending run reads its upstreams' runs, and a *missing*
  upstream run means "not part of this DAG run" (``queue_ready_runs``), so deleting
  a finished upstream under a waiting downstream would change what it waits for;
* an upstream_failed run stays while one of its direct upstream runs is a dead letter
  or upstream_failed itself, so that retrying the dead letter still finds it and
  resumes it (``restore_downstreams``). Such a chain goes one level per pass once
  the dead letter is acknowledged.

Backfills that ended before the cutoff go once none of their runs is left.

How
===

``run_once`` (sync: tests and ``pgflow db prune``) and ``run_once_async`` (the
leader) repeat one statement, ``prune_runs``, each time in its own short
transaction: take the ``batch`` oldest finished runs after a cursor through
``runs_finished_idx`` in ``(finished_at, id)`` order (so rows that must stay — dead letters,
runs held by the rules above, rows locked right now — are read once per pass, not
once per batch), lock those that may go with ``FOR UPDATE SKIP LOCKED`` and delete
them. Nothing waits for a prune: claims, renewals and finishes never touch a
finished run, and an operator retrying or acknowledging an old run at that instant
holds its row lock, so the prune skips it (and rechecks the state of every row it
locked, so a run retried a moment ago is no longer a candidate). No table lock, no
long transaction, no ``VACUUM``: autovacuum (per-table settings in migration 0008)
reclaims the space, which new runs then reuse, so the table stops growing once
retention is reached.

The leader calls ``Pruner.run`` from its loop on its lock connection, like the
safety net: at most ``budget_s`` (0.2 s) of batches per call, then the loop goes on
scheduling. A new pass starts every ``interval`` (retention/10, between 1 s and 60 s);
while a pass has a backlog (``Pruner.behind``) the loop comes straight back instead of
sleeping, so pruning takes most of the lock connection's time yet no tick waits more
than one budget. A deposed leader cannot delete anything: its transactions run on the
session whose termination deposes it, and a new leader starts its own pass. Two
pruners at once (a leader change mid-pass) skip each other's locked rows.
``pgflow.retention`` records the leader's retention and what its passes deleted, for
``pgflow db status``.

Tables added later follow the same rule by hanging off a run with an ``ON DELETE
CASCADE`` key (rows of the run written off the hot path: log chunks), or with a
statement of their own here,
run in the same pass (rows with their own lifetime, e.g. delivered notifications
older than the retention; consumed dataset events once no consumer can need them).

Design choice, and the measurements that decided it
===================================================

Time partitioning (Hatchet, Oban Pro) makes dropping a day O(1), but pgflow's ``runs``
cannot be partitioned on a finish time: a row moves partitions on every state change.
The exactly-once key (``job, logical_time``) was a unique index of ``runs`` when this
was decided (it moved to ``run_keys`` in migration 0024), and a unique index must
contain the partition key — so it would have had to be ``logical_time``, which
backfills set years in the past (a 2020 backfill run today would land in a partition
dropped long ago, or keep a 2020 partition alive), and ``attempts`` would need the key
in its foreign key. Moving finished runs to a history table doubles every finish write
and splits every listing. So pgflow deletes in batches and keeps the hot path on
partial indexes; the measurements say both are enough (2-core VM shared with other
work, PostgreSQL 15 with stock settings, ``bench/history.py``):

* Prune throughput: 2,000-run batches (with their attempts) took 53-57 ms at
  1,000,000 and 63 ms at 10,000,000 finished runs: 32,000-37,000 runs/s, flat with
  history. Deleting the attempts through the cascade key beat deleting them in a CTE
  of the same statement (35,000 vs 27,000 runs/s, 5,000-run batches, fsync off), but
  the key's check on every finished attempt cost the hot path more (about 3 µs a run,
  15 % of the finish statement), so the CTE it is since migration 0016.
  "Millions a day" is tens of runs a second. In the load test (2 replicas, 1,000,000
  no-op runs at 3,000/s, retention 10 s) the leader kept up: at most 4,500 runs (1.5 s
  of them) were past the retention at once, the runs table stayed at 210 MB from the
  middle of the run to its end, the claim took 3.3 / 3.1 ms (p50) and 13.6 / 13.2 ms
  (p99) in the first / last minute, and all 1,000,000 runs succeeded once and went.
* The dependency rules are scalar subqueries on the run key (``run_keys``), never
  joins: written as joins, the planner (with statistics from a quieter moment) started
  them from the queued and running runs, once per candidate; batches grew to 17 s
  under load, the leader's heartbeat went stale and standbys deposed it four times in
  a run.
* Hot statements, fastest of 7 round-robin EXPLAIN ANALYZE runs at 0 / 1M / 10M
  finished runs (ms): claim 100 8.7 / 9.4 / 8.3, renew 300 leases 7.8 / 8.2 / 9.0,
  finish 100 7.2 / 9.9 / 10.1, dependency hop 8.3 / 12.3 / 9.8, reap 0.84 / 0.77 /
  0.84, due jobs 1.8 / 1.9 / 1.7, DAG tick 5.6 / 6.4 / 5.8, backfill release 1.1 /
  1.3 / 1.2. Flat from 1M to 10M; from 0 to 1M, statements that insert index entries
  (a tick of 500 jobs 17 → 30 ms) pay for deeper, colder B-trees, O(log n). Every one
  walks a partial index of live runs or the run key (``tests/test_hot_path_plans.py``
  checks the plans at 1,000,000).
* HOT updates: before migration 0008 not one update of ``runs`` was HOT (0 of 41,803
  in a 20,000-run no-op run): ``runs_lease_idx`` indexed the lease expiry, which every
  renewal changes, and full pages left no room. Without that index (the reaper reads
  the running runs through ``runs_running_idx``: a few thousand rows at most) and with
  fillfactor 80, 94 % of lease renewals are HOT (2,400 of 2,550 in a renewal loop; 62 %
  with a real worker renewing 150 adjacent runs). Transitions cannot be HOT (``state``
  is in the partial indexes' predicates, by design), so no-op runs, which rarely renew,
  stay near 0 %.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pgflow.config import DEFAULT_RETENTION_S
from pgflow.queries import q

BATCH = 2000
BACKFILL_BATCH = 100
EVENT_BATCH = 5000
BUDGET_S = 0.2
MIN_INTERVAL_S = 1.0
MAX_INTERVAL_S = 60.0
STATUS_CAP = 100_000


@dataclass
class PrunePass:
    """What a pass deleted (``runs`` by state, ``backfills``), how many finished runs
    it looked at (``scanned``) in how many batches, and whether it reached the cutoff
    (``done``: everything older that remains is kept on purpose)."""

    runs: dict[str, int] = field(default_factory=dict)
    backfills: int = 0
    events: int = 0  # dataset events no job needs any more (pgflow/datasets.py)
    scanned: int = 0
    batches: int = 0
    done: bool = False
    seconds: float = 0.0
    # The cursor: (finished_at, id) of the last run looked at.
    after: tuple[datetime, int] | None = None

    @property
    def deleted(self) -> int:
        return sum(self.runs.values())

    def add(self, row: dict[str, Any], batch: int) -> None:
        self.batches += 1
        self.scanned += row["scanned"]
        for state, n in row["runs"].items():
            self.runs[state] = self.runs.get(state, 0) + int(n)
        if row["after_id"] is not None:
            self.after = (row["after_finished"], int(row["after_id"]))
        self.done = row["scanned"] < batch


def _batch_params(retention_s: float, now: datetime | None, batch: int,
                  after: tuple[datetime, int] | None) -> dict[str, Any]:
    return {"retention_s": retention_s, "now": now, "limit": batch,
            "after_finished": after[0] if after else None,
            "after_id": after[1] if after else None}


def _cutoff_params(retention_s: float, now: datetime | None,
                   limit: int = BACKFILL_BATCH) -> dict[str, Any]:
    return {"retention_s": retention_s, "now": now, "limit": limit}


def _check(retention_s: float, batch: int) -> None:
    if not retention_s > 0:
        raise ValueError(f"retention must be positive, got {retention_s!r}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch!r}")


def _go_on(found: PrunePass, started: float, budget_s: float | None,
           max_batches: int | None) -> bool:
    if found.done:
        return False
    if max_batches is not None and found.batches >= max_batches:
        return False
    return budget_s is None or time.monotonic() - started < budget_s


# prune_runs is never prepared: each batch is planned for its own cursor and cutoff (a
# generic plan cannot know where in the history the cursor is).


def run_once(conn: psycopg.Connection[Any], retention_s: float, *, now: datetime | None = None,
             batch: int = BATCH, max_batches: int | None = None, budget_s: float | None = None,
             pause_s: float = 0.0, after: tuple[datetime, int] | None = None) -> PrunePass:
    """Prune on a sync connection, one transaction per batch, until the cutoff is reached
    (or ``max_batches`` / ``budget_s`` seconds are spent), sleeping ``pause_s`` between
    batches; then the backfills left without runs. ``now`` pins the clock (tests)."""
    _check(retention_s, batch)
    found = PrunePass(after=after)
    started = time.monotonic()
    cur = conn.cursor(row_factory=dict_row)
    while True:
        with conn.transaction():
            row = cur.execute(q("prune_runs"), _batch_params(retention_s, now, batch,
                                                             found.after),
                              prepare=False).fetchone()
        assert row is not None  # an aggregate row
        found.add(row, batch)
        if not _go_on(found, started, budget_s, max_batches):
            break
        if pause_s:
            time.sleep(pause_s)
    if found.done:
        with conn.transaction():
            found.backfills = len(cur.execute(q("prune_backfills"),
                                              _cutoff_params(retention_s, now)).fetchall())
            cur.execute(q("prune_alert_history"), _cutoff_params(retention_s, now))
        with conn.transaction():
            found.events = len(cur.execute(q("prune_dataset_events"),
                                           _cutoff_params(retention_s, now, EVENT_BATCH)
                                           ).fetchall())
    found.seconds = time.monotonic() - started
    return found


async def run_once_async(conn: psycopg.AsyncConnection[Any], retention_s: float, *,
                         now: datetime | None = None, batch: int = BATCH,
                         max_batches: int | None = None, budget_s: float | None = None,
                         after: tuple[datetime, int] | None = None) -> PrunePass:
    """``run_once`` on an async connection (the leader's lock connection), no pauses:
    the leader's loop runs between two calls."""
    _check(retention_s, batch)
    found = PrunePass(after=after)
    started = time.monotonic()
    cur = conn.cursor(row_factory=dict_row)
    while True:
        async with conn.transaction():
            await cur.execute(q("prune_runs"),
                              _batch_params(retention_s, now, batch, found.after),
                              prepare=False)
            row = await cur.fetchone()
        assert row is not None
        found.add(row, batch)
        if not _go_on(found, started, budget_s, max_batches):
            break
    if found.done:
        async with conn.transaction():
            await cur.execute(q("prune_backfills"), _cutoff_params(retention_s, now))
            found.backfills = len(await cur.fetchall())
            await cur.execute(q("prune_alert_history"), _cutoff_params(retention_s, now))
        async with conn.transaction():
            await cur.execute(q("prune_dataset_events"),
                              _cutoff_params(retention_s, now, EVENT_BATCH))
            found.events = len(await cur.fetchall())
    found.seconds = time.monotonic() - started
    return found


def interval_for(retention_s: float) -> float:
    """Seconds between two passes without a backlog: a tenth of the retention, 1-60 s."""
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, retention_s / 10))


class Pruner:
    """The leader's retention service: ``due()`` says whether to call ``run`` now; a call
    does at most ``budget_s`` of batches and remembers where the pass got to, so a
    backlog is worked off over several loop iterations without ever holding the
    scheduling loop longer than the budget."""

    def __init__(self, retention_s: float = DEFAULT_RETENTION_S, *, replica_id: str = "?",
                 batch: int = BATCH, budget_s: float = BUDGET_S,
                 interval_s: float | None = None) -> None:
        _check(retention_s, batch)
        self.retention_s = retention_s
        self.replica_id = replica_id
        self.batch = batch
        self.budget_s = budget_s
        self.interval_s = interval_for(retention_s) if interval_s is None else interval_s
        self._next = 0.0  # the first pass right after winning leadership
        self._after: tuple[datetime, int] | None = None
        self.total = PrunePass()  # everything this pruner deleted, for logs and tests

    def due(self) -> bool:
        return time.monotonic() >= self._next

    @property
    def behind(self) -> bool:
        """The last call stopped at its budget with more to delete: the leader's loop
        then comes back without sleeping (scheduling in between, so no tick waits
        longer than one budget)."""
        return self._after is not None

    async def run(self, conn: psycopg.AsyncConnection[Any], log: Any = None) -> PrunePass:
        found = await run_once_async(conn, self.retention_s, batch=self.batch,
                                     budget_s=self.budget_s, after=self._after)
        # A pass that reached the cutoff starts over from the oldest run next time; one cut
        # short by the budget goes on from its cursor at the next iteration.
        self._after = None if found.done else found.after
        self._next = time.monotonic() + (self.interval_s if found.done else 0.0)
        for state, n in found.runs.items():
            self.total.runs[state] = self.total.runs.get(state, 0) + n
        self.total.backfills += found.backfills
        self.total.batches += found.batches
        await conn.execute(q("record_prune"), {
            "retention_s": self.retention_s, "replica_id": self.replica_id,
            "runs": found.deleted, "backfills": found.backfills})
        if log is not None and (found.deleted or found.backfills or found.events):
            log.info("retention: deleted finished runs", runs=found.deleted,
                     by_state=found.runs, backfills=found.backfills, batches=found.batches,
                     dataset_events=found.events,
                     backlog=not found.done, seconds=round(found.seconds, 3))
        return found


# ---------------------------------------------------------------- reading


def preview(conn: psycopg.Connection[Any], retention_s: float,
            now: datetime | None = None) -> list[dict[str, Any]]:
    """What a prune would delete now: one row per state with ``runs``, ``oldest`` and
    ``newest`` finished_at (``pgflow db prune --dry-run``)."""
    cur = conn.cursor(row_factory=dict_row)
    return cur.execute(q("prune_preview"), {"retention_s": retention_s, "now": now}).fetchall()


def status(conn: psycopg.Connection[Any], retention_s: float, now: datetime | None = None,
           cap: int = STATUS_CAP) -> dict[str, Any]:
    """The retention as ``db status`` shows it: the setting, the cutoff, how many finished
    runs are past it (exact up to ``cap``; ``capped`` beyond), the dead letters among
    them (kept until acknowledged) and the oldest finished run."""
    cur = conn.cursor(row_factory=dict_row)
    row = cur.execute(q("retention_status"),
                      {"retention_s": retention_s, "now": now, "cap": cap}).fetchone()
    assert row is not None
    leader = cur.execute(q("retention_leader")).fetchone()
    return {"retention_s": retention_s, **row, "leader": leader}
