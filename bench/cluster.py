"""The one PostgreSQL cluster that the anchors and pgflow are measured on.

``BENCH_PG_URL`` (``postgresql://user@host:port``, no database) points at a running
server that the benchmark leaves alone. Otherwise a private cluster with stock
settings is created and started under ``BENCH_PGROOT`` (default
``/tmp/pgflow-bench-pg``) on ``127.0.0.1:BENCH_PGPORT`` (default 55433) with the
anchors' ``cluster.sh`` — or, when the anchor folder is missing, with the same
commands run from here — and stopped at the end if this run started it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from bench import procs

PGBIN = Path(os.environ.get("PGBIN", "/usr/lib/postgresql/15/bin"))
OS_USER = os.environ.get("PGOS_USER", "pgbench_u")
DEFAULT_ROOT = "/tmp/pgflow-bench-pg"
DEFAULT_PORT = "55433"

Conn = psycopg.Connection[dict[str, Any]]


@dataclass
class Cluster:
    server_url: str
    control: _Control | None = None  # set when this run started the server

    def db_url(self, database: str) -> str:
        return f"{self.server_url}/{database}"

    def admin(self) -> Conn:
        return psycopg.connect(self.db_url("postgres"), autocommit=True, row_factory=dict_row)

    def reset_database(self, database: str) -> str:
        """Drop and re-create ``database``; returns its URL."""
        with self.admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{database}"')
        return self.db_url(database)

    def checkpoint(self) -> None:
        with self.admin() as conn:
            conn.execute("CHECKPOINT")

    def postmaster_pid(self) -> int:
        with self.admin() as conn:  # read /proc while the backend is still alive
            row = conn.execute("SELECT pg_backend_pid() AS pid").fetchone()
            assert row is not None
            return procs.parent_pid(int(row["pid"]))

    def settings(self) -> dict[str, str]:
        names = ["server_version", "fsync", "synchronous_commit", "shared_buffers",
                 "max_connections", "work_mem", "max_wal_size", "autovacuum", "jit"]
        with self.admin() as conn:
            rows = conn.execute("SELECT name, current_setting(name) AS value FROM pg_settings"
                                " WHERE name = ANY(%s)", (names,)).fetchall()
        return {row["name"]: row["value"] for row in rows}

    def stop(self) -> None:
        if self.control is not None:
            self.control.run("stop")


@dataclass(frozen=True)
class _Control:
    """init/start/stop of the private cluster: ``cluster.sh`` when present, else the
    same commands (initdb + pg_ctl as an unprivileged user when root)."""

    root: Path
    port: str
    script: Path | None

    def run(self, action: str) -> None:
        if self.script is not None:
            env = {**os.environ, "PGROOT": str(self.root), "PGPORT": self.port,
                   "PGBIN": str(PGBIN)}
            subprocess.run([str(self.script), action], env=env, check=True,
                           capture_output=True, text=True)
            return
        getattr(self, f"_{action}")()

    def _init(self) -> None:
        root_user = os.geteuid() == 0
        if root_user and subprocess.run(["id", OS_USER], capture_output=True).returncode:
            subprocess.run(["useradd", "-m", "-s", "/bin/bash", OS_USER], check=True)
        self.root.mkdir(parents=True, exist_ok=True)
        if root_user:
            subprocess.run(["chown", OS_USER, str(self.root)], check=True)
        self._as_pg(f"{PGBIN}/initdb -D {self.root}/data -U postgres --auth=trust -E UTF8"
                    " --locale=C.UTF-8")

    def _start(self) -> None:
        opts = (f"-c listen_addresses=127.0.0.1 -c port={self.port}"
                f" -c unix_socket_directories={self.root}")
        self._as_pg(f"{PGBIN}/pg_ctl -D {self.root}/data -l {self.root}/server.log"
                    f" -o {shlex.quote(opts)} -w start")

    def _stop(self) -> None:
        self._as_pg(f"{PGBIN}/pg_ctl -D {self.root}/data -m fast -w stop")

    @staticmethod
    def _as_pg(command: str) -> None:
        argv = (["su", OS_USER, "-s", "/bin/bash", "-c", f"cd /tmp && {command}"]
                if os.geteuid() == 0 else ["bash", "-c", command])
        subprocess.run(argv, check=True, capture_output=True, text=True)


def open_cluster(anchors_dir: Path) -> Cluster:
    """The cluster to measure on, started if needed (see the module docstring)."""
    url = os.environ.get("BENCH_PG_URL")
    if url:
        _wait_ready(url.rstrip("/"), timeout=10)
        return Cluster(url.rstrip("/"))
    port = os.environ.get("BENCH_PGPORT", DEFAULT_PORT)
    url = f"postgresql://postgres@127.0.0.1:{port}"
    if _reachable(url):
        return Cluster(url)
    script = anchors_dir / "cluster.sh"
    control = _Control(Path(os.environ.get("BENCH_PGROOT", DEFAULT_ROOT)), port,
                       script if script.exists() else None)
    if not (control.root / "data" / "PG_VERSION").exists():
        control.run("init")
    control.run("start")
    _wait_ready(url, timeout=30)
    return Cluster(url, control)


def _reachable(url: str) -> bool:
    try:
        with psycopg.connect(f"{url}/postgres", connect_timeout=3):
            return True
    except psycopg.OperationalError:
        return False


def _wait_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not _reachable(url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"PostgreSQL at {url} is not reachable")
        time.sleep(0.2)
