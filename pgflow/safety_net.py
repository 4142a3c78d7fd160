"""The safety net: finds what nothing will ever move, moves it, and tells on us.

Design note
===========

The dependency protocol (deps.py), the lease fencing (queue.py, reaper.py) and
the backfill release are meant to leave no run or backfill stuck. This module
checks that they did, on the leader, every ``INTERVAL_S`` seconds, with cheap
indexed statements (sql/queries/safety_net.sql):

- ``pending_ready`` / ``pending_no_upstream``: a pending run (not held by a
  running backfill) whose upstream runs at its logical time all succeeded, or
  that has none: it should have been queued. It is queued.
- ``pending_upstream_failed``: a pending run with a failed, cancelled or
  upstream_failed upstream: it becomes upstream_failed with its pending closure.
- ``lease_orphaned``: a running run whose lease has not expired but whose owner
  is not a live replica: its lease is expired now, so the reaper retries it.
- ``backfill_finished``: a running backfill with nothing left to run, whose
  last run ended more than ``BACKFILL_GRACE_S`` ago: it is completed.

Pending runs are walked ``PENDING_BATCH`` at a time in id order (a cursor kept
by the caller, wrapping around), so one pass costs the same whatever the
backlog. Every repair is a guarded UPDATE (it only changes a row still in the
state that was judged stuck), is logged as a warning naming the run or backfill
and the repair, and is counted in ``pgflow.repairs`` in the same statement:
``/metrics`` exposes the counts as ``pgflow_repairs_total{kind=...}``,
cluster-wide whichever replica led. A repair means a bug (or a crash between a
transaction and its follow-up); tests assert that none happens.

Only the first three kinds are stuck by construction: every committed state the
engine writes settles pending runs in the same transaction. A backfill is
completed by the transaction that ends its last run, except when that run was
handed back by a worker's renewal (completed by the release that follows it),
hence the grace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg

from pgflow import deps
from pgflow.status import ALIVE_TTLS

INTERVAL_S = 5.0
PENDING_BATCH = 1000
LEASE_BATCH = 500
BACKFILL_GRACE_S = 30.0
KINDS = ("pending_ready", "pending_no_upstream", "pending_upstream_failed", "lease_orphaned",
         "backfill_finished")


@dataclass
class NetPass:
    """What one pass found and repaired: ``repairs`` by kind (every kind listed), each
    repaired thing (``repaired``), and where the next pass resumes its walk of the
    pending runs (``after_id``; 0 once the walk wrapped around)."""

    repairs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    repaired: list[dict[str, Any]] = field(default_factory=list)
    after_id: int = 0

    @property
    def total(self) -> int:
        return sum(self.repairs.values())


def net_flow(*, lease_ttl: float, after_id: int = 0, limit: int = PENDING_BATCH,
             backfill_grace_s: float = BACKFILL_GRACE_S) -> deps.Flow[NetPass]:
    """One pass of the safety net as a dependency flow (run it in one transaction)."""
    found = NetPass()
    row = (yield ("repair_pending", {"after": after_id, "limit": limit}))[0]
    found.after_id = int(row["last_id"]) if row["scanned"] >= limit else 0
    _count(found, row["repaired"])
    doomed = [r["id"] for r in row["repaired"] if r["state"] == "upstream_failed"]
    settled = yield from deps.fail_flow(doomed)
    leases = yield ("repair_leases", {"ttl": lease_ttl, "alive_s": ALIVE_TTLS * lease_ttl,
                                      "limit": LEASE_BATCH})
    _count(found, leases)
    touched = settled.backfills | {r["backfill_id"] for r in row["repaired"] if r["backfill_id"]}
    if touched:  # runs repaired above may have been their backfills' last ones
        yield ("complete_backfills", {"ids": sorted(touched)})
    _count(found, (yield ("repair_backfills", {"grace": backfill_grace_s})))
    return found


def _count(found: NetPass, repaired: list[dict[str, Any]]) -> None:
    for item in repaired:
        found.repairs[item["kind"]] += 1
        found.repaired.append(item)


def report(found: NetPass, log: Any) -> None:
    """One warning per repair, naming what was stuck and what was done."""
    for item in found.repaired:
        kind = item["kind"]
        if kind == "backfill_finished":
            log.warning("safety net: completed a finished backfill nothing had closed",
                        repair=kind, backfill_id=item["id"], job=item["job"])
        elif kind == "lease_orphaned":
            log.warning("safety net: expired the lease of a run whose replica is gone",
                        repair=kind, run_id=item["id"], job=item["job"],
                        attempt=item["attempt"], lease_owner=item["lease_owner"])
        else:
            log.warning("safety net: moved a pending run nothing would have moved",
                        repair=kind, run_id=item["id"], job=item["job"],
                        logical_time=str(item["logical_time"]), state=item["state"])


def run_once(conn: psycopg.Connection[Any], *, lease_ttl: float = 30.0, after_id: int = 0,
             limit: int = PENDING_BATCH, backfill_grace_s: float = BACKFILL_GRACE_S,
             log: Any = None) -> NetPass:
    """One pass on a sync connection, in its own transaction (tests call this: a pass
    that repairs anything where nothing should be stuck is a bug)."""
    with conn.transaction():
        found = deps.run(conn, net_flow(lease_ttl=lease_ttl, after_id=after_id, limit=limit,
                                        backfill_grace_s=backfill_grace_s))
    if log is not None:
        report(found, log)
    return found


async def run_once_async(conn: psycopg.AsyncConnection[Any], *, lease_ttl: float,
                         after_id: int = 0, log: Any = None) -> NetPass:
    """One pass on an async connection (the leader's), in its own transaction."""
    async with conn.transaction():
        found = await deps.run_async(conn, net_flow(lease_ttl=lease_ttl, after_id=after_id))
    if log is not None:
        report(found, log)
    return found


def totals(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Repairs counted so far, cluster-wide, by kind (every kind listed)."""
    counts = dict.fromkeys(KINDS, 0)
    for row in deps.run(conn, _totals_flow()):
        counts[row["kind"]] = int(row["total"])
    return counts


def _totals_flow() -> deps.Flow[deps.Rows]:
    return (yield ("repair_totals", {}))
