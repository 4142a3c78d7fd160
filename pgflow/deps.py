"""Dependencies between runs of one logical time (a DAG run).

Design note
===========

Rule. A pending run is queued when every upstream run at its logical time has
succeeded (an upstream job with no run at that time does not hold it back) and
becomes ``upstream_failed`` as soon as one of them is failed, cancelled or
upstream_failed. A pending run *held* by a running backfill (trigger
``backfill``) waits for the backfill's release instead (see backfill.py).

Every way into ``pending`` is checked where it happens, so nothing waits for an
event that already took place:

- Completion: ``finish_attempts`` ends the attempts and locks the pending direct
  downstreams of runs that succeeded (id order); ``queue_ready_runs`` (the next
  statement, fresh snapshot) queues those that are ready.
- Creation (trigger, schedule tick, backfill), retry (a non-root run goes back
  to pending), restore (upstream_failed runs after an operator retry) and DAG
  edits (registration re-wires a job) *settle* the runs they made pending:
  ``lock_upstream_runs`` share-locks their upstream runs, then
  ``settle_pending`` (a new statement) queues or fails them.
- Failure: ``fail_downstreams`` marks the pending closure upstream_failed.

Why nothing strands. PostgreSQL (READ COMMITTED) gives each statement a
snapshot taken when it *starts*; a statement that waits for a row lock goes on
with that snapshot. So two transactions that each write a row and look for the
other's (a finisher F writes "U succeeded" and looks for U's pending
downstreams; a creator C writes "D pending" and looks at D's upstream U) can
both miss each other. The protocol orders them on U's row lock:

1. C inserts D, then share-locks U (``lock_upstream_runs``), then checks D in a
   new statement.
2. F updates U in ``finish_attempts`` (a row lock that conflicts with C's).

If F locked U first, C's lock waits for F's commit and C's check, a later
statement, sees U succeeded: C queues D. If C locked U first, F waits for C's
commit, so F's next statement, ``queue_ready_runs``, sees D even though
``finish_attempts``'s own snapshot (taken before it waited) did not. That is why
``queue_ready_runs`` looks again for pending downstreams of the runs that just
succeeded (``late``) instead of trusting the candidates of ``finish_attempts``;
it locks them in id order and is run once more on them, so two upstreams of a
late D finishing at once still serialise on D and the second sees the first.
The same holds when U fails or is cancelled (``fail_downstreams`` runs after
the update, in a new statement) and when U is retried (``restore_downstreams``
after ``run_retry``). ``fail_downstreams`` itself is repeated on the runs it
just marked until it marks none, because its recursive statement may wait for a
settler's lock on a pending run in the middle of the closure and then miss the
runs that settler created below it. DAG edits are the same case with edges in
place of runs: registration settles the pending runs of every re-wired job
after writing the new edges, and finishers read edges in the same fresh
statements. One order escapes that: a finisher whose statement began before
the edges committed and then waited for the registration's lock on its run
reads the edges in its older snapshot, does not see its new downstream run and
never runs ``queue_ready_runs`` for it, while the registration's settle saw
that upstream still running. So a registration that left re-wired runs
waiting settles them once more after its commit, once every transaction older
than the commit has ended (``registry._resettle_after_older_finishes``,
bounded: past the bound the safety net's pending repair queues them).

What remains: a deadlock is possible (PostgreSQL detects it and rolls one
transaction back; workers and the reaper retry their batch, an operator sees
the error and repeats) when locks are taken across statements in different
orders: a finisher holding a candidate from ``finish_attempts`` waits for a
late run that another finisher locked as its candidate, or a late run that a
settler share-locked as the upstream of a run it settles, while that other
party waits for a row the finisher holds. Each needs a creation, retry or edit
to commit between two finishers' snapshots on the same DAG run. Within one
statement locks are always taken in id order, so the ordinary race (two
upstreams finishing at once) cannot deadlock (test_deps checks PostgreSQL's
deadlock counter under load).

Implementation. Each protocol is a generator of ``(named query, params)``
steps that receives the rows of each step (``Flow``), written once and run by
the sync driver (operator actions, registration, backfill creation) or the
async one (the scheduler, workers, the reaper).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from pgflow.queries import q

if TYPE_CHECKING:  # queue imports this module
    from pgflow.queue import Finished

T = TypeVar("T")
Rows = list[dict[str, Any]]
Step = tuple[str, dict[str, Any]]
Flow = Generator[Step, Rows, T]


@dataclass
class Settled:
    """What a dependency step changed: runs queued, runs that became upstream_failed
    (with their closure), runs held for their backfill, and the backfills touched."""

    queued: list[int] = field(default_factory=list)
    doomed: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    backfills: set[int] = field(default_factory=set)


# ---------------------------------------------------------------- flows


def settle_flow(ids: Iterable[int], *, fresh: Iterable[int] = (), backfill: int | None = None,
                hold: bool = False) -> Flow[Settled]:
    """Settle the pending runs ``ids`` (and those of ``backfill``). ``fresh`` are runs
    this transaction created (nobody else can see them); with ``hold``, ready runs of a
    backfill are held for its release instead of queued."""
    ids, fresh = sorted(set(ids)), sorted(set(fresh))
    settled = Settled()
    if not ids and backfill is None:
        return settled
    params = {"ids": ids, "fresh": fresh, "backfill": backfill}
    locked = (yield ("lock_upstream_runs", params))[0]["locked"]
    all_fresh = backfill is not None or set(ids) <= set(fresh)
    if not locked and all_fresh:
        # Every upstream run of these new runs is new too: none succeeded or failed.
        return settled
    row = (yield ("settle_pending", {**params, "hold": hold}))[0]
    settled.queued += row["queued"]
    settled.held += row["held"]
    settled.backfills.update(row["backfills"])
    if row["doomed"]:
        settled.doomed += row["doomed"]
        yield from _fail_flow(row["doomed"], settled)
    return settled


def fail_flow(run_ids: Iterable[int]) -> Flow[Settled]:
    """The runs ``run_ids`` ended failed or cancelled (or became upstream_failed)."""
    settled = Settled()
    yield from _fail_flow(sorted(set(run_ids)), settled)
    return settled


def _fail_flow(ids: list[int], settled: Settled) -> Flow[None]:
    while ids:
        rows = yield ("fail_downstreams", {"ids": ids})
        ids = [row["id"] for row in rows]
        settled.doomed += ids
        settled.backfills.update(row["backfill_id"] for row in rows if row["backfill_id"])


def finish_flow(rows: Sequence[Finished]) -> Flow[Settled]:
    """After ``finish_attempts`` (its ``rows``), in the same transaction: queue the ready
    downstreams of runs that succeeded, fail those of runs that failed or were cancelled,
    and complete the backfills that have nothing left to run."""
    settled = Settled()
    candidates = list(rows[0].candidates or []) if rows else []
    succeeded = [r.id for r in rows if r.state == "succeeded" and r.downstream]
    if candidates or succeeded:
        out = (yield ("queue_ready_runs", {"ids": candidates, "finished": succeeded}))[0]
        settled.queued += out["queued"]
        settled.backfills.update(out["backfills"])
        if out["late"]:
            again = (yield ("queue_ready_runs", {"ids": out["late"], "finished": []}))[0]
            settled.queued += again["queued"]
            settled.backfills.update(again["backfills"])
    ended = [r.id for r in rows if r.state in ("failed", "cancelled")]
    yield from _fail_flow(sorted(ended), settled)
    done = settled.backfills | {r.backfill_id for r in rows if r.backfill_id}
    if done:
        yield ("complete_backfills", {"ids": sorted(done)})
    return settled


def restore_flow(run_id: int) -> Flow[int]:
    """Run ``run_id`` was retried: its upstream_failed downstreams wait again, unless
    another upstream still holds them back. Returns how many wait again."""
    restored = [row["id"] for row in (yield ("restore_downstreams", {"id": run_id}))]
    if not restored:
        return 0
    settled = yield from settle_flow(restored)
    return len(set(restored) - set(settled.doomed) - set(settled.queued))


# ---------------------------------------------------------------- drivers


def run(conn: psycopg.Connection[Any], flow: Flow[T]) -> T:
    """Run ``flow`` on a sync connection (inside the caller's transaction)."""
    cur = conn.cursor(row_factory=dict_row)
    try:
        query, params = next(flow)
        while True:
            cur.execute(q(query), params)
            query, params = flow.send(cur.fetchall() if cur.description else [])
    except StopIteration as done:
        result: T = done.value
        return result


async def run_async(conn: psycopg.AsyncConnection[Any], flow: Flow[T]) -> T:
    """Run ``flow`` on an async connection (inside the caller's transaction)."""
    cur = conn.cursor(row_factory=dict_row)
    try:
        query, params = next(flow)
        while True:
            await cur.execute(q(query), params)
            rows = await cur.fetchall() if cur.description else []
            query, params = flow.send(rows)
    except StopIteration as done:
        result: T = done.value
        return result


# ---------------------------------------------------------------- entry points


def settle(conn: psycopg.Connection[Any], ids: Iterable[int], *, fresh: Iterable[int] = (),
           backfill: int | None = None, hold: bool = False) -> Settled:
    """Call in the transaction that made ``ids`` pending (see ``settle_flow``)."""
    return run(conn, settle_flow(ids, fresh=fresh, backfill=backfill, hold=hold))


async def settle_async(conn: psycopg.AsyncConnection[Any], ids: Iterable[int], *,
                       fresh: Iterable[int] = ()) -> Settled:
    return await run_async(conn, settle_flow(ids, fresh=fresh))


def fail_downstreams(conn: psycopg.Connection[Any], run_ids: Iterable[int]) -> Settled:
    """Call when runs end failed or cancelled outside a worker (operator cancel)."""
    return run(conn, fail_flow(run_ids))


async def fail_downstreams_async(conn: psycopg.AsyncConnection[Any],
                                 run_ids: Iterable[int]) -> Settled:
    return await run_async(conn, fail_flow(run_ids))


async def after_finish(conn: psycopg.AsyncConnection[Any],
                       rows: Sequence[Finished]) -> Settled:
    """Call right after ``finish_attempts``, in its transaction (see ``finish_flow``)."""
    return await run_async(conn, finish_flow(rows))


def restore_after_retry(conn: psycopg.Connection[Any], run_id: int) -> int:
    """Call in the retry's transaction: downstream runs that failed because of ``run_id``
    wait again; those that still have another failed upstream stay upstream_failed.
    Returns how many runs wait again."""
    return run(conn, restore_flow(run_id))


def failed_upstreams(conn: psycopg.Connection[Any], run_id: int) -> list[dict[str, Any]]:
    """The failed or cancelled upstream runs that hold ``run_id`` back (same logical time)."""
    cur = conn.cursor(row_factory=dict_row)
    return cur.execute(q("failed_upstreams"), {"id": run_id}).fetchall()
