"""Scheduler leadership: exactly one replica turns cron ticks into runs.

Design note
===========

Election. Every replica with the scheduler role opens one dedicated
connection, the *lock connection*, and calls ``pg_try_advisory_lock`` with
``LEADER_LOCK_KEY`` about once a second. PostgreSQL grants a session lock to
one session at a time and releases it when that session ends, however it ends
(clean close, crash, network loss noticed by the server, termination), so the
lock itself decides who leads. The winner records itself in the singleton row
``pgflow.leader``: replica id, the lock session's ``pg_backend_pid()``, a term
one higher than the previous one, and a heartbeat.

Leading. The leader loops: ``datasets.consume`` (dataset-triggered runs, the same
shape: bounded passes on the lock connection, a heartbeat before each; it is woken
by NOTIFY ``pgflow_datasets``), ``scheduler.run_once``, which heartbeats (an UPDATE
guarded by replica id *and* term: no row back means the row was taken over and
it stops at once) before each of its passes, each pass one bounded
transaction; a heartbeat, the backfill release and, every few seconds, the
safety net (safety_net.py); then a sleep until the earliest ``next_fire_at``
of an unpaused job (the ``jobs_due_idx`` index; ``scheduler.AHEAD`` earlier for a
job without downstream jobs, whose runs are created ahead of the tick), the next
tick whose runs were created ahead (the leader then wakes the workers at that
instant, ``release_ticks``), a NOTIFY on ``pgflow_jobs`` (definitions changed,
paused, resumed) or 1 s, whichever comes first. Every
scheduling transaction runs *on the lock connection*. A backlog of any size
is many short passes, so the heartbeat never waits longer than one pass.
The alert evaluation (pgflow/alerts) runs in that loop too, every few seconds.
A tick due within ``TICK_GUARD_S`` is kept clear: the periodic chores (safety net,
pruning, alerts) wait until its pass ran, and an idle 1 s cycle that would end just
before it ends a guard earlier instead, so the pass starts on time (issue 16).

Frozen leaders. A leader process that is stopped (SIGSTOP, a debugger, a
blocked event loop) keeps its session open, so it keeps the lock and nobody
else can lead. Standbys therefore read the row when they fail to get the
lock: when its heartbeat is older than ``lease_ttl`` by the *database* clock
(replica clocks never matter), they ``pg_terminate_backend`` the recorded pid,
but only while that pid still holds the scheduler lock in this database (a
dead leader's pid may have been reused), then try the lock again. Termination
needs the standby to connect as the same role as the leader (or a member of
``pg_signal_backend``); pgflow replicas share one role.

Failures. Any error on the lock connection (connection lost, backend
terminated, server restart) makes the replica stop scheduling at once, close
the connection and compete again after an exponential backoff (full jitter,
capped at about 5 s); ``run_scheduler`` never raises on database errors.
A replica that stops (``stop`` set or task cancelled) closes the connection,
which releases the lock: a standby takes over within about a second.

Why no tick is lost or doubled.
* A tick is consumed in the transaction that inserts its run: the same
  transaction advances the job's persisted ``next_fire_at``. If a leader dies
  or is deposed before that commit, both roll back and the next leader fires
  the tick from the persisted time (its catchup policy decides about ticks
  missed during a long gap); nothing lives only in a leader's memory.
* A deposed leader cannot commit a tick late: its transactions run on the
  lock connection, so they can only commit while that session holds the lock,
  and terminating the session rolls back whatever was in flight. A frozen
  process that wakes up finds its connection gone, and its heartbeat (a term
  that is no longer current) affects no row.
* Two schedulers overlapping anyway (a replica whose session outlived its
  belief, a test running ``run_once`` by hand) still cannot double a tick:
  due jobs are locked with ``FOR UPDATE SKIP LOCKED`` for the pass, and
  a run's ``(job, logical_time)`` is unique (``run_keys``, migration 0024): a
  second insert of a pair skips its row.
What can still happen: after a leader freezes, no ticks fire until
``lease_ttl`` has passed and a standby took over; they then fire late (or are
skipped under ``catchup = "none"`` beyond its grace), never twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import structlog
from psycopg import AsyncConnection
from psycopg.rows import dict_row

from pgflow import backfill, datasets, retention, safety_net
from pgflow.alerts import evaluate as alert_evaluation
from pgflow.config import DEFAULT_RETENTION_S, LEADER_HEARTBEAT_S
from pgflow.db import connect_async
from pgflow.queries import q
from pgflow.retry import backoff_delay
from pgflow.scheduler import AHEAD, PassPace, SchedulePass, run_once

# "pgflow" followed by 0x0001: the one advisory lock the scheduler leader holds.
LEADER_LOCK_KEY = 0x7067666C6F770001

# Standbys try the lock this often; the leader never sleeps longer between heartbeats.
RETRY_INTERVAL = 1.0
MAX_SLEEP = LEADER_HEARTBEAT_S
# Reconnect backoff after a database error: full jitter over 0.2 s * 2^n, capped.
BACKOFF_BASE = 0.2
BACKOFF_CAP = 5.0
# When jobs look due but the pass found none (rows locked by a registration), wait this
# long instead of spinning.
BUSY_NAP = 0.1
# How long a standby waits for a terminated leader session to exit.
TERMINATE_WAIT_MS = 2000
# Chores and idle cycles stay this far from the next tick (its pass must start on time).
TICK_GUARD_S = 0.3
# The leader wakes this long before a release (runs created ahead become claimable);
# the server sleeps the rest (release_ticks), so the wake-up is on its clock.
RELEASE_LEAD_S = 0.02


@dataclass(frozen=True)
class LeaderInfo:
    """The row of ``pgflow.leader``; ``stale`` when its heartbeat is older than the TTL."""

    replica_id: str
    backend_pid: int
    term: int
    elected_at: datetime
    heartbeat_at: datetime
    stale: bool


async def current_leader(conn: AsyncConnection[Any], lease_ttl: float) -> LeaderInfo | None:
    """Who leads scheduling according to the database (None before the first election)."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(q("get_leader"), {"ttl": lease_ttl})
        row = await cur.fetchone()
    return None if row is None else LeaderInfo(**row)


class _LostLeadership(Exception):
    """The guarded heartbeat matched no row: another replica's term is current."""


class Leadership:
    """One replica's seat in the scheduler election; ``run`` competes, leads, schedules.

    ``lease_ttl`` is how old the leader's heartbeat may get before a standby deposes
    it (``PGFLOW_LEASE_TTL``). ``retry_interval`` is how often a standby tries the
    lock and ``max_sleep`` the longest pause between the leader's heartbeats; both
    default to 1 s.
    """

    def __init__(
        self,
        url: str,
        replica_id: str,
        lease_ttl: float,
        log: Any,
        *,
        retry_interval: float = RETRY_INTERVAL,
        max_sleep: float = MAX_SLEEP,
        retention_s: float = DEFAULT_RETENTION_S,
        net_interval: float = safety_net.INTERVAL_S,
        public_url: str = "http://127.0.0.1:8080",
        alert_interval: float = alert_evaluation.INTERVAL_S,
    ) -> None:
        if lease_ttl <= max_sleep:
            raise ValueError(
                f"lease_ttl must be longer than the heartbeat interval ({max_sleep}s),"
                f" got {lease_ttl}s"
            )
        self.url = url
        self.replica_id = replica_id
        self.lease_ttl = lease_ttl
        self.retry_interval = retry_interval
        self.max_sleep = max_sleep
        self.net_interval = net_interval  # how often the safety net runs (safety_net.py)
        self.retention_s = retention_s  # finished runs older than this are pruned (retention.py)
        self.public_url = public_url  # links in alert notifications (pgflow.alerts)
        self.alert_interval = alert_interval
        self._log = log.bind(component="scheduler", replica_id=replica_id)
        self._term: int | None = None
        self._confirmed_at = 0.0  # time.monotonic() of the last heartbeat that matched
        self._tick_at: float | None = None  # time.monotonic() of the next tick, as last read
        self._releases: set[datetime] = set()  # ticks whose runs were created ahead, unreleased
        # A scheduling pass lasts a quarter of the TTL at most, so heartbeats between
        # passes keep the term even on a loaded machine (scheduler.PassPace).
        self._pace = PassPace(target_s=lease_ttl / 4)
        self._failures = 0

    @property
    def is_leader(self) -> bool:
        """This replica won the lock and its term was confirmed within the lease TTL
        (a replica stuck on a dead connection stops claiming to lead after the TTL)."""
        return self._term is not None and time.monotonic() - self._confirmed_at < self.lease_ttl

    @property
    def term(self) -> int | None:
        return self._term

    async def run(self, stop: asyncio.Event) -> None:
        """Compete, lead and schedule until ``stop`` is set; database errors are logged
        and followed by a reconnect, never raised."""
        while not stop.is_set():
            try:
                async with await connect_async(self.url, "scheduler") as conn:
                    await self._compete(conn, stop)
            except psycopg.Error as exc:
                self._failures += 1
                self._log.warning("scheduler connection failed", error=_one_line(exc),
                                  failures=self._failures)
            except Exception:
                self._failures += 1
                self._log.exception("scheduler failed", failures=self._failures)
            finally:
                self._set_follower()
            # After an error, back off; after losing leadership, let another replica win.
            await _sleep(stop, self._retry_delay())

    def _retry_delay(self) -> float:
        if not self._failures:
            return self.retry_interval
        return backoff_delay(self._failures, BACKOFF_BASE, BACKOFF_CAP, jitter=True)

    async def _compete(self, conn: AsyncConnection[Any], stop: asyncio.Event) -> None:
        while not stop.is_set():
            won = await _fetch_value(conn, "try_leader_lock", {"key": LEADER_LOCK_KEY})
            if won:
                await self._lead(conn, stop)
                return  # leadership over: drop the lock connection
            deposed = await self._depose_frozen_leader(conn)
            self._failures = 0  # a whole standby round worked
            if not deposed:
                await _sleep(stop, self.retry_interval)

    async def _depose_frozen_leader(self, conn: AsyncConnection[Any]) -> bool:
        params = {"ttl": self.lease_ttl, "wait_ms": TERMINATE_WAIT_MS,
                  "key_high": LEADER_LOCK_KEY >> 32, "key_low": LEADER_LOCK_KEY & 0xFFFFFFFF}
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(q("depose_frozen_leader"), params)
            deposed = await cur.fetchall()
        for row in deposed:
            self._log.warning("deposed a frozen scheduler leader", leader=row["replica_id"],
                              term=row["term"], backend_pid=row["backend_pid"],
                              terminated=row["terminated"], lease_ttl=self.lease_ttl)
        return bool(deposed)

    async def _lead(self, conn: AsyncConnection[Any], stop: asyncio.Event) -> None:
        term = await _fetch_value(conn, "claim_leadership", {"replica_id": self.replica_id})
        self._term = int(term)
        self._log.info("scheduler leadership won", term=self._term)
        await conn.execute(q("listen_jobs"))
        net = _NetSchedule(self.net_interval)
        pruner = retention.Pruner(self.retention_s, replica_id=self.replica_id)
        alerting = alert_evaluation.Schedule(self.alert_interval)
        try:
            while not stop.is_set():
                # Dataset-triggered runs first: an event's NOTIFY is what woke us, most
                # likely (datasets.py); then cron ticks. Unless a tick is what woke us:
                # then its pass comes first, on time.
                tick_first = self._tick_reached()
                if tick_first:
                    result = await self._schedule(conn)
                fired = await datasets.consume(conn, before_pass=lambda: self._heartbeat(conn))
                if fired.runs:
                    self._log.info("dataset-triggered runs", runs=len(fired.runs),
                                   events=fired.events)
                if not tick_first:
                    result = await self._schedule(conn)
                self._report(result)
                await self._heartbeat(conn)
                released = await backfill.release(conn)
                if released:
                    self._log.debug("released backfill runs", runs=released)
                clear = self._clear_of_tick()
                if clear and net.due():
                    await net.run(conn, self.lease_ttl, self._log)
                if clear and pruner.due():
                    await pruner.run(conn, self._log)
                if clear and alerting.due():
                    await alerting.run(conn, public_url=self.public_url,
                                       lease_ttl=self.lease_ttl, log=self._log)
                if not result.more and not pruner.behind and not fired.more:  # backlog: go on
                    await self._wait_for_work(conn, stop, result)
        except _LostLeadership:
            self._log.warning("scheduler leadership lost: another replica's term is current",
                              term=self._term)
        finally:
            self._set_follower()

    async def _schedule(self, conn: AsyncConnection[Any]) -> SchedulePass:
        result = await run_once(conn, before_pass=lambda: self._heartbeat(conn), ahead=AHEAD,
                                pace=self._pace)
        self._releases.update(result.releases)
        return result

    async def _heartbeat(self, conn: AsyncConnection[Any]) -> None:
        params = {"replica_id": self.replica_id, "term": self._term}
        if await _fetch_value(conn, "leader_heartbeat", params) is None:
            raise _LostLeadership
        self._confirmed_at = time.monotonic()
        self._failures = 0

    async def _wait_for_work(
        self, conn: AsyncConnection[Any], stop: asyncio.Event, result: SchedulePass
    ) -> None:
        """Sleep until the next pass, the next release of runs created ahead, a
        notification or ``max_sleep``; at a release, wake the workers instead."""
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(q("seconds_until_due"), {"ahead_s": AHEAD.total_seconds(),
                                                       "releases": sorted(self._releases)})
            clock = await cur.fetchone()
        assert clock is not None  # aggregates only: one row
        seconds, release = clock["due"], clock["release"]
        if release is not None:
            if release <= RELEASE_LEAD_S:
                await self._release(conn)
                return
            seconds = release - RELEASE_LEAD_S if seconds is None else min(
                seconds, release - RELEASE_LEAD_S)
        self._tick_at = None if seconds is None else time.monotonic() + seconds
        if seconds is None:
            timeout = self.max_sleep
        elif seconds > 0:
            # A millisecond late, so the pass's now() is surely past the fire time.
            timeout = min(seconds + 0.001, self.max_sleep)
            if 0 < seconds - self.max_sleep < TICK_GUARD_S:
                timeout = seconds - TICK_GUARD_S  # the next cycle ends clear of the tick
        else:
            timeout = BUSY_NAP if result.jobs_due == 0 else 0.0
        if timeout > 0:
            await _notified_or_stopped(conn, stop, timeout)

    async def _release(self, conn: AsyncConnection[Any]) -> None:
        """The earliest tick whose runs were created ahead has come, or is about to (the
        server waits for it, release_ticks): the workers are woken to claim them. A tick
        the leader was too busy to meet is released late, never skipped."""
        tick = min(self._releases)
        self._releases.discard(tick)
        await conn.execute(q("release_ticks"), {"at": tick})

    def _tick_reached(self) -> bool:
        """The next tick, as last read, has come (the leader slept until it)."""
        return self._tick_at is not None and time.monotonic() >= self._tick_at

    def _clear_of_tick(self) -> bool:
        """No tick is expected within ``TICK_GUARD_S`` (as of the last look): chores may run.
        A tick already past was just handled by the pass. A stale estimate (definitions
        changed since) costs at most one postponed chore."""
        now = time.monotonic()
        return self._tick_at is None or not now <= self._tick_at < now + TICK_GUARD_S

    def _report(self, result: SchedulePass) -> None:
        if result.runs_created:
            self._log.info("scheduled runs", runs=result.runs_created,
                           jobs=result.jobs_fired, passes=result.passes,
                           as_of=result.as_of.isoformat() if result.as_of else None)
        if result.broken:
            self._log.error("schedules that cannot be evaluated were stopped; register"
                            " these jobs again with a valid schedule", jobs=result.broken)

    def _set_follower(self) -> None:
        if self._term is not None:
            self._log.info("scheduler leadership ended", term=self._term)
        self._term = None


class _NetSchedule:
    """When the leader runs the safety net next, and where its walk of pending runs is."""

    def __init__(self, interval: float = safety_net.INTERVAL_S) -> None:
        self.interval = interval
        self.after_id = 0
        self._next = time.monotonic() + interval

    def due(self) -> bool:
        return time.monotonic() >= self._next

    async def run(self, conn: AsyncConnection[Any], lease_ttl: float, log: Any) -> None:
        self._next = time.monotonic() + self.interval
        found = await safety_net.run_once_async(conn, lease_ttl=lease_ttl,
                                                after_id=self.after_id, log=log)
        self.after_id = found.after_id


async def run_scheduler(
    url: str,
    replica_id: str,
    lease_ttl: float,
    stop: asyncio.Event,
    log: structlog.stdlib.BoundLogger | Any,
    retention_s: float = DEFAULT_RETENTION_S,
    public_url: str = "http://127.0.0.1:8080",
) -> None:
    """The scheduler role of ``pgflow serve``: runs until ``stop`` is set."""
    await Leadership(url, replica_id, lease_ttl, log, retention_s=retention_s,
                     public_url=public_url).run(stop)


async def _fetch_value(conn: AsyncConnection[Any], query: str, params: dict[str, Any]) -> Any:
    """The first column of the first row of a named query, or None without a row."""
    async with conn.cursor() as cur:
        await cur.execute(q(query), params)
        row = await cur.fetchone()
    return None if row is None else row[0]


async def _notified_or_stopped(
    conn: AsyncConnection[Any], stop: asyncio.Event, timeout: float
) -> None:
    """Wait up to ``timeout`` s for a notification on the connection or for ``stop``.
    A connection error while listening is raised."""
    listening = asyncio.ensure_future(_drain_notifies(conn, timeout))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({listening, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (listening, stopping):
            task.cancel()
        # A cancelled listener leaves the connection mid-wait; that only happens when
        # stopping, and the connection is closed right after.
        await asyncio.gather(listening, stopping, return_exceptions=True)
    if listening.done() and not listening.cancelled():
        error = listening.exception()
        if error is not None:
            raise error


async def _drain_notifies(conn: AsyncConnection[Any], timeout: float) -> None:
    got = False
    async for _ in conn.notifies(timeout=timeout, stop_after=1):
        got = True
    if got:  # one wake-up for a burst of changes
        async for _ in conn.notifies(timeout=0):
            pass


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
