"""The wheel carries the top-level sql/ folder and runs outside the work tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_no_sql_file_lives_under_the_package() -> None:
    assert sorted(ROOT.joinpath("pgflow").rglob("*.sql")) == []
    assert sorted(p.name for p in ROOT.joinpath("sql", "migrations").glob("*.sql"))
    assert sorted(p.name for p in ROOT.joinpath("sql", "queries").glob("*.sql"))


def test_every_package_folder_is_listed_in_pyproject() -> None:
    config = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in ROOT.joinpath("pgflow").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert on_disk | {"pgflow.sql"} == set(config["packages"])
    assert config["package-dir"] == {"pgflow.sql": "sql"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools reuses build/lib: a migration renamed since the last build would ship twice.
    shutil.rmtree(ROOT / "build" / "lib", ignore_errors=True)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=240)
    if built.returncode != 0:
        pytest.fail(f"pip wheel failed: {built.stderr[-2000:]}")
    (found,) = out.glob("pgflow-*.whl")
    return found


def test_wheel_contains_every_migration_query_and_template(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for sub in ("migrations", "queries"):
        for sql_file in ROOT.joinpath("sql", sub).glob("*.sql"):
            assert f"pgflow/sql/{sub}/{sql_file.name}" in names
    assert any(n.startswith("pgflow/web/templates/") for n in names)
    assert "pgflow/cli/__init__.py" in names and "pgflow/embedded/__init__.py" in names


def test_installed_wheel_applies_every_migration(wheel: Path, tmp_path: Path,
                                                 empty_db_url: str) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(target), "PGFLOW_DATABASE_URL": empty_db_url}

    def pgflow(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "pgflow", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    where = subprocess.run([sys.executable, "-c", "import pgflow.sql; print(pgflow.sql.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(target))
    before = json.loads(pgflow("db", "status", "--json"))
    assert before["pending"] == len(before["migrations"]) > 0
    pgflow("db", "migrate")
    after = json.loads(pgflow("db", "status", "--json"))
    assert after["pending"] == 0
    assert [m["version"] for m in after["migrations"]] == [m["version"]
                                                           for m in before["migrations"]]
