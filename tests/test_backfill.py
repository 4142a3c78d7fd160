"""Backfills and lineage against real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from drive import check_nothing_stuck, finish_run
from engine import WorkerThread, add_job, start_dag, wait_for

from pgflow import backfill, lineage, runs
from pgflow.errors import PgflowError

Conn = psycopg.Connection[dict[str, Any]]
START = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _nothing_stuck(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from check_nothing_stuck(request)


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


def drain(conn: Conn, db_url: str, backfill_id: int, cap: int, rounds: int = 50) -> None:
    """Release and run the backfill's runs like the leader and workers would, checking
    the cap after every release, until it completes."""
    for _ in range(rounds):
        release(db_url)
        active = conn.execute(
            "SELECT count(*) AS n FROM pgflow.runs WHERE backfill_id = %s AND trigger ="
            " 'backfill' AND state IN ('queued', 'running', 'retrying')",
            (backfill_id,)).fetchone()
        assert active is not None and active["n"] <= cap
        queued = conn.execute("SELECT id FROM pgflow.runs WHERE backfill_id = %s AND"
                              " state = 'queued' ORDER BY id", (backfill_id,)).fetchall()
        if not queued:
            break
        for row in queued:
            finish_run(db_url, conn, row["id"])
    assert backfill.show(conn, backfill_id)["state"] == "completed"


def test_downstream_backfill_of_a_two_root_dag_releases_every_root(conn: Conn,
                                                                   db_url: str) -> None:
    """Defect 1: the other root of each tick's DAG run is held with the backfill's id and
    must be released (and counted against the cap) like the backfilled job's own runs."""
    add_job(conn, "r1", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "r2", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "join", entrypoint="jobfuncs:noop", depends_on=["r1", "r2"])
    made = backfill.create(conn, "r1", START, START + timedelta(hours=4), max_concurrency=2,
                           downstream=True)
    assert (made["ticks"], made["created"]) == (4, 4)
    assert release(db_url) == 2  # two roots of the first tick, or one of each of two
    drain(conn, db_url, made["id"], cap=2)
    assert backfill.show(conn, made["id"])["counts"] == {"succeeded": 12}


def test_downstream_backfill_over_ticks_that_already_ran(conn: Conn, db_url: str) -> None:
    """Defect 2, first way in: a job added downstream later, then a backfill of its root
    over ticks the root already ran. Nothing upstream will finish again, so the new runs
    are ready at once; they are held and released within the backfill's cap."""
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    for hour in range(3):
        finish_run(db_url, conn, runs.trigger(conn, "a", START + timedelta(hours=hour)))
    add_job(conn, "late", entrypoint="jobfuncs:noop", depends_on=["a"])
    made = backfill.create(conn, "a", START, START + timedelta(hours=3), max_concurrency=1,
                           downstream=True)
    assert (made["ticks"], made["created"], made["skipped"]) == (3, 0, 3)
    held = conn.execute("SELECT state, trigger FROM pgflow.runs WHERE job = 'late'").fetchall()
    assert held == [{"state": "pending", "trigger": "backfill"}] * 3
    drain(conn, db_url, made["id"], cap=1)
    assert backfill.show(conn, made["id"])["counts"] == {"succeeded": 3}


def test_downstream_backfill_behind_failed_ticks_fails_those_runs(conn: Conn,
                                                                  db_url: str) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    finish_run(db_url, conn, runs.trigger(conn, "a", START), "failed")
    add_job(conn, "late", entrypoint="jobfuncs:noop", depends_on=["a"])
    made = backfill.create(conn, "a", START, START + timedelta(hours=1), downstream=True)
    assert conn.execute("SELECT state FROM pgflow.runs WHERE job = 'late'").fetchall() == [
        {"state": "upstream_failed"}]
    assert backfill.show(conn, made["id"])["state"] == "completed"  # nothing left to run


def test_a_backfill_with_every_tick_skipped_completes_at_once(conn: Conn) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    runs.trigger(conn, "a", START)
    made = backfill.create(conn, "a", START, START + timedelta(hours=1))
    assert made["created"] == 0
    assert backfill.show(conn, made["id"])["state"] == "completed"


def test_cancelling_the_last_run_completes_the_backfill(conn: Conn, db_url: str) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    made = backfill.create(conn, "a", START, START + timedelta(hours=2), max_concurrency=1)
    release(db_url)
    first, second = (r["id"] for r in conn.execute(
        "SELECT id FROM pgflow.runs WHERE backfill_id = %s ORDER BY logical_time",
        (made["id"],)))
    finish_run(db_url, conn, first)
    runs.cancel(conn, second)
    assert backfill.show(conn, made["id"])["state"] == "completed"
