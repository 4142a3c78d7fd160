"""Circuit breakers over external sources (``sources = [...]`` in job definitions).

An operator opens a source's breaker when the system behind it is down or under
maintenance: runs of every job that lists the source are held back in the queue
(the claim query skips them) until the breaker is closed again. Opening records
the reason and who did it. Each change is one guarded statement: opening an open
breaker or closing a closed one is refused with its current state.
"""

from __future__ import annotations

from typing import Any

import psycopg

from pgflow.errors import Conflict, InvalidInput, NotFound
from pgflow.queries import q
from pgflow.spec import NAME_RE

Conn = psycopg.Connection[dict[str, Any]]
MAX_REASON = 1000


def list_breakers(conn: Conn) -> list[dict[str, Any]]:
    """Every known source, open breakers first; ``jobs`` counts the jobs that use it."""
    return conn.execute(q("breaker_list")).fetchall()


def open_sources(conn: Conn) -> list[str]:
    return [row["source"] for row in conn.execute(q("breakers_open_sources"))]


def open_breaker(conn: Conn, source: str, reason: str | None, by: str | None) -> dict[str, Any]:
    """Open the breaker of ``source`` (a source no job names yet may be opened too)."""
    check_source(source)
    reason = _check_reason(reason)
    with conn.transaction():
        row = conn.execute(q("breaker_open"), {"source": source, "reason": reason, "by": by,
                                               "now": None}).fetchone()
    if row is None:
        current = conn.execute(q("breaker_get"), {"source": source}).fetchone()
        since = current["changed_at"].isoformat() if current else "?"
        why = f" ({current['reason']})" if current and current["reason"] else ""
        raise Conflict(f"the breaker of source {source!r} is already open since {since}{why}")
    return row


def close_breaker(conn: Conn, source: str, reason: str | None, by: str | None) -> dict[str, Any]:
    """Close the breaker of ``source``: its jobs' held-back runs may be claimed again."""
    check_source(source)
    reason = _check_reason(reason)
    with conn.transaction():
        row = conn.execute(q("breaker_close"), {"source": source, "reason": reason, "by": by,
                                                "now": None}).fetchone()
        if row is not None:
            conn.execute(q("notify_queue"))
    if row is not None:
        return row
    if conn.execute(q("breaker_get"), {"source": source}).fetchone() is not None:
        raise Conflict(f"the breaker of source {source!r} is already closed")
    used = conn.execute(q("breaker_source_used"), {"source": source}).fetchone()
    if used and used["used"]:
        raise Conflict(f"the breaker of source {source!r} is already closed")
    raise NotFound(f"no source named {source!r}: no job lists it and it has no breaker"
                   " (see 'GET /api/v1/breakers')")


def check_source(source: str) -> None:
    if not (0 < len(source) <= 128 and NAME_RE.fullmatch(source)):
        raise InvalidInput("a source name starts with a letter or digit and uses only letters,"
                           " digits, '_', '.', '-' (at most 128 characters)")


def _check_reason(reason: str | None) -> str | None:
    if reason is None or not reason.strip():
        return None
    if len(reason) > MAX_REASON or "\x00" in reason:
        raise InvalidInput(f"a reason is plain text of at most {MAX_REASON} characters")
    return reason.strip()
