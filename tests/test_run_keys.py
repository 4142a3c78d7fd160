"""The exactly-once key of runs, (job, logical_time), in pgflow.run_keys (migration 0024):
kept in step with runs by triggers for every writer, with the semantics the unique index
of runs had (a repeated pair is skipped; a concurrent one waits for the first and is
skipped if it commits, inserted if it rolls back); a deleted run frees its pair."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from engine import add_job, wait_for
from psycopg.rows import dict_row

from pgflow import retention, runs
from pgflow.queries import q

Conn = psycopg.Connection[dict[str, Any]]
T0 = datetime(2031, 5, 1, tzinfo=UTC)
HAND_INSERT = ("INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger,"
               " tenant) VALUES (%s, %s, 'queued', 1, 'manual', 'default') RETURNING id")


def create(conn: Conn, jobs: list[str], times: list[datetime]) -> list[dict[str, Any]]:
    """The runs created, by logical time."""
    made = conn.execute(q("create_plain_runs"), {
        "jobs": jobs, "times": times, "trigger": "schedule", "params": None,
        "only_lone": False}).fetchall()
    return sorted(made, key=lambda r: r["logical_time"])


def keys_match_runs(conn: Conn) -> bool:
    """Every run has exactly its key and every key its run."""
    row = conn.execute("""
        SELECT count(*) AS n FROM pgflow.runs r
        FULL JOIN pgflow.run_keys k ON k.run_id = r.id
        WHERE r.id IS NULL OR k.run_id IS NULL
           OR (k.job, k.logical_time) IS DISTINCT FROM (r.job, r.logical_time)""").fetchone()
    return row is not None and row["n"] == 0


def test_a_pair_is_created_once_whoever_inserts_it(conn: Conn) -> None:
    add_job(conn, "k", entrypoint="jobfuncs:noop")
    first = create(conn, ["k", "k", "k"], [T0, T0, T0 + timedelta(hours=1)])
    assert [r["logical_time"] for r in first] == [T0, T0 + timedelta(hours=1)]
    assert create(conn, ["k"], [T0]) == []
    assert conn.execute(HAND_INSERT, ("k", T0)).fetchall() == []  # plain SQL too
    hand = conn.execute(HAND_INSERT, ("k", T0 + timedelta(hours=2))).fetchall()
    assert len(hand) == 1
    found = conn.execute(q("run_by_logical_time"),
                         {"job": "k", "logical_time": T0 + timedelta(hours=2)}).fetchone()
    assert found is not None and found["id"] == hand[0]["id"]
    assert keys_match_runs(conn)


@pytest.mark.parametrize("first_commits", [True, False])
def test_a_concurrent_insert_of_a_pair_waits_for_the_first(conn: Conn, db_url: str,
                                                           first_commits: bool) -> None:
    add_job(conn, "k", entrypoint="jobfuncs:noop")
    result: list[list[dict[str, Any]]] = []
    with psycopg.connect(db_url, row_factory=dict_row) as first, \
            psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as second:
        assert len(create(first, ["k"], [T0])) == 1  # uncommitted
        racer = threading.Thread(target=lambda: result.append(create(second, ["k"], [T0])))
        racer.start()
        wait_for(lambda: conn.execute(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()").fetchone()["n"] == 1)
        first.commit() if first_commits else first.rollback()
        racer.join(10)
    assert len(result) == 1 and len(result[0]) == (0 if first_commits else 1)
    assert conn.execute("SELECT count(*) AS n FROM pgflow.runs").fetchone()["n"] == 1
    assert keys_match_runs(conn)


def test_a_deleted_run_frees_its_pair(conn: Conn) -> None:
    add_job(conn, "k", entrypoint="jobfuncs:noop")
    made = create(conn, ["k", "k"], [T0, T0 + timedelta(hours=1)])
    conn.execute("DELETE FROM pgflow.runs WHERE id = %s", (made[0]["id"],))
    assert keys_match_runs(conn)
    again = create(conn, ["k"], [T0])
    assert len(again) == 1 and again[0]["id"] != made[0]["id"]
    conn.execute("TRUNCATE pgflow.runs CASCADE")
    assert conn.execute("SELECT count(*) AS n FROM pgflow.run_keys").fetchone()["n"] == 0
    assert len(create(conn, ["k"], [T0])) == 1


def test_retention_takes_the_keys_of_the_runs_it_deletes(conn: Conn) -> None:
    add_job(conn, "k", entrypoint="jobfuncs:noop")
    made = create(conn, ["k"] * 5, [T0 + timedelta(hours=i) for i in range(5)])
    conn.execute("UPDATE pgflow.runs SET state = 'succeeded', attempt = 1,"
                 " started_at = now() - interval '30 days',"
                 " finished_at = now() - interval '30 days' WHERE id = ANY(%s)",
                 ([r["id"] for r in made[:3]],))
    assert retention.run_once(conn, 86400.0).deleted == 3
    assert keys_match_runs(conn)
    assert len(create(conn, ["k"], [T0])) == 1  # the pair is free again


def test_a_bulk_load_keys_its_runs_in_one_statement(conn: Conn) -> None:
    add_job(conn, "k", entrypoint="jobfuncs:noop")
    create(conn, ["k"], [T0])
    with runs.keys_inserted_after(conn):
        conn.execute("INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger,"
                     " tenant) SELECT 'k', %s + make_interval(hours => i), 'queued', 1,"
                     " 'manual', 'default' FROM generate_series(1, 50) i", (T0,))
    assert keys_match_runs(conn)
    assert create(conn, ["k"], [T0 + timedelta(hours=7)]) == []  # the trigger is back
    with pytest.raises(psycopg.errors.UniqueViolation), runs.keys_inserted_after(conn):
        conn.execute(HAND_INSERT, ("k", T0))  # a repeated pair fails the load
    assert keys_match_runs(conn)


def test_a_hand_made_change_of_a_runs_time_moves_its_key(conn: Conn) -> None:
    add_job(conn, "k", entrypoint="jobfuncs:noop")
    made = create(conn, ["k", "k"], [T0, T0 + timedelta(hours=1)])
    conn.execute("UPDATE pgflow.runs SET logical_time = logical_time + interval '2 hours'"
                 " WHERE id = %s", (made[0]["id"],))
    assert keys_match_runs(conn)
    assert len(create(conn, ["k"], [T0])) == 1  # its old pair is free
    with pytest.raises(psycopg.errors.UniqueViolation):  # a pair that has a run
        conn.execute("UPDATE pgflow.runs SET logical_time = %s WHERE id = %s",
                     (T0 + timedelta(hours=1), made[0]["id"]))
    assert keys_match_runs(conn)
