"""PostgreSQL failover under load, for real: etcd and two Patroni-managed PostgreSQL
nodes on loopback (synchronous replication), two ``pgflow serve`` replicas on a
multi-host URL (``target_session_attrs=read-write``) ticking a job every second with
``catchup = "all"``.

1. The primary's postmaster is SIGKILLed: Patroni fails over to the synchronous
   standby, the old primary rejoins as a standby (pg_rewind).
2. The new primary's postmaster and backends are SIGSTOPped: its sockets stay open and
   its kernel still acknowledges every packet, so only client-side timeouts notice.
   Patroni promotes the other node once the frozen one's leader key expires; the frozen
   node is then resumed and must rejoin as a standby.

Then: one run per tick, none missing, each executed exactly once (commands append
``run attempt logical_time wall_time`` to a file). The times measured (promotion,
first new attempt, leadership back) are printed and written to
test-artifacts/failover.json; the README's "High availability" section quotes them.

Needs Debian's ``patroni`` and ``etcd-server`` (``make system-deps``) and PostgreSQL
server binaries; skipped, with the reason, without them. Nothing is installed here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from engine import free_port
from procs import Replicas, pgflow
from psycopg.rows import dict_row

from pgflow.embedded.binaries import PostgresNotFound, find_bindir
from pgflow.embedded.osuser import OsUser, service_user
from pgflow.embedded.procs import child_pids, pid_alive, processes_in

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
PASSWORD = "failover-test"
TTL_S = 10  # Patroni's leader key TTL: a primary whose Patroni stops renewing loses it
LEASE_TTL_S = 30.0  # pgflow's lease TTL: longer than any failover here
T = TypeVar("T")


def _patroni_version() -> tuple[int, ...]:
    done = subprocess.run(["patroni", "--version"], capture_output=True, text=True)
    found = re.search(r"(\d+)\.(\d+)\.(\d+)", done.stdout + done.stderr)
    return tuple(int(x) for x in found.groups()) if found else (0,)


def _etcd_has_v2() -> bool:
    done = subprocess.run(["etcd", "--help"], capture_output=True, text=True)
    return "--enable-v2" in done.stdout + done.stderr


def _missing() -> str | None:
    for tool, package in (("patroni", "patroni"), ("patronictl", "patroni"),
                          ("etcd", "etcd-server")):
        if shutil.which(tool) is None:
            return f"{tool} not found: install Debian's {package} (make system-deps)"
    try:
        find_bindir()
    except PostgresNotFound:
        return "no PostgreSQL server binaries (apt-get install postgresql)"
    # Patroni < 3.0.3 may overwrite a newer leader key through etcd's v3 API after its
    # own lease expired (patroni/patroni#2689): a split brain. Its v2 API does not.
    if _patroni_version() < (3, 0, 3) and not _etcd_has_v2():
        return "Patroni < 3.0.3 needs etcd's v2 API (--enable-v2), which this etcd lacks"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def poll(condition: Callable[[], T | None], timeout: float, interval: float = 0.2) -> T | None:
    """The first true value of ``condition`` within ``timeout`` seconds, else None."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)


def wait(what: str, condition: Callable[[], T | None], timeout: float) -> T:
    value = poll(condition, timeout)
    if value is None:
        raise AssertionError(f"{what}: not within {timeout:g}s")
    return value


# ---------------------------------------------------------------- the Patroni cluster


@dataclass
class Node:
    name: str
    root: Path
    pg_port: int
    api_port: int
    proc: subprocess.Popen[bytes] | None = None
    frozen: set[int] = field(default_factory=set)

    @property
    def data(self) -> Path:
        return self.root / "data"

    def postmaster(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().split()[0])
        return None


class PatroniCluster:
    """etcd plus two Patroni nodes in ``root``, run as ``user`` (PostgreSQL refuses root)."""

    def __init__(self, root: Path, user: OsUser | None) -> None:
        self.root = root
        self.user = user
        self.etcd: subprocess.Popen[bytes] | None = None
        self.etcd_port = free_port()
        self.nodes = [Node(f"n{i}", root / f"n{i}", free_port(), free_port()) for i in (1, 2)]

    # -------------------------------------------------------- lifecycle

    def start(self) -> None:
        v3 = _patroni_version() >= (3, 0, 3)
        peer = free_port()
        self.etcd = subprocess.Popen(
            ["etcd", "--name", "e", "--data-dir", str(self.root / "etcd"),
             "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"e=http://127.0.0.1:{peer}",
             *([] if v3 else ["--enable-v2"])],
            stdout=(self.root / "etcd.log").open("wb"), stderr=subprocess.STDOUT)
        dcs = f"etcd3: {{hosts: '127.0.0.1:{self.etcd_port}'}}" if v3 else \
            f"etcd: {{hosts: '127.0.0.1:{self.etcd_port}'}}"
        for node in self.nodes:
            node.root.mkdir()
            self._own(node.root)
            config = node.root / "patroni.yml"
            config.write_text(self._config(node, dcs))
            self._own(config)
            node.proc = subprocess.Popen(
                ["patroni", str(config)], cwd=node.root,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(node.root)},
                stdout=(node.root / "patroni.log").open("wb"), stderr=subprocess.STDOUT,
                start_new_session=True, **self._as_user())

    def _config(self, node: Node, dcs: str) -> str:
        bindir = find_bindir()
        return f"""\
scope: pgflow-failover
name: {node.name}
log: {{level: INFO}}
restapi: {{listen: '127.0.0.1:{node.api_port}', connect_address: '127.0.0.1:{node.api_port}'}}
{dcs}
bootstrap:
  dcs:
    ttl: {TTL_S}
    loop_wait: 1
    retry_timeout: 3
    # fail over at once when the primary's postmaster dies, rather than restart it
    primary_start_timeout: 0
    synchronous_mode: true
    maximum_lag_on_failover: 0
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters: {{wal_log_hints: 'on', max_connections: 100, fsync: 'off'}}
  initdb: [{{encoding: UTF8}}, {{locale: C}}]
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
postgresql:
  listen: '127.0.0.1:{node.pg_port}'
  connect_address: '127.0.0.1:{node.pg_port}'
  data_dir: '{node.data}'
  bin_dir: '{bindir}'
  pgpass: '{node.root / "pgpass"}'
  authentication:
    superuser: {{username: postgres, password: '{PASSWORD}'}}
    replication: {{username: replicator, password: '{PASSWORD}'}}
    rewind: {{username: rewinder, password: '{PASSWORD}'}}
  parameters: {{unix_socket_directories: '{node.root}'}}
"""

    def _own(self, path: Path) -> None:
        if self.user is not None:
            os.chown(path, self.user.uid, self.user.gid)

    def _as_user(self) -> dict[str, Any]:
        if self.user is None:
            return {}
        return {"user": self.user.uid, "group": self.user.gid, "extra_groups": []}

    def close(self) -> None:
        for node in self.nodes:
            self.thaw(node)
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(10)
        for node in self.nodes:
            victims = (processes_in(node.data) or set()) | (
                {pm} | child_pids(pm) if (pm := node.postmaster()) else set())
            for pid in victims:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.kill()
            self.etcd.wait(10)

    # -------------------------------------------------------- what Patroni says

    def members(self, via: Node | None = None) -> list[dict[str, Any]] | None:
        """GET /cluster from ``via`` (or any node that answers)."""
        for node in [via] if via else self.nodes:
            with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
                url = f"http://127.0.0.1:{node.api_port}/cluster"
                with urllib.request.urlopen(url, timeout=1) as response:
                    members: list[dict[str, Any]] = json.load(response)["members"]
                    return members
        return None

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def other(self, node: Node) -> Node:
        return next(n for n in self.nodes if n is not node)

    def leader(self, via: Node | None = None, not_: Node | None = None) -> Node | None:
        """The node Patroni has running as primary (``not_``: other than that one)."""
        for m in self.members(via) or []:
            if m["role"] == "leader" and m["state"] == "running" and (
                    not_ is None or m["name"] != not_.name):
                return self.node(m["name"])
        return None

    def standby(self, node: Node, via: Node) -> dict[str, Any] | None:
        """``node``'s member entry once it streams as a (synchronous) standby on the
        leader's timeline."""
        members = self.members(via) or []
        timelines = {m["timeline"] for m in members if m["role"] == "leader"}
        for m in members:
            if (m["name"] == node.name and m["role"] in ("replica", "sync_standby")
                    and m["state"] in ("running", "streaming") and m.get("timeline") in timelines):
                return m
        return None

    def healthy(self) -> Node | None:
        """The primary, once the other node is its synchronous standby."""
        leader = self.leader()
        if leader is None:
            return None
        members = self.members() or []
        return leader if any(m["role"] == "sync_standby" and m["state"] in (
            "running", "streaming") for m in members) else None

    def patronictl_list(self) -> str:
        done = subprocess.run(["patronictl", "-c", str(self.nodes[0].root / "patroni.yml"),
                               "list"], capture_output=True, text=True, timeout=30,
                              env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        return done.stdout + done.stderr

    # -------------------------------------------------------- faults

    def kill_postmaster(self, node: Node) -> None:
        pid = node.postmaster()
        assert pid is not None and pid_alive(pid), f"{node.name} has no postmaster"
        os.kill(pid, signal.SIGKILL)

    def freeze(self, node: Node) -> None:
        """SIGSTOP the postmaster and every backend: connections stay open, nothing answers."""
        pid = node.postmaster()
        assert pid is not None
        node.frozen = {pid} | child_pids(pid) | (processes_in(node.data) or set())
        for victim in node.frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGSTOP)

    def thaw(self, node: Node) -> None:
        for victim in node.frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGCONT)
        node.frozen = set()

    def url(self, database: str) -> str:
        hosts = ",".join(f"127.0.0.1:{n.pg_port}" for n in self.nodes)
        return (f"postgresql://postgres:{PASSWORD}@{hosts}/{database}"
                "?target_session_attrs=read-write&connect_timeout=2")


@pytest.fixture
def cluster() -> Iterator[PatroniCluster]:
    root = Path(tempfile.mkdtemp(prefix="pgflow-patroni-"))
    user = service_user(create=True)  # None unless root
    if user is not None:
        os.chown(root, user.uid, user.gid)
    root.chmod(0o755)
    patroni = PatroniCluster(root, user)
    try:
        patroni.start()
        yield patroni
    finally:
        patroni.close()
        for node in patroni.nodes:  # shown by pytest when the test failed
            log = node.root / "patroni.log"
            if log.exists():
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
                print(f"----- {node.name} patroni.log -----\n{tail}")
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- observing pgflow


def query(url: str, sql: str) -> list[dict[str, Any]] | None:
    """A fresh connection per call: one stuck on a frozen server cannot hold the test."""
    try:
        with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn, \
                conn.cursor() as cur:
            cur.execute("SET statement_timeout = '3s'")
            return cur.execute(sql).fetchall()
    except psycopg.Error:
        return None


def leader_term(url: str) -> int | None:
    rows = query(url, "SELECT term FROM pgflow.leader"
                      " WHERE heartbeat_at > now() - interval '3 seconds'")
    return int(rows[0]["term"]) if rows else None


@dataclass(frozen=True)
class Execution:
    run_id: int
    attempt: int
    logical_time: datetime
    at: float  # wall clock when the command ran


def executions(path: Path) -> list[Execution]:
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 4:
            found.append(Execution(int(parts[0]), int(parts[1]),
                                   datetime.fromisoformat(parts[2]), float(parts[3])))
    return found


def executed_after(path: Path, moment: float) -> float | None:
    """Wall time of the first command that ran after ``moment``."""
    later = [e.at for e in executions(path) if e.at > moment]
    return min(later) if later else None


def tick_executed(path: Path, logical_after: float) -> bool:
    return any(e.logical_time.timestamp() >= logical_after for e in executions(path))


def web_ready(port: int) -> bool:
    url = f"http://127.0.0.1:{port}/readyz"
    with contextlib.suppress(OSError, urllib.error.URLError), \
            urllib.request.urlopen(url, timeout=3) as response:
        return bool(response.status == 200)
    return False


# ---------------------------------------------------------------- the test


def test_replicas_survive_a_primary_crash_and_a_frozen_primary(
        cluster: PatroniCluster, tmp_path: Path) -> None:
    primary = wait("a primary with a synchronous standby", cluster.healthy, 90)
    with psycopg.connect(f"postgresql://postgres:{PASSWORD}@127.0.0.1:{primary.pg_port}"
                         "/postgres", autocommit=True) as admin:
        admin.execute("CREATE DATABASE pgflow")
    url = cluster.url("pgflow")
    ticks = tmp_path / "ticks.log"
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(
        "[jobs.tick]\n"
        'schedule = "* * * * * *"\n'
        'catchup = "all"\n'
        'command = ["/bin/sh", "-c", "echo $PGFLOW_RUN_ID $PGFLOW_ATTEMPT'
        f' $PGFLOW_LOGICAL_TIME $(date +%s.%N) >> {ticks}"]\n'
        'retry = { max_attempts = 5, backoff = "1s", max_backoff = "2s" }\n')
    pgflow(url, tmp_path, "apply", str(jobs))
    web_port = free_port()
    replicas = Replicas(url, tmp_path)
    measured: dict[str, Any] = {"patroni": ".".join(map(str, _patroni_version())),
                                "patroni_ttl_s": TTL_S, "lease_ttl_s": LEASE_TTL_S}
    try:
        replicas.start("a", roles=("scheduler", "worker", "reaper", "web"),
                           lease_ttl=LEASE_TTL_S, env={"PGFLOW_BIND": f"127.0.0.1:{web_port}"})
        replicas.start("b", lease_ttl=LEASE_TTL_S)
        wait("ticks running", lambda: len(executions(ticks)) >= 5, 60)
        # replica a plays the web role too: it may still be starting when b (worker
        # roles only) has run its first ticks
        wait("web role ready", lambda: web_ready(web_port) or None, 30)

        # 1. The primary's postmaster dies.
        term = wait("a leader", lambda: leader_term(url), 30)
        crashed = cluster.leader()
        assert crashed is not None
        killed_at = time.time()
        cluster.kill_postmaster(crashed)
        promoted = wait("promotion after the crash",
                        lambda: cluster.leader(via=cluster.other(crashed), not_=crashed), 60)
        measured["kill_promotion_s"] = time.time() - killed_at
        first = wait("a new attempt after the crash",
                     lambda: executed_after(ticks, killed_at), 60)
        measured["kill_first_attempt_s"] = first - killed_at
        wait("leadership after the crash", lambda: (t := leader_term(url)) and t > term, 60)
        measured["kill_leadership_s"] = time.time() - killed_at
        wait("the web role ready again", lambda: web_ready(web_port), 60)
        measured["kill_web_ready_s"] = time.time() - killed_at
        wait("the crashed primary rejoining as a standby",
             lambda: cluster.standby(crashed, via=promoted), 90)
        measured["kill_rejoined_s"] = time.time() - killed_at
        wait("ticks 15 s after the crash", lambda: tick_executed(ticks, killed_at + 15), 60)

        # 2. The new primary freezes: no socket closes, only timeouts notice.
        term = wait("a leader", lambda: leader_term(url), 30)
        frozen = promoted
        survivor = cluster.other(frozen)
        frozen_at = time.time()
        cluster.freeze(frozen)
        wait("promotion after the freeze",
             lambda: cluster.leader(via=survivor, not_=frozen), 60)
        promoted_at = time.time()
        measured["freeze_promotion_s"] = promoted_at - frozen_at
        # Only client-side timeouts can notice a frozen server: the kernel still answers
        # TCP keepalives and acknowledges what is sent. Give them the lease TTL.
        led = poll(lambda: (t := leader_term(url)) and t > term, LEASE_TTL_S)
        measured["freeze_leadership_s"] = time.time() - frozen_at if led else None
        if led:
            first = wait("a new attempt after the freeze",
                         lambda: executed_after(ticks, promoted_at), 60)
            measured["freeze_first_attempt_s"] = first - frozen_at
            wait("ticks 15 s after the freeze", lambda: tick_executed(ticks, frozen_at + 15), 60)
        thawed_at = time.time()
        measured["freeze_resumed_after_s"] = thawed_at - frozen_at
        cluster.thaw(frozen)
        wait("leadership after the resume", lambda: (t := leader_term(url)) and t > term, 60)
        measured["resume_leadership_s"] = time.time() - thawed_at
        first = wait("a new attempt after the resume",
                     lambda: executed_after(ticks, thawed_at), 60)
        measured["resume_first_attempt_s"] = first - thawed_at
        wait("the frozen primary rejoining as a standby",
             lambda: cluster.standby(frozen, via=survivor), 90)
        measured["freeze_rejoined_after_resume_s"] = time.time() - thawed_at
        wait("the web role ready after the freeze", lambda: web_ready(web_port), 60)
        wait("ticks after the resume", lambda: tick_executed(ticks, thawed_at + 3), 60)
        measured["patronictl_list"] = cluster.patronictl_list()

        # Stop ticking, let every run finish, then look.
        pgflow(url, tmp_path, "jobs", "pause", "tick")
        wait("every run finished", lambda: query(
            url, "SELECT 1 FROM pgflow.runs WHERE finished_at IS NULL LIMIT 1") == [], 90)
        runs = query(url, "SELECT id, logical_time, state, attempt FROM pgflow.runs"
                          " ORDER BY logical_time")
        assert runs, "no runs"
    finally:
        replicas.close()
    measured["runs"] = len(runs)
    print(json.dumps(measured, indent=2))
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "failover.json").write_text(json.dumps(measured, indent=2) + "\n")

    # One run per tick, none missing: every second from the first tick to the last.
    times = [int(r["logical_time"].timestamp()) for r in runs]
    assert times == list(range(times[0], times[-1] + 1)), "a tick is missing"
    assert {r["state"] for r in runs} == {"succeeded"}
    # None executed twice: each run's command ran once, by the attempt that succeeded.
    done = executions(ticks)
    by_run: dict[int, list[Execution]] = {}
    for e in done:
        by_run.setdefault(e.run_id, []).append(e)
    twice = {run: [e.attempt for e in es] for run, es in by_run.items() if len(es) > 1}
    assert twice == {}, f"executed more than once: {twice}"
    assert set(by_run) == {r["id"] for r in runs}
    if measured["freeze_leadership_s"] is None:
        pytest.xfail("while the primary was frozen, scheduling did not resume on the promoted"
                     " node within the lease TTL: the scheduler's lock connection (and the"
                     " replica heartbeat) wait on the frozen server without a client-side"
                     " timeout; it resumed once the frozen node came back (nothing lost or"
                     " doubled)")
