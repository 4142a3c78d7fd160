"""Queue health in /metrics and on the dashboard's data: dead tuples and vacuum of the
hot tables, the oldest open transaction and the xmin horizon, from the statistics
views of the real server."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
from engine import add_job, enqueue
from test_web_metrics import metrics_for, scrape, value
from webhelpers import Conn

from pgflow import queue_health

T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)


def test_dead_tuples_of_the_hot_tables_are_gauges(conn: Conn) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop")
    for i in range(40):
        enqueue(conn, "a", T0 + timedelta(minutes=i))
    conn.execute("DELETE FROM pgflow.runs WHERE logical_time >= %s", (T0 + timedelta(minutes=10),))
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT 1")  # this backend's counters reach the statistics now
    samples = scrape(metrics_for(conn))
    assert value(samples, "pgflow_table_dead_tuples", table="runs") == 30.0
    assert value(samples, "pgflow_table_live_tuples", table="runs") == 10.0
    for table in queue_health.HOT_TABLES:
        assert value(samples, "pgflow_table_dead_tuples", table=table) is not None
        # A fresh database: autovacuum never ran (0, the Prometheus convention).
        assert value(samples, "pgflow_table_last_autovacuum_timestamp_seconds",
                     table=table) == 0.0
        assert value(samples, "pgflow_table_last_autoanalyze_timestamp_seconds",
                     table=table) is not None


def test_an_open_transaction_and_its_snapshot_are_gauges(conn: Conn, db_url: str) -> None:
    metrics = metrics_for(conn)
    quiet = scrape(metrics)
    assert value(quiet, "pgflow_xmin_horizon_age_transactions") == 0.0
    assert value(quiet, "pgflow_oldest_transaction_age_seconds") == 0.0
    with psycopg.connect(db_url, application_name="long-report") as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pgflow.jobs").fetchone()
        for _ in range(3):
            conn.execute("SELECT pg_current_xact_id()")  # transactions after its snapshot
        held = scrape(metrics)
        assert (value(held, "pgflow_xmin_horizon_age_transactions") or 0) >= 3
        assert (value(held, "pgflow_oldest_transaction_age_seconds") or 0) > 0
        health = queue_health.read(conn)
        assert health["oldest_xact"]["application_name"] == "long-report"
        assert health["horizon"]["kind"] == "session"
        assert "long-report" in health["horizon"]["holder"]
    after = scrape(metrics)
    assert value(after, "pgflow_xmin_horizon_age_transactions") == 0.0



def test_the_dashboard_warns_about_dead_rows_and_old_transactions() -> None:
    health = {"tables": [{"table": "runs", "dead_tuples": 25_000, "warn": True},
                         {"table": "jobs", "dead_tuples": 10, "warn": False}],
              "oldest_xact": {"age_s": 1800.0, "pid": 42, "application_name": "psql"},
              "oldest_xact_warn": True,
              "horizon": {"xmin_age": 12_000_000, "kind": "replication slot",
                          "holder": "old_standby"}, "horizon_warn": True}
    messages = [m for _, m, _ in queue_health.warnings(health)]
    assert messages[0].startswith("pgflow.runs has 25,000 dead rows")
    assert "open for 30 min (pid 42 (psql))" in messages[1]
    assert messages[2] == ("The xmin horizon is 12,000,000 transactions old, held by"
                           " replication slot old_standby.")
    quiet = {**health, "tables": [], "oldest_xact_warn": False, "horizon_warn": False}
    assert queue_health.warnings(quiet) == []
