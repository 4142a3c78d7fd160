"""The worker role: claim runs into free slots, execute them, record how they end.

Concurrency model (the whole replica): one asyncio event loop. Runs are tasks;
commands are child processes awaited on the loop; sync Python jobs run in a
thread pool sized to ``--concurrency``; the database is reached through a few
dedicated async connections. A thousand sleeping runs cost a thousand tasks, not
a thousand threads or processes, and nothing needs locks: state lives on the
loop.

Four loops share a replica's worker state:
- claim: one ``claim_runs`` statement per wake-up, sized to the free slots; woken
  by NOTIFY ``pgflow_queue``, by a freed slot, or every second at the latest;
- complete: results are buffered and written by one ``finish_attempts`` statement
  per flush; while a flush is in flight the next batch gathers (group commit),
  so latency is one round-trip when idle and batches grow under load;
- heartbeat: every TTL/3 one ``renew_leases`` statement renews every lease this
  worker holds. A run that is not returned was taken from us (the reaper saw the
  lease expire): its attempt is stopped and its result dropped (fencing);
- listen: NOTIFY ``pgflow_cancel`` stops a running attempt at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg

from pgflow import queue, retry
from pgflow.db import connect_async
from pgflow.executor import KILL_GRACE_S, AttemptResult, Execution, Job
from pgflow.log import LazyLogger
from pgflow.queue import Finish

POLL_S = 1.0
CAPPED_CHECK_S = 0.5
_SUCCEEDED = retry.Decision(retry.SUCCEEDED)
MAX_CLAIM = 500
MAX_FLUSH = 5000


@dataclass
class Held:
    row: dict[str, Any]
    execution: Execution
    claimed_at: float
    task: asyncio.Task[None] | None = field(default=None)


class Worker:
    def __init__(self, url: str, worker_id: str, concurrency: int, lease_ttl: float,
                 log: Any) -> None:
        self.url = url
        self.id = worker_id
        self.concurrency = concurrency
        self.ttl = lease_ttl
        self.log = log
        self.active: dict[int, Held] = {}
        self._results: list[Finish] = []
        self._wake = asyncio.Event()
        self._flush = asyncio.Event()
        self._flushing = asyncio.Lock()
        self._idle = asyncio.Event()
        self._idle.set()
        self._claiming = True
        self._hurry = asyncio.Event()
        self._capped_seen = False
        self._capped_checked = 0.0
        self._threads = ThreadPoolExecutor(max_workers=concurrency,
                                           thread_name_prefix="pgflow-job")
        self._loops: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loops = [asyncio.create_task(self._supervise(loop), name=f"worker-{loop.__name__}")
                       for loop in (self._claim_loop, self._complete_loop, self._heartbeat_loop,
                                    self._listen_loop)]

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
        await self._flush_until_empty(deadline=time.monotonic() + 10)
        for loop in self._loops:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._threads.shutdown(wait=False, cancel_futures=True)

    def hurry(self) -> None:
        """Cut a drain's grace short (a second SIGTERM)."""
        self._hurry.set()

    # ------------------------------------------------------------ claim

    async def _claim_loop(self) -> None:
        conn: psycopg.AsyncConnection[Any] | None = None
        failures = 0
        while self._claiming:
            free = min(self.concurrency - len(self.active), MAX_CLAIM)
            if free <= 0:
                await _wait(self._wake, POLL_S)
                continue
            try:
                conn = conn or await _connect(self.url)
                self._wake.clear()
                rows = await queue.claim(conn, self.id, free, self.ttl)
                for row in rows:
                    self._start(row)
                if len(rows) < free and self._capped_due():
                    capped = await queue.claim_capped(conn, self.id, free - len(rows), self.ttl)
                    self._capped_seen = bool(capped)
                    for row in capped:
                        self._start(row)
                    rows += capped
                failures = 0
            except psycopg.Error as exc:
                conn, failures = await self._db_error("claim", exc, conn, failures)
                continue
            if len(rows) < free and self._claiming:
                await _wait(self._wake, POLL_S)
        await _close(conn)

    def _capped_due(self) -> bool:
        """Capped runs are looked for when the last look found some, else twice a second:
        an idle worker's wake-up stays one statement."""
        now = time.monotonic()
        if self._capped_seen or now - self._capped_checked >= CAPPED_CHECK_S:
            self._capped_checked = now
            return True
        return False

    def _start(self, row: dict[str, Any]) -> None:
        job = Job(run_id=row["id"], job=row["job"], logical_time=row["logical_time"],
                  attempt=row["attempt"], params=row["params"], command=row["command"],
                  entrypoint=row["entrypoint"], timeout_s=row["timeout_s"])
        log = LazyLogger(self.log, run_id=job.run_id, job=job.job, attempt=job.attempt)
        held = Held(row, Execution(job, log, self._threads), time.monotonic())
        if row["cancel_requested"]:
            held.execution.stop(retry.CANCELLED)
        self.active[job.run_id] = held
        self._idle.clear()
        held.task = asyncio.create_task(self._execute(held))

    async def _execute(self, held: Held) -> None:
        try:
            result = await held.execution.run()
        except Exception as exc:
            held.execution.logger.exception("internal error while running the attempt")
            result = AttemptResult(retry.FAILED, error=f"internal error: {exc!r}")
        run_id = held.row["id"]
        self.active.pop(run_id, None)
        if not self.active:
            self._idle.set()
        self._wake.set()
        if held.execution.stop_outcome == retry.LOST:
            held.execution.logger.warning("lease lost: attempt stopped, result discarded")
            return
        self._results.append(self._finish_for(held.row, result))
        self._flush.set()

    def _finish_for(self, row: dict[str, Any], result: AttemptResult) -> Finish:
        if result.outcome == retry.SUCCEEDED:  # the common case, kept cheap
            decision = _SUCCEEDED
        else:
            policy = None
            if row["backoff_s"] is not None:
                policy = retry.Policy(row["max_attempts"], row["backoff_s"],
                                      row["max_backoff_s"], row["jitter"],
                                      row["no_retry_exit_codes"])
            decision = retry.decide(result.outcome, row["attempt"], row["max_attempts"], policy,
                                    exit_code=result.exit_code, permanent=result.permanent)
        return Finish(run_id=row["id"], attempt=row["attempt"], owner=self.id,
                      state=decision.state, outcome=result.outcome,
                      started_at=row["attempt_started_at"], delay_s=decision.delay_s,
                      exit_code=result.exit_code, error=result.error,
                      stdout_tail=result.stdout_tail, stderr_tail=result.stderr_tail)

    # ------------------------------------------------------------ complete

    async def _complete_loop(self) -> None:
        conn: psycopg.AsyncConnection[Any] | None = None
        failures = 0
        while True:
            await self._flush.wait()
            self._flush.clear()
            try:
                conn = conn or await _connect(self.url)
                await self._flush_once(conn)
                failures = 0
            except psycopg.Error as exc:
                conn, failures = await self._db_error("complete", exc, conn, failures)
                self._flush.set()

    async def _flush_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        async with self._flushing:  # the drain and the complete loop may both flush
            while self._results:
                batch = self._results[:MAX_FLUSH]
                del self._results[: len(batch)]
                try:
                    done = await queue.finish(conn, batch)
                except BaseException:
                    self._results[:0] = batch
                    raise
                for finish in batch:
                    self._report(finish, done.get(finish.run_id))

    def _report(self, finish: Finish, state: str | None) -> None:
        fields = {"run_id": finish.run_id, "attempt": finish.attempt, "outcome": finish.outcome}
        if state is None:
            self.log.warning("lease lost before the result was recorded: result discarded",
                             **fields)
        elif finish.outcome == retry.SUCCEEDED:
            self.log.debug("attempt finished", state=state, **fields)
        else:
            self.log.info("attempt finished", state=state, exit_code=finish.exit_code,
                          error=finish.error, **fields)

    async def _flush_until_empty(self, deadline: float) -> None:
        conn: psycopg.AsyncConnection[Any] | None = None
        while (self._results or self._flushing.locked()) and time.monotonic() < deadline:
            try:
                conn = conn or await _connect(self.url)
                await self._flush_once(conn)
            except psycopg.Error as exc:
                conn, _ = await self._db_error("final flush", exc, conn, 1)
        if self._results:
            self.log.error("could not record results before exit; their leases will expire",
                           runs=[f.run_id for f in self._results])
        await _close(conn)

    # ------------------------------------------------------------ heartbeat

    async def _heartbeat_loop(self) -> None:
        conn: psycopg.AsyncConnection[Any] | None = None
        failures = 0
        while True:
            try:
                conn = conn or await _connect(self.url)
                sent = time.monotonic()
                rows = await queue.renew(conn, self.id, self.ttl)
                self._fence({row["id"]: row for row in rows}, sent)
                failures = 0
            except psycopg.Error as exc:
                conn, failures = await self._db_error("heartbeat", exc, conn, failures)
                continue
            await asyncio.sleep(self.ttl / 3)

    def _fence(self, still_ours: dict[int, dict[str, Any]], sent: float) -> None:
        for run_id, held in list(self.active.items()):
            row = still_ours.get(run_id)
            if row is None or row["attempt"] != held.row["attempt"]:
                if held.claimed_at < sent:  # claimed after the renewal started: not yet seen
                    held.execution.stop(retry.LOST)
            elif row["cancel_requested"]:
                held.execution.stop(retry.CANCELLED)

    # ------------------------------------------------------------ listen

    async def _listen_loop(self) -> None:
        failures = 0
        while True:
            conn: psycopg.AsyncConnection[Any] | None = None
            try:
                conn = await _connect(self.url)
                await conn.execute("LISTEN pgflow_queue")
                await conn.execute("LISTEN pgflow_cancel")
                self._wake.set()  # notifications may have been missed while disconnected
                failures = 0
                async for note in conn.notifies():
                    self._on_notify(note.channel, note.payload)
            except psycopg.Error as exc:
                conn, failures = await self._db_error("listen", exc, conn, failures)

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel == "pgflow_queue":
            self._wake.set()
        elif channel == "pgflow_cancel" and payload.isdigit():
            held = self.active.get(int(payload))
            if held is not None:
                held.execution.stop(retry.CANCELLED)

    # ------------------------------------------------------------ errors

    async def _db_error(self, what: str, exc: Exception, conn: psycopg.AsyncConnection[Any] | None,
                        failures: int) -> tuple[None, int]:
        failures += 1
        self.log.warning(f"{what}: database error, retrying", error=str(exc).strip(),
                         failures=failures)
        await _close(conn)
        await asyncio.sleep(min(5.0, 0.1 * 2**failures))
        return None, failures


async def _connect(url: str) -> psycopg.AsyncConnection[Any]:
    return await connect_async(url, "worker")


async def _close(conn: psycopg.AsyncConnection[Any] | None) -> None:
    if conn is not None:
        with contextlib.suppress(psycopg.Error):
            await conn.close()


async def _wait(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout=timeout)
