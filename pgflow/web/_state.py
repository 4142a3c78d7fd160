"""What one web app holds for its lifetime: settings, the signing key, the connection
pool and small per-replica caches. Nothing here is session state."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool
from starlette.requests import Request

from pgflow.config import Settings
from pgflow.metrics import Metrics
from pgflow.queries import q
from pgflow.web.auth import Signer

T = TypeVar("T")
Conn = psycopg.Connection[dict[str, Any]]


class TtlCache:
    """Values computed at most once per ``ttl_s`` per key by one thread; others wait for
    that computation instead of repeating it (no thundering herd on the dashboard)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._items: dict[str, tuple[float, Any]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def clear(self) -> None:
        self._items.clear()

    def get(self, key: str, compute: Callable[[], T]) -> T:
        item = self._items.get(key)
        if item is not None and item[0] > time.monotonic():
            return item[1]  # type: ignore[no-any-return]
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            item = self._items.get(key)
            if item is not None and item[0] > time.monotonic():
                return item[1]  # type: ignore[no-any-return]
            value = compute()
            self._items[key] = (time.monotonic() + self.ttl_s, value)
            return value


def _configure(conn: psycopg.Connection[Any]) -> None:
    conn.execute(q("session_setup"))


def new_pool(url: str, max_size: int = 10, *, pooled: bool = False) -> ConnectionPool[Any]:
    """Autocommit dict-row connections, checked on checkout (a restarted database costs
    one failed check, not one failed request). Statements are not prepared: listings
    with optional filters then get a plan for their actual values every time (and a
    ``pooled`` URL, PgBouncer's in transaction mode, could not keep them; nor a SET)."""
    return ConnectionPool(
        url, min_size=1, max_size=max_size, open=False, timeout=5.0, name="pgflow-web",
        check=ConnectionPool.check_connection, configure=None if pooled else _configure,
        kwargs={"autocommit": True, "row_factory": dict_row, "prepare_threshold": None,
                "connect_timeout": 5, "application_name": "pgflow-web"})


@dataclass
class WebState:
    url: str
    settings: Settings
    signer: Signer
    pool: ConnectionPool[Any]
    metrics: Metrics
    cache: TtlCache = field(default_factory=lambda: TtlCache(5.0))
    started_at: float = field(default_factory=time.time)
    # Per-minute (finished, succeeded, failed) counts of the last 24 h, keyed by minute
    # (epoch seconds), as the dashboard last read them (from pgflow.run_minutes).
    minutes: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    minutes_lock: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        with self.pool.connection() as conn:
            yield conn


def web_state(request: Request) -> WebState:
    state: WebState = request.app.state.web
    return state
