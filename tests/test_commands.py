"""Command attempts: real processes under the replica's supervisor process.

The first half drives ``Execution`` directly on an event loop of the test (the
supervisor is a real process, no database needed); the second half runs real
``pgflow serve`` replicas against real PostgreSQL to kill, freeze and inspect them.
Every wait is on a condition; no assertion compares a duration with a threshold.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from engine import add_job, attempts, free_port, wait_for
from procs import (
    Replicas,
    group_gone,
    process_gone,
    process_state,
    read_pid,
    run_state,
    trigger,
    wait_state,
)

from pgflow import environment, supervisor
from pgflow.executor import AttemptResult, Execution, Job
from pgflow.log import get_logger
from pgflow.retry import CANCELLED, FAILED, LOST, SUCCEEDED, TIMED_OUT

Conn = psycopg.Connection[dict[str, Any]]
FAST_RETRY = {"max_attempts": 3, "backoff": 0.1, "max_backoff": 0.1, "jitter": False}


def job(command: list[str] | str, *, timeout_s: float | None = None, attempt: int = 1,
        params: dict[str, Any] | None = None) -> Job:
    return Job(run_id=7, job="cmd", logical_time=datetime(2030, 1, 2, 3, 4, tzinfo=UTC),
               attempt=attempt, params=params or {}, command=command, entrypoint=None,
               timeout_s=timeout_s)


def execution(command: list[str] | str, **keys: Any) -> Execution:
    deadline = keys.pop("deadline", None)
    return Execution(job(command, **keys), get_logger(test=True), deadline=deadline)


def run(command: list[str] | str, **keys: Any) -> AttemptResult:
    return asyncio.run(execution(command, **keys).run())


async def until(condition: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll ``condition`` on the loop (the supervisor's replies need the loop running)."""
    give_up = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > give_up:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.02)
    return value


def pid_in(path: Path) -> int | None:
    text = path.read_text().strip() if path.exists() else ""
    return int(text) if text.isdigit() else None


def save_pid(path: Path, pid: str = "$$") -> str:
    return f"echo {pid} > {path}.tmp && mv {path}.tmp {path}"


def in_loop(body: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(body())


# ---------------------------------------------------------------- process groups (defect 11)


def test_the_attempt_ends_when_the_main_process_exits_and_a_background_child_dies(
        tmp_path: Path) -> None:
    child_file = tmp_path / "child"
    # The background loop keeps stdout open forever: waiting for EOF would never end.
    script = (f"sh -c 'while :; do sleep 1; done' & {save_pid(child_file, '$!')};"
              " echo started")
    result = run(["/bin/sh", "-c", script])
    assert (result.outcome, result.exit_code, result.stdout_tail) == (SUCCEEDED, 0, "started\n")
    child = pid_in(child_file)
    assert child is not None
    wait_for(lambda: process_gone(child), timeout=5)


def test_a_timeout_kills_the_whole_group_even_when_it_ignores_sigterm(tmp_path: Path) -> None:
    pgid_file, child_file = tmp_path / "pgid", tmp_path / "child"
    script = (f"trap '' TERM; {save_pid(pgid_file)}; sleep 300 & {save_pid(child_file, '$!')};"
              " wait; wait")
    result = run(["/bin/sh", "-c", script], timeout_s=0.5)
    assert (result.outcome, result.error) == (TIMED_OUT, "timed out after 0.5s")
    pgid, child = pid_in(pgid_file), pid_in(child_file)
    assert pgid is not None and child is not None
    wait_for(lambda: group_gone(pgid) and process_gone(child), timeout=5)


@pytest.mark.parametrize(("outcome", "signal_name"), [(CANCELLED, "SIGTERM"),
                                                      (LOST, "SIGKILL")])
def test_stop_ends_the_whole_group(tmp_path: Path, outcome: str, signal_name: str) -> None:
    """A cancel terminates (SIGTERM first); a lost lease kills at once (SIGKILL): the
    retry may already be running elsewhere."""
    pgid_file, child_file = tmp_path / "pgid", tmp_path / "child"
    script = f"{save_pid(pgid_file)}; sleep 300 & {save_pid(child_file, '$!')}; exec sleep 300"

    async def body() -> tuple[AttemptResult, int, int]:
        attempt = execution(["/bin/sh", "-c", script])
        task = asyncio.create_task(attempt.run())
        pgid = await until(lambda: pid_in(pgid_file))
        child = await until(lambda: pid_in(child_file))
        attempt.stop(outcome)
        return await task, pgid, child

    result, pgid, child = in_loop(body)
    assert result.outcome == outcome
    assert result.error == f"killed by {signal_name}"
    wait_for(lambda: group_gone(pgid) and process_gone(child), timeout=5)


def test_a_stop_before_the_start_never_starts_the_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    attempt = execution(["/bin/sh", "-c", f"touch {marker}"])
    attempt.stop(CANCELLED)
    result = asyncio.run(attempt.run())
    assert result.outcome == CANCELLED
    assert not marker.exists()


# ---------------------------------------------------------------- results


@pytest.mark.parametrize(("command", "outcome", "code", "error"), [
    ("echo out; echo err >&2", SUCCEEDED, 0, None),
    ("exit 3", FAILED, 3, "exited with code 3"),
    ("exit 75", FAILED, 75, "source unavailable (exit 75)"),
    ("kill -KILL $$", FAILED, None, "killed by SIGKILL"),
    (["true"], SUCCEEDED, 0, None),  # an argv list, found on PATH
    (["/nonexistent/prog", "x"], FAILED, 127,
     "cannot start '/nonexistent/prog': No such file or directory"),
    (["no-such-program-anywhere"], FAILED, 127,
     "cannot start 'no-such-program-anywhere': No such file or directory"),
])
def test_exit_statuses(command: list[str] | str, outcome: str, code: int | None,
                       error: str | None) -> None:
    result = run(command)
    assert (result.outcome, result.exit_code, result.error) == (outcome, code, error)
    if command == "echo out; echo err >&2":
        assert (result.stdout_tail, result.stderr_tail) == ("out\n", "err\n")
    if code == 127:
        assert result.stderr_tail == f"{error}\n"


def test_big_output_on_both_streams_is_read_while_it_runs_and_tailed() -> None:
    script = "yes o | head -c 300000; yes e | head -c 300000 >&2; echo END; echo END >&2"
    result = run(["/bin/sh", "-c", script])
    assert result.outcome == SUCCEEDED
    for tail in (result.stdout_tail, result.stderr_tail):
        assert tail is not None and len(tail) == 64 * 1024 and tail.endswith("END\n")


def test_params_larger_than_one_packet_reach_the_command() -> None:
    params = {"blob": "x" * (supervisor.INLINE_LIMIT + 10_000)}
    result = run(["/bin/sh", "-c", 'printf %s "$PGFLOW_PARAMS" | wc -c'], params=params)
    assert result.outcome == SUCCEEDED
    assert int(str(result.stdout_tail).strip()) == len(json.dumps(params))


def test_the_command_environment_has_the_run_variables_and_no_pgflow_or_libpq_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"PGFLOW_DATABASE_URL": "postgresql://u:hunter2@db/x",
                        "PGFLOW_SECRET_KEY": "k" * 32, "PGPASSWORD": "hunter2",
                        "PGSERVICE": "prod", "PGCONNECT_TIMEOUT": "3",
                        "ETL_REGION": "eu"}.items():
        monkeypatch.setenv(name, value)
    result = run(["env"], attempt=2, params={"a": 1})
    seen = dict(line.split("=", 1) for line in str(result.stdout_tail).splitlines()
                if "=" in line)
    assert sorted(k for k in seen if k.startswith("PG")) == [
        "PGFLOW_ATTEMPT", "PGFLOW_CONTROL", "PGFLOW_JOB", "PGFLOW_LOGICAL_TIME",
        "PGFLOW_PARAMS", "PGFLOW_RUN_ID"]
    assert seen["PGFLOW_CONTROL"] == "/dev/fd/3"  # the control pipe (pgflow.live)
    assert (seen["PGFLOW_RUN_ID"], seen["PGFLOW_JOB"], seen["PGFLOW_ATTEMPT"]) == \
        ("7", "cmd", "2")
    assert seen["PGFLOW_LOGICAL_TIME"] == "2030-01-02T03:04:00+00:00"
    assert json.loads(seen["PGFLOW_PARAMS"]) == {"a": 1}
    assert seen["ETL_REGION"] == "eu" and seen["PATH"] == os.environ["PATH"]
    assert "hunter2" not in str(result.stdout_tail)


def test_libpq_variables_are_pinned_into_the_url_the_url_winning() -> None:
    from psycopg import conninfo

    url = environment.pin_libpq("postgresql://u@/db?host=/run/pg", {
        "PGPASSWORD": "p&w d", "PGSSLMODE": "disable", "PGDATABASE": "other",
        "PGHOST": "elsewhere", "OTHER": "x"})
    assert conninfo.conninfo_to_dict(url) == {
        "user": "u", "dbname": "db", "host": "/run/pg", "password": "p&w d",
        "sslmode": "disable"}
    assert environment.pin_libpq("postgresql://u@/db", {"OTHER": "x"}) == "postgresql://u@/db"
    environ = {"PGFLOW_HOME": "/h", "PGPASSWORD": "x", "PGSERVICEFILE": "/s", "HOME": "/"}
    assert environment.scrub(environ) == ["PGFLOW_HOME", "PGPASSWORD"]
    assert environ == {"PGSERVICEFILE": "/s", "HOME": "/"}  # libpq has no keyword for it


# ---------------------------------------------------------------- lease deadline (defect 10)


def test_the_supervisor_kills_a_command_whose_lease_deadline_passes(tmp_path: Path) -> None:
    pgid_file = tmp_path / "pgid"
    script = f"{save_pid(pgid_file)}; sleep 300 & wait"
    result = run(["/bin/sh", "-c", script], deadline=time.monotonic() + 1.0)
    assert result.outcome == LOST
    assert "lease deadline passed" in str(result.error)
    pgid = pid_in(pgid_file)
    assert pgid is not None
    wait_for(lambda: group_gone(pgid), timeout=5)


def test_extend_keeps_a_command_alive_past_its_first_deadline(tmp_path: Path) -> None:
    go = tmp_path / "go"
    script = f"while [ ! -e {go} ]; do sleep 0.05; done; echo done"

    async def body() -> AttemptResult:
        first = time.monotonic() + 1.0
        attempt = execution(["/bin/sh", "-c", script], deadline=first)
        task = asyncio.create_task(attempt.run())
        # Renew like a worker does (every ttl/3) until well past the first deadline.
        while time.monotonic() < first + 1.5:
            attempt.extend(time.monotonic() + 1.0)
            await asyncio.sleep(0.3)
        assert not task.done()
        go.touch()
        return await task

    result = in_loop(body)
    assert (result.outcome, result.stdout_tail) == (SUCCEEDED, "done\n")


# ---------------------------------------------------------------- a dead supervisor


def test_a_dead_supervisor_fails_its_attempts_kills_their_groups_and_is_replaced(
        tmp_path: Path) -> None:
    pgid_file, child_file = tmp_path / "pgid", tmp_path / "child"
    script = f"{save_pid(pgid_file)}; sleep 300 & {save_pid(child_file, '$!')}; wait"

    async def body() -> tuple[AttemptResult, AttemptResult, int, int]:
        attempt = execution(["/bin/sh", "-c", script])
        task = asyncio.create_task(attempt.run())
        await until(lambda: pid_in(child_file))
        old = supervisor.for_loop().pid
        os.kill(old, signal.SIGKILL)
        failed = await task
        after = await execution(["/bin/sh", "-c", "echo again"]).run()
        return failed, after, old, supervisor.for_loop().pid

    failed, after, old, new = in_loop(body)
    assert failed.outcome == FAILED
    assert f"the command supervisor (pid {old}) died (killed by SIGKILL)" in str(failed.error)
    pgid, child = pid_in(pgid_file), pid_in(child_file)
    assert pgid is not None and child is not None
    wait_for(lambda: group_gone(pgid) and process_gone(child), timeout=5)
    assert (after.outcome, after.stdout_tail) == (SUCCEEDED, "again\n")
    assert new != old


# ---------------------------------------------------------------- real replicas


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_kill9_of_a_replica_its_supervisor_kills_the_commands_and_exits(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    pgid_file, child_file = tmp_path / "pgid", tmp_path / "child"
    script = f"{save_pid(pgid_file)}; sleep 300 & {save_pid(child_file, '$!')}; wait"
    add_job(conn, "forks", command=["/bin/sh", "-c", script])
    replica = replicas.start("a")
    replica.id(conn)
    trigger(db_url, tmp_path, "forks")
    pgid, child = read_pid(pgid_file), read_pid(child_file)
    watcher = parent_of(pgid)
    assert watcher != replica.pid and parent_of(watcher) == replica.pid  # the supervisor
    replica.kill9()
    wait_for(lambda: group_gone(pgid) and process_gone(child), timeout=5)
    wait_for(lambda: process_gone(watcher), timeout=5)


@pytest.mark.parametrize("freeze", ["replica", "its process group"])
def test_a_frozen_replica_command_dies_at_its_lease_deadline_before_the_retry(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas, freeze: str) -> None:
    pid_file, child_file = tmp_path / "pid1", tmp_path / "child1"
    # Attempt 1 runs until killed; attempt 2 reports whether any process of attempt 1
    # is still alive while it runs. A zombie is dead: `kill -0` would count it, and an
    # orphan's zombie waits for pid 1, which may be slow to reap on a loaded machine.
    alive = "alive() { [ -r /proc/$1/status ] && ! grep -q '^State:.*[ZX]' /proc/$1/status; };"
    script = (f'{alive} if [ "$PGFLOW_ATTEMPT" = 1 ]; then {save_pid(pid_file)};'
              f" sleep 300 & {save_pid(child_file, '$!')}; wait; fi;"
              f' if alive "$(cat {pid_file})" || alive "$(cat {child_file})";'
              " then echo overlap; else echo alone; fi")
    add_job(conn, "frozen", command=["/bin/sh", "-c", script], retry=FAST_RETRY)
    first = replicas.start("a")
    first.id(conn)
    run_id = trigger(db_url, tmp_path, "frozen")
    pid, child = read_pid(pid_file), read_pid(child_file)
    watcher = parent_of(pid)
    second = replicas.start("b")
    second.id(conn)

    if freeze == "replica":
        first.stop_signal()
    else:  # `kill -STOP -<pgid>`: the supervisor has a session of its own
        os.killpg(first.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(first.pid) in ("T", "t"), timeout=5)
    seen: dict[str, datetime] = {}

    def attempt_1_dead() -> bool:
        gone = process_gone(pid) and process_gone(child)
        # Read after the check: both processes died before `now`.
        row = conn.execute("SELECT attempt, lease_expires_at, clock_timestamp() AS now"
                           " FROM pgflow.runs WHERE id = %s", (run_id,)).fetchone()
        assert row is not None
        if row["attempt"] == 1:  # a frozen replica renews no more: its last expiry
            seen["expiry"] = row["lease_expires_at"]
        if gone:
            seen["dead_by"] = row["now"]
        return gone

    wait_for(attempt_1_dead, timeout=20, interval=0.01)
    lease_expired_at, observed_dead_by = seen["expiry"], seen["dead_by"]
    assert process_state(watcher) not in ("T", "t", None)  # it ran while the replica froze
    # The command was dead before the lease it held could have expired in the database...
    assert observed_dead_by <= lease_expired_at, (observed_dead_by, lease_expired_at)
    done = wait_state(conn, run_id, "succeeded", "failed", timeout=30)
    assert done["state"] == "succeeded" and done["attempt"] == 2
    tried = attempts(conn, run_id)
    # ...so the retry on the other replica ran alone.
    assert tried[1]["stdout_tail"] == "alone\n"
    assert tried[1]["started_at"] > lease_expired_at


def test_jobs_never_see_pgflow_or_libpq_secrets(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    password, key, libpq_password = "Secr3tPw", "session-key-" + "s" * 24, "An0therPw"
    parts = urlsplit(db_url)
    database = parts.path.lstrip("/")
    # The password in the URL; the database only in PGDATABASE, which libpq reads at every
    # connect: the replica works only if it kept that value after scrubbing it.
    url = urlunsplit(parts._replace(netloc=f"{parts.netloc}:{password}", path="/"))
    assert "@" in url.split("?")[0]
    dump = tmp_path / "python-env.json"
    add_job(conn, "shell", command=["env"])
    add_job(conn, "python", entrypoint="envdump:dump", params={"path": str(dump)})
    port = free_port()
    replica = replicas.start("a", roles=("scheduler", "worker", "reaper", "web"), env={
        "PGFLOW_DATABASE_URL": url, "PGFLOW_SECRET_KEY": key, "PGPASSWORD": libpq_password,
        "PGDATABASE": database, "PGFLOW_BIND": f"127.0.0.1:{port}"})
    replica.id(conn)
    replica.wait_log("web role serving")
    runs = [trigger(db_url, tmp_path, "shell"), trigger(db_url, tmp_path, "python")]
    for run_id in runs:
        assert wait_state(conn, run_id, "succeeded", "failed")["state"] == "succeeded"
    command_env = str(attempts(conn, runs[0])[0]["stdout_tail"])
    python_env = dump.read_text()
    replica_env = Path(f"/proc/{replica.pid}/environ").read_bytes().decode(errors="replace")
    for seen in (command_env, python_env, replica_env):
        for secret in (password, key, libpq_password):
            assert secret not in seen
    assert "PGFLOW_RUN_ID=" in command_env and "PGDATABASE" not in command_env
    python_names = json.loads(python_env)
    assert not [k for k in python_names if k.startswith("PGFLOW_") or k in
                ("PGPASSWORD", "PGDATABASE")]
    # The web role signs sessions with PGFLOW_SECRET_KEY, read before the scrub (else it
    # would have made $PGFLOW_HOME/secret).
    assert not (tmp_path / "secret").exists()
    assert run_state(conn, runs[1])["state"] == "succeeded"
