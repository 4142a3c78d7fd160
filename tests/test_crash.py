"""Crash tests with real ``pgflow serve`` processes and real PostgreSQL.

Workers killed with SIGKILL or frozen with SIGSTOP mid-run, the database killed
and restarted under running replicas, timeouts, cancellation, retries with
backoff, dead letters and graceful shutdown. Every wait is on a condition with a
timeout; the lease TTL is 2 s so that recovery paths run in seconds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from engine import add_job, attempts, wait_for
from procs import (
    TTL,
    Replicas,
    db_now,
    group_gone,
    pgflow,
    process_gone,
    process_state,
    read_pid,
    run_state,
    scalar,
    sh,
    trigger,
    wait_state,
)
from psycopg.rows import dict_row

from pgflow import migrate
from pgflow.embedded import Cluster

Conn = psycopg.Connection[dict[str, Any]]

FAST_RETRY = {"max_attempts": 3, "backoff": 0.1, "max_backoff": 0.1, "jitter": False}


def save_pid(path: Path, pid: str = "$$") -> str:
    """Shell that writes ``pid`` to ``path`` atomically."""
    return f"echo {pid} > {path}.tmp && mv {path}.tmp {path}"


def outcomes(conn: Conn, run_id: int) -> list[tuple[int, str | None]]:
    return [(a["attempt"], a["outcome"]) for a in attempts(conn, run_id)]


# ---------------------------------------------------------------- kill -9 of a worker


def test_kill9_of_a_worker_mid_run_is_retried_by_another_replica(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    pidfile = tmp_path / "attempt1.pid"
    # Attempt 1 records its pid and sleeps (exec: the pid is the replica's own child);
    # later attempts succeed at once.
    script = (f'if [ "$PGFLOW_ATTEMPT" = 1 ]; then {save_pid(pidfile)}; exec sleep 60; fi;'
              ' echo "attempt $PGFLOW_ATTEMPT done"')
    add_job(conn, "crashy", command=sh(script), retry=FAST_RETRY)

    first = replicas.start("a")
    first_id = first.id(conn)
    run_id = trigger(db_url, tmp_path, "crashy")
    child = read_pid(pidfile)
    running = run_state(conn, run_id)
    assert (running["state"], running["attempt"], running["lease_owner"]) == \
        ("running", 1, first_id)
    assert not process_gone(child)

    second = replicas.start("b")
    second_id = second.id(conn)
    first.kill9()

    # PDEATHSIG: the command dies with the replica that started it, at once.
    wait_for(lambda: process_gone(child), timeout=5)
    # The lease expires (TTL 2 s), the reaper records attempt 1 as lost, the other
    # replica runs attempt 2.
    done = wait_state(conn, run_id, "succeeded", "failed", timeout=20)
    assert done["state"] == "succeeded"
    assert done["attempt"] == 2
    tried = attempts(conn, run_id)
    assert [(a["attempt"], a["outcome"], a["worker_id"]) for a in tried] == [
        (1, "lost", first_id), (2, "succeeded", second_id)]
    assert "lease expired" in tried[0]["error"]
    assert "attempt 2 done" in tried[1]["stdout_tail"]
    assert second.alive()


def test_kill9_of_a_worker_leaves_no_process_of_the_command(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    pgid_file, child_file = tmp_path / "pgid", tmp_path / "child"
    script = f"{save_pid(pgid_file)}; sleep 60 & {save_pid(child_file, '$!')}; wait"
    add_job(conn, "forks", command=sh(script), retry=FAST_RETRY)
    replica = replicas.start("a")
    replica.id(conn)
    trigger(db_url, tmp_path, "forks")
    pgid, child = read_pid(pgid_file), read_pid(child_file)
    replica.kill9()
    wait_for(lambda: process_gone(pgid), timeout=5)  # the direct child: PDEATHSIG
    try:
        wait_for(lambda: group_gone(pgid), timeout=5)
    except AssertionError:
        raise AssertionError(f"pid {child} (state {process_state(child)}) of the command's"
                             " process group outlived the killed replica") from None


# ---------------------------------------------------------------- SIGSTOP of a worker


def test_a_frozen_worker_late_result_is_discarded(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    go, pidfile = tmp_path / "go", tmp_path / "attempt1.pid"
    # Attempt 1 waits for the test's go-ahead, then "succeeds"; attempt 2 takes 3 s and
    # prints which attempt it was.
    script = (f'if [ "$PGFLOW_ATTEMPT" = 1 ]; then {save_pid(pidfile)};'
              f' while [ ! -e {go} ]; do sleep 0.05; done; echo "late attempt 1"; exit 0; fi;'
              ' sleep 3; echo "attempt $PGFLOW_ATTEMPT"')
    add_job(conn, "frozen", command=sh(script), retry=FAST_RETRY)

    first = replicas.start("a")
    first_id = first.id(conn)
    run_id = trigger(db_url, tmp_path, "frozen")
    child = read_pid(pidfile)
    assert run_state(conn, run_id)["lease_owner"] == first_id
    second = replicas.start("b")
    second_id = second.id(conn)

    first.stop_signal()
    # Lease expires, the other replica's reaper takes the run, its worker runs attempt 2.
    retry = wait_for(lambda: (row := run_state(conn, run_id))["attempt"] == 2 and
                     row["state"] == "running" and row, timeout=20)
    assert retry["lease_owner"] == second_id
    # Attempt 1's command now "succeeds" while its replica is still frozen...
    go.touch()
    wait_for(lambda: process_state(child) in ("Z", None), timeout=5)
    # ...and the replica wakes up with that result while attempt 2 is running.
    offset = first.log_size()
    first.cont()
    discarded = first.wait_log("result discarded", since=offset,
                               where=lambda r: r.get("run_id") == run_id)
    assert discarded["attempt"] == 1
    assert run_state(conn, run_id)["attempt"] == 2  # the late result changed nothing

    done = wait_state(conn, run_id, "succeeded", "failed", timeout=20)
    assert done["state"] == "succeeded"
    tried = attempts(conn, run_id)
    assert [(a["attempt"], a["outcome"], a["worker_id"]) for a in tried] == [
        (1, "lost", first_id), (2, "succeeded", second_id)]
    assert tried[0]["stdout_tail"] is None  # the late output was dropped with the result
    assert "attempt 2" in tried[1]["stdout_tail"]
    assert first.alive() and second.alive()


# ---------------------------------------------------------------- database restart


@pytest.fixture
def cluster_url(private_cluster: Cluster) -> str:
    url = private_cluster.url
    with psycopg.connect(url, autocommit=True) as admin:
        migrate.migrate(admin)
    return url


def connect(url: str) -> Conn:
    return psycopg.connect(url, autocommit=True, row_factory=dict_row)


def test_a_replica_started_while_the_database_is_down_waits_for_it(
        private_cluster: Cluster, cluster_url: str, tmp_path: Path) -> None:
    # A compose file or a node reboot starts replicas beside a database that is not up
    # yet (or still replaying its WAL): the replica waits rather than exiting.
    started = Replicas(cluster_url, tmp_path)
    try:
        with connect(cluster_url) as conn:
            add_job(conn, "quick", entrypoint="jobfuncs:noop")
        private_cluster.kill()
        replica = started.start("early")
        wait_for(lambda: "waiting up to 60 s for the database" in replica.tail(), timeout=20)
        time.sleep(1.5)
        assert replica.alive(), replica.tail()
        private_cluster.start()
        with connect(cluster_url) as conn:
            replica.id(conn, timeout=30)
            quick = trigger(cluster_url, tmp_path, "quick")
            assert wait_state(conn, quick, "succeeded", "failed")["state"] == "succeeded"
    finally:
        started.close()


def test_a_replica_refused_for_good_exits_at_once_with_one_line(
        private_cluster: Cluster, cluster_url: str, tmp_path: Path) -> None:
    # Only a server that is starting is waited for; a database that does not exist is
    # a mistake to report now, not in a minute.
    missing = cluster_url.replace("/pgflow?", "/no_such_database?")
    assert missing != cluster_url
    started = Replicas(missing, tmp_path)
    try:
        replica = started.start("misconfigured")
        assert replica.wait_exit(20) != 0
        output = replica.tail()
        assert output.startswith("error: cannot connect to "), output
        assert '"no_such_database" does not exist' in output and output.count("\n") == 0
        assert "waiting" not in output
    finally:
        started.close()


@pytest.mark.parametrize("outage", ["kill", "stop", "kill-beyond-ttl"])
def test_replicas_survive_a_database_restart(
        private_cluster: Cluster, cluster_url: str, tmp_path: Path, outage: str) -> None:
    started = Replicas(cluster_url, tmp_path)
    try:
        with connect(cluster_url) as conn:
            add_job(conn, "quick", entrypoint="jobfuncs:noop")
            add_job(conn, "across", command=sh("sleep 3; echo finished"), retry=FAST_RETRY)
            a, b = started.start("a"), started.start("b")
            ids = {a.id(conn), b.id(conn)}
            across = trigger(cluster_url, tmp_path, "across")
            wait_state(conn, across, "running")

        down = time.monotonic()
        if outage == "stop":
            private_cluster.stop("fast")  # sessions terminated by the server
        else:
            private_cluster.kill()  # SIGKILL: crash recovery on start
        assert not private_cluster.is_running()
        if outage == "kill-beyond-ttl":
            time.sleep(TTL + 1.5)  # the scenario: leases expire while the database is down
        private_cluster.start()
        down = time.monotonic() - down

        assert a.alive() and b.alive()
        with connect(cluster_url) as conn:
            restarted = db_now(conn)
            # Both replicas reconnect: their heartbeats are newer than the restart...
            wait_for(lambda: scalar(
                conn, "SELECT count(*) FROM pgflow.replicas WHERE id = ANY(%s)"
                " AND heartbeat_at > %s", (list(ids), restarted)) == 2, timeout=20)
            # ...a scheduler leads again...
            wait_for(lambda: conn.execute(
                "SELECT 1 FROM pgflow.leader WHERE heartbeat_at > %s", (restarted,)).fetchone(),
                timeout=20)
            # ...a run triggered now succeeds...
            quick = trigger(cluster_url, tmp_path, "quick")
            assert wait_state(conn, quick, "succeeded", "failed")["state"] == "succeeded"
            # ...and the run that was running across the restart ends well: finished by
            # its worker when the lease outlived the outage, else lost and retried.
            done = wait_state(conn, across, "succeeded", "failed", timeout=30)
            assert done["state"] == "succeeded", outcomes(conn, across)
            history = outcomes(conn, across)
            assert history[-1] == (done["attempt"], "succeeded")
            assert all(outcome == "lost" for _, outcome in history[:-1]), history
            print(f"database {outage}: down {down:.1f}s; run across it: {history}")
        assert a.alive() and b.alive()
        assert any(r.events("database error") or r.events("connection failed") for r in (a, b))
    finally:
        started.close()


# ---------------------------------------------------------------- timeout and cancel


def test_a_command_past_its_timeout_is_timed_out_and_its_group_killed(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    pgid_file = tmp_path / "pgid"
    script = f"{save_pid(pgid_file)}; sleep 60 & wait"
    add_job(conn, "slow", command=sh(script), timeout="1s")
    replicas.start("a").id(conn)
    run_id = trigger(db_url, tmp_path, "slow")
    pgid = read_pid(pgid_file)
    done = wait_state(conn, run_id, "succeeded", "failed", timeout=15)
    assert done["state"] == "failed"  # max_attempts 1: dead-lettered
    [attempt] = attempts(conn, run_id)
    assert attempt["outcome"] == "timed_out"
    assert "timed out after 1s" in attempt["error"]
    elapsed = (attempt["finished_at"] - attempt["started_at"]).total_seconds()
    assert 1.0 <= elapsed < 5.0
    wait_for(lambda: group_gone(pgid), timeout=5)


def test_cancel_stops_a_running_command_within_seconds(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    pgid_file = tmp_path / "pgid"
    script = f"{save_pid(pgid_file)}; sleep 60 & wait"
    add_job(conn, "cancelme", command=sh(script), retry=FAST_RETRY)
    replicas.start("a").id(conn)
    run_id = trigger(db_url, tmp_path, "cancelme")
    pgid = read_pid(pgid_file)
    wait_state(conn, run_id, "running")

    asked = time.monotonic()
    out = pgflow(db_url, tmp_path, "runs", "cancel", str(run_id)).stdout
    assert "cancel requested" in out
    done = wait_state(conn, run_id, "cancelled", "succeeded", "failed", timeout=10)
    assert done["state"] == "cancelled"
    assert time.monotonic() - asked < 5.0
    assert outcomes(conn, run_id) == [(1, "cancelled")]
    wait_for(lambda: group_gone(pgid), timeout=5)
    shown = json.loads(pgflow(db_url, tmp_path, "runs", "show", str(run_id), "--json").stdout)
    assert shown["state"] == "cancelled"
    assert [a["outcome"] for a in shown["attempts"]] == ["cancelled"]


# ---------------------------------------------------------------- retries and dead letters


def test_retries_wait_out_their_backoff_then_dead_letter(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    backoff, cap = 1.0, 1.5
    add_job(conn, "flaky", entrypoint="jobfuncs:fail",
            retry={"max_attempts": 3, "backoff": backoff, "max_backoff": cap, "jitter": False})
    replicas.start("a").id(conn)
    run_id = trigger(db_url, tmp_path, "flaky")
    done = wait_state(conn, run_id, "failed", "succeeded", timeout=25)
    assert done["state"] == "failed"
    tried = attempts(conn, run_id)
    assert [(a["attempt"], a["outcome"]) for a in tried] == [
        (1, "failed"), (2, "failed"), (3, "failed")]
    assert "attempt 3 failed" in tried[2]["error"]
    # Exponential without jitter: 1 s after attempt 1, min(2 s, cap) after attempt 2.
    for before, after, delay in ((tried[0], tried[1], backoff), (tried[1], tried[2], cap)):
        waited = (after["started_at"] - before["finished_at"]).total_seconds()
        gap = (after["started_at"] - before["started_at"]).total_seconds()
        assert delay <= waited < delay + 3.0, (waited, delay)
        assert gap >= delay
    dead = json.loads(pgflow(db_url, tmp_path, "runs", "list", "--state", "failed",
                             "--json").stdout)
    assert [r["id"] for r in dead] == [run_id]


def test_dead_letter_operator_retry_and_ack(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    add_job(conn, "once", entrypoint="jobfuncs:fail_once")  # fails attempt 1 only
    add_job(conn, "broken", entrypoint="jobfuncs:permanent",
            retry={"max_attempts": 5, "backoff": 0.1})
    replicas.start("a").id(conn)
    once = trigger(db_url, tmp_path, "once")
    broken = trigger(db_url, tmp_path, "broken")
    assert wait_state(conn, once, "failed", "succeeded")["state"] == "failed"
    assert wait_state(conn, broken, "failed", "succeeded")["state"] == "failed"
    assert outcomes(conn, broken) == [(1, "failed")]  # PermanentError: no retry

    def dead_letters() -> int:
        status = json.loads(pgflow(db_url, tmp_path, "status", "--json").stdout)
        return int(status["queue"]["dead_letters"])

    assert dead_letters() == 2
    pgflow(db_url, tmp_path, "runs", "ack", str(broken))
    assert dead_letters() == 1
    out = pgflow(db_url, tmp_path, "runs", "retry", str(once)).stdout
    assert "queued for retry" in out
    done = wait_state(conn, once, "succeeded", "failed")
    assert done["state"] == "succeeded"
    assert done["max_attempts"] == 2  # a fresh budget on top of the attempt used
    assert outcomes(conn, once) == [(1, "failed"), (2, "succeeded")]
    assert dead_letters() == 0
    refused = pgflow(db_url, tmp_path, "runs", "retry", str(once), check=False)
    assert refused.returncode != 0 and "succeeded" in refused.stderr


# ---------------------------------------------------------------- graceful shutdown


def long_first_attempt(pidfile: Path) -> list[str]:
    """Attempt 1 records its pid and sleeps a minute; later attempts succeed at once."""
    return sh(f'if [ "$PGFLOW_ATTEMPT" = 1 ]; then {save_pid(pidfile)}; exec sleep 60; fi;'
              ' echo "attempt $PGFLOW_ATTEMPT done"')


def test_sigterm_puts_a_long_run_back_in_the_queue_for_another_replica(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    pidfile = tmp_path / "attempt1.pid"
    add_job(conn, "long", command=long_first_attempt(pidfile),
            retry={"max_attempts": 1, "backoff": 0.1})
    first = replicas.start("a", grace="1s")
    first_id = first.id(conn)
    run_id = trigger(db_url, tmp_path, "long")
    child = read_pid(pidfile)

    sent = time.monotonic()
    first.term()
    assert first.wait_exit(timeout=15) == 0
    # Straight back to the queue, without waiting for the lease to expire.
    back = run_state(conn, run_id)
    assert time.monotonic() - sent < 1.0 + 5.0
    assert (back["state"], back["attempt"], back["max_attempts"], back["lease_owner"]) == \
        ("queued", 1, 2, None)
    [interrupted] = attempts(conn, run_id)
    assert (interrupted["outcome"], interrupted["worker_id"]) == ("interrupted", first_id)
    assert process_gone(child)
    assert conn.execute("SELECT 1 FROM pgflow.replicas WHERE id = %s",
                        (first_id,)).fetchone() is None  # deregistered

    second = replicas.start("b")
    second_id = second.id(conn)
    done = wait_state(conn, run_id, "succeeded", "failed")
    assert done["state"] == "succeeded"  # max_attempts 1, yet the interruption cost nothing
    assert [(a["attempt"], a["outcome"], a["worker_id"]) for a in attempts(conn, run_id)] == [
        (1, "interrupted", first_id), (2, "succeeded", second_id)]


def test_sigterm_grace_lets_short_runs_finish_and_a_second_sigterm_cuts_it(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    pidfile = tmp_path / "attempt1.pid"
    add_job(conn, "long", command=long_first_attempt(pidfile))
    add_job(conn, "short", command=sh("sleep 2; echo short done"))
    replica = replicas.start("a", grace="60s")
    replica_id = replica.id(conn)
    long_id = trigger(db_url, tmp_path, "long")
    short_id = trigger(db_url, tmp_path, "short")
    read_pid(pidfile)  # the long run's command started
    wait_state(conn, short_id, "running")

    first_signal = time.monotonic()
    replica.term()
    wait_for(lambda: scalar(conn, "SELECT stopping FROM pgflow.replicas WHERE id = %s",
                            (replica_id,)), timeout=5)
    # Within the grace the short run finishes normally; the long one keeps running.
    assert wait_state(conn, short_id, "succeeded", "failed")["state"] == "succeeded"
    assert outcomes(conn, short_id) == [(1, "succeeded")]
    assert run_state(conn, long_id)["state"] == "running"
    assert replica.alive()

    # A second SIGTERM (more than 1 s after the first) skips the rest of the grace.
    time.sleep(max(0.0, first_signal + 1.2 - time.monotonic()))
    second_signal = time.monotonic()
    replica.term()
    assert replica.wait_exit(timeout=15) == 0
    assert time.monotonic() - second_signal < 8.0  # not the 60 s grace
    back = run_state(conn, long_id)
    assert (back["state"], back["max_attempts"]) == ("queued", 2)
    assert outcomes(conn, long_id) == [(1, "interrupted")]


def test_sigterm_does_not_wait_for_a_sync_job_that_ignores_cancellation(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    marker = tmp_path / "started"
    add_job(conn, "stubborn", entrypoint="jobfuncs:stubborn_sleep",
            params={"marker": str(marker), "seconds": 120})
    replica = replicas.start("a", grace="1s")
    run_id = trigger(db_url, tmp_path, "stubborn")
    wait_for(marker.exists, timeout=20)
    replica.term()
    assert replica.wait_exit(timeout=15) == 0
    back = run_state(conn, run_id)
    assert (back["state"], back["max_attempts"]) == ("queued", 2)
    assert [a["outcome"] for a in attempts(conn, run_id)] == ["interrupted"]
