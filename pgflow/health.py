"""A tiny HTTP health listener for replicas without the web role (``--health-bind``).

Kubernetes (or any supervisor) probes a worker like a web replica: ``GET /healthz``
(liveness) and ``GET /readyz`` (readiness) on ``PGFLOW_HEALTH_BIND``, nothing else,
no auth, no data beyond role names. It is a plain asyncio server in the replica's own
event loop, so an answer at all means the loop is not stuck.

- ``/healthz``: 200 while every role of the replica runs (heartbeat, scheduler, reaper,
  web, and the worker's loops); 503 naming the roles that stopped, so the pod restarts.
  A draining replica (SIGTERM) stays live while its roles wind down.
- ``/readyz``: 200 when it is live, not draining (SIGTERM), and the database answers
  within ``CHECK_TIMEOUT_S`` with a schema at least as new as this replica's
  migrations; otherwise 503 with the reason. A database outage makes replicas unready,
  not dead: they reconnect on their own, a restart would not help.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg

from pgflow import migrate
from pgflow.config import split_bind
from pgflow.db import bounded, connect_async
from pgflow.dbconfig import redact
from pgflow.errors import PgflowError
from pgflow.queries import q

if TYPE_CHECKING:
    from pgflow.serve import ServeOptions
    from pgflow.worker import Worker

CHECK_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 5.0
Liveness = Callable[[], dict[str, bool]]


def start(options: ServeOptions, roles: list[asyncio.Task[None]], worker: Worker | None,
          stopping: asyncio.Event, stop: asyncio.Event, log: Any) -> asyncio.Task[None]:
    """Bind ``options.health_bind`` now (PgflowError if it cannot) and serve it until
    ``stop``. ``roles`` are the replica's role tasks; a worker's loops are its tasks
    named ``worker-*``. A web role that is only one of the default roles may be missing
    (another replica on the host has the port), as ``pgflow serve`` allows."""
    assert options.health_bind is not None
    sock = bind(options.health_bind)
    tasks = list(roles)
    loops = ([t for t in asyncio.all_tasks() if t.get_name().startswith("worker-")]
             if worker is not None else [])
    optional = set() if options.web_required else {"web"}

    def liveness() -> dict[str, bool]:
        alive = {t.get_name(): not t.done() for t in tasks if t.get_name() not in optional}
        if worker is not None:
            alive["worker"] = bool(loops) and not any(t.done() for t in loops)
        return alive

    checker = Health(options.pooled_url, liveness, stopping, pooled=options.pooled)
    return asyncio.create_task(checker.serve(sock, options.health_bind, stop, log),
                               name="health")


def bind(address: str) -> socket.socket:
    """A listening socket for ``host:port``; PgflowError naming the address if it fails."""
    host, port = split_bind(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as exc:
        raise PgflowError(f"cannot serve the health listener on {address}: "
                          f"{exc.strerror or exc} (set --health-bind)") from None
    sock.setblocking(False)
    return sock


class Health:
    """Answers ``/healthz`` from ``liveness`` and ``/readyz`` from it and the database."""

    def __init__(self, url: str, liveness: Liveness, stopping: asyncio.Event,
                 timeout: float = CHECK_TIMEOUT_S, *, pooled: bool = False) -> None:
        self.url = url
        self.pooled = pooled  # url is PgBouncer's
        self.liveness = liveness
        self.stopping = stopping
        self.timeout = timeout
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._checking = asyncio.Lock()  # one database check at a time, however many probes
        self._schema = max((m.version for m in migrate.available()), default=0)

    async def serve(self, sock: socket.socket, address: str, stop: asyncio.Event,
                    log: Any) -> None:
        server = await asyncio.start_server(self._handle, sock=sock)
        log.info("health listener serving", bind=address)
        try:
            await stop.wait()
        finally:
            server.close()
            await server.wait_closed()
            await self._drop()

    async def healthz(self) -> tuple[int, dict[str, Any]]:
        roles = self.liveness()
        stopped = sorted(name for name, alive in roles.items() if not alive)
        # While draining, roles end one by one on purpose: the replica is still live.
        if stopped and not self.stopping.is_set():
            return 503, {"status": "failing", "roles": roles,
                         "reason": "stopped: " + ", ".join(stopped)}
        return 200, {"status": "ok", "roles": roles}

    async def readyz(self) -> tuple[int, dict[str, Any]]:
        status, body = await self.healthz()
        if status != 200:
            return 503, {**body, "status": "unavailable"}
        if self.stopping.is_set():
            return 503, {"status": "unavailable", "reason": "draining (shutting down)"}
        reason = await self._database_problem()
        if reason is not None:
            return 503, {"status": "unavailable", "reason": reason}
        return 200, {"status": "ready"}

    async def _database_problem(self) -> str | None:
        async with self._checking:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = await asyncio.wait_for(
                        connect_async(self.url, "health", statement_timeout=self.timeout,
                                      connect_timeout=self.timeout, pooled=self.pooled),
                        self.timeout + 1)
                conn = self._conn
                cur = await bounded(conn, conn.execute(q("health_schema_version")),
                                    self.timeout, "health check")
                row = await cur.fetchone()
            except (psycopg.Error, OSError, TimeoutError) as exc:
                await self._drop()
                text = str(exc).strip().splitlines() or [type(exc).__name__]
                return f"database: {redact(text[0])}"
        version = int(row[0]) if row is not None else 0
        if version < self._schema:
            return (f"database schema is at migration {version:04d}, this replica needs"
                    f" {self._schema:04d} (run 'pgflow db migrate')")
        return None

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 1.0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path = await asyncio.wait_for(_read_request(reader), REQUEST_TIMEOUT_S)
            if method not in ("GET", "HEAD"):
                status, body = 405, {"status": "error", "reason": f"{method} is not allowed"}
            elif path == "/healthz":
                status, body = await self.healthz()
            elif path == "/readyz":
                status, body = await self.readyz()
            else:
                status, body = 404, {"status": "error",
                                     "reason": "only /healthz and /readyz are served here"}
            writer.write(_response(status, body, head=method == "HEAD"))
            await writer.drain()
        except (TimeoutError, ValueError, ConnectionError, asyncio.IncompleteReadError):
            pass  # a client that sent nothing usable, or left: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    """The method and path of an HTTP/1.x request; its headers are read and ignored."""
    line = await reader.readline()
    while await reader.readline() not in (b"\r\n", b"\n", b""):
        pass
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError("not an HTTP request")
    return parts[0], parts[1].split("?", 1)[0]


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed",
            503: "Service Unavailable"}


def _response(status: int, body: dict[str, Any], *, head: bool = False) -> bytes:
    payload = (json.dumps(body) + "\n").encode()
    headers = (f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
               "Content-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n"
               "Cache-Control: no-store\r\n"
               "Connection: close\r\n\r\n").encode()
    return headers if head else headers + payload
