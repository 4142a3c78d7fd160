"""Long runs (SPEC §4e): live output, progress, checkpoints, re-runs, reprocessing.

Real ``pgflow serve`` replicas (tests/procs.py) and the real PostgreSQL of the suite;
every wait is on a condition (no timing thresholds).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from engine import add_job, attempts, enqueue, wait_for
from procs import ROOT, TTL, Replicas, child_env, pgflow, read_pid, run_state, wait_state

from pgflow import live, queue
from pgflow.db import connect_async
from pgflow.errors import Conflict
from pgflow.rerun import rerun

Conn = psycopg.Connection[dict[str, Any]]

FAST_RETRY = {"max_attempts": 3, "backoff": 0.1, "max_backoff": 0.1, "jitter": False}


@pytest.fixture
def replicas(db_url: str, tmp_path: Path) -> Iterator[Replicas]:
    started = Replicas(db_url, tmp_path)
    yield started
    started.close()


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


def trigger(url: str, workdir: Path, job: str, *args: str) -> int:
    return int(pgflow(url, workdir, "trigger", job, *args).stdout.strip())


def logs(url: str, workdir: Path, run_id: int, *args: str) -> str:
    return pgflow(url, workdir, "runs", "logs", str(run_id), *args).stdout


def chattering(go: Path) -> list[str]:
    """A command printing a numbered line every 0.2 s until ``go`` exists."""
    return sh(f'i=0; while [ ! -e {go} ]; do i=$((i+1)); echo "line $i"; sleep 0.2; done;'
              ' echo "all done"; echo "to stderr" >&2')


# ---------------------------------------------------------------- live output


def test_output_is_visible_while_the_command_runs_and_follow_ends_with_it(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    go = tmp_path / "go"
    add_job(conn, "chatty", command=chattering(go))
    replicas.start("a").id(conn)
    run_id = trigger(db_url, tmp_path, "chatty")

    seen = wait_for(lambda: "line 1\n" in (out := logs(db_url, tmp_path, run_id)) and out,
                    timeout=20)
    assert run_state(conn, run_id)["state"] == "running"  # visible before it ended
    assert seen.startswith("line 1\n")

    follow = subprocess.Popen([sys.executable, "-m", "pgflow", "runs", "logs", str(run_id),
                               "--follow"], cwd=ROOT, env=child_env(db_url, tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        go.touch()
        out, err = follow.communicate(timeout=30)  # ends by itself once the attempt ends
    finally:
        follow.kill()
    assert follow.returncode == 0, err
    assert out.startswith("line 1\nline 2\n")
    assert "all done\n" in out and "to stderr\n" in out
    assert wait_state(conn, run_id, "succeeded")["state"] == "succeeded"
    # The whole output is there after the end too, with the attempt number.
    assert logs(db_url, tmp_path, run_id, "--attempt", "1") == out
    tail = attempts(conn, run_id)[0]["stdout_tail"]
    assert tail.startswith("line 1\n") and tail.endswith("all done\n")


def test_short_commands_keep_their_output_in_the_tails_only(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    add_job(conn, "quick", command=sh("echo out; echo err >&2"))
    replicas.start("a").id(conn)
    run_id = trigger(db_url, tmp_path, "quick")
    wait_state(conn, run_id, "succeeded")
    assert logs(db_url, tmp_path, run_id) == "out\nerr\n"
    bad = pgflow(db_url, tmp_path, "runs", "logs", str(run_id), "--attempt", "2", check=False)
    assert bad.returncode != 0 and "no attempt 2" in bad.stderr
    assert "Traceback" not in bad.stderr
