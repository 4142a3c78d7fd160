import threading
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pgflow import migrate

EXPECTED_TABLES = {"jobs", "job_deps", "runs", "attempts", "schema_migrations"}

SURFACE = {
    "jobs": {"name", "tenant", "schedule", "timezone", "paused", "next_fire_at"},
    "job_deps": {"job", "upstream"},
    "runs": {"id", "job", "logical_time", "state", "attempt", "trigger", "tenant", "priority",
             "created_at", "started_at", "finished_at"},
    "attempts": {"run_id", "attempt", "worker_id", "started_at", "finished_at", "outcome",
                 "exit_code", "error"},
}


def columns(conn: psycopg.Connection[Any], table: str) -> set[str]:
    rows = conn.execute(
        "SELECT column_name FROM information_schema.columns"
        " WHERE table_schema = 'pgflow' AND table_name = %s", (table,)).fetchall()
    return {r[0] for r in rows}


def test_fresh_database_gets_every_migration(empty_db_url: str) -> None:
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        assert [m.version for m in migrate.pending(conn)] == [m.version for m in
                                                              migrate.available()]
        applied = migrate.migrate(conn)
        assert applied and migrate.pending(conn) == []
        tables = {r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'pgflow'")}
        assert tables >= EXPECTED_TABLES
        for table, expected in SURFACE.items():
            assert expected <= columns(conn, table), table
        assert migrate.migrate(conn) == []  # idempotent


def test_schema_has_the_constraints_and_indexes_hot_paths_need(empty_db_url: str) -> None:
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        migrate.migrate(conn)
        indexes = {r[0]: r[1] for r in conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'pgflow'")}
        assert "state = ANY" in indexes["runs_claimable_idx"]
        assert "NOT capped" in indexes["runs_claimable_idx"]
        # The reaper reads running runs through runs_running_idx; no index holds the lease
        # expiry, so renewals can be HOT updates (migration 0008). A claim writes no entry
        # to runs_job_idx: running runs are in runs_running_idx alone (migration 0023).
        assert "state = 'running'" in indexes["runs_running_idx"]
        assert "state <> 'running'" in indexes["runs_job_idx"]
        assert not any("lease_expires_at" in d for d in indexes.values())
        assert "next_fire_at" in indexes["jobs_due_idx"]
        # The exactly-once key is run_keys' (migration 0024): runs has no unique index
        # but its primary key, so neither a claim nor a finish checks a uniqueness.
        unique = {r[0] for r in conn.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE i.indrelid = 'pgflow.runs'::regclass AND i.indisunique")}
        assert unique == {"runs_pkey"}
        key = conn.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = 'pgflow.run_keys'::regclass AND contype = 'p'").fetchone()
        assert key == ("PRIMARY KEY (job, logical_time) INCLUDE (run_id)",)


def test_an_upgrade_keys_the_runs_it_finds(empty_db_url: str) -> None:
    """Migration 0024 gives every existing run its key: a tick created before the
    upgrade is not created again after it."""
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        before = [m for m in migrate.available() if m.version < 24]
        with conn.transaction():
            conn.execute(migrate._BOOTSTRAP)
            for m in before:
                conn.execute(m.sql.encode())
                conn.execute("INSERT INTO pgflow.schema_migrations (version, name, checksum)"
                             " VALUES (%s, %s, %s)", (m.version, m.name, m.checksum))
        conn.execute("INSERT INTO pgflow.jobs (name, entrypoint, definition)"
                     " VALUES ('j', 'jobfuncs:noop', '{}')")
        made = conn.execute(
            "INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant)"
            " SELECT 'j', timestamptz '2030-01-01' + make_interval(hours => i), 'queued', 1,"
            " 'schedule', 'default' FROM generate_series(1, 3) i RETURNING id").fetchall()
        assert [m.version for m in migrate.migrate(conn)] == [
            m.version for m in migrate.available() if m.version >= 24]
        keys = conn.execute("SELECT run_id FROM pgflow.run_keys ORDER BY run_id").fetchall()
        assert keys == made
        again = conn.execute(
            "INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant)"
            " VALUES ('j', timestamptz '2030-01-01 01:00', 'queued', 1, 'schedule', 'default')"
            " RETURNING id").fetchall()
        assert again == []


def test_concurrent_migrations_apply_once(empty_db_url: str) -> None:
    results: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def run() -> None:
        try:
            with psycopg.connect(empty_db_url, autocommit=True) as conn:
                barrier.wait()
                results.append(len(migrate.migrate(conn)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(results) == [0] * 5 + [len(migrate.available())]


def test_status_reports_applied_and_pending(empty_db_url: str) -> None:
    with psycopg.connect(empty_db_url, autocommit=True, row_factory=dict_row) as conn:
        assert all(s.applied_at is None for s in migrate.status(conn))
        migrate.migrate(conn)
        assert all(s.applied_at and not s.modified for s in migrate.status(conn))


def test_state_constraints_reject_invalid_rows(conn: psycopg.Connection[Any]) -> None:
    insert = ("INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant,"
              " finished_at) VALUES ('j', now(), %s, 1, 'manual', 'default', %s)")
    for state, finished in (("bogus", None), ("succeeded", None), ("queued", "now")):
        try:
            with conn.transaction():
                conn.execute(insert, (state, "now" if finished else None))
        except psycopg.errors.CheckViolation:
            continue
        raise AssertionError(f"state={state} finished={finished} was accepted")
