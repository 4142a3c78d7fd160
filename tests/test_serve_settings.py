"""``pgflow serve`` takes its settings from the environment like from its flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from procs import ROOT, Conn, child_env, scalar, until


def serve(url: str, tmp_path: Path, *args: str, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "pgflow", "serve", "--role", "worker", *args],
                            cwd=ROOT, env={**child_env(url, tmp_path), **env},
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(10)


def test_pgflow_concurrency_sizes_the_replica(db_url: str, conn: Conn, tmp_path: Path) -> None:
    proc = serve(db_url, tmp_path, PGFLOW_CONCURRENCY="3")
    try:
        assert until(lambda: scalar(conn, "SELECT concurrency FROM pgflow.replicas")) == 3
    finally:
        stop(proc)
    proc = serve(db_url, tmp_path, "--concurrency", "5", PGFLOW_CONCURRENCY="3")
    try:
        until(lambda: scalar(conn, "SELECT 1 FROM pgflow.replicas WHERE concurrency = 5"))
    finally:
        stop(proc)


@pytest.mark.parametrize(("args", "env", "message"), [
    ((), {"PGFLOW_CONCURRENCY": "0"}, "error: invalid setting PGFLOW_CONCURRENCY='0'"),
    (("--concurrency", "lots"), {}, "error: invalid setting flag --concurrency='lots'"),
    ((), {"PGFLOW_LEASE_TTL": "1"},
     "error: invalid setting PGFLOW_LEASE_TTL='1': must be longer than the leader's 1 s"),
    ((), {"PGFLOW_LOG_FORMAT": "xml"}, "error: invalid setting PGFLOW_LOG_FORMAT='xml'"),
])
def test_bad_serve_settings_are_one_line(db_url: str, tmp_path: Path, args: tuple[str, ...],
                                         env: dict[str, str], message: str) -> None:
    proc = serve(db_url, tmp_path, *args, **env)
    _, err = proc.communicate(timeout=60)
    text = err.decode()
    assert proc.returncode != 0 and text.startswith(message), text
    assert text.count("\n") == 1 and "Traceback" not in text
