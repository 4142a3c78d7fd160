"""The health listener (pgflow/health.py) of a real worker-only ``pgflow serve``: what a
Kubernetes liveness and readiness probe sees."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from engine import add_job, enqueue, free_port
from procs import Replica, Replicas, until, wait_state
from psycopg.rows import dict_row

from pgflow.embedded import Cluster

Answer = tuple[int, dict[str, Any]]


def probe(port: int, path: str, method: str = "GET") -> Answer | None:
    """The status and JSON body, or None while nothing listens."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")
    except (ConnectionError, urllib.error.URLError):
        return None


def wait_answer(port: int, path: str, status: int, timeout: float = 30.0) -> dict[str, Any]:
    def answered() -> dict[str, Any] | None:
        answer = probe(port, path)
        return answer[1] if answer is not None and answer[0] == status else None
    try:
        return until(answered, timeout=timeout)
    except AssertionError:
        raise AssertionError(f"{path} never answered {status}: last {probe(port, path)}") from None


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[list[Replicas]]:
    started: list[Replicas] = []
    yield started
    for group in started:
        group.close()


def worker(group: Replicas, port: int, **options: Any) -> Replica:
    return group.start("worker", roles=("worker",),
                       env={"PGFLOW_HEALTH_BIND": f"127.0.0.1:{port}"}, **options)


def test_a_worker_only_replica_answers_liveness_and_readiness(
        db_url: str, tmp_path: Path, replicas: list[Replicas]) -> None:
    group = Replicas(db_url, tmp_path)
    replicas.append(group)
    port = free_port()
    worker(group, port)
    assert wait_answer(port, "/healthz", 200) == {
        "status": "ok", "roles": {"heartbeat": True, "alerts": True, "worker": True}}
    assert wait_answer(port, "/readyz", 200) == {"status": "ready"}
    assert probe(port, "/healthz", method="HEAD") == (200, {})
    not_found = probe(port, "/metrics")
    assert not_found is not None and not_found[0] == 404
    refused = probe(port, "/readyz", method="POST")
    assert refused is not None and refused[0] == 405


def test_readiness_follows_the_database_and_liveness_does_not(
        private_cluster: Cluster, tmp_path: Path, replicas: list[Replicas]) -> None:
    group = Replicas(private_cluster.ensure_running(), tmp_path)
    replicas.append(group)
    port = free_port()
    worker(group, port)
    wait_answer(port, "/readyz", 200)
    private_cluster.kill()
    down = wait_answer(port, "/readyz", 503)
    assert down["status"] == "unavailable" and down["reason"].startswith("database: ")
    assert probe(port, "/healthz") == (200, {"status": "ok", "roles": {
        "heartbeat": True, "alerts": True, "worker": True}})
    private_cluster.start()
    assert wait_answer(port, "/readyz", 200) == {"status": "ready"}


def test_a_draining_replica_is_not_ready(db_url: str, tmp_path: Path,
                                         replicas: list[Replicas]) -> None:
    group = Replicas(db_url, tmp_path)
    replicas.append(group)
    port = free_port()
    replica = worker(group, port, grace="30s")
    with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as conn:
        add_job(conn, "slow", entrypoint="jobfuncs:sleep", params={"seconds": 20})
        run_id = enqueue(conn, "slow")
        wait_state(conn, run_id, "running")
        wait_answer(port, "/readyz", 200)
        replica.term()
        assert wait_answer(port, "/readyz", 503) == {"status": "unavailable",
                                                     "reason": "draining (shutting down)"}
        # Still live while it drains: a liveness probe must not kill a draining pod.
        answer = probe(port, "/healthz")
        assert answer is not None and answer[0] == 200
