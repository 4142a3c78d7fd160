"""Helpers for engine tests: register jobs, create runs, wait for conditions."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg

from pgflow import registry
from pgflow.queries import q
from pgflow.spec import JobSpec

T = TypeVar("T")
Conn = psycopg.Connection[dict[str, Any]]


def add_job(conn: Conn, name: str, **keys: Any) -> None:
    keys.setdefault("retry", {"max_attempts": 1})
    registry.apply(conn, [JobSpec.model_validate({"name": name, **keys})])


def enqueue(conn: Conn, job: str, at: datetime | None = None,
            params: dict[str, Any] | None = None) -> int:
    import json

    moment = at or datetime.now(UTC)
    row = conn.execute(q("create_runs"), {
        "jobs": [job], "times": [moment], "trigger": "manual", "params": json.dumps(params or {}),
        "downstream": False, "state": "queued", "priority_offset": 0, "backfill_id": None,
    }).fetchone()
    assert row is not None
    conn.execute(q("notify_queue"))
    return int(row["id"])


def run_row(conn: Conn, run_id: int) -> dict[str, Any]:
    row = conn.execute("SELECT * FROM pgflow.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return row


def attempts(conn: Conn, run_id: int) -> list[dict[str, Any]]:
    return conn.execute("SELECT * FROM pgflow.attempts WHERE run_id = %s ORDER BY attempt",
                        (run_id,)).fetchall()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], T], timeout: float = 20.0, interval: float = 0.05) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


class WorkerThread:
    """A Worker on its own event loop in a thread, so tests stay synchronous."""

    def __init__(self, url: str, concurrency: int = 4, lease_ttl: float = 30.0,
                 worker_id: str = "test-worker") -> None:
        import threading

        from pgflow.log import get_logger
        from pgflow.worker import Worker

        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.worker: Worker | None = None

        def main() -> None:
            asyncio.set_event_loop(self.loop)

            async def create() -> None:
                self.worker = Worker(url, worker_id, concurrency, lease_ttl,
                                     get_logger(test=True))
                self.worker.start()
                self.ready.set()

            self.loop.run_until_complete(create())
            self.loop.run_forever()
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker's loop and return its result."""
        async def invoke() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(invoke(), self.loop).result(10)

    def stop(self, grace: float = 5.0) -> None:
        assert self.worker is not None
        asyncio.run_coroutine_threadsafe(self.worker.drain(grace), self.loop).result(grace + 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_dag(conn: Conn, jobs: list[str], at: datetime, *, downstream: bool = True,
              trigger: str = "manual") -> dict[str, int]:
    """Create the DAG run of ``jobs`` at ``at``; returns {job: run id} of the created runs."""
    rows = conn.execute(q("create_runs"), {
        "jobs": jobs, "times": [at] * len(jobs), "trigger": trigger, "params": None,
        "downstream": downstream, "state": "queued", "priority_offset": 0,
        "backfill_id": None}).fetchall()
    conn.execute(q("notify_queue"))
    return {row["job"]: row["id"] for row in rows}


def states(conn: Conn, at: datetime) -> dict[str, str]:
    rows = conn.execute("SELECT job, state FROM pgflow.runs WHERE logical_time = %s", (at,))
    return {row["job"]: row["state"] for row in rows}
