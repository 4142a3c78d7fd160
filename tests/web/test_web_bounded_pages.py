"""Listings and the dashboard do bounded work on any history: run pages whose filter
their index does not cover look at a bounded slice per page, yet following the cursors
returns exactly the matching runs; the dashboard's chart counts each closed minute once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from engine import add_job

from pgflow import runs
from pgflow.queries import q

Conn = psycopg.Connection[dict[str, Any]]
T0 = datetime(2030, 1, 1, tzinfo=UTC)


def _runs(conn: Conn) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop", tenant="big")
    add_job(conn, "b", entrypoint="jobfuncs:noop", tenant="small")
    for i in range(40):
        job = "b" if i % 10 == 3 else "a"
        conn.execute("INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger,"
                     " tenant) VALUES (%s, %s, %s, 1, %s, %s)",
                     (job, T0 + timedelta(minutes=i), "queued" if i % 2 else "pending",
                      "manual" if i % 7 == 0 else "schedule", "small" if job == "b" else "big"))


def _walk(conn: Conn, limit: int, **filters: Any) -> tuple[list[int], list[int]]:
    """Follow next cursors to the end: (run ids in order, page sizes)."""
    ids: list[int] = []
    sizes: list[int] = []
    before = None
    while True:
        rows, before = runs.page_runs(conn, limit=limit, before=before, **filters)
        ids += [r["id"] for r in rows]
        sizes.append(len(rows))
        if before is None:
            return ids, sizes


@pytest.mark.parametrize("filters", [
    {"tenant": "small"}, {"trigger": "manual"}, {"job": "a", "state": "queued"},
    {"state": "queued", "tenant": "small"}, {"since": T0 + timedelta(minutes=30)},
    {}, {"job": "b"}, {"state": "queued"},
])
def test_bounded_run_pages_return_exactly_the_matching_runs(
        conn: Conn, monkeypatch: pytest.MonkeyPatch, filters: dict[str, Any]) -> None:
    _runs(conn)
    monkeypatch.setattr(runs, "RUNS_SCAN", 6)
    expected = [r["id"] for r in conn.execute(
        "SELECT id FROM pgflow.runs WHERE (%(job)s::text IS NULL OR job = %(job)s)"
        " AND (%(state)s::text IS NULL OR state = %(state)s)"
        " AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)"
        " AND (%(trigger)s::text IS NULL OR trigger = %(trigger)s)"
        " AND (%(since)s::timestamptz IS NULL OR logical_time >= %(since)s) ORDER BY id DESC",
        {"job": None, "state": None, "tenant": None, "trigger": None, "since": None,
         **filters})]
    ids, sizes = _walk(conn, 3, **filters)
    assert ids == expected and expected
    if set(filters) in ({"tenant"}, {"trigger"}):
        assert 0 in sizes or any(0 < n < 3 for n in sizes[:-1])  # short pages, cursor on


def test_the_dashboard_counts_closed_minutes_once(conn: Conn) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop")
    now = conn.execute("SELECT date_trunc('minute', now()) AS m").fetchone()["m"]  # type: ignore[index]
    for i, minutes_ago in enumerate((30, 30, 29, 3, 0)):
        at = now - timedelta(minutes=minutes_ago) + timedelta(seconds=1)
        conn.execute("INSERT INTO pgflow.runs (job, logical_time, state, attempt, max_attempts,"
                     " trigger, tenant, started_at, finished_at) VALUES ('a', %s, %s, 1, 1,"
                     " 'manual', 'default', %s, %s)",
                     (T0 + timedelta(seconds=i), "failed" if i == 1 else "succeeded", at, at))
    # The first call counts the oldest hour of the last 24 hours (zeros included).
    conn.execute(q("web_rollup_minutes"), {"settle_s": 120, "limit": 60})
    assert _counted(conn) == {}
    assert conn.execute("SELECT count(*) AS n FROM pgflow.run_minutes").fetchone()["n"] == 60  # type: ignore[index]
    row = conn.execute(q("web_dashboard"), {"live_s": 600}).fetchone()
    assert row is not None
    minutes = {m["minute"]: m["finished"] for m in row["minutes"] if m["finished"]}
    # The live part (after the counted minutes, at most 10 minutes back) adds the rest.
    assert minutes == {int((now - timedelta(minutes=3)).timestamp()): 1,
                       int(now.timestamp()): 1}
    for _ in range(30):
        conn.execute(q("web_rollup_minutes"), {"settle_s": 120, "limit": 60})
    # Closed minutes (ended 2 minutes ago) are counted once; the current one is not.
    assert _counted(conn) == {now - timedelta(minutes=30): (2, 1),
                              now - timedelta(minutes=29): (1, 0),
                              now - timedelta(minutes=3): (1, 0)}
    row = conn.execute(q("web_dashboard"), {"live_s": 600}).fetchone()
    assert row is not None
    minutes = {m["minute"]: m["finished"] for m in row["minutes"] if m["finished"]}
    assert sum(minutes.values()) == 5
    assert minutes[int((now - timedelta(minutes=30)).timestamp())] == 2


def _counted(conn: Conn) -> dict[datetime, tuple[int, int]]:
    return {r["minute"]: (r["finished"], r["failed"]) for r in conn.execute(
        "SELECT minute, finished, failed FROM pgflow.run_minutes WHERE finished > 0")}
