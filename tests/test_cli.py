import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pgflow.cli import run

PIPELINE = Path(__file__).parent.parent / "examples" / "etl" / "pipeline.toml"


@pytest.fixture
def cli(db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PGFLOW_DATABASE_URL", db_url)

    def invoke(*args: str) -> tuple[int, str, str]:
        code = run(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def write(tmp_path: Path, text: str, name: str = "jobs.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_apply_and_list_the_example_pipeline(cli) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = cli("apply", str(PIPELINE))
    assert code == 0 and out.strip() == "created 6, updated 0, unchanged 0"
    code, out, _ = cli("apply", str(PIPELINE))
    assert out.strip() == "created 0, updated 0, unchanged 6"
    code, out, _ = cli("jobs", "list", "--json")
    jobs = json.loads(out)
    assert [j["name"] for j in jobs] == ["archive_orders", "check_orders", "extract_orders",
                                          "load_orders", "report_sales", "transform_orders"]
    assert jobs[2]["schedule"] == "* * * * *" and jobs[2]["next_fire_at"]
    code, out, _ = cli("jobs", "list")
    assert out.splitlines()[0].split()[:3] == ["NAME", "TENANT", "SCHEDULE"]


def test_show_pause_resume_delete(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cli("apply", write(tmp_path, "[jobs.solo]\nschedule = '@daily'\ncommand = 'true'\n"))
    assert cli("jobs", "pause", "solo")[:2] == (0, "solo paused\n")
    code, out, _ = cli("jobs", "show", "solo", "--json")
    shown = json.loads(out)
    assert shown["paused"] is True and shown["definition"]["schedule"] == "@daily"
    assert cli("jobs", "resume", "solo")[1] == "solo resumed\n"
    assert cli("jobs", "delete", "solo")[1] == "solo deleted\n"
    code, _, err = cli("jobs", "show", "solo")
    assert code == 1 and err == "error: no job named 'solo' (see 'pgflow jobs list')\n"


def test_invalid_file_names_every_job_and_key_and_applies_nothing(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = write(tmp_path, """
[jobs.ok]
schedule = "0 * * * *"
command = "true"

[jobs.bad_cron]
schedule = "99 * * * *"
command = "true"

[jobs.typo]
command = "true"
schedle = "0 * * * *"

[jobs.orphan]
depends_on = ["nowhere"]
command = "true"

[jobs.loop_a]
depends_on = ["loop_b"]
command = "true"

[jobs.loop_b]
depends_on = ["loop_a"]
command = "true"

[jobs.dep_sched]
depends_on = ["ok"]
schedule = "0 * * * *"
command = "true"
""")
    code, out, err = cli("apply", path)
    assert code == 1 and out == ""
    assert "Traceback" not in err
    for fragment in ("job 'bad_cron': schedule:", "job 'typo': schedle: unknown key, did you mean"
                     " 'schedule'?", "job 'orphan': depends_on: unknown upstream job 'nowhere'",
                     "dependency cycle: loop_", "job 'dep_sched': schedule:"):
        assert fragment in err, (fragment, err)
    assert json.loads(cli("jobs", "list", "--json")[1]) == []


def test_broken_toml_is_one_line(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli("apply", write(tmp_path, "[jobs.x\ncommand='y'"))
    assert code == 1 and err.count("\n") == 1 and "invalid TOML" in err


def test_prune(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cli("apply", write(tmp_path, "[jobs.a]\ncommand='true'\n[jobs.b]\ncommand='true'\n"))
    _code, out, _ = cli("apply", "--prune", write(tmp_path, "[jobs.a]\ncommand='true'\n", "a.toml"))
    assert out.strip() == "created 0, updated 0, unchanged 1, pruned 1"


def test_db_status_json(cli) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = cli("db", "status", "--json")
    status = json.loads(out)
    assert code == 0 and status["pending"] == 0 and status["migrations"][0]["version"] == 1
    assert cli("db", "migrate")[1] == "schema is up to date\n"


def test_db_stop_with_external_url_is_refused(cli) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli("db", "stop")
    assert code == 1 and "only stops the embedded database" in err


def test_usage_errors_are_one_line(cli) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli("jobs", "frobnicate")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGFLOW_")}
    env.update(extra)
    return env


def test_unreachable_database_is_one_line_without_traceback(tmp_path: Path) -> None:
    env = subprocess_env(PGFLOW_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none")
    done = subprocess.run([sys.executable, "-m", "pgflow", "jobs", "list"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("error: cannot connect to postgresql://nobody@127.0.0.1:1/none")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_invalid_setting_is_one_line(tmp_path: Path) -> None:
    # A command checks the settings it uses: `status` reads the lease TTL (`jobs list`,
    # which only connects, does not load it; tests/test_cli_startup.py).
    env = subprocess_env(PGFLOW_LEASE_TTL="forever", PGFLOW_DATABASE_URL="postgresql://x@/y")
    done = subprocess.run([sys.executable, "-m", "pgflow", "status"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("error: invalid setting PGFLOW_LEASE_TTL='forever'")


def test_registration_errors_are_one_line(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli("apply", write(tmp_path, "[jobs.a]\nschedule='x'\ncommand='true'\n"
                                                "[jobs.b]\ndepends_on=['zz']\ncommand='true'\n"))
    assert code == 1 and err.count("\n") == 1
    assert "job 'a': schedule:" in err and "job 'b': depends_on:" in err
