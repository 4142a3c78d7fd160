"""The worker role: claim runs into free slots, execute them, record how they end.

Concurrency model (the whole replica): one asyncio event loop. Runs are tasks;
commands are child processes awaited on the loop; sync Python jobs run in a
thread pool sized to ``--concurrency``; the database is reached through a few
dedicated async connections. A thousand sleeping runs cost a thousand tasks, not
a thousand threads or processes, and nothing needs locks: state lives on the
loop.

Five loops share a replica's worker state:
- claim: one ``claim_runs`` statement per wake-up, sized to the free slots (tenants
  share them by weight: pgflow/policies.py); woken by NOTIFY ``pgflow_queue``, by a
  freed slot, or every second at the latest. Capped jobs (a ``max_active_runs``, a
  capped tenant or source) are looked at twice a second, or on every wake-up while
  some wait: their runs that are not of lower priority than the best claimable
  uncapped run are claimed first, the others after the uncapped claim; at the same
  cadence, half-open breakers get their one probe run (pgflow/breakers.py). A claim
  that leaves slots free offers them to triggers (pgflow/handoff.py);
- complete: results are buffered and written by one ``finish_attempts`` statement
  per flush; while a flush is in flight the next batch gathers (group commit),
  so latency is one round-trip when idle and batches grow under load. Successes
  that need nothing after them (no downstream job, no backfill, no breaker: the
  claim's ``plain`` hint, checked again by the statement) are written without a
  transaction around the statement; the other results in one transaction;
- heartbeat: every TTL/3 one ``renew_leases`` statement renews exactly the
  (run, attempt) pairs this worker holds. A pair that is not returned was taken
  from us (the reaper saw the lease expire): its attempt is stopped and its result
  dropped (fencing);
- fence: stops every attempt whose local lease deadline passed (below);
- listen: NOTIFY ``pgflow_cancel`` stops a running attempt at once; a run handed
  to this worker by a trigger arrives on its own channel and starts at once, or is
  given back (``give_back_handoff``) when it cannot.

Leases, as this worker keeps them:
- The books are keyed by (run id, attempt): ``active`` holds the attempts that
  execute, ``_unrecorded`` the ended ones whose result is not written yet; both
  are renewed. A result whose finish matched no row is *disputed*, not dropped at
  once: the server that answered may be a former primary woken from a freeze, whose
  stale rows say the lease is gone while the real primary says it is ours. The next
  renewal settles it: renewed, the result is recorded again; not renewed, the lease
  was lost and the result is dropped (fencing).
  When a claim returns a run whose older attempt still executes here
  (our lease on it was lost and the run came back to us), the old attempt is
  stopped and the new one starts only once it ended.
- Self-fencing: each held attempt has a local deadline, the ``time.monotonic()``
  taken just before sending the claim or the last renewal that covered it, plus
  the TTL. The database computed its expiry from a later instant, so the local
  deadline is never later. When it passes unrenewed (the database unreachable, or
  silent), the fence loop stops the attempt as ``lost`` by itself; the supervisor
  of a command gets the same deadline (``Execution.extend``) and kills it even if
  this process is frozen. Every statement is bounded (``db.bounded``), so no loop
  hangs on a dead socket, and the sessions carry server-side timeouts and TCP
  keepalives (``db.connect_async``).
- A claim whose reply never arrived (the connection died after the commit) leaves
  runs that the database says we own but that we never saw. A heartbeat sent while
  no claim is in flight (claims and such heartbeats take turns on ``_claim_gate``)
  gives them back: queued again, no attempt used up (``renew_leases``).
- A sync job runs in a thread, and Python cannot kill a thread. On a timeout or a
  stop the attempt ends at once (recorded ``timed_out``, ``cancelled``...) and the
  job is told through ``ctx.cancelled``; if it ignores that, its thread runs on and
  keeps its slot (``_abandoned``) until the function returns, so the worker never
  claims a sync run that would wait for a free thread. What cannot be made to
  happen: the function stopping, or its side effects after the timeout being
  prevented. Jobs that must be killable belong in a ``command`` (a process group).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg

from pgflow import breakers, handoff, live, queue, retry
from pgflow.claimed import Claimed
from pgflow.db import StatementTimeout, bounded, close_async, connect_async
from pgflow.executor import KILL_GRACE_S, AttemptResult, Execution, Job
from pgflow.log import LazyLogger
from pgflow.queries import q
from pgflow.queue import Finish

POLL_S = 1.0
CAPPED_CHECK_S = 0.5
HEARTBEAT_FLOOR_S = 0.2  # the shortest pause between two renewals
LISTEN_PING_S = 5.0
_SUCCEEDED = retry.Decision(retry.SUCCEEDED)
MAX_CLAIM = 500
# The claim session's plans are made again when a claim comes back full (a backlog) and
# they are REPLAN_S old, and in any case when they are REPLAN_MAX_S old: see
# Worker._replan_if_stale.
REPLAN_S = 10.0
REPLAN_MAX_S = 60.0
MAX_FLUSH = 5000
# Results per finish statement are bounded by size too: 5,000 results with 128 KiB of
# output each would not fit in one parameter (PostgreSQL's jsonb stops at 256 MB).
MAX_FLUSH_CHARS = 8 * 1024 * 1024

Key = tuple[int, int]  # (run id, attempt): what a lease is on


@dataclass(slots=True)
class Held:
    """One attempt this worker executes under its lease (made for every run: slots)."""

    key: Key  # (row.id, row.attempt)
    row: Claimed
    execution: Execution
    deadline: float  # time.monotonic() by which the lease could have expired
    replaces: Held | None = None  # an older attempt of the run, stopped before this starts
    task: asyncio.Task[None] | None = field(default=None)
    self_fenced: bool = False  # stopped by its own deadline, not by the database


class Worker:
    def __init__(self, url: str, worker_id: str, concurrency: int, lease_ttl: float,
                 log: Any, *, pooler_url: str | None = None,
                 log_limit: int = live.DEFAULT_LOG_LIMIT) -> None:
        self.url = url  # direct: the LISTEN session
        self.pooler_url = pooler_url  # claims, renewals, completions, when set (pooler.py)
        self.id = worker_id
        self.concurrency = concurrency
        self.ttl = lease_ttl
        self.log = log
        # Whether a success is logged at all: the call alone, arguments built and dropped
        # by the filtering logger, cost about 1 µs a run (issue 16).
        self._log_successes = _logs_debug(log)
        self.active: dict[Key, Held] = {}
        self._newest: dict[int, Held] = {}  # run id -> its newest attempt in ``active``
        self._unrecorded: set[Key] = set()  # ended, result not written yet: still renewed
        self._disputed: dict[Key, Finish] = {}  # finish matched no row: the next renewal decides
        self._abandoned = 0  # sync jobs' threads running on after their attempt ended
        self._results: list[Finish] = []
        self._wake = asyncio.Event()
        self._planned_at = 0.0  # time.monotonic() the claim session's plans date from
        self.replans = 0  # times they were dropped (_replan_if_stale)
        self._flush = asyncio.Event()
        self._flushing = asyncio.Lock()
        self._claim_gate = asyncio.Lock()
        self._fence_wake = asyncio.Event()
        self._wake_heartbeat = asyncio.Event()
        self._fence_at = 0.0
        self._idle = asyncio.Event()
        self._idle.set()
        self._claiming = True
        self._hurry = asyncio.Event()
        self._capped_seen = True  # until the first look says otherwise
        # Handoffs (pgflow/handoff.py): the LISTEN session's backend, the claims that
        # offered free slots (seq -> time.monotonic() just before sending), the handed-off
        # runs to give back.
        self._listen_pid: int | None = None
        self._offers: dict[int, float] = {}
        self._offer_seq = 0
        self._give_backs: list[Key] = []
        self._claim_in_flight = False  # a claim is in flight: handoffs wait for it
        self._deferred: list[tuple[int, Claimed]] = []  # handoffs waiting for it
        self._capped_checked = 0.0
        self._threads = ThreadPoolExecutor(max_workers=concurrency,
                                           thread_name_prefix="pgflow-job")
        self._loops: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        # Statements are bounded on the client (a silent socket) and on the server.
        self._statement_s = max(1.0, lease_ttl)
        self._bound_s = self._statement_s + 2.0
        self._beat_bound_s = max(0.5, lease_ttl / 3)
        self._fence_margin_s = min(1.0, lease_ttl / 10)
        # Live output, progress and checkpoints of the attempts held here (pgflow.live).
        self.log_limit = log_limit
        self._live = live.Flusher(worker_id, self._live_attempts, self._connect, log,
                                  self._bound_s)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()  # a task per run: no lookup each time
        self._loops = [asyncio.create_task(self._supervise(loop), name=f"worker-{loop.__name__}")
                       for loop in (self._claim_loop, self._complete_loop, self._heartbeat_loop,
                                    self._fence_loop, self._listen_loop, self._live.loop)]

    async def _supervise(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Database errors are handled inside each loop; anything else is a bug that must not
        silently stop the replica from claiming or heartbeating: log it and restart the loop."""
        while True:
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("worker loop failed; restarting it", loop=loop.__name__)
                await asyncio.sleep(1.0)

    async def drain(self, grace: float) -> None:
        """Graceful stop: claim nothing more, let attempts finish for ``grace`` seconds,
        then interrupt the rest (their runs go straight back to the queue)."""
        self._claiming = False
        self._wake.set()
        idle = asyncio.create_task(self._idle.wait())
        hurry = asyncio.create_task(self._hurry.wait())
        await asyncio.wait({idle, hurry}, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        hurry.cancel()
        for held in list(self.active.values()):
            held.execution.stop(retry.INTERRUPTED)
        tasks = [h.task for h in self.active.values() if h.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=KILL_GRACE_S + 2)
        # The claim loop withdraws the offer as it ends; a handoff taken before that is
        # given back by the final flush, which must therefore come after it.
        if self._loops:
            await asyncio.wait(self._loops[:1], timeout=self._bound_s)  # the claim loop
        await self._flush_until_empty(deadline=time.monotonic() + 10)
        for loop in self._loops:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._threads.shutdown(wait=False, cancel_futures=True)

    def hurry(self) -> None:
        """Cut a drain's grace short (a second SIGTERM)."""
        self._hurry.set()

    def free_slots(self) -> int:
        """Attempts this worker may start now: executing attempts and the threads of
        abandoned sync jobs take a slot each."""
        return self.concurrency - len(self.active) - self._abandoned

    async def _connect(self, *, listen: bool = False, generic_plans: bool = False,
                       prepare_at_once: bool = False) -> psycopg.AsyncConnection[Any]:
        """A session for claims, renewals and completions, through the pooler when there is
        one; with ``listen``, the LISTEN session: always direct (a session of its own).
        ``prepare_at_once``: a direct session prepares each statement on its first use, not
        its fifth (the claim writes its limit into the text, a text per limit; the first
        finish of a burst). ``generic_plans``: the claim session, which also plans its
        statements once (sql/queries/sessions.sql). A pooled session does neither."""
        pooler = None if listen else self.pooler_url
        conn = await connect_async(pooler or self.url, "worker-listen" if listen else "worker",
                                   statement_timeout=self._statement_s,
                                   connect_timeout=min(10.0, self._bound_s),
                                   pooled=pooler is not None)
        if pooler is None and (prepare_at_once or generic_plans):
            conn.prepare_threshold = 0
        if generic_plans and pooler is None:
            try:
                await bounded(conn, conn.execute(q("generic_plans")), self._bound_s, "connect")
            except BaseException:
                await close_async(conn)
                raise
        return conn

    # ------------------------------------------------------------ claim

    async def _claim_loop(self) -> None:
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            failures = 0
            while self._claiming:
                free = min(self.free_slots(), MAX_CLAIM)
                if free <= 0:
                    await _wait(self._wake, POLL_S)
                    continue
                try:
                    if conn is None:
                        conn = await self._connect(generic_plans=True)
                        self._planned_at = time.monotonic()
                    self._wake.clear()
                    async with self._claim_gate:
                        self._claim_in_flight = True
                        try:
                            claimed = await self._claim(conn, free)
                        finally:
                            self._claim_in_flight = False
                            self._take_deferred()
                    await self._replan_if_stale(conn, backlog=claimed >= free)
                    failures = 0
                except psycopg.Error as exc:
                    conn, failures = await self._db_error("claim", exc, conn, failures)
                    continue
                if claimed < free and self._claiming:
                    await _wait(self._wake, POLL_S)
            if conn is not None:  # draining: triggers hand us nothing more
                with contextlib.suppress(psycopg.Error):
                    await bounded(conn, queue.withdraw_offer(conn, self.id), self._bound_s, "claim")
        finally:
            await close_async(conn)  # also when a bug ends the loop (_supervise restarts it)

    async def _replan_if_stale(self, conn: psycopg.AsyncConnection[Any], *,
                               backlog: bool) -> None:
        """Drop the claim session's prepared statements when they are ``REPLAN_S`` old and
        a claim came back full (``backlog``), or ``REPLAN_MAX_S`` old: their generic plans
        were made for the runs table as it was then. Planned on a nearly empty table (a
        replica started before the runs came: a fresh install, the seeds' burst), the
        claim's UPDATE reads runs sequentially, a scan of the whole table per claim (4 ms a
        claim of 64 at 10,000 runs, and growing) until an ANALYZE happens to invalidate
        the plan (never, with autovacuum off). Dropped, they are planned again a few
        claims later, for the table as it is now."""
        now = time.monotonic()
        age = now - self._planned_at
        if self.pooler_url is not None or age < (REPLAN_S if backlog else REPLAN_MAX_S):
            return  # a pooled session prepares nothing
        self._planned_at = now
        # never prepared itself: psycopg would prepare it after five runs like any other
        await bounded(conn, conn.execute(q("replan"), prepare=False), self._bound_s, "claim")
        self.replans += 1

    async def _claim(self, conn: psycopg.AsyncConnection[Any], free: int) -> int:
        """Claim up to ``free`` runs and start them; returns how many.

        While capped runs are known to wait, they are looked at first and those not of
        lower priority than the best uncapped run are claimed before the uncapped claim
        (a capped run of high priority must not wait behind uncapped work of lower
        priority); the other capped runs take the slots the uncapped claim left. The
        periodic look for new capped runs comes after the uncapped claim, so an idle
        worker's wake-up is not delayed by it: a capped run that appears meanwhile waits
        at most that one claim. The uncapped claim stays one statement."""
        due = self._capped_due()
        started = 0
        waiting = None
        if due and self._capped_seen:
            waiting = await self._look_capped(conn)
            if first := waiting.before_uncapped():
                started += await self._claim_capped(conn, first, free, waiting.uncapped_priority)
        if started < free:
            sent = time.monotonic()
            rows = await bounded(conn, queue.claim(conn, self.id, free - started, self.ttl,
                                                   self._offer(sent)),
                                 self._bound_s, "claim")
            started += self._start_all(rows, sent)
        rest: list[str] = []
        if due and waiting is None:
            waiting = await self._look_capped(conn)
            rest = [job for job, _ in waiting.jobs]
        elif waiting is not None and waiting.uncapped_priority is not None:
            rest = [job for job, _ in waiting.jobs]  # the first capped claim took them all
        if started < free and rest:
            started += await self._claim_capped(conn, rest, free - started, None)
        if due and started < free:
            started += await self._claim_probes(conn, free - started)
        return started

    def _offer(self, sent: float) -> queue.Offer | None:
        """The offer a claim sent at ``sent`` makes of the slots it leaves free: none
        through a pooler (a session's pid means nothing there), without a LISTEN session,
        or while draining."""
        if self.pooler_url is not None or self._listen_pid is None or not self._claiming:
            return None
        self._offer_seq += 1
        self._offers[self._offer_seq] = sent
        while next(iter(self._offers.values())) < sent - self.ttl:  # its deadline passed
            del self._offers[next(iter(self._offers))]
        # An offer lapses well within a lease: a handoff made from it reaches us with
        # time left before its deadline (the offering claim's send time + TTL).
        return queue.Offer(self._offer_seq, self._listen_pid,
                           lapse_s=min(handoff.OFFER_S, self.ttl / 2))

    def _handed_off(self, payload: str) -> None:
        """A trigger handed us a run (pgflow/handoff.py): start it now, with the deadline
        of the claim whose offer it took, or give it back."""
        try:
            worker, seq, row = handoff.decode(payload)
        except (ValueError, KeyError, TypeError) as exc:  # not sent by pgflow
            self.log.warning("unreadable handoff notification ignored", error=repr(exc))
            return
        if worker != self.id:  # our channel's pid once was another session's (handoff.py)
            self.log.warning("handoff for another worker ignored", run_id=row.id,
                             worker=worker)
            return
        if self._claim_in_flight:  # our claim is in flight: what it fills decides (after it)
            self._deferred.append((seq, row))
            return
        self._take_handoff(seq, row)

    def _take_handoff(self, seq: int, row: Claimed) -> None:
        key: Key = (row.id, row.attempt)
        sent = self._offers.get(seq)
        now = time.monotonic()
        free = self.free_slots()
        if (sent is None or sent + self.ttl - self._fence_margin_s <= now
                or not self._claiming or free <= 0 or key in self.active):
            self.log.info("handed-off run given back", run_id=key[0], attempt=key[1],
                          free_slots=free, claiming=self._claiming)
            self._give_backs.append(key)
            self._flush.set()
            return
        self._start(row, sent + self.ttl)
        if sent + self.ttl - now < self.ttl / 2:
            self._wake_heartbeat.set()  # the offer was old: renew the lease early

    def _take_deferred(self) -> None:
        """The handoffs that arrived while our claim was in flight, now that its runs
        have their slots."""
        deferred, self._deferred = self._deferred, []
        for seq, row in deferred:
            self._take_handoff(seq, row)

    async def _claim_probes(self, conn: psycopg.AsyncConnection[Any], limit: int) -> int:
        """Half-open breakers' probe runs (one per breaker, cluster-wide; breakers.py),
        looked for at the capped cadence: one cheap look while every breaker is closed."""
        if not await bounded(conn, breakers.probe_wanted(conn), self._bound_s, "claim"):
            return 0
        sent = time.monotonic()
        rows = await bounded(conn, breakers.claim_probes(conn, self.id, limit, self.ttl),
                             self._bound_s, "claim")
        for row in rows:
            self.log.info("probe run claimed for a half-open breaker", run_id=row.id,
                          job=row.job)
        return self._start_all(rows, sent)

    async def _look_capped(self, conn: psycopg.AsyncConnection[Any]) -> queue.CappedWaiting:
        waiting = await bounded(conn, queue.capped_waiting(conn), self._bound_s, "claim")
        self._capped_seen = bool(waiting.jobs)
        return waiting

    async def _claim_capped(self, conn: psycopg.AsyncConnection[Any], jobs: list[str],
                            limit: int, min_priority: int | None) -> int:
        if not jobs:
            return 0
        sent = time.monotonic()
        rows = await bounded(conn, queue.claim_capped(conn, self.id, jobs, limit, self.ttl,
                                                      min_priority), self._bound_s, "claim")
        return self._start_all(rows, sent)

    def _capped_due(self) -> bool:
        """Capped runs are looked for when the last look found some, else twice a second:
        an idle worker's wake-up stays one statement."""
        now = time.monotonic()
        if self._capped_seen or now - self._capped_checked >= CAPPED_CHECK_S:
            self._capped_checked = now
            return True
        return False

    def _start_all(self, rows: list[Claimed], sent: float) -> int:
        for row in rows:
            self._start(row, sent + self.ttl)
        return len(rows)

    def _start(self, row: Claimed, deadline: float) -> None:
        if row.cancel_requested:
            # Cancelled before it began: nothing is started, the run ends cancelled.
            self._record(Finish(run_id=row.id, attempt=row.attempt, owner=self.id,
                                state=retry.CANCELLED, outcome=retry.CANCELLED,
                                started_at=row.attempt_started_at,
                                error="cancel requested before the attempt started"))
            return
        # Positional: keyword arguments cost as much again (0.7 µs a run, issue 16).
        job = Job(row.id, row.job, row.logical_time, row.attempt, row.params, row.command,
                  row.entrypoint, row.timeout_s, row.checkpoint, row.trigger_events)
        log = LazyLogger(self.log, {"run_id": row.id, "job": row.job, "attempt": row.attempt})
        execution = Execution(job, log, self._threads, deadline=deadline,
                              log_limit=self.log_limit)
        held = Held((row.id, row.attempt), row, execution, deadline, self._newest.get(row.id))
        if held.replaces is not None:
            log.warning("run claimed again while its older attempt still runs here:"
                        " stopping that one first", older_attempt=held.replaces.row.attempt)
            held.replaces.execution.stop(retry.LOST)
        self.active[held.key] = held
        self._newest[job.run_id] = held
        self._idle.clear()
        if deadline - self._fence_margin_s < self._fence_at:
            self._fence_wake.set()
        loop = self._loop or asyncio.get_running_loop()
        held.task = execution.task = loop.create_task(self._execute(held))

    async def _execute(self, held: Held) -> None:
        older = held.replaces
        held.replaces = None
        if older is not None and older.task is not None:
            # Never two attempts of one run at once here (unless the old one refuses to end).
            await asyncio.wait({older.task}, timeout=KILL_GRACE_S + 5)
        try:
            result = await held.execution.run()
        except Exception as exc:
            held.execution.logger.exception("internal error while running the attempt")
            result = AttemptResult(retry.FAILED, error=f"internal error: {exc!r}")
        lost = held.execution.stop_outcome == retry.LOST and not held.self_fenced
        reported = held.execution.live
        if not lost and reported is not None and reported.needs_final():
            # Its last output and checkpoint are stored before its result is.
            await self._live.final(held.key, reported, self._bound_s)
        self._ended(held)
        if held.execution.stop_outcome == retry.LOST and not held.self_fenced:
            held.execution.logger.warning("lease lost: attempt stopped, result discarded")
            return
        finish = self._finish_for(held.row, result)
        if held.self_fenced and finish.outcome == retry.LOST:
            # The database may still hold our lease (it only went silent): say so there.
            finish = dataclasses.replace(
                finish, error="lease not renewed in time (database unreachable):"
                              " attempt stopped by its worker, result discarded")
        self._record(finish)

    def _ended(self, held: Held) -> None:
        """Take an attempt that stopped executing off the books (its thread may not)."""
        self.active.pop(held.key, None)
        if self._newest.get(held.row.id) is held:
            del self._newest[held.row.id]
        thread = held.execution.thread
        if thread is not None and not thread.done():
            held.execution.logger.warning("sync job ignores cancellation: its thread keeps a"
                                          " slot until it returns")
            self._abandoned += 1
            loop = asyncio.get_running_loop()
            thread.add_done_callback(lambda _: _call_soon(loop, self._thread_returned))
        if not self.active:
            self._idle.set()
        self._wake.set()

    def _live_attempts(self) -> list[tuple[Key, live.LiveOutput]]:
        return [(key, reported) for key, held in self.active.items()
                if (reported := held.execution.live) is not None]

    def _thread_returned(self) -> None:
        self._abandoned -= 1
        self._wake.set()

    def _finish_for(self, row: Claimed, result: AttemptResult) -> Finish:
        if result.outcome == retry.SUCCEEDED:  # the common case, kept cheap
            decision = _SUCCEEDED
        else:
            policy = None
            if (row.backoff_s is not None and row.max_backoff_s is not None
                    and row.jitter is not None and row.no_retry_exit_codes is not None):
                policy = retry.Policy(row.max_attempts, row.backoff_s, row.max_backoff_s,
                                      row.jitter, row.no_retry_exit_codes)
            decision = retry.decide(result.outcome, row.attempt, row.max_attempts, policy,
                                    exit_code=result.exit_code, permanent=result.permanent)
        sources = tuple(row.sources or ())
        unavailable: tuple[str, ...] = ()
        if result.outcome == retry.FAILED and result.exit_code == retry.EX_TEMPFAIL:
            # SourceUnavailable("x") names one source; exit 75 means every source of the job
            unavailable = (result.unavailable_source,) if result.unavailable_source else sources
        # Positional, in Finish's field order (once a run: keywords cost 0.8 µs more).
        return Finish(row.id, row.attempt, self.id, decision.state, result.outcome,
                      row.attempt_started_at, decision.delay_s, result.exit_code,
                      result.error, result.stdout_tail, result.stderr_tail, sources,
                      unavailable, False, row.plain)

    def _record(self, finish: Finish) -> None:
        self._unrecorded.add((finish.run_id, finish.attempt))
        self._results.append(finish)
        self._flush.set()

    # ------------------------------------------------------------ complete

    async def _complete_loop(self) -> None:
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            failures = 0
            while True:
                try:
                    conn = conn or await self._complete_session()
                    await self._flush.wait()
                    self._flush.clear()
                    await self._flush_once(conn)
                    failures = 0
                except psycopg.Error as exc:
                    conn, failures = await self._db_error("complete", exc, conn, failures)
                    self._flush.set()
        finally:
            await close_async(conn)

    async def _complete_session(self) -> psycopg.AsyncConnection[Any]:
        """The session that records results, opened before the first result and warmed by
        an empty finish: connecting (4 to 10 ms here) and a cold backend's first finish (5
        to 9 ms, against 2 to 3 once warm) were on the path of the first batch of a tick's
        burst (issue 16)."""
        conn = await self._connect(prepare_at_once=True)
        try:
            await bounded(conn, queue.finish(conn, []), self._bound_s, "finish")
        except BaseException:
            await close_async(conn)
            raise
        return conn

    async def _flush_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Write the results gathered so far, a batch at a time. Each batch holds
        ``_flushing``: the drain and the complete loop may both flush, and a renewal waits
        for the batch in flight (``_beat``), between two batches at most."""
        while True:
            async with self._flushing:
                if self._give_backs:
                    await self._give_back(conn)
                if not self._results:
                    return
                batch = self._next_batch()
                try:
                    await self._write(conn, batch)
                except BaseException:
                    # Put back what is not recorded yet (a split batch may be half done).
                    self._results[:0] = [f for f in batch
                                         if (f.run_id, f.attempt) in self._unrecorded]
                    raise

    async def _give_back(self, conn: psycopg.AsyncConnection[Any]) -> None:
        keys = list(self._give_backs)
        rows = await bounded(conn, queue.give_back(conn, self.id, keys), self._bound_s,
                             "finish")
        del self._give_backs[:len(keys)]
        if len(rows) < len(keys):
            self.log.info("handed-off runs not given back: no longer ours",
                          runs=sorted({k[0] for k in keys} - {r["id"] for r in rows}))

    def _next_batch(self) -> list[Finish]:
        count, size = 0, 0
        for finish in self._results:
            size += queue.result_size(finish)
            if count and (count >= MAX_FLUSH or size > MAX_FLUSH_CHARS):
                break
            count += 1
        batch = self._results[:count]
        del self._results[:count]
        return batch

    async def _write(self, conn: psycopg.AsyncConnection[Any], batch: list[Finish]) -> None:
        """Record ``batch``. When the database refuses it while the connection stays
        healthy, the batch itself is at fault (too big, a value it cannot store): it is
        split in halves, and a result refused alone is recorded with less of its output,
        so one poisonous result cannot hold back the others forever.

        Successes that need nothing after them are written first by a statement of their
        own (``queue.finish_plain``, no transaction); the rest in one transaction."""
        rest = batch
        try:
            done = await bounded(conn, queue.finish_plain(conn, batch), self._bound_s,
                                 "finish")
            if done:
                rest = [f for f in batch if f.run_id not in done]
                self._written([f for f in batch if f.run_id in done], done)
            if rest:
                self._written(rest, await bounded(conn, queue.finish(conn, rest),
                                                  self._bound_s, "finish"))
        except psycopg.Error as exc:
            if conn.closed or conn.broken or not _refusal(exc):
                raise  # the connection's or the moment's trouble: retry the batch as is
            await self._refused(conn, rest, exc)

    def _written(self, finishes: list[Finish], done: dict[int, str]) -> None:
        for finish in finishes:
            self._unrecorded.discard((finish.run_id, finish.attempt))
            self._report(finish, done.get(finish.run_id))

    async def _refused(self, conn: psycopg.AsyncConnection[Any], batch: list[Finish],
                       exc: psycopg.Error) -> None:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if len(batch) > 1:
            self.log.warning("finish batch refused by the database; splitting it",
                             results=len(batch), error=reason)
            half = len(batch) // 2
            await self._write(conn, batch[:half])
            await self._write(conn, batch[half:])
            return
        [finish] = batch
        smaller = queue.shrunk(finish, reason)
        fields = {"run_id": finish.run_id, "attempt": finish.attempt, "error": reason}
        if smaller is None:
            # Nothing left to drop: not this result's content. Its lease will expire and
            # the reaper will record the attempt as lost.
            self.log.error("result refused by the database even without its output;"
                           " dropping it", **fields)
            self._unrecorded.discard((finish.run_id, finish.attempt))
            return
        self.log.warning("result refused by the database; recording it with less output",
                         **fields)
        await self._write(conn, [smaller])

    def _report(self, finish: Finish, state: str | None) -> None:
        if state is None:
            self._disputed[(finish.run_id, finish.attempt)] = finish
            self._wake_heartbeat.set()
        elif finish.outcome != retry.SUCCEEDED:
            self.log.info("attempt finished", state=state, exit_code=finish.exit_code,
                          error=finish.error, run_id=finish.run_id, attempt=finish.attempt,
                          outcome=finish.outcome)
        elif self._log_successes:
            self.log.debug("attempt finished", state=state, run_id=finish.run_id,
                           attempt=finish.attempt, outcome=finish.outcome)

    async def _flush_until_empty(self, deadline: float) -> None:
        conn: psycopg.AsyncConnection[Any] | None = None
        while ((self._results or self._give_backs or self._flushing.locked())
               and time.monotonic() < deadline):
            try:
                conn = conn or await self._connect()
                await self._flush_once(conn)
            except psycopg.Error as exc:
                conn, _ = await self._db_error("final flush", exc, conn, 1)
        if self._results:
            self.log.error("could not record results before exit; their leases will expire",
                           runs=[f.run_id for f in self._results])
        if self._disputed:  # no renewal settles them any more
            self.log.warning("results whose finish matched no row were not settled before"
                             " exit: discarded; a lease still ours will expire",
                             runs=[run_id for run_id, _ in self._disputed])
        await close_async(conn)

    # ------------------------------------------------------------ heartbeat

    async def _heartbeat_loop(self) -> None:
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            failures = 0
            while True:
                try:
                    conn = conn or await self._connect()
                    self._wake_heartbeat.clear()
                    await self._beat(conn)
                    failures = 0
                except psycopg.Error as exc:
                    conn, failures = await self._db_error("heartbeat", exc, conn, failures)
                    continue
                # A disputed result is settled at once, but a stale server that keeps refusing
                # its finish cannot turn renewals into a tight loop.
                await asyncio.sleep(HEARTBEAT_FLOOR_S)
                await _wait(self._wake_heartbeat, self.ttl / 3 - HEARTBEAT_FLOOR_S)
        finally:
            await close_async(conn)

    async def _beat(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """One renewal of exactly the attempts held now. It gives back unheld runs only
        if it holds the claim gate: a claim in flight may have committed runs that are
        not in the books yet.

        It waits (briefly) for the finish batch in flight: the renewal and that batch
        update the same rows (results not written yet are renewed) from two sessions, in
        different orders, and deadlocked, a second's stall each (PostgreSQL's
        deadlock_timeout) and one of the two statements lost (issue 16). The pairs go in
        id order, the order live_flush locks them in."""
        release = await _acquire(self._claim_gate, timeout=min(1.0, self.ttl / 10))
        writing = await _acquire(self._flushing, timeout=min(1.0, self.ttl / 10))
        try:
            held = sorted({*self.active, *self._unrecorded, *self._disputed})
            sent = time.monotonic()
            renewal = await bounded(conn, queue.renew(conn, self.id, self.ttl, held, release),
                                    self._beat_bound_s, "heartbeat")
        finally:
            if writing:
                self._flushing.release()
            if release:
                self._claim_gate.release()
        self._renewed(held, renewal, sent + self.ttl)

    def _renewed(self, sent: list[Key], renewal: queue.Renewal, deadline: float) -> None:
        ours = {(row["id"], row["attempt"]): row for row in renewal.renewed}
        self._settle_disputes(sent, ours)
        for key in sent:
            held = self.active.get(key)
            if held is None:
                continue  # ended meanwhile: its finish statement is fenced by itself
            row = ours.get(key)
            if row is None:
                held.execution.stop(retry.LOST)
                continue
            held.deadline = deadline
            held.execution.extend(deadline)
            if row["cancel_requested"]:
                held.execution.stop(retry.CANCELLED)
        if renewal.released:
            self.log.warning("gave back runs claimed for this worker whose claim reply never"
                             " arrived", runs=[(r["id"], r["released"]) for r in renewal.released])

    def _settle_disputes(self, sent: list[Key], ours: dict[Key, Any]) -> None:
        """Disputed results the renewal covered: recorded again where the lease is ours
        after all, dropped where it is not."""
        for key in sent:
            finish = self._disputed.pop(key, None)
            if finish is None:
                continue
            fields = {"run_id": finish.run_id, "attempt": finish.attempt,
                      "outcome": finish.outcome}
            if key in ours:
                self.log.warning("a finish was refused by a server that no longer holds the"
                                 " run; the lease is still ours: recording the result again",
                                 **fields)
                self._record(finish)
            else:
                self.log.warning("lease lost before the result was recorded: result discarded",
                                 **fields)

    # ------------------------------------------------------------ fence

    async def _fence_loop(self) -> None:
        """Stop every attempt whose lease could expire: no renewal covered it for almost a
        whole TTL. It acts a little early (``_fence_margin_s``) so that the stop, e.g. an
        async job's cleanup, is over when the lease expires. Runs on the loop alone, so it
        works while statements hang."""
        while True:
            now = time.monotonic()
            nearest = now + self.ttl
            for held in list(self.active.values()):
                if held.execution.stop_outcome is not None:
                    continue
                if held.deadline - self._fence_margin_s <= now:
                    held.self_fenced = True
                    held.execution.stop(retry.LOST)
                    held.execution.logger.warning("lease not renewed in time: attempt stopped")
                else:
                    nearest = min(nearest, held.deadline - self._fence_margin_s)
            self._fence_at = nearest
            self._fence_wake.clear()
            await _wait(self._fence_wake, nearest - now)

    # ------------------------------------------------------------ listen

    async def _listen_loop(self) -> None:
        failures = 0
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            while True:
                try:
                    conn = await self._connect(listen=True)
                    await bounded(conn, conn.execute(q("listen_worker")), self._bound_s,
                                  "listen")
                    self._listen_pid = conn.info.backend_pid  # our handoff channel
                    self._wake.set()  # notifications may have been missed while disconnected
                    failures = 0
                    while True:
                        async for note in conn.notifies(timeout=LISTEN_PING_S):
                            self._on_notify(note.channel, note.payload)
                        # Quiet for a while: make sure the connection is alive, not silent.
                        await bounded(conn, conn.execute(q("ping")), self._beat_bound_s,
                                      "listen")
                except psycopg.Error as exc:
                    self._listen_pid = None  # offers with it stay unused (their pid is gone)
                    conn, failures = await self._db_error("listen", exc, conn, failures)
        finally:
            self._listen_pid = None
            await close_async(conn)

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel == "pgflow_queue":
            self._wake.set()
        elif channel.startswith(handoff.CHANNEL_PREFIX):
            self._handed_off(payload)
        elif channel == "pgflow_cancel" and payload.isdigit():
            held = self._newest.get(int(payload))
            if held is not None:
                held.execution.stop(retry.CANCELLED)

    # ------------------------------------------------------------ errors

    async def _db_error(self, what: str, exc: Exception, conn: psycopg.AsyncConnection[Any] | None,
                        failures: int) -> tuple[None, int]:
        failures += 1
        self.log.warning(f"{what}: database error, retrying", error=str(exc).strip(),
                         failures=failures, timeout=isinstance(exc, StatementTimeout))
        await close_async(conn)
        await asyncio.sleep(min(5.0, 0.1 * 2**failures))
        return None, failures


# SQLSTATE classes that say nothing about the statement itself: connection, rollback
# (deadlock, serialization), resources, lock not available, cancel (statement_timeout, a
# lock wait), system errors. Retried as they are, later.
_TRANSIENT = ("08", "40", "53", "55", "57", "58")


def _refusal(exc: psycopg.Error) -> bool:
    """The database refused the statement because of what it carried."""
    state = exc.sqlstate or ""
    return bool(state) and (state[:2] not in _TRANSIENT or state == "53200")  # out of memory


async def _wait(event: asyncio.Event, timeout: float) -> None:
    # wait_for, not asyncio.timeout (which would save a task per wake-up): on 3.11 a
    # timeout that expires as the event is set leaves the cancellation pending (uncancel
    # does not clear it), and the loop's next await dies of it (tests/test_worker.py).
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout=timeout)


async def _acquire(lock: asyncio.Lock, timeout: float) -> bool:
    """Take ``lock`` if it comes free within ``timeout``; True if taken."""
    try:
        await asyncio.wait_for(lock.acquire(), timeout=timeout)
    except TimeoutError:
        return False
    return True


def _logs_debug(log: Any) -> bool:
    """Whether ``log`` keeps debug records (a logger that cannot tell: it may)."""
    enabled = getattr(log, "is_enabled_for", None)
    return True if enabled is None else bool(enabled(logging.DEBUG))


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """From another thread; the loop may be gone already (the replica exits)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)

