"""pgflow.worker_demand (migration 0009): what an autoscaler reads, and its /metrics gauges."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from engine import add_job, enqueue
from prometheus_client.parser import text_string_to_metric_families

from pgflow import breakers
from pgflow.metrics import Metrics
from pgflow.queries import q

Conn = psycopg.Connection[dict[str, Any]]
T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)


def demand(conn: Conn) -> dict[str, Any]:
    row = conn.execute(q("worker_demand")).fetchone()
    assert row is not None
    return row


def counts(conn: Conn) -> tuple[int, int, int]:
    row = demand(conn)
    return row["claimable"], row["running"], row["held"]


def start(conn: Conn, run_id: int) -> None:
    """Put a run in the state a worker's claim leaves it in."""
    conn.execute("UPDATE pgflow.runs SET state = 'running', attempt = attempt + 1,"
                 " lease_owner = 'w', lease_expires_at = now() + interval '1 min',"
                 " attempt_started_at = now(), started_at = now() WHERE id = %s", (run_id,))


def test_an_empty_queue_is_one_row_of_zeros(conn: Conn) -> None:
    assert demand(conn) == {"claimable": 0, "running": 0, "held": 0,
                            "oldest_claimable_age_s": 0.0}


def test_claimable_counts_due_runs_only(conn: Conn) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop")
    ids = [enqueue(conn, "a", T0 + timedelta(minutes=i)) for i in range(5)]
    conn.execute("UPDATE pgflow.runs SET state = 'retrying', available_at = now() + interval '1h'"
                 " WHERE id = %s", (ids[0],))  # waiting out its backoff: not yet
    conn.execute("UPDATE pgflow.runs SET state = 'retrying' WHERE id = %s", (ids[1],))  # due
    conn.execute("UPDATE pgflow.runs SET state = 'pending' WHERE id = %s", (ids[2],))
    start(conn, ids[3])
    assert counts(conn) == (2, 1, 0)
    conn.execute("UPDATE pgflow.runs SET available_at = now() - interval '90 s' WHERE id = %s",
                 (ids[4],))
    assert demand(conn)["oldest_claimable_age_s"] >= 90


def test_an_open_breaker_holds_the_runs_of_every_job_touching_its_source(conn: Conn) -> None:
    add_job(conn, "crm_sync", entrypoint="jobfuncs:noop", sources=["crm", "mail"])
    add_job(conn, "other", entrypoint="jobfuncs:noop", sources=["warehouse"])
    add_job(conn, "capped_crm", entrypoint="jobfuncs:noop", sources=["crm"], max_active_runs=5)
    for i in range(3):
        enqueue(conn, "crm_sync", T0 + timedelta(minutes=i))
        enqueue(conn, "capped_crm", T0 + timedelta(minutes=i))
    enqueue(conn, "other", T0)
    assert counts(conn) == (7, 0, 0)
    breakers.open_breaker(conn, "crm", "down", "test")
    assert counts(conn) == (1, 0, 6)
    breakers.close_breaker(conn, "crm", None, "test")
    assert counts(conn) == (7, 0, 0)


def test_a_job_at_its_cap_holds_what_does_not_fit(conn: Conn) -> None:
    add_job(conn, "capped", entrypoint="jobfuncs:noop", max_active_runs=2)
    ids = [enqueue(conn, "capped", T0 + timedelta(minutes=i)) for i in range(5)]
    assert counts(conn) == (2, 0, 3)
    start(conn, ids[0])
    assert counts(conn) == (1, 1, 3)
    start(conn, ids[1])
    assert counts(conn) == (0, 2, 3)
    # Nothing claimable: the capped runs' wait is not a claimable run's wait.
    assert demand(conn)["oldest_claimable_age_s"] == 0.0


def test_the_view_reads_the_claim_indexes_not_the_history(conn: Conn) -> None:
    """Scanning 200,000 finished runs would make an autoscaler's poll cost grow with the
    history: the plan reads the waiting runs from the claim's partial indexes."""
    conn.execute("""
        INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant,
                                 finished_at)
        SELECT 'hist' || (i % 50), '2020-01-01'::timestamptz + i * interval '1 minute',
               'succeeded', 1, 'schedule', 'default', now()
        FROM generate_series(1, 200000) i""")
    conn.execute("""
        INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant, capped)
        SELECT 'q' || (i % 20), '2021-01-01'::timestamptz + i * interval '1 minute', 'queued',
               1, 'schedule', 'default', i % 10 = 0
        FROM generate_series(1, 2000) i""")
    conn.execute("ANALYZE pgflow.runs")
    row = conn.execute("EXPLAIN (FORMAT JSON) SELECT * FROM pgflow.worker_demand").fetchone()
    assert row is not None
    nodes = list(_plan_nodes(row["QUERY PLAN"][0]["Plan"]))
    on_runs = [n for n in nodes if n.get("Relation Name") == "runs"]
    assert [n for n in on_runs if n["Node Type"] == "Seq Scan"] == []
    indexes = {n["Index Name"] for n in nodes if "Index Name" in n}
    assert {"runs_claimable_idx", "runs_claimable_capped_idx"} <= indexes
    # 200 capped runs of two jobs (q0, q10) without a jobs row: one at a time each
    assert counts(conn) == (1800 + 2, 0, 198)


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def test_metrics_export_the_demand_as_gauges(conn: Conn) -> None:
    add_job(conn, "capped", entrypoint="jobfuncs:noop", max_active_runs=1)
    ids = [enqueue(conn, "capped", T0 + timedelta(minutes=i)) for i in range(3)]
    start(conn, ids[0])

    @contextmanager
    def lend() -> Iterator[Conn]:
        yield conn

    text = Metrics(lend, lease_ttl=30.0, settle_s=0.0).render().decode()
    samples = {s.name: s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name.startswith("pgflow_worker_demand")}
    assert samples == {"pgflow_worker_demand_claimable": 0.0,
                       "pgflow_worker_demand_running": 1.0,
                       "pgflow_worker_demand_held": 2.0,
                       "pgflow_worker_demand_oldest_claimable_age_seconds": 0.0}
