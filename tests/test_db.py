"""pgflow.db helpers that shape parameters."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import psycopg

from pgflow.db import array_literal

Conn = psycopg.Connection[dict[str, Any]]


def test_an_array_literal_reads_back_as_the_values_it_was_made_of(conn: Conn) -> None:
    # Text that means something in array syntax: NULL unquoted, quotes, backslashes,
    # braces, separators, blanks.
    texts = ["null", "NULL", 'a"b', "c\\d", "", " sp ", "{x}", "a,b", None, "fan_00001"]
    row = conn.execute("SELECT %(a)s::text[] AS v", {"a": array_literal(texts)}).fetchone()
    assert row is not None and row["v"] == texts
    paris = datetime(2030, 1, 1, 1, tzinfo=ZoneInfo("Europe/Paris"))
    times = [datetime(2030, 1, 1, tzinfo=UTC), None, paris,
             datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=UTC) + timedelta(microseconds=1)]
    row = conn.execute("SELECT %(a)s::timestamptz[] AS v", {"a": array_literal(times)}
                       ).fetchone()
    assert row is not None and row["v"] == times
    row = conn.execute("SELECT cardinality(%(a)s::text[]) AS n", {"a": array_literal([])}
                       ).fetchone()
    assert row == {"n": 0}
