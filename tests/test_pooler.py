"""Replicas and the CLI through a real PgBouncer in transaction mode (``PGFLOW_POOLER_URL``).

Twenty ``pgflow serve`` replicas share one PgBouncer whose pool has 10 server connections
and run a fan-out (a root job and 8 downstream jobs, 32 DAG runs from a backfill and
triggers) exactly once; PostgreSQL sees the pool plus, per replica, only the sessions
that must be direct (the scheduler's lock session, the worker's LISTEN session). A single
replica with the web role, and CLI commands whose direct URL leads nowhere, show that the
web, the CLI and the secrets scrubbing work through the pooler too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from engine import free_port
from pgbouncer import PgBouncer, server_connections
from procs import ROOT, Conn, Replicas, child_env, pgflow, scalar, until

from pgflow.config import load_settings
from pgflow.errors import ConfigError

LEAVES = 8
BACKFILL_TICKS = 30  # yearly ticks from 2000 to 2030
TRIGGERS = ("2040-01-01T00:00:00Z", "2041-01-01T00:00:00Z")
REPLICAS = 20
SCHEDULERS = 2
POOL = 10
NOWHERE = "postgresql://nobody@127.0.0.1:1/nowhere"  # a direct URL that leads nowhere

Start = Callable[..., PgBouncer]


def database_of(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


@pytest.fixture
def start_bouncer(server_url: str, db_url: str) -> Iterator[Start]:
    started: list[PgBouncer] = []

    def start(**options: Any) -> PgBouncer:
        bouncer = PgBouncer.start(server_url, database_of(db_url), **options)
        started.append(bouncer)
        return bouncer

    yield start
    for bouncer in started:
        print("----- pgbouncer log tail -----\n" + "\n".join(bouncer.log().splitlines()[-30:]))
        bouncer.stop()


def cli(url: str, workdir: Path, env: dict[str, str], *args: str,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    return pgflow(url, workdir, *args, check=check, timeout=60, env=env)


def direct_sessions(conn: Conn, bouncer: PgBouncer, database: str) -> Counter[str]:
    """pgflow's sessions on the server that are not PgBouncer's, by application_name.
    PgBouncer's server sessions are read before and after, so one it opens meanwhile is
    not taken for a direct one."""
    before = {s["remote_pid"] for s in bouncer.show("SERVERS", database)}
    rows = conn.execute(
        "SELECT pid, application_name FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND application_name LIKE 'pgflow-%'").fetchall()
    after = {s["remote_pid"] for s in bouncer.show("SERVERS", database)}
    return Counter(r["application_name"] for r in rows if r["pid"] not in before | after)


def fan_out_jobs(path: Path, out: Path) -> Path:
    job = f'entrypoint = "jobfuncs:record"\nparams = {{ path = "{out}" }}\n' \
          "retry = { max_attempts = 1 }\n"
    text = f'[jobs.root]\nschedule = "0 0 1 1 *"\n{job}'
    for i in range(LEAVES):
        text += f'\n[jobs.leaf_{i}]\ndepends_on = ["root"]\n{job}'
    path.write_text(text)
    return path


def test_twenty_replicas_share_a_pool_of_ten_and_run_a_fan_out_exactly_once(
        conn: Conn, db_url: str, tmp_path: Path, start_bouncer: Start,
        replicas: Replicas) -> None:
    database = database_of(db_url)
    bouncer = start_bouncer(pool_size=POOL)
    env = {"PGFLOW_POOLER_URL": bouncer.url(database)}
    out = tmp_path / "executions.txt"
    cli(db_url, tmp_path, env, "apply", str(fan_out_jobs(tmp_path / "jobs.toml", out)))
    for i in range(REPLICAS):
        roles = ("scheduler", "worker", "reaper") if i < SCHEDULERS else ("worker",)
        replicas.start(f"r{i}", roles=roles, concurrency=2, lease_ttl=30, env=env)
    until(lambda: scalar(conn, "SELECT count(*) FROM pgflow.replicas") == REPLICAS or None,
          timeout=120)

    cli(db_url, tmp_path, env, "backfill", "root", "--start", "2000-01-01T00:00:00Z",
        "--end", "2030-01-01T00:00:00Z", "--downstream", "--max-concurrency", "1000")
    for at in TRIGGERS:
        cli(db_url, tmp_path, env, "trigger", "root", "--logical-time", at)
    expected = (BACKFILL_TICKS + len(TRIGGERS)) * (1 + LEAVES)

    most_servers, most_clients = 0, 0
    direct: list[Counter[str]] = []

    def finished() -> bool:
        nonlocal most_servers, most_clients
        [pool] = bouncer.show("POOLS", database)
        most_servers = max(most_servers, server_connections(pool))
        most_clients = max(most_clients, int(pool["cl_active"]) + int(pool["cl_waiting"]))
        if len(direct) < 3:
            direct.append(direct_sessions(conn, bouncer, database))
        done = scalar(conn, "SELECT count(*) FROM pgflow.runs WHERE state IN"
                            " ('succeeded', 'failed', 'upstream_failed', 'cancelled')")
        return bool(done == expected)

    until(finished, timeout=150)

    runs = conn.execute("SELECT id, state, attempt FROM pgflow.runs").fetchall()
    assert len(runs) == expected
    assert {(r["state"], r["attempt"]) for r in runs} == {("succeeded", 1)}
    attempts = conn.execute("SELECT run_id, outcome FROM pgflow.attempts").fetchall()
    assert sorted(a["run_id"] for a in attempts) == sorted(r["id"] for r in runs)
    assert {a["outcome"] for a in attempts} == {"succeeded"}
    executed = Counter(line.split()[0] for line in out.read_text().splitlines())
    assert executed == Counter(str(r["id"]) for r in runs)  # every run's job ran once
    workers = scalar(conn, "SELECT count(DISTINCT worker_id) FROM pgflow.attempts")
    assert workers > 1
    # No statement failed through the pooler (a prepared statement on another server
    # session, a SET that did not stick...): the roles would have retried it quietly.
    for replica in replicas.started:
        assert not [r for r in replica.logs() if r.get("level") in ("warning", "error")], \
            replica.tail()

    # Ten server connections at most, for dozens of clients.
    assert 0 < most_servers <= POOL, most_servers
    assert most_clients > POOL, most_clients
    clients = Counter(c["application_name"] for c in bouncer.show("CLIENTS", database))
    assert clients["pgflow-replica"] == REPLICAS
    assert clients["pgflow-worker"] >= 2 * REPLICAS  # claims and renewals, at least
    servers = scalar(conn, "SELECT count(*) FROM pg_stat_activity WHERE datname ="
                           " current_database() AND pid <> pg_backend_pid()")
    assert servers <= POOL + SCHEDULERS + REPLICAS
    # Straight to PostgreSQL: the leader's lock sessions and the LISTEN sessions only.
    for seen in direct:
        assert set(seen) <= {"pgflow-scheduler", "pgflow-worker-listen"}, seen
    assert until(lambda: direct_sessions(conn, bouncer, database) == Counter({
        "pgflow-scheduler": SCHEDULERS, "pgflow-worker-listen": REPLICAS}) or None)
    leader_pid = scalar(conn, "SELECT backend_pid FROM pgflow.leader")
    assert scalar(conn, "SELECT application_name FROM pg_stat_activity WHERE pid = %s",
                  (leader_pid,)) == "pgflow-scheduler"


def test_web_cli_and_secrets_through_the_pooler(
        conn: Conn, db_url: str, tmp_path: Path, start_bouncer: Start,
        replicas: Replicas) -> None:
    database = database_of(db_url)
    bouncer = start_bouncer(connect_query=None)  # pgflow warns what it lacks
    # The database only in PGDATABASE and a password in the pooler URL: pooled connections
    # work only if the replica pinned PGDATABASE before scrubbing it, and jobs never see
    # the URL.
    secret = "Secr3tPooler"
    pooler = f"postgresql://{bouncer.user}:{secret}@127.0.0.1:{bouncer.port}/"
    through_pooler = {"PGFLOW_DATABASE_URL": NOWHERE, "PGFLOW_POOLER_URL": pooler,
                      "PGDATABASE": database}
    dump = tmp_path / "python-env.json"
    jobs = tmp_path / "jobs.toml"
    jobs.write_text('[jobs.shell]\ncommand = ["env"]\n\n[jobs.python]\n'
                    f'entrypoint = "envdump:dump"\nparams = {{ path = "{dump}" }}\n')

    # The CLI never needs the direct URL, except to migrate.
    cli(db_url, tmp_path, through_pooler, "apply", str(jobs))
    listed = json.loads(cli(db_url, tmp_path, through_pooler, "jobs", "list", "--json").stdout)
    assert sorted(j["name"] for j in listed) == ["python", "shell"]
    assert json.loads(cli(db_url, tmp_path, through_pooler, "db", "status", "--json")
                      .stdout)["pending"] == 0
    token = cli(db_url, tmp_path, through_pooler, "token", "create", "--role", "viewer"
                ).stdout.strip()
    migrate = cli(db_url, tmp_path, through_pooler, "db", "migrate", check=False)
    assert migrate.returncode == 1
    assert migrate.stderr.startswith("error: cannot connect to postgresql://nobody@127.0.0.1:1")

    port = free_port()
    replica = replicas.start("web", roles=("scheduler", "worker", "reaper", "web"), env={
        "PGFLOW_POOLER_URL": pooler, "PGDATABASE": database, "PGFLOW_BIND": f"127.0.0.1:{port}"})
    replica.wait_log("web role serving", timeout=60)
    assert "lack pgflow's session settings: add connect_query='SET jit = off; SET" \
        " client_connection_check_interval = 1000'" in replica.tail(200)
    runs = [int(cli(db_url, tmp_path, through_pooler, "trigger", name).stdout)
            for name in ("shell", "python")]
    until(lambda: scalar(conn, "SELECT count(*) FROM pgflow.runs WHERE state = 'succeeded'"
                               " AND id = ANY(%s)", (runs,)) == 2 or None, timeout=60)

    base = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200
    listing = httpx.get(f"{base}/api/v1/runs", headers={"Authorization": f"Bearer {token}"},
                        timeout=10)
    assert listing.status_code == 200, listing.text
    assert set(runs) <= {r["id"] for r in listing.json()["items"]}
    shown = json.loads(cli(db_url, tmp_path, through_pooler, "runs", "show", str(runs[0]),
                           "--json").stdout)
    assert shown["state"] == "succeeded"

    clients = {c["application_name"] for c in bouncer.show("CLIENTS", database)}
    assert {"pgflow-replica", "pgflow-worker", "pgflow-reaper", "pgflow-web"} <= clients
    assert until(lambda: direct_sessions(conn, bouncer, database) == Counter({
        "pgflow-scheduler": 1, "pgflow-worker-listen": 1}) or None)

    command_env = str(scalar(conn, "SELECT stdout_tail FROM pgflow.attempts WHERE run_id = %s",
                             (runs[0],)))
    python_env = dump.read_text()
    replica_env = Path(f"/proc/{replica.pid}/environ").read_bytes().decode(errors="replace")
    for seen in (command_env, python_env, replica_env):
        assert secret not in seen
    for seen in (command_env, python_env):
        assert "PGFLOW_POOLER_URL" not in seen
    assert "PGFLOW_RUN_ID=" in command_env


def test_the_pooler_url_is_a_setting_and_a_serve_flag() -> None:
    url = "postgresql://pgflow@pgbouncer:6432/pgflow"
    assert load_settings({"PGFLOW_POOLER_URL": url}).pooler_url == url
    assert load_settings({"PGFLOW_POOLER_URL": ""}).pooler_url is None
    assert load_settings({}, pooler_url=url).pooler_url == url
    with pytest.raises(ConfigError, match=r"PGFLOW_POOLER_URL='mysql://x'.*postgresql://"):
        load_settings({"PGFLOW_POOLER_URL": "mysql://x"})
    done = subprocess.run([sys.executable, "-m", "pgflow", "serve", "--pooler-url", "nope"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=child_env(NOWHERE, Path("/nonexistent")))
    assert done.returncode != 0
    assert done.stderr.startswith("error: invalid setting flag --pooler-url='nope'")
    assert done.stderr.count("\n") == 1


def test_the_kubernetes_deployments_take_an_optional_pooler_url_from_the_secret() -> None:
    from test_deploy import container, env, find

    for name in ("pgflow-scheduler", "pgflow-worker"):
        variable = env(container(find("Deployment", name)))["PGFLOW_POOLER_URL"]
        assert variable["valueFrom"]["secretKeyRef"] == {
            "name": "pgflow", "key": "PGFLOW_POOLER_URL", "optional": True}
