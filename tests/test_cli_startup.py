"""The command line imports only what a command needs (pgflow/cli/_lazy.py): the root
help lists every command group from the table without importing any of them, the table's
short help matches each command's docstring, and ``import pgflow`` stays light while its
public names still resolve."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

import pgflow
from pgflow.cli import COMMANDS, cli, run
from pgflow.cli._lazy import resolve

HEAVY = ("pydantic", "pydantic_settings", "psycopg", "structlog", "starlette", "croniter",
         "pgflow.registry", "pgflow.spec")


def _modules_after(code: str, *env: tuple[str, str]) -> tuple[list[str], str]:
    """Which heavy modules a fresh interpreter has loaded after running ``code``."""
    probe = (f"import sys\n{code}\n"
             f"print('MODULES=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, env={**_base_env(), **dict(env)})
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("MODULES="))
    loaded = line.removeprefix("MODULES=")
    return (loaded.split(",") if loaded else []), done.stdout


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PGFLOW_")}


def test_root_help_lists_every_command_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--help"]) == 0
    listed = capsys.readouterr().out.split("Commands:", 1)[1]
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    assert names == sorted(COMMANDS)
    for name in COMMANDS:
        assert cli.get_command(click.Context(cli), name) is not None


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_table_short_help_is_the_commands_own(name: str) -> None:
    command = resolve(COMMANDS[name].target)
    assert command.name == name
    assert COMMANDS[name].short_help == command.get_short_help_str(limit=10_000)


def test_root_help_imports_no_command_module() -> None:
    loaded, out = _modules_after(
        "from pgflow.cli import run\nrun(['--help'])")
    assert loaded == []
    assert "trigger" in out and "Create a manual run of job NAME" in out


def test_import_pgflow_is_light_and_its_names_resolve() -> None:
    loaded, _ = _modules_after("import pgflow")
    assert loaded == []
    assert pgflow.PermanentError.__module__ == "pgflow.context"
    assert pgflow.Flow.__name__ == "Flow"
    assert {"Context", "Flow", "JobSpec", "PermanentError", "RetryPolicy",
            "SourceUnavailable"} <= set(dir(pgflow))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        pgflow.nothing  # noqa: B018


def test_subgroup_help_lists_its_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["jobs", "--help"]) == 0
    out = capsys.readouterr().out
    for sub in ("list", "show", "pause", "resume", "delete"):
        assert f"  {sub} " in out


def test_unknown_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: No such command 'nope'") and err.count("\n") == 1


def test_jobs_list_reads_through_libpq_without_psycopg_or_the_registry(db_url: str) -> None:
    loaded, out = _modules_after(
        "from pgflow.cli import run\nrun(['jobs', 'list', '--json'])",
        ("PGFLOW_DATABASE_URL", db_url))
    assert json.loads(out.split("MODULES=")[0]) == []
    assert loaded == []  # pgflow/libpq.py: psycopg's import was most of the command's time


def test_bad_database_url_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--database-url", "mysql://x", "jobs", "list"]) == 1
    err = capsys.readouterr().err
    assert err == ("error: invalid setting flag --database-url='mysql://x': expected a URL"
                   " starting with postgresql://\n")
