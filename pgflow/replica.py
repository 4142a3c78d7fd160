"""A replica's identity and its heartbeat row in ``pgflow.replicas``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any

import psycopg

from pgflow import __version__
from pgflow.db import bounded, close_async, connect_async
from pgflow.queries import q

ROLES = ("scheduler", "worker", "reaper", "web")


@dataclass(frozen=True)
class Replica:
    id: str
    host: str
    pid: int
    roles: tuple[str, ...]
    concurrency: int

    @classmethod
    def new(cls, roles: tuple[str, ...], concurrency: int) -> Replica:
        host = socket.gethostname()
        pid = os.getpid()
        return cls(f"{host}-{pid}-{secrets.token_hex(3)}", host, pid, roles, concurrency)

    def params(self) -> dict[str, Any]:
        return {"id": self.id, "host": self.host, "pid": self.pid, "roles": list(self.roles),
                "version": __version__, "concurrency": self.concurrency}


async def run_heartbeat(url: str, replica: Replica, lease_ttl: float, stop: asyncio.Event,
                        stopping: asyncio.Event, log: Any, *, pooled: bool = False) -> None:
    """Register the replica and keep its heartbeat fresh until ``stop``; deregister then
    (``pooled``: ``url`` is PgBouncer's)."""
    conn: psycopg.AsyncConnection[Any] | None = None
    failures = 0
    try:
        while not stop.is_set():
            try:
                conn = conn or await connect_async(url, "replica", pooled=pooled)
                await bounded(conn, conn.execute(q("heartbeat_replica"), {
                    **replica.params(), "stopping": stopping.is_set()}), lease_ttl,
                    "replica heartbeat")
                failures = 0
            except psycopg.Error as exc:
                failures += 1
                log.warning("replica heartbeat: database error, retrying",
                            error=str(exc).strip())
                await close_async(conn)
                conn = None
            pause = lease_ttl / 3 if not failures else min(lease_ttl / 3, 0.2 * 2**failures)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.execute(q("deregister_replica"), {"id": replica.id})
    finally:
        await close_async(conn)  # also when a bug ends the role (serve restarts it)
