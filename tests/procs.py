"""Real ``pgflow serve`` replicas as subprocesses, for crash and multi-replica tests.

A ``Replica`` is one ``python -m pgflow serve`` process with its own log file. Tests
kill it (``kill9``), freeze it (``stop_signal`` / ``cont``) or stop it gracefully
(``term``), and read what it did from the database and from its JSON log.
``Replicas`` starts them and, when the test ends, kills every one of them and any
command process of theirs still running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar, cast

import psycopg
from engine import wait_for

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
ALL_ROLES = ("scheduler", "worker", "reaper")
TTL = 2.0

Conn = psycopg.Connection[dict[str, Any]]
T = TypeVar("T")


def until(condition: Callable[[], T | None], timeout: float = 20.0) -> T:
    """``engine.wait_for`` for a condition that returns its value or None."""
    return cast(T, wait_for(condition, timeout=timeout))


def scalar(conn: Conn, query: str, params: Any = None) -> Any:
    """The first column of the first row of ``query`` (None without a row)."""
    row = conn.execute(query, params).fetchone()
    return None if row is None else next(iter(row.values()))


def child_env(url: str, home: Path) -> dict[str, str]:
    """The environment of a replica or CLI call: this database, jobfuncs importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGFLOW_")}
    path = [str(TESTS), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    # TEST_PGFLOW_DATABASE tags the replica's job processes (jobs never see PGFLOW_* nor
    # PG* settings, but inherit the rest) so that a test can find and kill leftovers.
    env.update(PGFLOW_DATABASE_URL=url, PGFLOW_HOME=str(home), PYTHONPATH=":".join(path),
               PYTHONUNBUFFERED="1", TEST_PGFLOW_DATABASE=url)
    return env


class Replica:
    """One ``pgflow serve`` process; its stdout and stderr go to ``log_path``."""

    def __init__(self, url: str, workdir: Path, name: str, *,
                 roles: Iterable[str] = ALL_ROLES, concurrency: int = 4,
                 lease_ttl: float = TTL, grace: str = "10s",
                 env: dict[str, str] | None = None) -> None:
        """``env``: variables set on top of ``child_env`` (an empty value unsets one)."""
        self.name = name
        self.url = url
        self.log_path = workdir / f"replica-{name}.log"
        args = [sys.executable, "-m", "pgflow", "serve", "--concurrency", str(concurrency),
                "--grace", grace, "--lease-ttl", str(lease_ttl), "--log-level", "info"]
        for role in roles:
            args += ["--role", role]
        with open(self.log_path, "ab") as log:
            # A session of its own: the test's Ctrl-C or signals do not reach it by accident.
            extra = env or {}
            environ = {k: v for k, v in {**child_env(url, workdir), **extra}.items()
                       if v or k not in extra}
            self.proc = subprocess.Popen(args, cwd=ROOT, env=environ,
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self._id: str | None = None

    def __repr__(self) -> str:
        return f"Replica({self.name!r}, pid={self.pid})"

    @property
    def pid(self) -> int:
        return self.proc.pid

    # ------------------------------------------------------------ signals

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill9(self) -> None:
        """SIGKILL, like a crash or the OOM killer; reaped at once (no zombie)."""
        self.signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop_signal(self) -> None:
        """SIGSTOP: the process freezes, its sockets (and database sessions) stay open."""
        self.signal(signal.SIGSTOP)
        wait_for(lambda: process_state(self.pid) in ("T", "t", None), timeout=5)

    def cont(self) -> None:
        self.signal(signal.SIGCONT)

    def term(self) -> None:
        """SIGTERM: graceful drain."""
        self.signal(signal.SIGTERM)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Kill the process if it still runs (works on a stopped process too)."""
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)

    # ------------------------------------------------------------ database

    def id(self, conn: Conn, timeout: float = 20.0) -> str:
        """The replica's id in pgflow.replicas (waits for it to register)."""
        if self._id is None:
            def registered() -> str | None:
                self._check_running()
                row = conn.execute("SELECT id FROM pgflow.replicas WHERE pid = %s",
                                   (self.pid,)).fetchone()
                return None if row is None else str(row["id"])
            self._id = until(registered, timeout=timeout)
        return self._id

    def _check_running(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self} exited with {self.proc.returncode}:\n{self.tail()}")

    # ------------------------------------------------------------ logs

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def logs(self, since: int = 0) -> list[dict[str, Any]]:
        """JSON log records written after byte offset ``since`` (other lines skipped)."""
        with open(self.log_path, "rb") as log:
            log.seek(since)
            data = log.read()
        records = []
        for line in data.decode("utf-8", "replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records

    def events(self, text: str, since: int = 0) -> list[dict[str, Any]]:
        """Records whose ``event`` contains ``text``."""
        return [r for r in self.logs(since) if text in str(r.get("event", ""))]

    def wait_log(self, text: str, since: int = 0, timeout: float = 15.0,
                 where: Callable[[dict[str, Any]], bool] = lambda r: True) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((r for r in self.events(text, since) if where(r)), None)
        try:
            return until(found, timeout=timeout)
        except AssertionError:
            raise AssertionError(f"{self} never logged {text!r}:\n{self.tail()}") from None

    def tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class Replicas:
    """Starts replicas for one test; at the end kills all of them and every command
    process they left behind (found by the database URL in its environment)."""

    def __init__(self, url: str, workdir: Path) -> None:
        self.url = url
        self.workdir = workdir
        self.started: list[Replica] = []

    def start(self, name: str, **options: Any) -> Replica:
        replica = Replica(self.url, self.workdir, name, **options)
        self.started.append(replica)
        return replica

    def close(self) -> None:
        for replica in self.started:
            replica.close()
        for pid in command_processes(self.url):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for replica in self.started:  # shown by pytest when the test failed
            print(f"----- {replica} log tail -----\n{replica.tail(60)}")


# ---------------------------------------------------------------- processes


def process_state(pid: int) -> str | None:
    """The state letter in /proc/PID/stat (R, S, T, Z, ...), or None without a process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def process_gone(pid: int) -> bool:
    """The process no longer runs: ``kill(pid, 0)`` fails, or only its zombie is left
    (nobody reaped it yet: an orphan's new parent may be slow to)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return process_state(pid) in (None, "Z", "X")


def group_gone(pgid: int) -> bool:
    """No live process is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return False
    return True


def command_processes(url: str) -> list[int]:
    """Live processes started by a replica for a run (they carry PGFLOW_RUN_ID) of the
    database at ``url`` (TEST_PGFLOW_DATABASE, inherited from the replica)."""
    marker = b"TEST_PGFLOW_DATABASE=" + url.encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes() + b"\0"
        except OSError:
            continue
        if (marker in environ and b"\0PGFLOW_RUN_ID=" in b"\0" + environ
                and process_state(int(entry.name)) not in (None, "Z", "X")):
            found.append(int(entry.name))
    return found


def read_pid(path: Path, timeout: float = 20.0) -> int:
    """Wait for a command to write its pid to ``path``."""
    def written() -> int | None:
        text = path.read_text().strip() if path.exists() else ""
        return int(text) if text.isdigit() else None
    return until(written, timeout=timeout)


# ---------------------------------------------------------------- database


def leader(conn: Conn) -> dict[str, Any] | None:
    """The pgflow.leader row with the leader's pid from pgflow.replicas."""
    return conn.execute(
        "SELECT l.replica_id, l.term, l.backend_pid, l.elected_at, l.heartbeat_at, r.pid"
        " FROM pgflow.leader l LEFT JOIN pgflow.replicas r ON r.id = l.replica_id").fetchone()


def wait_for_leader(conn: Conn, replica: Replica | None = None, *,
                    among: Iterable[Replica] = (), after_term: int = 0,
                    timeout: float = 20.0) -> dict[str, Any]:
    """Wait until ``replica`` (or any replica, or one of ``among``) leads with a term above
    ``after_term``; returns the leader row plus ``replica`` (the Replica that leads, when
    it is one of ``among`` or ``replica``)."""
    candidates = list(among) + ([replica] if replica is not None else [])

    def elected() -> dict[str, Any] | None:
        row = leader(conn)
        if row is None or row["term"] <= after_term:
            return None
        if replica is not None and row["replica_id"] != replica.id(conn):
            return None
        leading = next((r for r in candidates if r.pid == row["pid"]), None)
        if candidates and leading is None:
            return None
        return {**row, "replica": leading}

    return until(elected, timeout=timeout)


def run_state(conn: Conn, run_id: int) -> dict[str, Any]:
    row = conn.execute("SELECT * FROM pgflow.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None, f"no run {run_id}"
    return row


def wait_state(conn: Conn, run_id: int, *states: str, timeout: float = 20.0) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        row = run_state(conn, run_id)
        return row if row["state"] in states else None
    try:
        return until(reached, timeout=timeout)
    except AssertionError:
        row = run_state(conn, run_id)
        raise AssertionError(f"run {run_id} did not reach {states} within {timeout}s: "
                             f"state={row['state']} attempt={row['attempt']} "
                             f"owner={row['lease_owner']}") from None


def db_now(conn: Conn) -> datetime:
    row = conn.execute("SELECT now() AS now").fetchone()
    assert row is not None
    now: datetime = row["now"]
    return now


# ---------------------------------------------------------------- CLI


def pgflow(url: str, workdir: Path, *args: str, check: bool = True, timeout: float = 30.0,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the ``pgflow`` CLI against ``url`` (``env`` on top of the test environment);
    with ``check`` a non-zero exit fails."""
    done = subprocess.run([sys.executable, "-m", "pgflow", *args], cwd=ROOT,
                          env={**child_env(url, workdir), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"pgflow {' '.join(args)} exited {done.returncode}:\n"
                             f"{done.stdout}\n{done.stderr}")
    return done


def sh(script: str) -> list[str]:
    """A job command running ``script`` in /bin/sh."""
    return ["/bin/sh", "-c", script]


def trigger(url: str, workdir: Path, job: str, *args: str) -> int:
    """``pgflow trigger JOB ARGS...``: the new run's id."""
    return int(pgflow(url, workdir, "trigger", job, *args).stdout.strip())
