"""Prometheus metrics from the database: one statement per scrape, counters only go up."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from engine import add_job, enqueue
from prometheus_client.parser import text_string_to_metric_families
from psycopg.rows import dict_row
from webhelpers import Conn, finished_run

from pgflow import breakers
from pgflow.metrics import DURATION_BOUNDS, Histogram, Metrics

T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(metrics: Metrics) -> Samples:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def metrics_for(conn: Conn) -> Metrics:
    @contextmanager
    def lend() -> Iterator[Conn]:
        yield conn

    return Metrics(lend, lease_ttl=30.0, settle_s=0.0)


def test_gauges_read_the_current_state(conn: Conn) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop", tenant="sales", sources=["warehouse"])
    for i in range(3):
        enqueue(conn, "a", T0 + timedelta(minutes=i))
    finished_run(conn, "a", T0 - timedelta(days=1), "failed")
    breakers.open_breaker(conn, "warehouse", "down", "test")
    conn.execute("INSERT INTO pgflow.replicas (id, host, pid, roles, version) VALUES"
                 " ('r1', 'h', 1, '{worker}', '0'), ('r2', 'h', 2, '{worker}', '0')")
    conn.execute("UPDATE pgflow.replicas SET heartbeat_at = now() - interval '1 hour'"
                 " WHERE id = 'r2'")
    conn.execute("INSERT INTO pgflow.leader (replica_id, backend_pid, term) VALUES ('r1', 1, 4)")
    samples = scrape(metrics_for(conn))
    assert value(samples, "pgflow_database_up") == 1.0
    assert value(samples, "pgflow_queue_depth", state="queued", tenant="sales") == 3.0
    assert value(samples, "pgflow_queue_runs", state="running") == 0.0
    assert value(samples, "pgflow_dead_letters") == 1.0
    assert value(samples, "pgflow_replicas", state="alive") == 1.0
    assert value(samples, "pgflow_replicas", state="not_responding") == 1.0
    assert value(samples, "pgflow_leader_present") == 1.0
    assert value(samples, "pgflow_leader_term") == 4.0
    assert value(samples, "pgflow_leader_info", replica_id="r1") == 1.0
    assert value(samples, "pgflow_breaker_open", source="warehouse") == 1.0
    assert (value(samples, "pgflow_oldest_waiting_seconds") or 0) >= 0


def test_counters_count_each_event_once(conn: Conn) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop")
    metrics = metrics_for(conn)
    finished_run(conn, "a", T0 - timedelta(hours=1), "succeeded")  # before the first scrape
    first = scrape(metrics)
    assert value(first, "pgflow_runs_finished_total", pgflow_job="a", tenant="default",
                 outcome="succeeded") is None
    for i in range(3):
        finished_run(conn, "a", T0 + timedelta(hours=i), "succeeded", seconds=4.0)
    finished_run(conn, "a", T0 + timedelta(hours=5), "failed", seconds=0.2)
    conn.execute("UPDATE pgflow.runs SET trigger = 'schedule', started_at = now(),"
                 " logical_time = now() - interval '3 seconds'"
                 " WHERE id = (SELECT max(id) FROM pgflow.runs)")
    second = scrape(metrics)
    assert value(second, "pgflow_runs_finished_total", pgflow_job="a", tenant="default",
                 outcome="succeeded") == 3.0
    assert value(second, "pgflow_runs_finished_total", pgflow_job="a", tenant="default",
                 outcome="failed") == 1.0
    assert value(second, "pgflow_attempts_total", pgflow_job="a", outcome="failed") == 1.0
    assert value(second, "pgflow_attempt_duration_seconds_count", pgflow_job="a") == 4.0
    assert value(second, "pgflow_attempt_duration_seconds_bucket", pgflow_job="a",
                 le="0.5") == 1.0
    assert value(second, "pgflow_attempt_duration_seconds_bucket", pgflow_job="a",
                 le="5.0") == 4.0
    assert abs((value(second, "pgflow_attempt_duration_seconds_sum", pgflow_job="a") or 0)
               - 12.2) < 0.1
    assert value(second, "pgflow_schedule_lag_seconds_count") == 1.0
    assert value(second, "pgflow_schedule_lag_seconds_bucket", le="2.0") == 0.0
    assert value(second, "pgflow_schedule_lag_seconds_bucket", le="5.0") == 1.0
    third = scrape(metrics)
    for key in (("pgflow_runs_finished_total", "succeeded"), ("pgflow_runs_finished_total",
                                                              "failed")):
        assert value(third, key[0], pgflow_job="a", tenant="default", outcome=key[1]) == \
            value(second, key[0], pgflow_job="a", tenant="default", outcome=key[1])


def _started_scheduled_run(conn: Conn, state: str) -> tuple[Metrics, int]:
    """A scheduled run that started a second after its tick, after a first scrape; in
    ``state`` (running: under a lease)."""
    add_job(conn, "a", entrypoint="jobfuncs:noop")
    metrics = metrics_for(conn)
    scrape(metrics)
    run_id = enqueue(conn, "a", T0)
    leased = state == "running"
    conn.execute("UPDATE pgflow.runs SET trigger = 'schedule', state = %(state)s, attempt = 1,"
                 " started_at = now(), logical_time = now() - interval '1 second',"
                 " attempt_started_at = CASE WHEN %(leased)s THEN now() END,"
                 " lease_owner = CASE WHEN %(leased)s THEN 'w' END,"
                 " lease_expires_at = CASE WHEN %(leased)s THEN now() + interval '1 min' END"
                 " WHERE id = %(id)s", {"state": state, "leased": leased, "id": run_id})
    return metrics, run_id


# A scheduled run that started since the last scrape, then what it does next: counted
# once whichever index finds it (running: runs_running_idx; started and waiting to retry:
# runs_schedule_started_idx; finished: runs_finished_idx).
NEXT_STEP = {
    "running": "UPDATE pgflow.runs SET state = 'succeeded', finished_at = now(),"
               " lease_owner = NULL, lease_expires_at = NULL, attempt_started_at = NULL"
               " WHERE id = %s",
    "retrying": "UPDATE pgflow.runs SET state = 'running', attempt = 2, lease_owner = 'w',"
                " attempt_started_at = now(), lease_expires_at = now() + interval '1 min'"
                " WHERE id = %s",
}


@pytest.mark.parametrize("state", list(NEXT_STEP))
def test_the_schedule_lag_counts_a_started_run_once(conn: Conn, state: str) -> None:
    metrics, run_id = _started_scheduled_run(conn, state)
    started = scrape(metrics)  # started since the last scrape, not finished: counted
    assert value(started, "pgflow_schedule_lag_seconds_count") == 1.0
    assert value(started, "pgflow_schedule_lag_seconds_bucket", le="2.0") == 1.0
    conn.execute(NEXT_STEP[state], (run_id,))
    assert value(scrape(metrics), "pgflow_schedule_lag_seconds_count") == 1.0  # not again


def test_a_database_outage_keeps_counters_and_says_so(conn: Conn, db_url: str) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop")
    broken = psycopg.connect(db_url, autocommit=True, row_factory=dict_row)

    @contextmanager
    def lend() -> Iterator[Conn]:
        yield broken

    metrics = Metrics(lend, lease_ttl=30.0, settle_s=0.0)
    scrape(metrics)
    broken.close()
    samples = scrape(metrics)
    assert value(samples, "pgflow_database_up") == 0.0
    assert value(samples, "pgflow_metrics_scrape_errors_total") == 1.0
    assert value(samples, "pgflow_schedule_lag_seconds_count") == 0.0


def test_histogram_buckets_use_le_semantics() -> None:
    histogram = Histogram(DURATION_BOUNDS)
    histogram.add_bucket(len(DURATION_BOUNDS), 2, 0.1)  # <= every bound: the first bucket
    histogram.add_bucket(0, 1, 99999.0)  # above every bound: +Inf only
    buckets = dict(histogram.buckets())
    assert buckets["0.1"] == 2.0 and buckets["21600.0"] == 2.0 and buckets["+Inf"] == 3.0
