"""Serving the web app inside ``pgflow serve``'s event loop (uvicorn, no extra process)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from pgflow import db
from pgflow.config import Settings, split_bind
from pgflow.errors import PgflowError
from pgflow.web.app import create_app
from pgflow.web.auth import check_bind_allowed


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: ``pgflow serve`` owns SIGTERM/SIGINT and
    stops the web role through ``stop``."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(bind: str) -> socket.socket:
    """A listening socket for ``host:port``; PgflowError naming the address if it fails."""
    host, port = split_bind(bind)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, reuse_port=False)
    except OSError as exc:
        reason = str(exc.strerror or exc).split(" (while attempting")[0]
        raise PgflowError(f"cannot serve the web role on {bind}: {reason}"
                          " (is another process using that port? set --bind)") from None
    sock.setblocking(False)
    return sock


async def run_web(url: str, settings: Settings, bind: str, stop: asyncio.Event,
                  log: Any, *, secret: bytes | None = None, pooled: bool = False) -> None:
    """Serve the web role on ``bind`` until ``stop`` is set; ``secret`` signs sessions
    (default: ``load_secret``, which reads ``PGFLOW_SECRET_KEY``); ``pooled``: ``url`` is
    PgBouncer's.

    Refuses (PgflowError) a non-loopback bind while no admin token exists, and an
    address that cannot be bound, before serving anything.
    """
    host, _ = split_bind(bind)
    conn = await asyncio.to_thread(lambda: db.connect(url, pooled=pooled))
    try:
        await asyncio.to_thread(check_bind_allowed, conn, host)
    finally:
        await asyncio.to_thread(conn.close)
    sock = bind_socket(bind)
    app = create_app(url, settings, secret=secret, pooled=pooled)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                            proxy_headers=True, server_header=False,
                            timeout_graceful_shutdown=5)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    server = _Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    log.info("web role serving", bind=bind)
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        server.should_exit = True
        stopping.cancel()
        with contextlib.suppress(SystemExit):
            await serving
        sock.close()
    log.info("web role stopped")
