import json
from typing import Any

import psycopg
import pytest

from pgflow import status
from pgflow.cli import run
from pgflow.queries import q

Conn = psycopg.Connection[dict[str, Any]]
TTL = 30.0


def add_replica(conn: Conn, replica_id: str, age_s: float, roles: list[str]) -> None:
    conn.execute(
        "INSERT INTO pgflow.replicas (id, host, pid, roles, version, concurrency, heartbeat_at)"
        " VALUES (%s, 'host-' || %s, 4242, %s, '0.1.0', 8,"
        " now() - make_interval(secs => %s))", [replica_id, replica_id, roles, age_s])


def set_leader(conn: Conn, replica_id: str, age_s: float) -> None:
    conn.execute(
        "INSERT INTO pgflow.leader (replica_id, backend_pid, term, heartbeat_at)"
        " VALUES (%s, 999, 7, now() - make_interval(secs => %s))", [replica_id, age_s])


def add_runs(conn: Conn, state: str, tenant: str, count: int) -> None:
    running = state == "running"
    conn.execute(
        "INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant,"
        " attempt, lease_owner, lease_expires_at, attempt_started_at, finished_at)"
        " SELECT 'job-' || %(state)s || %(tenant)s, now() - make_interval(mins => i), %(state)s,"
        " 3, 'schedule', %(tenant)s, CASE WHEN %(running)s THEN 1 ELSE 0 END,"
        " CASE WHEN %(running)s THEN 'w1' END, CASE WHEN %(running)s THEN now() END,"
        " CASE WHEN %(running)s THEN now() END,"
        " CASE WHEN %(state)s IN ('succeeded', 'failed', 'cancelled', 'upstream_failed')"
        "      THEN now() END"
        " FROM generate_series(1, %(count)s) AS i",
        {"state": state, "tenant": tenant, "count": count, "running": running})


@pytest.fixture
def cluster(conn: Conn) -> Conn:
    add_replica(conn, "r1", 2.0, ["scheduler", "worker", "reaper", "web"])
    add_replica(conn, "r2", 10.0, ["worker"])
    add_replica(conn, "r3", 3 * TTL + 5, ["worker"])
    add_runs(conn, "queued", "sales", 3)
    add_runs(conn, "queued", "default", 2)
    add_runs(conn, "running", "sales", 1)
    add_runs(conn, "retrying", "default", 1)
    add_runs(conn, "succeeded", "sales", 5)
    add_runs(conn, "failed", "sales", 2)
    conn.execute("UPDATE pgflow.runs SET acked_at = now()"
                 " WHERE id = (SELECT min(id) FROM pgflow.runs WHERE state = 'failed')")
    return conn


def test_replicas_with_ages_by_the_database_clock(cluster: Conn) -> None:
    set_leader(cluster, "r1", 1.0)
    report = status.cluster_status(cluster, TTL)
    replicas = {r["id"]: r for r in report["replicas"]}
    assert list(replicas) == ["r1", "r2", "r3"]
    assert replicas["r1"]["roles"] == ["scheduler", "worker", "reaper", "web"]
    assert (replicas["r1"]["host"], replicas["r1"]["pid"], replicas["r1"]["version"],
            replicas["r1"]["concurrency"]) == ("host-r1", 4242, "0.1.0", 8)
    assert 2.0 <= replicas["r1"]["heartbeat_age_s"] < 10
    assert [r["alive"] for r in replicas.values()] == [True, True, False]


def test_leader_fresh_stale_and_absent(cluster: Conn) -> None:
    assert status.cluster_status(cluster, TTL)["leader"] is None
    set_leader(cluster, "r1", 1.0)
    leader = status.cluster_status(cluster, TTL)["leader"]
    assert (leader["replica_id"], leader["term"], leader["host"], leader["stale"]) == (
        "r1", 7, "host-r1", False)
    cluster.execute("UPDATE pgflow.leader SET heartbeat_at = now() - interval '45 s'")
    leader = status.cluster_status(cluster, TTL)["leader"]
    assert leader["stale"] is True and leader["heartbeat_age_s"] >= 45


def test_leader_whose_replica_row_is_gone(conn: Conn) -> None:
    set_leader(conn, "ghost", 1.0)
    leader = status.cluster_status(conn, TTL)["leader"]
    assert leader["replica_id"] == "ghost" and leader["host"] is None


def test_queue_depth_by_state_and_tenant(cluster: Conn) -> None:
    queue = status.cluster_status(cluster, TTL)["queue"]
    assert queue["by_state"] == {"pending": 0, "queued": 5, "running": 1, "retrying": 1}
    assert [(r["state"], r["tenant"], r["runs"]) for r in queue["by_tenant"]] == [
        ("queued", "default", 2), ("queued", "sales", 3), ("retrying", "default", 1),
        ("running", "sales", 1)]
    assert queue["dead_letters"] == 1


def test_empty_cluster(conn: Conn) -> None:
    report = status.cluster_status(conn, TTL)
    assert report["replicas"] == [] and report["leader"] is None
    assert report["queue"] == {"by_state": {"pending": 0, "queued": 0, "running": 0,
                                            "retrying": 0},
                               "by_tenant": [], "dead_letters": 0}


def plan(conn: Conn, name: str, args: dict[str, Any] | None = None) -> str:
    rows = conn.execute("EXPLAIN " + q(name), args or {}).fetchall()
    return "\n".join(row["QUERY PLAN"] for row in rows)


def test_queries_skip_the_finished_history(cluster: Conn) -> None:
    add_runs(cluster, "succeeded", "history", 200_000)
    cluster.execute("ANALYZE pgflow.runs")
    no_cursor = {"tenant": None, "before_id": None, "limit": 100, "trigger": None,
                 "since": None, "until": None}
    plans = {
        "status_queue_depth": plan(cluster, "status_queue_depth"),
        "status_dead_letters": plan(cluster, "status_dead_letters"),
        "runs_dead_letters": plan(cluster, "runs_dead_letters", {"limit": 100}),
        "queued": plan(cluster, "runs_list_by_state", {"state": "queued", **no_cursor}),
        # running runs are not in runs_state_idx: runs_running_idx holds them
        "running": plan(cluster, "runs_list_by_state", {"state": "running", **no_cursor}),
        "succeeded": plan(cluster, "runs_list_by_state", {"state": "succeeded", **no_cursor}),
        "by_job": plan(cluster, "runs_list_by_job", {"job": "job-queuedsales", "state": None,
                                                     **no_cursor}),
    }
    for name, explained in plans.items():
        assert "Seq Scan on runs" not in explained, (name, explained)
    # Either partial index of failed runs reads dead letters only.
    assert any(index in plans["status_dead_letters"]
               for index in ("runs_dead_idx", "runs_failed_idx"))
    # a job's runs: those not running, and the running ones, each from its own index
    assert "runs_job_idx" in plans["by_job"] and "runs_running_idx" in plans["by_job"]
    assert "runs_running_idx" in plans["running"], plans["running"]


@pytest.fixture
def cli(db_url: str, cluster: Conn, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Any:
    monkeypatch.setenv("PGFLOW_DATABASE_URL", db_url)
    monkeypatch.setenv("PGFLOW_LEASE_TTL", "30s")

    def invoke(*args: str) -> tuple[int, str, str]:
        code = run(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def test_cli_status(cli: Any, cluster: Conn) -> None:
    set_leader(cluster, "r1", 1.0)
    code, out, _ = cli("status")
    lines = out.splitlines()
    assert code == 0
    assert lines[0].startswith("leader: r1 (term 7, heartbeat ")
    assert lines[1] == "replicas: 2 alive, 1 not responding"
    assert lines[2].split() == ["ID", "HOST", "PID", "ROLES", "VERSION", "CONCURRENCY",
                                "HEARTBEAT_AGE_S", "ALIVE", "STOPPING"]
    assert lines[3].split()[:4] == ["r1", "host-r1", "4242", "scheduler,worker,reaper,web"]
    assert "queue: pending 0, queued 5, running 1, retrying 1; dead letters 1" in lines
    assert lines[-1].split() == ["running", "sales", "1"]
    document = json.loads(cli("status", "--json")[1])
    assert document["leader"]["replica_id"] == "r1"
    assert document["queue"]["by_state"]["queued"] == 5


def test_cli_status_stale_leader(cli: Any, cluster: Conn) -> None:
    set_leader(cluster, "r2", 60.0)
    line = cli("status")[1].splitlines()[0]
    assert line.startswith("leader: r2 (term 7, heartbeat 6") and "STALE" in line
