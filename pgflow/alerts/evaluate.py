"""The alert evaluation pass (the leader, every ``INTERVAL_S``) and the ``no_leader``
check (every replica). Why each event fires once per transition, and what a leader
change mid-pass does, is in the design note of ``pgflow.alerts``."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import dict_row

from pgflow.alerts import RESOLVED_EVENT, knob
from pgflow.queries import q
from pgflow.status import ALIVE_TTLS

INTERVAL_S = knob("PGFLOW_ALERTS_INTERVAL", 5.0)
# §4d thresholds.
BACKLOG_S = 300.0
FAILURE_RATE = 0.20
FAILURE_MIN_ATTEMPTS = 20
FAILURE_WINDOW_S = 900.0
# Runs that committed a finish this long after their finished_at are still seen.
RUNS_SLACK_S = 15.0
# backlog and failure_rate read a window of attempts and the waiting runs: every 30 s.
CLUSTER_EVERY_S = knob("PGFLOW_ALERTS_CLUSTER_EVERY", 30.0)
RUNS_BATCH = 5000
DEADLINE_LOOKBACK_S = 86400.0
BATCH = 1000
ERROR_CHARS = 2000


@dataclass(frozen=True)
class Thresholds:
    """The §4d thresholds (tests shorten them)."""

    backlog_s: float = BACKLOG_S
    failure_rate: float = FAILURE_RATE
    failure_min_attempts: int = FAILURE_MIN_ATTEMPTS
    failure_window_s: float = FAILURE_WINDOW_S


@dataclass
class AlertPass:
    """What one pass changed: incidents opened and resolved (by event), notifications queued."""

    opened: dict[str, int] = field(default_factory=dict)
    resolved: dict[str, int] = field(default_factory=dict)
    notifications: int = 0

    @property
    def changed(self) -> int:
        return sum(self.opened.values()) + sum(self.resolved.values())


@dataclass(frozen=True)
class Transition:
    """Open or resolve the incident (event, key), with the notification payload."""

    kind: str  # "open" | "resolve"
    event: str
    key: str
    summary: str
    payload: dict[str, Any]
    job: str | None = None
    tenant: str | None = None
    run_id: int | None = None
    source: str | None = None
    runs: tuple[int, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)
    once: bool = False  # opened already resolved (replica_lost: no resolution)


class Links:
    """UI links under ``PGFLOW_PUBLIC_URL``."""

    def __init__(self, public_url: str) -> None:
        self.base = public_url.rstrip("/")

    def __call__(self, path: str) -> str:
        return self.base + path


async def apply(conn: AsyncConnection[Any], transitions: list[Transition],
                found: AlertPass) -> None:
    """Write each transition with its notifications, in order (a job's streak may open,
    resolve and open again within one pass)."""
    async with conn.cursor(row_factory=dict_row) as cur:
        for t in transitions:
            status = "firing" if t.kind == "open" else "resolved"
            note_event = t.event if t.kind == "open" else RESOLVED_EVENT.get(t.event, t.event)
            payload = {"event": note_event, "status": status, "summary": t.summary,
                       **{k: v for k, v in t.payload.items() if v is not None}}
            params = {"event": t.event, "key": t.key, "job": t.job, "tenant": t.tenant,
                      "run_id": t.run_id, "source": t.source, "runs": list(t.runs),
                      "summary": t.summary, "details": json.dumps(t.details, default=str),
                      "once": t.once, "note_event": note_event, "status": status,
                      "payload": json.dumps(payload, default=str)}
            await cur.execute(q("alert_open" if t.kind == "open" else "alert_resolve"), params)
            row = await cur.fetchone()
            assert row is not None
            if row["changed"]:
                counts = found.opened if t.kind == "open" else found.resolved
                counts[t.event] = counts.get(t.event, 0) + 1
                found.notifications += int(row["notified"])


# ---------------------------------------------------------------- the leader's pass


async def run_once(conn: AsyncConnection[Any], *, public_url: str, lease_ttl: float,
                   thresholds: Thresholds = Thresholds(), cluster: bool = True) -> AlertPass:
    """One evaluation pass in one transaction (on the leader's lock connection);
    ``cluster``: include backlog and failure_rate."""
    links = Links(public_url)
    found = AlertPass()
    async with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(q("alert_lock_cursor"))
        cursor = await cur.fetchone()
        assert cursor is not None
        checked_at = await _streaks(cur, conn, cursor, links, found)
        last_transition = await _breakers(cur, conn, cursor["breaker_transition"], links, found)
        await _deadlines(cur, conn, links, found)
        if cluster:
            await _cluster(cur, conn, links, thresholds, found)
        await _lost_replicas(cur, conn, lease_ttl, links, found)
        await cur.execute(q("alert_save_cursor"), {"runs_checked_at": checked_at,
                                                   "breaker_transition": last_transition})
    return found


async def _streaks(cur: Any, conn: AsyncConnection[Any], cursor: dict[str, Any], links: Links,
                   found: AlertPass) -> datetime:
    since = cursor["runs_checked_at"]
    await cur.execute(q("alert_finished_runs"), {
        "since": since - timedelta(seconds=RUNS_SLACK_S), "limit": RUNS_BATCH})
    rows = await cur.fetchall()
    full = len(rows) >= RUNS_BATCH
    checked_at: datetime = rows[-1]["finished_at"] if full else cursor["now"]
    if not rows:
        return checked_at
    jobs = sorted({r["job"] for r in rows})
    await cur.execute(q("alert_open_streaks"), {"jobs": jobs})
    open_by_job: dict[str, dict[str, Any]] = {r["job"]: r for r in await cur.fetchall()}
    # In finish order: ("open", first dead letter, the streak's dead letters in this batch)
    # or ("resolve", the success, []); dead letters of a streak already open are appended.
    plan: list[tuple[str, dict[str, Any], list[int]]] = []
    appended: dict[int, list[int]] = {}
    current: dict[str, list[int] | None] = {}  # the runs list of a streak opened in this batch
    streak: dict[str, bool] = {job: job in open_by_job for job in jobs}
    for row in rows:
        job = row["job"]
        if row["state"] == "failed":
            if not streak[job]:
                streak[job] = True
                runs: list[int] = [row["id"]]
                current[job] = runs
                plan.append(("open", row, runs))
            elif (opened := current.get(job)) is not None:
                opened.append(row["id"])
            else:
                appended.setdefault(open_by_job[job]["id"], []).append(row["id"])
        elif streak[job]:
            streak[job] = False
            current[job] = None
            open_by_job.pop(job, None)
            plan.append(("resolve", row, []))
    if appended:  # before the transitions: a streak this batch resolves takes them too
        await cur.execute(q("alert_append_runs"), {
            "rows": json.dumps([{"id": k, "runs": v} for k, v in appended.items()])})
    transitions = [_run_failed(row, runs, links) if kind == "open" else
                   _run_recovered(row, links) for kind, row, runs in plan]
    await apply(conn, transitions, found)
    last: dict[str, dict[str, Any]] = {}
    for row in rows:
        last[row["job"]] = {"job": row["job"], "last_run_id": row["id"],
                            "last_finished_at": row["finished_at"].isoformat()}
    await cur.execute(q("alert_save_streaks"), {"rows": json.dumps(list(last.values()))})
    return checked_at


def _run_failed(row: dict[str, Any], runs: list[int], links: Links) -> Transition:
    error = (row["error"] or "")[:ERROR_CHARS] or None
    summary = (f"job {row['job']} failed: run {row['id']} dead-lettered after attempt"
               f" {row['attempt']}" + (f": {_last_line(error)}" if error else ""))
    if len(runs) > 1:
        summary = f"job failing: {row['job']}, {len(runs)} dead letters in a row"
    return Transition(
        "open", "run_failed", row["job"], summary, job=row["job"], tenant=row["tenant"],
        run_id=row["id"], runs=tuple(runs),
        details={"logical_time": row["logical_time"], "attempt": row["attempt"],
                 "error": error},
        payload={"url": links(f"/runs/{row['id']}"), "job": row["job"],
                 "tenant": row["tenant"], "run_id": row["id"],
                 "logical_time": _iso(row["logical_time"]), "attempt": row["attempt"],
                 "error": error})


def _run_recovered(row: dict[str, Any], links: Links) -> Transition:
    return Transition(
        "resolve", "run_failed", row["job"],
        f"job {row['job']} recovered: run {row['id']} succeeded", job=row["job"],
        tenant=row["tenant"], details={"recovered_by": row["id"]},
        payload={"url": links(f"/runs/{row['id']}"), "job": row["job"], "tenant": row["tenant"],
                 "run_id": row["id"], "logical_time": _iso(row["logical_time"]),
                 "attempt": row["attempt"]})


async def _breakers(cur: Any, conn: AsyncConnection[Any], after: int, links: Links,
                    found: AlertPass) -> int:
    await cur.execute(q("alert_breaker_transitions"), {"after": after, "limit": BATCH})
    rows = await cur.fetchall()
    transitions = []
    for row in rows:
        if row["to_state"] == "open":
            transitions.append(_breaker("open", row["source"], row["reason"], links))
        elif row["to_state"] == "closed":
            transitions.append(_breaker("resolve", row["source"], row["reason"], links))
    await apply(conn, transitions, found)
    await cur.execute(q("alert_breaker_drift"))
    drift = [_breaker("open" if r["incident"] is None else "resolve", r["source"], None, links)
             for r in await cur.fetchall()]
    await apply(conn, drift, found)
    return int(rows[-1]["id"]) if rows else after


def _breaker(kind: str, source: str, reason: str | None, links: Links) -> Transition:
    if kind == "open":
        summary = f"breaker of source {source} opened" + (f": {reason}" if reason else "")
    else:
        summary = f"breaker of source {source} closed"
    return Transition(kind, "breaker_opened", source, summary, source=source,
                      payload={"url": links("/breakers"), "source": source})


async def _deadlines(cur: Any, conn: AsyncConnection[Any], links: Links,
                     found: AlertPass) -> None:
    await cur.execute(q("alert_deadline_missed"), {"lookback_s": DEADLINE_LOOKBACK_S,
                                                   "limit": BATCH})
    opened = [Transition(
        "open", "deadline_missed", str(r["id"]),
        f"run {r['id']} of job {r['job']} missed its deadline"
        f" ({_duration(r['deadline_s'])} after {_iso(r['logical_time'])}); it is {r['state']}",
        job=r["job"], tenant=r["tenant"], run_id=r["id"], runs=(r["id"],),
        details={"logical_time": r["logical_time"], "state": r["state"],
                 "deadline_s": r["deadline_s"]},
        payload={"url": links(f"/runs/{r['id']}"), "job": r["job"], "tenant": r["tenant"],
                 "run_id": r["id"], "logical_time": _iso(r["logical_time"]),
                 "attempt": r["attempt"] or None})
        for r in await cur.fetchall()]
    await apply(conn, opened, found)
    await cur.execute(q("alert_deadline_settled"))
    settled = [Transition(
        "resolve", "deadline_missed", r["key"],
        f"run {r['key']} of job {r['job']} " + (
            "succeeded" if r["state"] == "succeeded" else
            "is gone" if r["state"] is None else f"was settled ({r['state']})"),
        job=r["job"], details={"state": r["state"]},
        payload={"url": links(f"/runs/{r['key']}"), "job": r["job"],
                 "run_id": r["run_id"]})
        for r in await cur.fetchall()]
    await apply(conn, settled, found)


async def _cluster(cur: Any, conn: AsyncConnection[Any], links: Links, th: Thresholds,
                   found: AlertPass) -> None:
    await cur.execute(q("alert_cluster_facts"), {"window_s": th.failure_window_s})
    facts = await cur.fetchone()
    assert facts is not None
    is_open = set(facts["open"])
    wait = float(facts["oldest_wait_s"] or 0.0)
    transitions = []
    if wait > th.backlog_s and "backlog" not in is_open:
        transitions.append(Transition(
            "open", "backlog", "cluster",
            f"the oldest claimable run has waited {_duration(wait)}"
            f" (more than {_duration(th.backlog_s)})",
            details={"oldest_wait_s": wait}, payload={"url": links("/")}))
    elif wait <= th.backlog_s and "backlog" in is_open:
        transitions.append(Transition(
            "resolve", "backlog", "cluster",
            f"no claimable run has waited more than {_duration(th.backlog_s)}",
            details={"oldest_wait_s": wait}, payload={"url": links("/")}))
    attempts, failed = int(facts["attempts"]), int(facts["failed"])
    failing = attempts >= th.failure_min_attempts and failed > th.failure_rate * attempts
    rate = f"{failed} of {attempts} attempts of the last {_duration(th.failure_window_s)} failed"
    details = {"attempts": attempts, "failed": failed}
    if failing and "failure_rate" not in is_open:
        transitions.append(Transition("open", "failure_rate", "cluster", rate, details=details,
                                      payload={"url": links("/runs?state=failed")}))
    elif not failing and "failure_rate" in is_open:
        transitions.append(Transition("resolve", "failure_rate", "cluster",
                                      f"failure rate back under {th.failure_rate:.0%}: {rate}",
                                      details=details, payload={"url": links("/")}))
    await apply(conn, transitions, found)


async def _lost_replicas(cur: Any, conn: AsyncConnection[Any], lease_ttl: float, links: Links,
                         found: AlertPass) -> None:
    await cur.execute(q("alert_lost_replicas"), {"dead_s": ALIVE_TTLS * lease_ttl})
    lost = []
    for r in await cur.fetchall():
        runs = tuple(sorted({*r["held"], *r["lost"]}))
        if not runs:
            continue
        lost.append(Transition(
            "open", "replica_lost", r["id"],
            f"replica {r['id']} ({r['host']} pid {r['pid']}) stopped heartbeating at"
            f" {_iso(r['heartbeat_at'])} while it held {len(runs)} run(s)",
            runs=runs, once=True,
            details={"host": r["host"], "pid": r["pid"], "heartbeat_at": r["heartbeat_at"]},
            payload={"url": links("/replicas"), "replica": r["id"],
                     "run_id": runs[0] if len(runs) == 1 else None}))
    await apply(conn, lost, found)


# ---------------------------------------------------------------- no_leader (any replica)


async def check_no_leader(conn: AsyncConnection[Any], *, public_url: str,
                          lease_ttl: float) -> AlertPass:
    """Open ``no_leader`` when the leader's heartbeat is older than twice the lease TTL,
    resolve it when a leader is back; safe to run on every replica at once."""
    links = Links(public_url)
    found = AlertPass()
    after_s = 2 * lease_ttl
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(q("alert_leader_age"))
        row = await cur.fetchone()
        if row is None:
            return found  # never elected yet
        if row["age_s"] > after_s and not row["open"]:
            summary = (f"no scheduler leader for {_duration(row['age_s'])} (last leader:"
                       f" {row['replica_id']}): nothing is being scheduled")
            query, status, kind = "alert_no_leader_open", "firing", found.opened
        elif row["age_s"] <= after_s and row["open"]:
            summary = f"scheduler leader is back: {row['replica_id']}"
            query, status, kind = "alert_no_leader_resolve", "resolved", found.resolved
        else:
            return found
        payload = {"event": "no_leader", "status": status, "summary": summary,
                   "url": links("/replicas")}
        await cur.execute(q(query), {"summary": summary, "after_s": after_s,
                                     "note_event": "no_leader", "status": status,
                                     "payload": json.dumps(payload)})
        result = await cur.fetchone()
        assert result is not None
        if result["changed"]:
            kind["no_leader"] = 1
            found.notifications += int(result["notified"])
    return found


class Schedule:
    """When the leader evaluates next (like the safety net's schedule in leader.py)."""

    def __init__(self, interval: float = INTERVAL_S,
                 cluster_every: float = CLUSTER_EVERY_S) -> None:
        self.interval = interval
        self.cluster_every = cluster_every
        self._next = time.monotonic()
        self._next_cluster = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() >= self._next

    async def run(self, conn: AsyncConnection[Any], *, public_url: str, lease_ttl: float,
                  log: Any) -> AlertPass:
        self._next = time.monotonic() + self.interval
        cluster = time.monotonic() >= self._next_cluster
        if cluster:
            self._next_cluster = time.monotonic() + self.cluster_every
        try:
            found = await run_once(conn, public_url=public_url, lease_ttl=lease_ttl,
                                   cluster=cluster)
        except (psycopg.OperationalError, psycopg.InterfaceError):
            raise  # the lock connection is gone: the leader's loop handles it
        except psycopg.Error as exc:
            # A failed pass rolled back; scheduling goes on and the next pass retries.
            log.error("alerts: evaluation pass failed", error=str(exc).strip())
            return AlertPass()
        if found.changed:
            log.info("alerts: incidents changed", opened=found.opened, resolved=found.resolved,
                     notifications=found.notifications)
        return found


def _iso(value: Any) -> str | None:
    if value is None:
        return None
    return str(value.astimezone(UTC).isoformat().replace("+00:00", "Z"))


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return (lines[-1] if lines else "")[:200]


def _duration(seconds: float) -> str:
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"
