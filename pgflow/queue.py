"""The run lifecycle statements, shaped for batches: claim, renew, finish.

These are the only writers of ``running`` and of attempt endings, but for the trigger
that hands its run to an idle worker (pgflow/handoff.py); the SQL is in
``sql/queries/queue.sql``. Each call is one statement whatever the batch size.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from functools import lru_cache
from typing import Any, NamedTuple

import psycopg
from psycopg.rows import dict_row

from pgflow import backfill, breakers, deps, handoff
from pgflow.claimed import Claimed, claimed_rows, named_rows
from pgflow.queries import q


# Not frozen: made for every run, and a frozen dataclass's __init__ costs six times as
# much (object.__setattr__ per field). Treated as immutable (dataclasses.replace).
@dataclass(slots=True)
class Finish:
    """How one attempt ended and what its run becomes."""

    run_id: int
    attempt: int
    owner: str
    state: str
    outcome: str
    started_at: datetime | None
    delay_s: float = 0.0
    exit_code: int | None = None
    error: str | None = None
    stdout_tail: str | None = None
    stderr_tail: str | None = None
    sources: tuple[str, ...] = ()  # the job's, for its breakers (a success resets them)
    unavailable: tuple[str, ...] = ()  # a source-unavailable attempt: the sources it names
    refund: bool = False  # the attempt does not use up the budget (set by ``finish``)
    plain: bool = False  # its run needs nothing after a success (Claimed.plain)


class Finished(NamedTuple):
    """A row of ``finish_attempts``: an attempt that counted, and its run's new state.
    Loaded in binary as a tuple (``named_rows``): at 500 results a statement, a dict per
    row cost the worker 1.6 µs a result more (issue 16)."""

    id: int
    state: str
    backfill_id: int | None
    candidates: list[int] | None  # the same on every row: pending downstreams it locked
    delivered: int
    downstream: bool  # queue_ready_runs must look for its late downstreams


finished_rows = named_rows(Finished)


def finish_params(finishes: Sequence[Finish], *, arrays: bool = True) -> dict[str, Any]:
    """The ``finish_attempts`` parameters for the whole batch: the plain successes of one
    owner (``_plain_success``) as arrays, sent in binary, and the other results as one
    JSON document whose null keys are left out (``jsonb_to_recordset`` reads a missing
    key as null). ``arrays=False`` sends every result as JSON (tests: both ways end an
    attempt the same)."""
    owner = next((f.owner for f in finishes if _plain_success(f)), None) if arrays else None
    ids: list[int] = []
    attempts: list[int] = []
    started: list[datetime | None] = []
    codes: list[int | None] = []
    others: list[str] = []
    for f in finishes:
        if f.owner == owner and _plain_success(f):
            ids.append(f.run_id)
            attempts.append(f.attempt)
            started.append(f.started_at)
            codes.append(f.exit_code)
        else:
            others.append(_COMPACT.encode(_result(f)))
    return {"results": "[" + ",".join(others) + "]", "ok_owner": owner, "ok_ids": ids,
            "ok_attempts": attempts, "ok_started": started, "ok_exit_codes": codes,
            "plain": False}


_COMPACT = json.JSONEncoder(separators=(",", ":"))


def _plain_success(f: Finish) -> bool:
    """A success with nothing to say beyond its exit code: most results."""
    return (f.state == f.outcome == "succeeded" and f.started_at is not None and not f.refund
            and f.error is None and f.stdout_tail is None and f.stderr_tail is None
            and f.delay_s == 0)


def _result(f: Finish) -> dict[str, Any]:
    result: dict[str, Any] = {
        "id": f.run_id, "attempt": f.attempt, "owner": f.owner, "state": f.state,
        "delay_s": f.delay_s, "outcome": f.outcome, "refund": f.refund}
    if f.started_at is not None:
        result["started_at"] = f.started_at.isoformat()
    if f.exit_code is not None:
        result["exit_code"] = f.exit_code
    if f.error is not None:
        result["error"] = _clean(f.error)
    if f.stdout_tail is not None:
        result["stdout_tail"] = _clean(f.stdout_tail)
    if f.stderr_tail is not None:
        result["stderr_tail"] = _clean(f.stderr_tail)
    return result


def _clean(text: str | None) -> str | None:
    # PostgreSQL text cannot hold NUL, nor a lone surrogate (an exception message built
    # from a surrogate-escaped file name has them); job output can.
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text.replace("\x00", "\ufffd")


def result_size(f: Finish) -> int:
    """About how many characters ``f`` adds to a finish batch (the output dominates)."""
    return 200 + len(f.error or "") + len(f.stdout_tail or "") + len(f.stderr_tail or "")


SHRUNK_TAIL = 4096


def shrunk(f: Finish, reason: str) -> Finish | None:
    """A smaller version of a result the database refused: the ends of its output, then
    none of it; None when nothing is left to drop."""
    note = f"[pgflow: output cut, the database refused it: {reason[:200]}]\n"
    tails = (f.stdout_tail, f.stderr_tail)
    if any(t is not None and len(t) > SHRUNK_TAIL for t in tails) or len(f.error or "") > 1000:
        def cut(text: str | None) -> str | None:
            return None if text is None or len(text) <= SHRUNK_TAIL else note + text[-SHRUNK_TAIL:]
        return replace(f, stdout_tail=cut(f.stdout_tail), stderr_tail=cut(f.stderr_tail),
                       error=None if f.error is None else f.error[:1000])
    if any(t is not None for t in tails) or f.error:
        error = (f.error or "").encode("ascii", "backslashreplace").decode("ascii")[:1000]
        return replace(f, stdout_tail=None, stderr_tail=None,
                       error=f"{error} [pgflow: output dropped, the database refused it:"
                             f" {reason[:200]}]".strip())
    return None


def _refunded(f: Finish) -> Finish:
    """A source-unavailable attempt while its breaker opens or is open: the run waits for
    the breaker (held), with its budget intact, whatever the worker decided."""
    state = "retrying" if f.state in ("retrying", "failed") else f.state
    return replace(f, state=state, delay_s=0.0, refund=True)


@dataclass(frozen=True)
class Offer:
    """What a claim that leaves slots free offers to triggers (pgflow/handoff.py)."""

    seq: int  # names this claim in the handoffs made from its offer
    listen_pid: int  # the backend pid of the worker's LISTEN session
    lapse_s: float = handoff.OFFER_S  # how long the offer lasts unless renewed


# claim_runs' parameters of the offer, for a claim that makes none (a worker's claims
# always pass them: ``claim``; tests and the bench run the statement by itself).
NO_OFFER: dict[str, Any] = {"seq": None, "listen_pid": None, "offer_s": None}


async def claim(conn: psycopg.AsyncConnection[Any], worker: str, limit: int,
                ttl: float, offer: Offer | None = None) -> list[Claimed]:
    """Claim up to ``limit`` runs; with ``offer``, slots left free are offered to
    triggers, and without it any earlier offer of ``worker`` is withdrawn."""
    cur = conn.cursor(row_factory=claimed_rows)
    params = {"worker": worker, "ttl": ttl, "seq": offer and offer.seq,
              "listen_pid": offer and offer.listen_pid, "offer_s": offer and offer.lapse_s}
    # Binary results: timestamps and arrays of hundreds of rows load faster than text.
    await cur.execute(_claim_sql(limit), params, binary=True)
    return await cur.fetchall()


async def give_back(conn: psycopg.AsyncConnection[Any], worker: str,
                    keys: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    """Queue again the handed-off runs (run id, attempt) this worker will not start;
    returns those given back (a run cancelled meanwhile ends cancelled, and its
    downstream runs fail with it)."""
    async with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(q("give_back_handoff"), {
            "worker": worker, "ids": [run_id for run_id, _ in keys],
            "attempts": [attempt for _, attempt in keys]})
        rows = await cur.fetchall()
        ended = [row["id"] for row in rows if row["state"] == "cancelled"]
        if ended:
            await deps.fail_downstreams_async(conn, ended)
    return rows


async def withdraw_offer(conn: psycopg.AsyncConnection[Any], worker: str) -> None:
    await conn.execute(q("withdraw_offer"), {"worker": worker})


@lru_cache(maxsize=1024)
def _claim_sql(limit: int) -> str:
    """claim_runs with its limit written in. The claim session runs generic plans (made
    once for any values: sql/queries/sessions.sql); with the limit a parameter, that plan
    guessed a tenth of the queue as candidates and, with 10,000 runs queued, ran 20 times
    slower than one made for the actual limit (41 against 2 ms a claim of 64). With the
    limit in the text, the generic plan is the one a custom plan would be. One text per
    limit: at most MAX_CLAIM of them, and a worker's claims mostly repeat a few."""
    return q("claim_runs").replace("%(limit)s", str(int(limit)))


@dataclass(frozen=True)
class CappedWaiting:
    """Capped jobs with room and a claimable run, best waiting priority first."""

    jobs: list[tuple[str, int]]  # (job, best claimable priority)
    uncapped_priority: int | None  # the best claimable uncapped run's, None without one

    def before_uncapped(self) -> list[str]:
        """Jobs whose best run must be claimed before the uncapped claim: it is not of
        lower priority than any claimable uncapped run."""
        floor = self.uncapped_priority
        return [job for job, best in self.jobs if floor is None or best >= floor]


async def capped_waiting(conn: psycopg.AsyncConnection[Any]) -> CappedWaiting:
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(q("capped_jobs_waiting"))
    rows = await cur.fetchall()
    return CappedWaiting([(row["job"], row["priority"]) for row in rows],
                         rows[0]["uncapped_priority"] if rows else None)


async def claim_capped(conn: psycopg.AsyncConnection[Any], worker: str, jobs: list[str],
                       limit: int, ttl: float,
                       min_priority: int | None = None) -> list[Claimed]:
    """Claim runs of ``jobs`` (jobs with a max_active_runs cap), never exceeding a cap
    cluster-wide; with ``min_priority``, only runs of at least that priority."""
    if not jobs or limit <= 0:
        return []
    cur = conn.cursor(row_factory=claimed_rows)
    async with conn.transaction():
        await conn.execute(q("lock_capped_jobs"), {"jobs": jobs})
        await cur.execute(q("claim_capped_runs"),
                          {"jobs": jobs, "worker": worker, "limit": limit, "ttl": ttl,
                           "min_priority": min_priority})
        return await cur.fetchall()


@dataclass(frozen=True)
class Renewal:
    """What one heartbeat found: the held attempts still ours (``renewed``, with their
    ``cancel_requested``), and the runs given back (``released``: claimed for this worker
    but never received by it)."""

    renewed: list[dict[str, Any]]
    released: list[dict[str, Any]]


async def renew(conn: psycopg.AsyncConnection[Any], worker: str, ttl: float,
                held: Sequence[tuple[int, int]], release: bool) -> Renewal:
    """Renew the leases of exactly the (run id, attempt) pairs in ``held``; with
    ``release``, give back the runs this worker owns but does not hold."""
    params = {"worker": worker, "ttl": ttl, "ids": [run_id for run_id, _ in held],
              "attempts": [attempt for _, attempt in held], "release": release}
    cur = conn.cursor(row_factory=dict_row)
    if not release:
        await cur.execute(q("renew_leases"), params)
        return Renewal(await cur.fetchall(), [])
    async with conn.transaction():  # a run given back cancelled fails its downstreams
        await cur.execute(q("renew_leases"), params)
        rows = await cur.fetchall()
        released = [row for row in rows if row["released"] is not None]
        ended = [row["id"] for row in released if row["released"] == "cancelled"]
        if ended:  # repeated until it marks nothing new (pgflow/deps.py)
            await deps.fail_downstreams_async(conn, ended)
        if len(ended) < len(released):
            await cur.execute(q("notify_queue"))
    backfills = sorted({row["backfill_id"] for row in released if row["backfill_id"]})
    if backfills:
        await backfill.release(conn, backfills)
    return Renewal([row for row in rows if row["released"] is None], released)


async def finish_plain(conn: psycopg.AsyncConnection[Any],
                       finishes: Sequence[Finish]) -> dict[int, str]:
    """Record the successes of ``finishes`` that need nothing after them
    (``needs_nothing_after``: most results) by ``finish_attempts`` alone, in plain mode,
    with no transaction around it; returns {run_id: new state} for those it ended. BEGIN
    and COMMIT were two of a batch's three round trips, about a tenth of the CPU of a run
    at concurrency 64 (issue 16). The statement checks again what the claim's hint said
    (the run has no backfill, its job no downstream job): the results it did not end, and
    every other one, go to ``finish``."""
    alone = [f for f in finishes if needs_nothing_after(f)]
    if not alone:
        return {}
    cur = conn.cursor(row_factory=finished_rows)
    await cur.execute(q("finish_attempts"), {**finish_params(alone), "plain": True},
                      binary=True)
    return {row.id: row.state for row in await cur.fetchall()}


def needs_nothing_after(f: Finish) -> bool:
    """A success that no breaker, dependency, backfill or retry has to hear of once it is
    recorded: what ``finish_attempts`` in plain mode accepts."""
    return (f.plain and f.state == "succeeded" and not f.sources and not f.unavailable
            and not f.refund)


async def finish(conn: psycopg.AsyncConnection[Any],
                 finishes: Sequence[Finish]) -> dict[int, str]:
    """End attempts and evaluate what depends on them, in one transaction; returns
    {run_id: new state} for the attempts that were still ours (the others were fenced off
    and change nothing)."""
    async with conn.transaction():
        opened: tuple[str, ...] = ()
        unavailable = [(f.run_id, f.attempt, f.owner, f.unavailable)
                       for f in finishes if f.unavailable]
        if unavailable:  # breakers count, open; the attempt keeps its budget (breakers.py)
            outcome = await breakers.record_unavailable(conn, unavailable)
            opened = outcome.opened
            if outcome.refunded:
                finishes = [_refunded(f) if f.run_id in outcome.refunded else f
                            for f in finishes]
        cur = conn.cursor(row_factory=finished_rows)
        await cur.execute(q("finish_attempts"), finish_params(finishes), binary=True)
        rows = await cur.fetchall()
        done = {row.id: row.state for row in rows}
        await breakers.hold(conn, opened)
        closed = await breakers.record_successes(conn, [
            (f.run_id, f.sources) for f in finishes
            if f.sources and done.get(f.run_id) == "succeeded"])
        wake = bool(closed) or any(state in ("queued", "retrying") for state in done.values())
        # Downstreams queued or failed, backfills completed (pgflow/deps.py).
        settled = await deps.after_finish(conn, rows)
        wake = wake or bool(settled.queued)
        if wake:
            await conn.execute(q("notify_queue"))
    backfills = sorted({row.backfill_id for row in rows if row.backfill_id is not None})
    if backfills:  # a finished backfill run frees a slot of its backfill: refill it now
        await backfill.release(conn, backfills)
    return done
