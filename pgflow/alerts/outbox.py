"""The notification outbox: the sender every replica runs, test sends, listings.

How rows are claimed, retried and given up is in the design note of ``pgflow.alerts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import dict_row

from pgflow.alerts import evaluate, knob, secrets, webhook
from pgflow.db import connect_async
from pgflow.errors import NotFound
from pgflow.queries import q
from pgflow.retry import backoff_delay

POLL_S = knob("PGFLOW_ALERTS_POLL", 1.0)  # how often a sender looks for due rows
BACKOFF_BASE_S = knob("PGFLOW_ALERTS_BACKOFF", 5.0)  # first retry within this, doubling
BACKOFF_CAP_S = 3600.0
IN_FLIGHT = 8  # requests one replica has open at once
PER_ALERT = 2  # of which at most this many to one alert's receiver
LEASE_S = webhook.TIMEOUT_S + 20.0  # a claimed row is retried by others after this
NO_LEADER_EVERY_S = knob("PGFLOW_ALERTS_NO_LEADER_EVERY", 5.0)


@dataclass(frozen=True)
class Target:
    """Where one alert's notifications go, with its secrets resolved."""

    url: str | None
    fmt: str
    secret: str | None
    problem: str | None = None  # why it cannot be sent (variable missing...)


def resolve_target(definition: dict[str, Any] | None) -> Target:
    if definition is None:
        return Target(None, "json", None, "the alert is no longer defined")
    url = definition.get("url")
    if url is None and definition.get("url_env"):
        url = secrets.lookup(definition["url_env"])
        if not url:
            return Target(None, definition["format"], None,
                          f"environment variable {definition['url_env']} (url_env) is not set"
                          " on the sending replica")
    secret = None
    if definition.get("secret_env"):
        secret = secrets.lookup(definition["secret_env"])
        if not secret:
            return Target(None, definition["format"], None,
                          f"environment variable {definition['secret_env']} (secret_env) is"
                          " not set on the sending replica")
    return Target(url, definition["format"], secret)


async def send(notification_id: str, payload: dict[str, Any], target: Target,
               timeout: float = webhook.TIMEOUT_S) -> webhook.Answer:
    if target.url is None:
        return webhook.Answer(None, target.problem)
    raw = webhook.body(notification_id, payload, target.fmt)
    return await webhook.post(target.url, raw, webhook.headers(notification_id, raw,
                                                               target.secret), timeout)


class Sender:
    """Delivers due notifications (any replica) and checks ``no_leader`` on the side.

    ``in_flight`` requests at once, each its own task with its own timeout: a receiver
    that hangs holds one slot until its timeout, the others go on."""

    def __init__(self, url: str, *, public_url: str, lease_ttl: float, log: Any,
                 poll_s: float = POLL_S, in_flight: int = IN_FLIGHT,
                 per_alert: int = PER_ALERT,
                 timeout: float = webhook.TIMEOUT_S, backoff_base_s: float = BACKOFF_BASE_S,
                 no_leader_every_s: float = NO_LEADER_EVERY_S, pooled: bool = False) -> None:
        self.url = url
        self.pooled = pooled  # url is a transaction-mode PgBouncer (pgflow/pooler.py)
        self.public_url = public_url
        self.lease_ttl = lease_ttl
        self.poll_s = poll_s
        self.in_flight = in_flight
        self.per_alert = per_alert
        self.timeout = timeout
        self.backoff_base_s = backoff_base_s
        self.no_leader_every_s = no_leader_every_s
        self._log = log.bind(component="alerts")
        self._tasks: dict[asyncio.Task[None], str] = {}  # request -> alert
        self._lock = asyncio.Lock()  # one statement at a time on the sender's connection
        # A replica judges no_leader only once it has itself waited twice the lease TTL:
        # a cluster (re)starting gets its time to elect before anyone pages.
        self._next_leader_check = time.monotonic() + 2 * lease_ttl

    async def run(self, stop: asyncio.Event) -> None:
        failures = 0
        while not stop.is_set():
            try:
                async with await connect_async(self.url, "alerts", pooled=self.pooled) as conn:
                    while not stop.is_set():
                        await self.run_once(conn)
                        failures = 0
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), self.poll_s)
            except psycopg.Error as exc:
                failures += 1
                self._log.warning("alert sender: database error, retrying",
                                  error=str(exc).strip().splitlines()[0] if str(exc) else "")
            finally:
                await self._drain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(5.0, 0.2 * 2 ** failures))

    async def run_once(self, conn: AsyncConnection[Any]) -> int:
        """Check no_leader when due; claim as many due rows as there are free slots and
        start sending them. Returns how many were claimed."""
        if time.monotonic() >= self._next_leader_check:
            self._next_leader_check = time.monotonic() + self.no_leader_every_s
            async with self._lock:
                found = await evaluate.check_no_leader(conn, public_url=self.public_url,
                                                       lease_ttl=self.lease_ttl)
            if found.changed:
                self._log.warning("alerts: no_leader changed", opened=found.opened,
                                  resolved=found.resolved)
        free = self.in_flight - len(self._tasks)
        if free <= 0:
            return 0
        counts = Counter(self._tasks.values())
        busy = sorted(alert for alert, n in counts.items() if n >= self.per_alert)
        async with self._lock, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(q("notification_claim"), {
                "lease_s": LEASE_S, "limit": free, "per_alert": self.per_alert, "busy": busy})
            rows = await cur.fetchall()
        for row in rows:
            task = asyncio.create_task(self._deliver(conn, row))
            self._tasks[task] = row["alert"]
            task.add_done_callback(self._forget)
        return len(rows)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)

    async def _deliver(self, conn: AsyncConnection[Any], row: dict[str, Any]) -> None:
        try:
            target = resolve_target(row["target"])
            answer = await send(row["id"], row["payload"], target, self.timeout)
            params = {"id": row["id"], "attempts": row["attempts"], "status": answer.status}
            async with self._lock:
                if answer.ok:
                    await conn.execute(q("notification_delivered"), params)
                    self._log.info("alert delivered", notification=row["id"],
                                   alert=row["alert"], alert_event=row["event"],
                                   attempts=row["attempts"])
                    return
                delay = backoff_delay(row["attempts"], self.backoff_base_s, BACKOFF_CAP_S,
                                      jitter=True, draw=random.random)
                cur = await conn.execute(q("notification_failed"), {
                    **params, "error": answer.describe()[:1000], "delay_s": delay,
                    "give_up": row["target"] is None})
                result = await cur.fetchone()
            # The URL may be a secret (url_env): log the alert's name, never its URL.
            self._log.warning("alert not delivered", notification=row["id"],
                              alert=row["alert"], alert_event=row["event"],
                              attempts=row["attempts"],
                              answer=answer.describe()[:200],
                              given_up=bool(result and result[0] == "given_up"),
                              retry_in_s=round(delay, 1))
        except psycopg.Error as exc:
            # The row stays claimed until its lease passes, then it is retried.
            self._log.warning("alert sender: could not record a result", error=str(exc))
        except Exception:
            self._log.exception("alert sender: delivery failed", notification=row["id"])

    async def _drain(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_sender(url: str, *, public_url: str, lease_ttl: float, stop: asyncio.Event,
                     log: Any, pooled: bool = False) -> None:
    """The alert sender of ``pgflow serve`` (every replica): runs until ``stop``."""
    await Sender(url, public_url=public_url, lease_ttl=lease_ttl, log=log,
                 pooled=pooled).run(stop)


# ---------------------------------------------------------------- test sends, listings


@dataclass(frozen=True)
class TestResult:
    notification_id: str
    answer: webhook.Answer


def send_test(conn: psycopg.Connection[Any], name: str, public_url: str,
              timeout: float = webhook.TIMEOUT_S) -> TestResult:
    """Send a test notification to alert ``name`` now and record it in the delivery log."""
    definition = conn.execute(q("alert_definition"), {"name": name}).fetchone()
    if definition is None:
        known = [r["name"] for r in conn.execute(q("alert_definitions")).fetchall()]
        hint = f" (defined: {', '.join(known)})" if known else " (no alert is defined)"
        raise NotFound(f"unknown alert {name!r}{hint}")
    payload = {"event": "test", "status": "firing",
               "summary": f"test notification from pgflow for alert {name}",
               "url": evaluate.Links(public_url)("/alerts")}
    row = conn.execute(q("notification_test"), {"alert": name,
                                                "payload": json.dumps(payload)}).fetchone()
    assert row is not None
    conn.commit()
    target = resolve_target(dict(definition))
    answer = asyncio.run(send(row["id"], row["payload"], target, timeout))
    conn.execute(q("notification_test_result"), {
        "id": row["id"], "ok": answer.ok, "status": answer.status,
        "error": None if answer.ok else answer.describe()[:1000]})
    conn.commit()
    return TestResult(row["id"], answer)


def overview(conn: psycopg.Connection[Any], *, limit: int = 50) -> dict[str, Any]:
    """Active incidents, recent ones, the definitions and the delivery log."""
    return {
        "active": conn.execute(q("incidents_open"), {"limit": 500}).fetchall(),
        "recent": conn.execute(q("incidents_recent"), {"limit": limit}).fetchall(),
        "alerts": conn.execute(q("alert_definitions")).fetchall(),
        "deliveries": conn.execute(q("notifications_recent"), {"limit": limit}).fetchall(),
        "backlog": conn.execute(q("notification_backlog")).fetchone(),
    }


def firing(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """How many incidents are open (the banner's one indexed lookup)."""
    row = conn.execute(q("incidents_firing_count")).fetchone()
    return dict(row) if row else {"firing": 0, "latest": None}


BANNER_ITEMS = 5


def banner(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """The newest open incidents and how many are open, for the banner on every page:
    one indexed query."""
    rows = conn.execute(q("incidents_banner"), {"limit": BANNER_ITEMS}).fetchall()
    return {"total": int(rows[0]["total"]) if rows else 0, "items": rows}
