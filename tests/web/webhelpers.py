"""Helpers for the web tests: auth headers, a real uvicorn server in a thread, and
rows for runs in given states (as the engine leaves them)."""

from __future__ import annotations

import re
import threading
import time
from datetime import datetime
from typing import Any

import psycopg
import uvicorn
from engine import enqueue, free_port
from starlette.applications import Starlette

Conn = psycopg.Connection[dict[str, Any]]
SECRET = b"test-secret-0123456789abcdef"
ROLES = ("viewer", "operator", "admin")


def auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


class ServerThread:
    """uvicorn serving ``app`` on a free loopback port in a daemon thread."""

    def __init__(self, app: Starlette) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test web server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def finished_run(conn: Conn, job: str, at: datetime, state: str = "failed", *,
                 seconds: float = 3.0, error: str | None = "boom",
                 exit_code: int | None = 1) -> int:
    """A run of ``job`` that ended in ``state`` after one attempt of ``seconds``."""
    run_id = enqueue(conn, job, at)
    outcome = "succeeded" if state == "succeeded" else "cancelled" if state == "cancelled" \
        else "failed"
    conn.execute(
        "UPDATE pgflow.runs SET state = %(state)s, attempt = 1, started_at = now()"
        " - make_interval(secs => %(s)s), finished_at = now() WHERE id = %(id)s",
        {"state": state, "s": seconds, "id": run_id})
    conn.execute(
        "INSERT INTO pgflow.attempts (run_id, attempt, worker_id, started_at, finished_at,"
        " outcome, exit_code, error, stdout_tail, stderr_tail)"
        " VALUES (%(id)s, 1, 'w1', now() - make_interval(secs => %(s)s), now(), %(o)s,"
        " %(code)s, %(error)s, 'hello from stdout', 'warning on stderr')",
        {"id": run_id, "s": seconds, "o": outcome, "code": exit_code,
         "error": error if state != "succeeded" else None})
    return run_id


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    assert match, "no CSRF field on the page"
    return match.group(1)
