"""The safety net against real PostgreSQL: every kind of stuck state, built by hand in
SQL (the engine itself must never produce one), is found, repaired with a guarded
UPDATE, logged and counted cluster-wide; what is not stuck is left alone."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import structlog
from engine import add_job, start_dag, states, wait_for
from psycopg import AsyncConnection
from psycopg.rows import dict_row
from structlog.testing import capture_logs

from pgflow import backfill, reaper, safety_net
from pgflow.leader import Leadership
from pgflow.metrics import Metrics

Conn = psycopg.Connection[dict[str, Any]]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def net(conn: Conn, **options: Any) -> safety_net.NetPass:
    options.setdefault("backfill_grace_s", 0)
    return safety_net.run_once(conn, log=structlog.get_logger(), **options)


def only(found: safety_net.NetPass) -> dict[str, int]:
    return {kind: n for kind, n in found.repairs.items() if n}


def set_state(conn: Conn, job: str, state: str, at: datetime = T0) -> None:
    finished = state in ("succeeded", "failed", "cancelled", "upstream_failed")
    conn.execute("UPDATE pgflow.runs SET state = %s,"
                 " finished_at = CASE WHEN %s THEN now() - interval '1 hour' END"
                 " WHERE job = %s AND logical_time = %s", (state, finished, job, at))


@pytest.fixture
def dag(conn: Conn) -> dict[str, int]:
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "b", entrypoint="jobfuncs:noop", depends_on=["a"])
    add_job(conn, "c", entrypoint="jobfuncs:noop", depends_on=["b"])
    return start_dag(conn, ["a"], T0)


def test_a_consistent_dag_run_needs_no_repair(conn: Conn, dag: dict[str, int]) -> None:
    assert net(conn).total == 0
    assert states(conn, T0) == {"a": "queued", "b": "pending", "c": "pending"}
    assert set(safety_net.totals(conn).values()) == {0}


def test_a_pending_run_whose_upstreams_succeeded_is_queued(conn: Conn,
                                                           dag: dict[str, int]) -> None:
    set_state(conn, "a", "succeeded")  # as if its completion had forgotten b
    with capture_logs() as logs:
        found = net(conn)
    assert only(found) == {"pending_ready": 1}
    assert states(conn, T0) == {"a": "succeeded", "b": "queued", "c": "pending"}
    warning = next(e for e in logs if e["log_level"] == "warning")
    assert (warning["repair"], warning["run_id"], warning["job"]) == (
        "pending_ready", dag["b"], "b")
    assert safety_net.totals(conn)["pending_ready"] == 1
    assert net(conn).total == 0  # repaired for good


def test_a_pending_run_behind_a_failed_upstream_fails_with_its_closure(
        conn: Conn, dag: dict[str, int]) -> None:
    set_state(conn, "a", "failed")
    found = net(conn)
    assert only(found) == {"pending_upstream_failed": 1}
    assert states(conn, T0) == {"a": "failed", "b": "upstream_failed", "c": "upstream_failed"}


@pytest.mark.parametrize("how", ["root", "upstream without a run"])
def test_a_pending_run_with_no_upstream_run_is_queued(conn: Conn, dag: dict[str, int],
                                                      how: str) -> None:
    if how == "root":
        set_state(conn, "a", "pending")
        job = "a"
    else:
        conn.execute("DELETE FROM pgflow.runs WHERE id = %s", (dag["a"],))
        job = "b"
    assert only(net(conn)) == {"pending_no_upstream": 1}
    assert states(conn, T0)[job] == "queued"


def test_runs_held_by_a_running_backfill_are_left_to_its_release(conn: Conn,
                                                                 db_url: str) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    made = backfill.create(conn, "a", T0, T0 + timedelta(hours=3))
    assert net(conn).total == 0
    assert conn.execute("SELECT count(*) AS n FROM pgflow.runs WHERE state = 'pending'"
                        " AND backfill_id = %s", (made["id"],)).fetchone() == {"n": 3}


def test_a_lease_whose_owner_is_gone_is_expired_and_then_reaped(conn: Conn, db_url: str,
                                                                dag: dict[str, int]) -> None:
    conn.execute("INSERT INTO pgflow.replicas (id, host, pid, roles, version)"
                 " VALUES ('alive', 'h', 1, '{worker}', 'test')")
    ttl = 30
    for run_id, owner, age in ((dag["a"], "ghost", 2 * ttl), (dag["b"], "alive", 2 * ttl),
                               (dag["c"], "starting", 1)):
        conn.execute(
            "UPDATE pgflow.runs SET state = 'running', attempt = 1, lease_owner = %s,"
            " lease_expires_at = now() + interval '1 minute', started_at = now(),"
            " attempt_started_at = now() - %s * interval '1 s' WHERE id = %s",
            (owner, age, run_id))
    found = net(conn, lease_ttl=ttl)
    assert only(found) == {"lease_orphaned": 1}
    assert found.repaired[0]["lease_owner"] == "ghost"

    async def reap() -> reaper.ReapPass:
        async with await AsyncConnection.connect(db_url, autocommit=True) as aconn:
            return await reaper.run_once(aconn)

    assert asyncio.run(reap()).reaped == 1
    outcome = conn.execute("SELECT outcome FROM pgflow.attempts WHERE run_id = %s",
                           (dag["a"],)).fetchone()
    assert outcome == {"outcome": "lost"}
    assert net(conn, lease_ttl=ttl).total == 0


def test_a_finished_backfill_left_running_is_completed_after_the_grace(
        conn: Conn, db_url: str) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    made = backfill.create(conn, "a", T0, T0 + timedelta(hours=2))
    conn.execute("UPDATE pgflow.runs SET state = 'succeeded', finished_at = now()"
                 " WHERE backfill_id = %s", (made["id"],))
    assert net(conn, backfill_grace_s=3600).total == 0  # its last run just ended
    assert only(net(conn)) == {"backfill_finished": 1}
    assert backfill.show(conn, made["id"])["state"] == "completed"


def test_a_repair_is_guarded_by_the_state_it_judged(conn: Conn, db_url: str,
                                                    dag: dict[str, int]) -> None:
    """Another transaction queues b while the net judges it stuck: the net's UPDATE
    waits for b's row, finds it no longer pending, and repairs (and counts) nothing."""
    set_state(conn, "a", "succeeded")
    found: list[safety_net.NetPass] = []
    with psycopg.connect(db_url, row_factory=dict_row) as other, \
            psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as netconn:
        other.execute("UPDATE pgflow.runs SET state = 'queued' WHERE id = %s", (dag["b"],))
        pid = netconn.info.backend_pid
        thread = threading.Thread(target=lambda: found.append(net(netconn)))
        thread.start()
        wait_for(lambda: conn.execute(
            "SELECT 1 AS waiting FROM pg_stat_activity WHERE pid = %s"
            " AND wait_event_type = 'Lock'", (pid,)).fetchone())
        other.commit()
        thread.join(10)
    assert only(found[0]) == {}
    assert states(conn, T0)["b"] == "queued"
    assert set(safety_net.totals(conn).values()) == {0}


def test_the_walk_over_pending_runs_resumes_and_wraps(conn: Conn,
                                                      dag: dict[str, int]) -> None:
    first = net(conn, limit=1)
    assert first.after_id == dag["b"]
    second = net(conn, limit=1, after_id=first.after_id)
    assert second.after_id == dag["c"]
    assert net(conn, limit=1, after_id=second.after_id).after_id == 0  # wrapped around


def test_metrics_expose_the_cluster_wide_repair_counts(conn: Conn, db_url: str,
                                                       dag: dict[str, int]) -> None:
    set_state(conn, "a", "succeeded")
    net(conn)
    metrics = Metrics(lambda: psycopg.connect(db_url, autocommit=True, row_factory=dict_row),
                      lease_ttl=30)
    text = metrics.render().decode()
    assert 'pgflow_repairs_total{kind="pending_ready"} 1.0' in text
    assert 'pgflow_repairs_total{kind="lease_orphaned"} 0.0' in text


def test_the_leader_runs_the_safety_net(conn: Conn, db_url: str,
                                        dag: dict[str, int]) -> None:
    set_state(conn, "a", "succeeded")

    async def scenario() -> None:
        leadership = Leadership(db_url, "leader", 3.0, structlog.get_logger(),
                                net_interval=0.2)
        stop = asyncio.Event()
        task = asyncio.create_task(leadership.run(stop))
        try:
            for _ in range(200):
                if await asyncio.to_thread(lambda: states(conn, T0)["b"] == "queued"):
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("the leader never repaired the stuck run")
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert safety_net.totals(conn)["pending_ready"] == 1
