"""Backfills and lineage against real PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from engine import WorkerThread, add_job, start_dag, wait_for

from pgflow import backfill, lineage
from pgflow.errors import PgflowError

Conn = psycopg.Connection[dict[str, Any]]
START = datetime(2026, 1, 1, tzinfo=UTC)


def release(db_url: str) -> int:
    async def go() -> int:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            return await backfill.release(c)

    return asyncio.run(go())


def test_one_run_per_tick_skipping_existing(conn: Conn) -> None:
    add_job(conn, "hourly", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    start_dag(conn, ["hourly"], START + timedelta(hours=2))
    calls: list[int] = []
    made = backfill.create(conn, "hourly", START, START + timedelta(hours=5),
                           progress=calls.append)
    assert (made["ticks"], made["created"], made["skipped"]) == (5, 4, 1)
    assert sum(calls) == 5
    rows = conn.execute("SELECT trigger, state, priority FROM pgflow.runs"
                        " WHERE backfill_id = %s", (made["id"],)).fetchall()
    assert len(rows) == 4
    assert {(r["trigger"], r["state"]) for r in rows} == {("backfill", "pending")}
    assert all(r["priority"] < -1_000_000 for r in rows)


def test_backfill_refuses_bad_requests(conn: Conn) -> None:
    add_job(conn, "root", entrypoint="jobfuncs:noop", schedule="@daily")
    add_job(conn, "child", entrypoint="jobfuncs:noop", depends_on=["root"])
    with pytest.raises(PgflowError, match="no schedule"):
        backfill.create(conn, "child", START, START + timedelta(days=2))
    with pytest.raises(PgflowError, match="before"):
        backfill.create(conn, "root", START, START)
    with pytest.raises(PgflowError, match="no job named"):
        backfill.create(conn, "nope", START, START + timedelta(days=1))


def test_release_respects_the_cap_and_completes(conn: Conn, db_url: str) -> None:
    add_job(conn, "b", entrypoint="jobfuncs:sleep", schedule="*/5 * * * *",
            params={"seconds": 0.3})
    made = backfill.create(conn, "b", START, START + timedelta(hours=1), max_concurrency=3)
    assert made["created"] == 12
    assert release(db_url) == 3
    assert release(db_url) == 0  # still 3 queued: cap reached
    handle = WorkerThread(db_url, concurrency=8)
    try:
        def drained() -> bool:
            release(db_url)
            return bool(backfill.show(conn, made["id"])["state"] == "completed")

        wait_for(drained, timeout=60, interval=0.1)
    finally:
        handle.stop()
    overlap = conn.execute("""
        SELECT max(n) AS peak FROM (
            SELECT (SELECT count(*) FROM pgflow.attempts b JOIN pgflow.runs rb ON rb.id = b.run_id
                    WHERE rb.backfill_id = %(id)s AND b.started_at <= a.started_at
                      AND b.finished_at > a.started_at) AS n
            FROM pgflow.attempts a JOIN pgflow.runs r ON r.id = a.run_id
            WHERE r.backfill_id = %(id)s) x""", {"id": made["id"]}).fetchone()
    assert overlap is not None and overlap["peak"] <= 3
    assert backfill.show(conn, made["id"])["counts"] == {"succeeded": 12}


def test_production_runs_go_first(conn: Conn, db_url: str) -> None:
    add_job(conn, "hist", entrypoint="jobfuncs:noop", schedule="* * * * *")
    add_job(conn, "prod", entrypoint="jobfuncs:noop", schedule="0 0 1 1 *")
    made = backfill.create(conn, "hist", START, START + timedelta(hours=2), max_concurrency=50)
    release(db_url)
    prod = start_dag(conn, ["prod"], datetime.now(UTC))["prod"]
    order = conn.execute("SELECT id FROM pgflow.runs WHERE state = 'queued'"
                         " ORDER BY priority DESC, available_at, id LIMIT 1").fetchone()
    assert order == {"id": prod}
    assert made["created"] == 120


def test_cancel_backfill(conn: Conn, db_url: str) -> None:
    add_job(conn, "c", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    made = backfill.create(conn, "c", START, START + timedelta(hours=10))
    release(db_url)
    result = backfill.cancel(conn, made["id"])
    assert result["cancelled"] == 10
    assert backfill.show(conn, made["id"])["state"] == "cancelled"
    with pytest.raises(PgflowError, match="already cancelled"):
        backfill.cancel(conn, made["id"])


def test_lineage_and_dag_run(conn: Conn) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "b", entrypoint="jobfuncs:noop", depends_on=["a"])
    add_job(conn, "c", entrypoint="jobfuncs:noop", depends_on=["b"])
    add_job(conn, "x", entrypoint="jobfuncs:noop", depends_on=["a"])
    start_dag(conn, ["a"], START)
    graph = lineage.lineage(conn, "b")
    assert [(n["job"], n["depth"], n["state"]) for n in graph["nodes"]] == [
        ("a", -1, "queued"), ("b", 0, "pending"), ("c", 1, "pending")]
    assert graph["edges"] == [{"upstream": "a", "job": "b"}, {"upstream": "b", "job": "c"}]
    runs = lineage.dag_run(conn, "c", START)
    assert sorted(r["job"] for r in runs) == ["a", "b", "c", "x"]


def test_backfill_cli_spec_form(conn: Conn, db_url: str, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from pgflow.cli import run

    monkeypatch.setenv("PGFLOW_DATABASE_URL", db_url)
    add_job(conn, "daily", entrypoint="jobfuncs:noop", schedule="0 0 * * *")
    assert run(["backfill", "daily", "--start", "2026-01-01", "--end", "2026-01-11",
                "--max-concurrency", "3"]) == 0
    assert capsys.readouterr().out == "backfill 1: 10 run(s) created, 0 tick(s) skipped" \
        " (already had a run)\n"
    assert run(["backfill", "daily", "--start", "2026-01-05", "--end", "2026-01-12",
                "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == 6
    assert run(["backfill", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(b["id"], b["max_concurrency"], b["progress"]) for b in listed] == [
        (2, 2, "0/1"), (1, 3, "0/10")]
    assert run(["backfill", "show", "1"]) == 0
    assert "pending 10" in capsys.readouterr().out
    assert run(["backfill", "cancel", "1"]) == 0
    assert "10 run(s) cancelled" in capsys.readouterr().out
    assert run(["backfill", "show"]) == 2
    assert "needs an ID" in capsys.readouterr().err
    assert run(["backfill", "daily"]) == 2
    assert run(["backfill", "daily", "--start", "2026-02-01", "--end", "2026-01-01"]) == 1
    assert capsys.readouterr().err.strip().endswith("--start must be before --end")
