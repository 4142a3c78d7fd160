"""`make dist`: dist/pgflow, one executable file that needs only a Python >= 3.11.

The file is built once for the module (make skips it while it is newer than the
sources) and run from another folder by interpreters that know nothing of the
project's virtualenv: ``python3 -I`` with a bare environment, and the file's own
``#!/usr/bin/env python3``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from procs import until
from psycopg.rows import dict_row

ROOT = Path(__file__).resolve().parent.parent
DIST = ROOT / "dist" / "pgflow"
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


@pytest.fixture(scope="module")
def executable() -> Path:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done = subprocess.run(["make", "dist"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        if "pex" in tail and ("No matching distribution" in tail or "Could not" in tail):
            pytest.skip(f"the build tool (pex) cannot be installed here: {tail}")
        raise AssertionError(f"make dist failed:\n{done.stdout}\n{done.stderr}")
    assert DIST.is_file() and os.access(DIST, os.X_OK)
    return DIST


@pytest.fixture
def elsewhere(tmp_path: Path) -> Iterator[Path]:
    """A folder outside the repository, with a home of its own."""
    (tmp_path / "home").mkdir()
    yield tmp_path


def bare_env(home: Path, **extra: str) -> dict[str, str]:
    """No virtualenv on PATH, no PYTHONPATH, no PGFLOW_* but what is given."""
    return {"PATH": SYSTEM_PATH, "HOME": str(home), "LANG": "C.UTF-8", **extra}


def system_python() -> str:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("no system python3 outside the virtualenv")


def run(executable: Path, where: Path, *args: str, env: dict[str, str],
        python: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    argv = [python, "-I", str(executable), *args] if python else [str(executable), *args]
    return subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True,
                          timeout=timeout)


def interpreters() -> list[str]:
    """Every CPython >= 3.11 this machine has outside the virtualenv (pyenv's included)."""
    found = [system_python()]
    pyenv = Path.home() / ".pyenv" / "versions"
    for version in sorted(pyenv.glob("3.1[1-9]*")) if pyenv.is_dir() else []:
        python = version / "bin" / "python3"
        if python.exists() and str(python) not in found:
            found.append(str(python))
    return found


def test_help_runs_on_every_python_from_another_folder(executable: Path,
                                                       elsewhere: Path) -> None:
    for python in interpreters():
        done = run(executable, elsewhere, "--help", env=bare_env(elsewhere / "home"),
                   python=python)
        assert done.returncode == 0, f"{python}: {done.stderr}"
        assert "Usage: pgflow" in done.stdout
    # and through its own shebang
    done = run(executable, elsewhere, "serve", "--help", env=bare_env(elsewhere / "home"))
    assert done.returncode == 0, done.stderr
    assert "--health-bind" in done.stdout


def test_migrations_load_from_inside_the_file(executable: Path, elsewhere: Path,
                                             empty_db_url: str) -> None:
    env = bare_env(elsewhere / "home", PGFLOW_DATABASE_URL=empty_db_url)
    python = system_python()
    done = run(executable, elsewhere, "db", "migrate", env=env, python=python)
    assert done.returncode == 0, done.stderr
    done = run(executable, elsewhere, "db", "status", "--json", env=env, python=python)
    assert done.returncode == 0, done.stderr
    # The file was built from this tree: it carries exactly its migrations.
    shipped = sorted(p.stem for p in (ROOT / "sql" / "migrations").glob("*.sql"))
    migrations = json.loads(done.stdout)["migrations"]
    assert sorted(f"{m['version']:04d}_{m['name']}" for m in migrations) == shipped
    assert {m["state"] for m in migrations} == {"applied"}
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute("SELECT * FROM pgflow.worker_demand").fetchone() is not None


def test_a_worker_claims_and_finishes_a_triggered_run(executable: Path, elsewhere: Path,
                                                     db_url: str) -> None:
    marker = elsewhere / "ran"
    (elsewhere / "jobs.toml").write_text(
        "[jobs.hello]\n"
        f'command = ["/bin/sh", "-c", "echo $PGFLOW_RUN_ID > {marker}"]\n')
    env = bare_env(elsewhere / "home", PGFLOW_DATABASE_URL=db_url)
    python = system_python()
    done = run(executable, elsewhere, "apply", "jobs.toml", env=env, python=python)
    assert done.returncode == 0, done.stderr
    done = run(executable, elsewhere, "trigger", "hello", env=env, python=python)
    assert done.returncode == 0, done.stderr
    run_id = int(done.stdout.strip().split()[-1])
    log = (elsewhere / "serve.log").open("wb")
    serve = subprocess.Popen([python, "-I", str(executable), "serve", "--role", "worker",
                              "--concurrency", "2", "--log-format", "json"],
                             cwd=elsewhere, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as conn:
            def finished() -> str | None:
                assert serve.poll() is None, (elsewhere / "serve.log").read_text()
                row = conn.execute("SELECT state FROM pgflow.runs WHERE id = %s",
                                   (run_id,)).fetchone()
                assert row is not None
                return row["state"] if row["state"] in ("succeeded", "failed") else None
            assert until(finished, timeout=60) == "succeeded"
        assert marker.read_text().strip() == str(run_id)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0, (elsewhere / "serve.log").read_text()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(10)
        log.close()


def test_the_embedded_default_where_postgresql_binaries_exist(executable: Path,
                                                              elsewhere: Path) -> None:
    from pgflow.embedded.binaries import PostgresNotFound, find_bindir

    try:
        find_bindir()
    except PostgresNotFound:
        pytest.skip("no PostgreSQL server binaries here")
    home = elsewhere / "pgflow-home"
    env = bare_env(elsewhere / "home", PGFLOW_HOME=str(home))
    python = system_python()
    try:
        done = run(executable, elsewhere, "db", "status", "--json", env=env, python=python)
        assert done.returncode == 0, done.stderr
        assert "embedded PostgreSQL" in done.stderr
        assert json.loads(done.stdout)
    finally:
        run(executable, elsewhere, "db", "stop", env=env, python=python)
