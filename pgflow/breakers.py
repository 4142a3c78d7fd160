"""Circuit breakers, one per external source (``sources = [...]`` in job definitions).

States (SPEC §4c): ``closed`` → ``open`` after ``failure_threshold`` consecutive
source-unavailable attempts (exit 75, ``SourceUnavailable``: the named source, or
every source of the job when unnamed) of jobs touching the source; a success
touching it resets the count. While a breaker is not closed, the runs of every job
touching its source are *held*: flagged out of the claim indexes (pending, queued and
retrying runs, in the transaction of the transition), so they cost a claim nothing;
their downstream runs simply stay pending. The attempt that opens the breaker, and
every source-unavailable attempt while it is open, goes back to ``retrying`` without
using up the run's budget (``max_attempts`` + 1, as an interrupted attempt).

After the cooldown the breaker is ``half_open`` (``breaker_half_open_due``, a guarded
UPDATE that any replica's claim loop may run; the first wins). Exactly one probe run
goes through, cluster-wide: ``claim_probe`` sets the breaker's ``probe_run`` with a
compare-and-set on the value it read, in the statement that claims the run. The probe
succeeding closes the breaker and releases the held runs; the probe (or any attempt)
being source-unavailable again re-opens it with the cooldown doubled, capped at
``MAX_COOLDOWN_S`` (1 h) or the base cooldown when that is longer. A probe that ends
otherwise (failed, lost) frees the slot for another probe.

The counting happens in the finish transaction (``record``): the breakers of the
sources named are locked in name order, the results still holding their lease are
locked, the transitions are decided by ``after_unavailable`` (pure: plain values in,
plain values out) and written by guarded UPDATEs whose row counts are checked.

An operator opens (``manual``: no probe, it stays open until closed by hand) and
closes breakers by hand; every transition is logged in ``pgflow.breaker_transitions``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pgflow.claimed import Claimed, claimed_rows
from pgflow.errors import Conflict, InvalidInput, NotFound
from pgflow.queries import q
from pgflow.spec import NAME_RE

Conn = psycopg.Connection[dict[str, Any]]
MAX_REASON = 1000


def list_breakers(conn: Conn) -> list[dict[str, Any]]:
    """Every known source, open breakers first; ``jobs`` counts the jobs that use it."""
    return conn.execute(q("breaker_list")).fetchall()


def open_sources(conn: Conn) -> list[str]:
    return [row["source"] for row in conn.execute(q("breakers_open_sources"))]


def open_breaker(conn: Conn, source: str, reason: str | None, by: str | None) -> dict[str, Any]:
    """Open the breaker of ``source`` (a source no job names yet may be opened too)."""
    check_source(source)
    reason = _check_reason(reason)
    with conn.transaction():
        row = conn.execute(q("breaker_open"), {"source": source, "reason": reason, "by": by,
                                               "now": None}).fetchone()
        if row is not None:
            conn.execute(q("breaker_hold_runs"), {"sources": [source]})
    if row is None:
        current = conn.execute(q("breaker_get"), {"source": source}).fetchone()
        since = current["changed_at"].isoformat() if current else "?"
        why = f" ({current['reason']})" if current and current["reason"] else ""
        raise Conflict(f"the breaker of source {source!r} is already open since {since}{why}")
    return row


def close_breaker(conn: Conn, source: str, reason: str | None, by: str | None) -> dict[str, Any]:
    """Close the breaker of ``source``: its jobs' held-back runs may be claimed again."""
    check_source(source)
    reason = _check_reason(reason)
    with conn.transaction():
        row = conn.execute(q("breaker_close"), {"source": source, "reason": reason, "by": by,
                                                "now": None}).fetchone()
        if row is not None:
            conn.execute(q("breaker_release_runs"), {"sources": [source]})
            conn.execute(q("notify_queue"))
    if row is not None:
        return row
    if conn.execute(q("breaker_get"), {"source": source}).fetchone() is not None:
        raise Conflict(f"the breaker of source {source!r} is already closed")
    used = conn.execute(q("breaker_source_used"), {"source": source}).fetchone()
    if used and used["used"]:
        raise Conflict(f"the breaker of source {source!r} is already closed")
    raise NotFound(f"no source named {source!r}: no job lists it and it has no breaker"
                   " (see 'GET /api/v1/breakers')")


def check_source(source: str) -> None:
    if not (0 < len(source) <= 128 and NAME_RE.fullmatch(source)):
        raise InvalidInput("a source name starts with a letter or digit and uses only letters,"
                           " digits, '_', '.', '-' (at most 128 characters)")


def _check_reason(reason: str | None) -> str | None:
    if reason is None or not reason.strip():
        return None
    if len(reason) > MAX_REASON or "\x00" in reason:
        raise InvalidInput(f"a reason is plain text of at most {MAX_REASON} characters")
    return reason.strip()


def recent_transitions(conn: Conn, limit: int = 20) -> list[dict[str, Any]]:
    return conn.execute(q("breaker_transitions_recent"), {"limit": limit}).fetchall()


# ---------------------------------------------------------------- automatic transitions

MAX_COOLDOWN_S = 3600.0
CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class State:
    """A breaker as the finish transaction locked it."""

    source: str
    state: str
    failures: int
    cooldown_s: float | None
    threshold: int
    base_s: float


@dataclass(frozen=True)
class Change:
    state: str
    failures: int
    cooldown_s: float | None
    reason: str


def next_cooldown(current: float | None, base_s: float) -> float:
    """The cooldown after a failed probe: doubled, capped at 1 h (or the base, if longer)."""
    return min((current or base_s) * 2, max(base_s, MAX_COOLDOWN_S))


def after_unavailable(b: State, count: int) -> Change:
    """What ``count`` more source-unavailable attempts do to breaker ``b``."""
    if b.state == CLOSED:
        failures = b.failures + count
        if failures >= b.threshold:
            return Change(OPEN, failures, b.base_s,
                          f"{failures} consecutive source-unavailable attempts")
        return Change(CLOSED, failures, None, "")
    if b.state == HALF_OPEN:
        cooldown = next_cooldown(b.cooldown_s, b.base_s)
        return Change(OPEN, b.failures, cooldown,
                      f"probe found the source unavailable: open again for {cooldown:g}s")
    return Change(b.state, b.failures, b.cooldown_s, "")  # open: stays open


@dataclass(frozen=True)
class Outcome:
    """What ``record`` decided for a finish batch."""

    refunded: frozenset[int]  # runs whose source-unavailable attempt keeps its budget
    opened: tuple[str, ...]  # sources whose breaker left closed/half_open for open


Async = psycopg.AsyncConnection[Any]


async def record_unavailable(conn: Async, results: Sequence[tuple[int, int, str, Sequence[str]]]
                             ) -> Outcome:
    """Count source-unavailable attempts ``(run id, attempt, owner, sources)`` — inside the
    finish transaction, before ``finish_attempts``. Only results still holding their lease
    count (they are locked until the finish)."""
    sources = sorted({s for *_, named in results for s in named})
    if not sources:
        return Outcome(frozenset(), ())
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(q("breaker_ensure"), {"sources": sources})
    await cur.execute(q("breaker_lock_sources"), {"sources": sources})
    states = {row["source"]: State(row["source"], row["state"], row["failures"],
                                   row["cooldown_s"], row["threshold"], row["base_s"])
              for row in await cur.fetchall()}
    await cur.execute(q("breaker_leases_held"), {
        "ids": [r[0] for r in results], "attempts": [r[1] for r in results],
        "owners": [r[2] for r in results]})
    valid = {row["id"] for row in await cur.fetchall()}
    counts: dict[str, int] = {}
    first_run: dict[str, int] = {}
    for run_id, _, _, named in results:
        if run_id in valid:
            for source in set(named):
                counts[source] = counts.get(source, 0) + 1
                first_run.setdefault(source, run_id)
    opened: list[str] = []
    not_closed: set[str] = set()
    for source, count in sorted(counts.items()):
        b = states[source]
        change = after_unavailable(b, count)
        await cur.execute(q("breaker_set"), {
            "source": source, "expected": b.state, "state": change.state,
            "failures": change.failures, "cooldown_s": change.cooldown_s,
            "reason": change.reason, "run_id": first_run[source]})
        if await cur.fetchone() is None:  # locked above: cannot happen, but never assume
            raise psycopg.errors.SerializationFailure(f"breaker {source!r} changed under us")
        if change.state != CLOSED:
            not_closed.add(source)
        if change.state == OPEN and b.state != OPEN:
            opened.append(source)
    refunded = frozenset(run_id for run_id, _, _, named in results
                         if run_id in valid and not_closed.intersection(named))
    return Outcome(refunded, tuple(opened))


async def hold(conn: Async, sources: Sequence[str]) -> None:
    """After the finish: the runs of the just-opened sources' jobs are held."""
    if sources:
        await conn.execute(q("breaker_hold_runs"), {"sources": list(sources)})


async def record_successes(conn: Async, ok: Sequence[tuple[int, Sequence[str]]]) -> list[str]:
    """Successes touching sources (already recorded): reset counts, close probed breakers
    and release their runs; returns the sources closed."""
    if not ok:
        return []
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(q("breaker_successes"), {"ok": json.dumps(
        [{"id": run_id, "sources": list(sources)} for run_id, sources in ok])})
    closed = [row["source"] for row in await cur.fetchall()]
    if closed:
        await cur.execute(q("breaker_release_runs"), {"sources": closed})
    return closed


async def half_open_due(conn: Async) -> list[str]:
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(q("breaker_half_open_due"))
    return [row["source"] for row in await cur.fetchall()]


async def probe_wanted(conn: Async) -> bool:
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(q("breakers_waiting"))
    row = await cur.fetchone()
    return bool(row and row["due"])


async def claim_probes(conn: Async, worker: str, limit: int, ttl: float
                       ) -> list[Claimed]:
    """Move due breakers to half_open and claim their probe runs (one per breaker,
    cluster-wide)."""
    async with conn.transaction():
        await half_open_due(conn)
    cur = conn.cursor(row_factory=claimed_rows)
    await cur.execute(q("claim_probe"), {"worker": worker, "limit": limit, "ttl": ttl})
    return await cur.fetchall()
