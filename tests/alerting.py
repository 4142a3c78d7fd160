"""Helpers for alert tests: a real webhook receiver, evaluation and delivery passes."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg

from pgflow import registry
from pgflow.alerts import evaluate, outbox
from pgflow.db import connect_async
from pgflow.log import get_logger

Conn = psycopg.Connection[dict[str, Any]]
PUBLIC = "http://pgflow.example:8080"


class Receiver:
    """An HTTP server in a thread that records every POST. ``answers[path]`` is a list of
    status codes to give in turn (then 200); a path in ``hang`` blocks until released."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.answers: dict[str, list[int]] = {}
        self.hang: set[str] = set()
        self.release = threading.Event()
        self.hanging = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                owner.requests.append({"path": self.path, "headers": dict(self.headers),
                                       "raw": raw, "body": json.loads(raw)})
                if self.path in owner.hang:
                    owner.hanging.set()
                    owner.release.wait(60)
                queue = owner.answers.get(self.path, [])
                code = queue.pop(0) if queue else 200
                try:
                    self.send_response(code)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:
                    pass  # the sender gave up waiting (a timeout test)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def bodies(self, path: str = "/hook") -> list[dict[str, Any]]:
        return [r["body"] for r in self.requests if r["path"] == path]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def apply_toml(conn: Conn, path: Path, text: str) -> registry.ApplyResult:
    path.write_text(text)
    loaded = registry.load_sources([str(path)])
    return registry.apply(conn, loaded.specs, invalid=loaded.errors, policies=loaded.policies,
                          source=str(path))


def evaluate_once(url: str, lease_ttl: float = 30.0,
                  thresholds: evaluate.Thresholds | None = None) -> evaluate.AlertPass:
    async def main() -> evaluate.AlertPass:
        async with await connect_async(url, "test-alerts") as conn:
            return await evaluate.run_once(conn, public_url=PUBLIC, lease_ttl=lease_ttl,
                                           thresholds=thresholds or evaluate.Thresholds())

    return asyncio.run(main())


def deliver(url: str, done: Callable[[], bool], within: float = 30.0,
            **options: Any) -> None:
    """Run a sender (short backoff) until ``done()``."""
    options.setdefault("backoff_base_s", 0.05)
    options.setdefault("no_leader_every_s", 3600.0)

    async def main() -> None:
        sender = outbox.Sender(url, public_url=PUBLIC, lease_ttl=30.0,
                               log=get_logger(test=True), **options)
        async with await connect_async(url, "test-sender") as conn:
            deadline = time.monotonic() + within
            try:
                while not done():
                    if time.monotonic() > deadline:
                        raise AssertionError(f"deliveries not done within {within}s")
                    await sender.run_once(conn)
                    await asyncio.sleep(0.05)
            finally:
                await sender._drain()

    asyncio.run(main())


def notifications(conn: Conn) -> list[dict[str, Any]]:
    return conn.execute("SELECT * FROM pgflow.notifications ORDER BY created_at, event").fetchall()


def incidents(conn: Conn, event: str | None = None) -> list[dict[str, Any]]:
    return conn.execute("SELECT * FROM pgflow.incidents WHERE %(e)s::text IS NULL OR event = %(e)s"
                        " ORDER BY id", {"e": event}).fetchall()
