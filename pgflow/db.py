"""Where the database is and how to reach it.

``resolve_url`` returns ``PGFLOW_DATABASE_URL`` or, when it is unset, the URL of
the embedded cluster of ``PGFLOW_HOME`` (started on demand). ``connect`` turns
every connection failure into one readable DatabaseUnavailable line.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pgflow import migrate
from pgflow.config import Settings
from pgflow.errors import DatabaseUnavailable


def resolve_url(settings: Settings, *, announce: bool = True) -> str:
    if settings.database_url:
        return settings.database_url
    from pgflow.embedded import embedded_cluster

    url = embedded_cluster(settings.home).ensure_running()
    if announce:
        print(f"pgflow: using embedded PostgreSQL {url}", file=sys.stderr)
    return url


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


# pgflow's statements are short OLTP statements, but the row estimates of the recursive
# DAG queries can pass jit_above_cost, and compiling then costs about a second each.
SESSION_SETUP = "SET jit = off"


def connect(url: str, **kwargs: Any) -> psycopg.Connection[dict[str, Any]]:
    """An autocommit connection returning dict rows."""
    try:
        conn = psycopg.connect(
            url, autocommit=True, row_factory=dict_row, connect_timeout=10, **kwargs
        )
        conn.execute(SESSION_SETUP)
        return conn
    except (psycopg.Error, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise DatabaseUnavailable(f"cannot connect to {redact(url)}: {reason}") from None


def connect_migrated(url: str) -> psycopg.Connection[dict[str, Any]]:
    """A connection to a database whose schema is current (pending migrations are applied:
    ``migrate`` is safe from several processes at once)."""
    conn = connect(url)
    if migrate.pending(conn):
        applied = migrate.migrate(conn)
        print(f"pgflow: applied {len(applied)} migration(s)", file=sys.stderr)
    return conn


async def connect_async(url: str, name: str) -> psycopg.AsyncConnection[Any]:
    """An autocommit connection for a replica's role ``name`` (its application_name).
    Raises psycopg errors: the roles retry with backoff."""
    conn = await psycopg.AsyncConnection.connect(
        url, autocommit=True, connect_timeout=10, application_name=f"pgflow-{name}",
        # Notice a dead peer in seconds instead of the kernel's hours (TCP only).
        keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3)
    await conn.execute(SESSION_SETUP)
    return conn
