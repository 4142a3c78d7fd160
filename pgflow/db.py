"""How to reach the database (where it is, ``PGFLOW_DATABASE_URL`` or the embedded
cluster: ``dbconfig.resolve_url``). ``connect`` turns every connection failure into one
readable DatabaseUnavailable line.

A replica's own connections (``connect_async``) notice a dead peer in seconds (TCP
keepalives and ``tcp_user_timeout``, both ways); worker and reaper sessions also get
server-side statement and idle-transaction timeouts sized from the lease TTL, and
their loops bound every statement on the client too (``bounded``): a silent
partition, where the socket neither answers nor fails, is caught by nothing else.

``pooled=True`` marks a connection to a transaction-mode PgBouncer (``PGFLOW_POOLER_URL``):
nothing is prepared and nothing is SET on it, since consecutive transactions may run on
different server sessions. What goes through the pooler and what must stay direct, and
the connections each role opens: the design note of ``pgflow/pooler.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from pgflow import migrate
from pgflow.dbconfig import unreachable
from pgflow.errors import DatabaseUnavailable
from pgflow.queries import q


def connect(url: str, *, pooled: bool = False,
            **kwargs: Any) -> psycopg.Connection[dict[str, Any]]:
    """An autocommit connection returning dict rows (``pooled``: through PgBouncer)."""
    if pooled:
        kwargs["prepare_threshold"] = None
    try:
        conn = psycopg.connect(
            url, autocommit=True, row_factory=dict_row, connect_timeout=10, **kwargs
        )
        if not pooled:
            conn.execute(q("session_setup"))
        return conn
    except (psycopg.Error, ValueError) as exc:
        raise unreachable(url, str(exc) or type(exc).__name__) from None


def connect_pooled(url: str, pooler_url: str | None) -> psycopg.Connection[dict[str, Any]]:
    """A connection through ``pooler_url`` (PGFLOW_POOLER_URL) when set, else to ``url``."""
    return connect(pooler_url, pooled=True) if pooler_url else connect(url)


def connect_migrated(url: str, pooler_url: str | None = None, *,
                     wait_s: float = 0.0) -> psycopg.Connection[dict[str, Any]]:
    """A connection to a database whose schema is current (pending migrations are applied:
    ``migrate`` is safe from several processes at once). With ``pooler_url`` the connection
    goes through the pooler, and only migrations, when some are pending, use ``url``.
    ``wait_s``: how long to wait for a server that is starting or restarting."""
    conn = _connect_when_started(lambda: connect_pooled(url, pooler_url), wait_s)
    if migrate.pending(conn):
        migrator = connect(url) if pooler_url else conn
        try:
            applied = migrate.migrate(migrator)
        finally:
            if migrator is not conn:
                migrator.close()
        print(f"pgflow: applied {len(applied)} migration(s)", file=sys.stderr)
    return conn


def _connect_when_started(connect_once: Callable[[], psycopg.Connection[dict[str, Any]]],
                          wait_s: float) -> psycopg.Connection[dict[str, Any]]:
    """``connect_once()``, tried again every half second for up to ``wait_s`` while the
    server says it is starting (``DatabaseUnavailable.starting``); any other refusal, such
    as a wrong password or a missing database, is raised at once."""
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            return connect_once()
        except DatabaseUnavailable as exc:
            if not exc.starting or time.monotonic() >= deadline:
                raise
            if not told:
                print(f"pgflow: waiting up to {wait_s:g} s for the database ({exc})",
                      file=sys.stderr)
                told = True
            time.sleep(0.5)


# Notice a dead peer in seconds instead of the kernel's hours (TCP only; no-ops on a unix
# socket): keepalive probes on an idle connection, and a cap on how long data we sent may
# stay unacknowledged (libpq's tcp_user_timeout, in ms).
_TCP: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                        "keepalives_count": 3, "tcp_user_timeout": 10_000}


async def connect_async(url: str, name: str, *, statement_timeout: float | None = None,
                        connect_timeout: float = 10,
                        pooled: bool = False) -> psycopg.AsyncConnection[Any]:
    """An autocommit connection for a replica's role ``name`` (its application_name).
    Raises psycopg errors: the roles retry with backoff.

    With ``statement_timeout`` (seconds), the server ends any statement, or transaction
    left idle, that outlasts it and drops the session quickly if the client vanishes
    mid-statement: for worker and reaper sessions, whose statements are worthless once a
    lease could have expired. (Not for the leader, whose session holds its lock.)
    A ``pooled`` connection sets nothing (PgBouncer's settings stand in: pgflow/pooler.py)
    and prepares nothing."""
    extra: dict[str, Any] = {"prepare_threshold": None} if pooled else {}
    conn = await psycopg.AsyncConnection.connect(
        url, autocommit=True, connect_timeout=max(2, round(connect_timeout)),
        application_name=f"pgflow-{name}", **_TCP, **extra)
    if pooled:
        return conn
    if statement_timeout is None:
        await conn.execute(q("session_setup"))
    else:
        await conn.execute(q("session_limits"),
                           {"timeout": f"{max(1, round(statement_timeout * 1000))}ms"})
    return conn


def array_literal(values: Sequence[str | datetime | None]) -> str:
    """``values`` as the text of a PostgreSQL array (``{"a","b",NULL}``), for a parameter
    the statement casts (``%(x)s::text[]``, ``::timestamptz[]``). psycopg dumps a list
    element by element in Python (a 10,000-element timestamptz list took 25 ms, about
    as long as the statement that used it); the server parses this text in C. Each
    distinct time is formatted once (a tick's runs share a handful)."""
    formatted: dict[datetime, str] = {}
    parts = []
    for value in values:
        if value is None:
            parts.append("NULL")
            continue
        if isinstance(value, datetime):
            text = formatted.get(value)
            if text is None:
                text = formatted[value] = value.isoformat()
        else:
            text = value
            if '"' in text or "\\" in text:
                text = text.replace("\\", "\\\\").replace('"', '\\"')
        parts.append(f'"{text}"')
    return "{" + ",".join(parts) + "}"


class StatementTimeout(psycopg.OperationalError):
    """A statement got no answer in time; its connection was closed."""


T = TypeVar("T")


async def bounded(conn: psycopg.AsyncConnection[Any], work: Awaitable[T], timeout: float,
                  what: str = "statement") -> T:
    """Await ``work`` (statements on ``conn``) for at most ``timeout`` seconds.

    A silent partition leaves a socket that neither answers nor fails; server timeouts
    never fire (the server never got the statement) and TCP timeouts only fire when the
    peer's kernel stops acknowledging. So past ``timeout`` the connection is closed and
    StatementTimeout raised. Closing comes first: cancelling psycopg's wait would make it
    send a cancel request and wait for the answer, over the same dead network."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        return task.result()
    await conn.close()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise StatementTimeout(f"{what}: no answer from the database within {timeout:g}s")


async def close_async(conn: psycopg.AsyncConnection[Any] | None) -> None:
    """Close ``conn`` if there is one, whatever state it is in."""
    if conn is not None:
        with contextlib.suppress(psycopg.Error):
            await conn.close()
