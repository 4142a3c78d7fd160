"""deploy/: the Kubernetes manifests (validated offline, KEDA's query run for real) and the
Compose file (validated by docker compose where it is installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kubernetes_validate
import psycopg
import pytest
import yaml
from engine import add_job, enqueue

from pgflow import breakers
from pgflow.duration import parse_duration

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose.yaml"
KEDA = "keda.sh/v1alpha1"
# The postgresql scaler's trigger metadata (keda.sh/docs/latest/scalers/postgresql).
KEDA_POSTGRESQL_KEYS = {"query", "targetQueryValue", "activationTargetQueryValue",
                        "connectionFromEnv", "host", "port", "userName", "dbName", "sslmode",
                        "passwordFromEnv"}
T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
Conn = psycopg.Connection[dict[str, Any]]
Doc = dict[str, Any]


def documents(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> list[Doc]:
    """Every object `kubectl apply -k deploy/k8s` creates, plus the example Secret and
    the bootstrap Job applied by hand."""
    return [d for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for d in documents(path)]


def find(kind: str, name: str) -> Doc:
    found = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(deployment: Doc) -> Doc:
    containers: list[Doc] = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def flag(args: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` in ``args``."""
    return args[args.index(name) + 1] if name in args else None


def env(c: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in c.get("env", [])}


# ---------------------------------------------------------------- kubernetes


def test_the_core_kinds_validate_strictly_against_the_kubernetes_schemas() -> None:
    core = [d for d in manifests() if not d["apiVersion"].startswith("keda.sh/")]
    assert {d["kind"] for d in core} == {"Deployment", "Service", "PodDisruptionBudget",
                                         "Secret", "Job"}
    for document in core:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(),
                                     strict=True)


def test_kustomization_names_every_manifest_but_the_examples() -> None:
    kustomization = documents(K8S / "kustomization.yaml")[0]
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {
        "kustomization.yaml", "secret.example.yaml", "admin-token-job.yaml"}
    images = {d["image"] for d in manifests() if d["kind"] in ("Deployment", "Job")
              for d in [container(d) if d["kind"] == "Deployment"
                        else d["spec"]["template"]["spec"]["containers"][0]]}
    assert images == {i["name"] for i in kustomization["images"]}


def test_the_scheduler_web_pair() -> None:
    deployment = find("Deployment", "pgflow-scheduler")
    assert deployment["spec"]["replicas"] == 2
    c = container(deployment)
    args = c["args"]
    assert args[0] == "serve"
    assert {args[i + 1] for i, a in enumerate(args) if a == "--role"} == {
        "scheduler", "reaper", "web"}
    port = int(str(flag(args, "--bind")).rsplit(":", 1)[1])
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert set(env(c)) >= {"PGFLOW_DATABASE_URL", "PGFLOW_SECRET_KEY"}
    grace_outlasts_drain(deployment)


def test_workers_run_only_the_worker_role_with_the_health_listener() -> None:
    deployment = find("Deployment", "pgflow-worker")
    c = container(deployment)
    args = c["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--role"] == ["worker"]
    port = int(str(flag(args, "--health-bind")).rsplit(":", 1)[1])
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"health": port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert "PGFLOW_SECRET_KEY" not in env(c)  # workers have no use for the session key
    grace_outlasts_drain(deployment)


def grace_outlasts_drain(deployment: Doc) -> None:
    """The kubelet's SIGKILL comes after terminationGracePeriodSeconds: it must leave the
    drain its --grace plus the bounded rest (stopping commands, the last writes)."""
    grace = parse_duration(flag(container(deployment)["args"], "--grace") or "10s")
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= grace + 20


def test_every_pod_reads_the_database_url_from_the_secret() -> None:
    secret = find("Secret", "pgflow")
    for d in manifests():
        if d["kind"] not in ("Deployment", "Job"):
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            for variable in env(c).values():
                if variable["name"] in ("PGFLOW_DATABASE_URL", "PGFLOW_SECRET_KEY"):
                    ref = variable["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == "pgflow"
                    assert ref["key"] in secret["stringData"]
            assert "PGFLOW_DATABASE_URL" in env(c), d["metadata"]["name"]


def test_the_home_and_tmp_mounts_match_the_image() -> None:
    """readOnlyRootFilesystem: the writable places are the image's PGFLOW_HOME and /tmp."""
    home = re.search(r"PGFLOW_HOME=(\S+)", (ROOT / "Dockerfile").read_text())
    assert home is not None
    for name in ("pgflow-scheduler", "pgflow-worker"):
        c = container(find("Deployment", name))
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert {m["mountPath"] for m in c["volumeMounts"]} == {home.group(1), "/tmp"}


def test_service_and_disruption_budgets_select_the_pods() -> None:
    scheduler_labels = find("Deployment", "pgflow-scheduler")["spec"]["template"]["metadata"][
        "labels"]
    worker_labels = find("Deployment", "pgflow-worker")["spec"]["template"]["metadata"]["labels"]
    service = find("Service", "pgflow-web")
    assert service["spec"]["selector"].items() <= scheduler_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    scheduler_pdb = find("PodDisruptionBudget", "pgflow-scheduler")["spec"]
    assert scheduler_pdb["selector"]["matchLabels"].items() <= scheduler_labels.items()
    assert scheduler_pdb["minAvailable"] == 1
    worker_pdb = find("PodDisruptionBudget", "pgflow-worker")["spec"]
    assert worker_pdb["selector"]["matchLabels"].items() <= worker_labels.items()


def test_keda_scales_the_workers_on_worker_demand() -> None:
    scaled = find("ScaledObject", "pgflow-worker")
    assert scaled["apiVersion"] == KEDA
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": "pgflow-worker"}
    assert spec["minReplicaCount"] == 0 < spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "postgresql"
    metadata = trigger["metadata"]
    assert set(metadata) <= KEDA_POSTGRESQL_KEYS
    assert all(isinstance(v, str) for v in metadata.values())  # KEDA reads strings
    assert "pgflow.worker_demand" in metadata["query"]
    concurrency = env(container(find("Deployment", "pgflow-worker")))["PGFLOW_CONCURRENCY"]
    assert metadata["targetQueryValue"] == concurrency["value"]
    assert metadata["activationTargetQueryValue"] == "0"
    auth = find("TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert auth["apiVersion"] == KEDA
    (ref,) = auth["spec"]["secretTargetRef"]
    assert ref["parameter"] == "connection"
    assert ref["name"] == "pgflow"
    assert ref["key"] in find("Secret", "pgflow")["stringData"]


def keda_query() -> str:
    query: str = find("ScaledObject", "pgflow-worker")["spec"]["triggers"][0]["metadata"]["query"]
    return query


def poll(conn: Conn) -> Any:
    """What KEDA's scaler reads: the first column of the one row."""
    rows = conn.execute(keda_query()).fetchall()
    assert len(rows) == 1 and len(rows[0]) == 1
    return next(iter(rows[0].values()))


def test_the_trigger_query_counts_runs_that_need_a_worker(conn: Conn) -> None:
    assert poll(conn) == 0
    add_job(conn, "etl", entrypoint="jobfuncs:noop", sources=["crm"])
    add_job(conn, "report", entrypoint="jobfuncs:noop")
    ids = [enqueue(conn, "etl", T0 + timedelta(minutes=i)) for i in range(5)]
    ids += [enqueue(conn, "report", T0 + timedelta(minutes=i)) for i in range(7)]
    value = poll(conn)
    assert value == 12 and isinstance(value, int)  # "the query must return an integer"
    conn.execute("UPDATE pgflow.runs SET state = 'running', attempt = 1, lease_owner = 'w',"
                 " lease_expires_at = now() + interval '1 min', attempt_started_at = now()"
                 " WHERE id = ANY(%s)", (ids[-2:],))
    assert poll(conn) == 12  # running runs keep their workers
    breakers.open_breaker(conn, "crm", "down", "test")
    assert poll(conn) == 7  # held by the breaker: no worker can start them
    conn.execute("UPDATE pgflow.runs SET state = 'succeeded', finished_at = now(),"
                 " lease_owner = NULL, lease_expires_at = NULL WHERE id = ANY(%s)",
                 (ids[-2:],))
    assert poll(conn) == 5


# ---------------------------------------------------------------- compose


def compose() -> Doc:
    document: Doc = yaml.safe_load(COMPOSE.read_text())
    return document


def test_compose_services_are_healthy_before_their_dependents_start() -> None:
    services = compose()["services"]
    assert {"postgres", "scheduler", "worker"} <= set(services)
    for name in ("postgres", "scheduler", "worker"):
        assert services[name]["healthcheck"]["test"], name
    for name in ("scheduler", "worker"):
        conditions = {dep: d["condition"] for dep, d in services[name]["depends_on"].items()}
        assert conditions["postgres"] == "service_healthy"
        assert conditions["bootstrap"] == "service_completed_successfully"
        url = services[name]["environment"]["PGFLOW_DATABASE_URL"]
        assert "@postgres:5432/" in url


def test_compose_workers_scale_and_drain() -> None:
    worker = compose()["services"]["worker"]
    # --scale worker=3 needs no fixed name and no host port
    assert "container_name" not in worker and "ports" not in worker
    command = worker["command"]
    assert [command[i + 1] for i, a in enumerate(command) if a == "--role"] == ["worker"]
    port = str(flag(command, "--health-bind")).rsplit(":", 1)[1]
    assert f"127.0.0.1:{port}/readyz" in " ".join(worker["healthcheck"]["test"])
    grace = parse_duration(flag(command, "--grace") or "10s")
    assert parse_duration(worker["stop_grace_period"]) >= grace + 20


def test_compose_builds_the_repository_image() -> None:
    for name in ("scheduler", "worker", "bootstrap"):
        build = compose()["services"][name]["build"]
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == ROOT and (context / build["dockerfile"]).is_file()


def compose_cli() -> list[str] | None:
    """`docker compose` (v2) or `docker-compose` (v1), whichever answers here."""
    if shutil.which("docker"):
        done = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if done.returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_docker_compose_accepts_the_file() -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip("neither 'docker compose' nor 'docker-compose' is installed"
                    " (make system-deps installs Debian's docker-compose)")
    done = subprocess.run([*cli, "-f", str(COMPOSE), "config", "-q"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    scaled = subprocess.run([*cli, "-f", str(COMPOSE), "config", "--services"],
                            capture_output=True, text=True, timeout=60)
    assert {"postgres", "bootstrap", "scheduler", "worker"} <= set(scaled.stdout.split())


def test_docker_compose_up() -> None:
    """Bringing the stack up needs a Docker engine that can pull postgres:16 and
    python:3.12-slim; the suite only runs it where one answers."""
    if shutil.which("docker") is None or subprocess.run(
            ["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("no Docker engine answers here ('docker info' fails): compose up"
                    " is not run")
    pytest.skip("a Docker engine answers, but building and pulling images takes minutes:"
                " run 'docker compose -f deploy/compose.yaml up --scale worker=3' by hand")
