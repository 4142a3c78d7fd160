"""A silent network partition between a replica and PostgreSQL.

Replica "a" reaches the database only through a TCP relay in the test process. The
relay then turns into a black hole: it forwards nothing either way but keeps every
socket open, so nothing fails — statements just never get an answer, TCP keepalives
are answered by the relay's kernel, and the server never hears of the statements.
Replica "b" (a direct connection) reaps the expired lease and retries the run. The
attempt on "a" must be over before the retry starts: "a" stops it by itself when its
lease could expire (SPEC §4, self-fencing).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from engine import add_job, attempts, enqueue, wait_for
from fencefuncs import journal
from procs import Replica, Replicas, read_pid, run_state, wait_state
from psycopg.conninfo import conninfo_to_dict

Conn = psycopg.Connection[dict[str, Any]]
FAST_RETRY = {"max_attempts": 3, "backoff": 0.1, "max_backoff": 0.1, "jitter": False}


class Relay:
    """Forwards TCP connections on 127.0.0.1 to the server of ``url`` (unix socket or TCP).
    ``silence()`` stops all forwarding, both ways, keeping the sockets open."""

    def __init__(self, url: str) -> None:
        params = conninfo_to_dict(url)
        host, port = str(params.get("host") or "/tmp"), int(params.get("port") or 5432)
        if host.startswith("/"):
            self._upstream: tuple[int, Any] = (socket.AF_UNIX, f"{host}/.s.PGSQL.{port}")
        else:
            self._upstream = (socket.AF_INET, (host, port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = [self._listener]
        self._silent = threading.Event()
        self._closed = threading.Event()
        user = quote(str(params.get("user") or os.environ.get("USER", "postgres")), safe="")
        self.url = (f"postgresql://{user}@127.0.0.1:{self._listener.getsockname()[1]}/"
                    f"{quote(str(params['dbname']), safe='')}?sslmode=disable")
        threading.Thread(target=self._accept, daemon=True).start()

    def silence(self) -> None:
        self._silent.set()

    def close(self) -> None:
        self._closed.set()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.socket(self._upstream[0], socket.SOCK_STREAM)
                upstream.connect(self._upstream[1])
            except OSError:
                return
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            while not self._closed.is_set():
                if self._silent.is_set():  # read nothing, send nothing: bytes pile up
                    time.sleep(0.05)
                    continue
                ready, _, _ = select.select([src], [], [], 0.05)
                if not ready:
                    continue
                data = src.recv(65536)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if not self._silent.is_set():  # a partition drops what is in flight
                    dst.sendall(data)


@pytest.fixture
def relay(db_url: str) -> Iterator[Relay]:
    handle = Relay(db_url)
    yield handle
    handle.close()


@pytest.fixture
def cut_off(relay: Relay, tmp_path: Path) -> Iterator[Replicas]:
    """Replicas whose database connections go through the relay."""
    started = Replicas(relay.url, tmp_path)
    yield started
    started.close()


@pytest.fixture
def direct(db_url: str, tmp_path: Path) -> Iterator[Replicas]:
    started = Replicas(db_url, tmp_path)
    yield started
    started.close()


def partition_while_running(conn: Conn, relay: Relay, cut_off: Replicas, direct: Replicas,
                            job: str, started: Any) -> tuple[int, Replica, Replica]:
    """Run ``job`` on replica a (behind the relay) until ``started()``, start replica b,
    then silence the relay. Returns (run id, a, b)."""
    a = cut_off.start("a", roles=("worker",))
    a_id = a.id(conn)
    run_id = enqueue(conn, job)
    wait_for(started, timeout=20)
    assert run_state(conn, run_id)["lease_owner"] == a_id
    b = direct.start("b", roles=("worker", "reaper"))
    b.id(conn)
    relay.silence()
    return run_id, a, b


def retry_start(conn: Conn, run_id: int, b: Replica) -> float:
    """When attempt 2 started (the database's clock), once it has succeeded on b."""
    done = wait_state(conn, run_id, "succeeded", "failed", timeout=30)
    assert done["state"] == "succeeded"
    tried = attempts(conn, run_id)
    assert [(t["attempt"], t["outcome"]) for t in tried] == [(1, "lost"), (2, "succeeded")]
    assert "lease expired" in tried[0]["error"]  # reaped by b: a could not say anything
    assert tried[1]["worker_id"] == b.id(conn)
    return float(tried[1]["started_at"].timestamp())


def test_a_partitioned_replica_stops_its_python_job_before_the_retry_starts(
        conn: Conn, tmp_path: Path, relay: Relay, cut_off: Replicas, direct: Replicas) -> None:
    log = tmp_path / "journal"
    add_job(conn, "cut", entrypoint="fencefuncs:first_attempt_sleeps",
            params={"journal": str(log)}, retry=FAST_RETRY)
    run_id, a, b = partition_while_running(
        conn, relay, cut_off, direct, "cut",
        lambda: [e for e, _, n, _ in journal(log) if (e, n) == ("start", 1)])
    retried = retry_start(conn, run_id, b)
    stopped = [t for e, _, n, t in journal(log) if (e, n) == ("cancelled", 1)]
    assert stopped, f"attempt 1 never saw its cancellation:\n{a.tail()}"
    print(f"attempt 1 stopped {retried - stopped[0]:.3f}s before the retry started")
    assert stopped[0] < retried
    assert a.alive()  # it kept running, cut off, and fenced itself


def test_a_partitioned_replica_kills_its_command_before_the_retry_starts(
        conn: Conn, tmp_path: Path, relay: Relay, cut_off: Replicas, direct: Replicas) -> None:
    pidfile = tmp_path / "attempt1.pid"
    script = (f'if [ "$PGFLOW_ATTEMPT" = 1 ]; then echo $$ > {pidfile}.tmp &&'
              f' mv {pidfile}.tmp {pidfile}; exec sleep 60; fi; echo "attempt $PGFLOW_ATTEMPT"')
    add_job(conn, "cutcmd", command=["/bin/sh", "-c", script], retry=FAST_RETRY)
    deaths: list[float] = []
    run_id, a, b = partition_while_running(conn, relay, cut_off, direct, "cutcmd",
                                           pidfile.exists)
    watcher = watch_exit(read_pid(pidfile), deaths)
    retried = retry_start(conn, run_id, b)
    watcher.join(10)
    assert deaths, f"attempt 1's command outlived the retry:\n{a.tail()}"
    print(f"attempt 1's command died {retried - deaths[0]:.3f}s before the retry started")
    assert deaths[0] < retried
    assert a.alive()


def watch_exit(pid: int, deaths: list[float]) -> threading.Thread:
    """Note the moment process ``pid`` exits (a pidfd turns readable then)."""
    fd = os.pidfd_open(pid)

    def wait() -> None:
        try:
            select.select([fd], [], [], 30)
            if select.select([fd], [], [], 0)[0]:
                deaths.append(time.time())
        finally:
            os.close(fd)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread
