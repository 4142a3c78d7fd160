from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgflow import registry
from pgflow.errors import Conflict, NotFound, PgflowError
from pgflow.registry import RegistrationError
from pgflow.spec import JobSpec

Conn = psycopg.Connection[dict[str, Any]]


def spec(name: str, **keys: Any) -> JobSpec:
    keys.setdefault("command", "true")
    return JobSpec.model_validate({"name": name, **keys})


def job_names(conn: Conn) -> list[str]:
    return [r["name"] for r in conn.execute("SELECT name FROM pgflow.jobs ORDER BY name")]


def test_apply_reports_created_updated_unchanged(conn: Conn) -> None:
    first = registry.apply(conn, [spec("a", schedule="0 * * * *"), spec("b", depends_on=["a"])])
    assert (first.created, first.updated, first.unchanged) == (["a", "b"], [], [])
    again = registry.apply(conn, [spec("a", schedule="0 * * * *"), spec("b", depends_on=["a"])])
    assert again.unchanged == ["a", "b"]
    changed = registry.apply(conn, [spec("a", schedule="0 * * * *", priority=5)])
    assert changed.updated == ["a"]
    deps = conn.execute("SELECT job, upstream FROM pgflow.job_deps").fetchall()
    assert deps == [{"job": "b", "upstream": "a"}]


def test_next_fire_at_is_computed_in_the_jobs_timezone(conn: Conn) -> None:
    registry.apply(conn, [spec("berlin", schedule="0 9 * * *", timezone="Europe/Berlin")])
    row = conn.execute("SELECT next_fire_at, now() AS now FROM pgflow.jobs").fetchone()
    assert row is not None
    fire = row["next_fire_at"].astimezone(UTC)
    assert fire > row["now"]
    assert fire.hour in (7, 8) and fire.minute == 0  # 09:00 CEST or CET


def test_unchanged_schedule_keeps_its_persisted_fire_time(conn: Conn) -> None:
    registry.apply(conn, [spec("a", schedule="0 0 1 1 *")])
    pinned = datetime(2020, 1, 1, tzinfo=UTC)
    conn.execute("UPDATE pgflow.jobs SET next_fire_at = %s", (pinned,))
    registry.apply(conn, [spec("a", schedule="0 0 1 1 *", priority=1)])
    assert conn.execute("SELECT next_fire_at FROM pgflow.jobs").fetchone() == {
        "next_fire_at": pinned}
    registry.apply(conn, [spec("a", schedule="0 0 2 1 *", priority=1)])
    row = conn.execute("SELECT next_fire_at FROM pgflow.jobs").fetchone()
    assert row is not None and row["next_fire_at"] > pinned


def test_a_bad_job_applies_nothing_and_every_problem_is_named(conn: Conn) -> None:
    registry.apply(conn, [spec("existing", schedule="0 * * * *")])
    with pytest.raises(RegistrationError) as info:
        registry.apply(conn, [
            spec("good", schedule="0 * * * *"),
            spec("orphan", depends_on=["missing"]),
            spec("other_root", schedule="*/5 * * * *"),
            spec("mixed", depends_on=["existing", "other_root"]),
        ])
    message = str(info.value)
    assert "nothing applied" in message
    assert "job 'orphan': depends_on: unknown upstream job 'missing'" in message
    assert "job 'mixed': depends_on: upstream roots have different schedules" in message
    assert job_names(conn) == ["existing"]


def test_cycle_through_existing_jobs_is_found_and_named(conn: Conn) -> None:
    registry.apply(conn, [spec("a", schedule="0 * * * *"), spec("b", depends_on=["a"]),
                          spec("c", depends_on=["b"])])
    with pytest.raises(RegistrationError) as info:
        registry.apply(conn, [spec("a", depends_on=["c"])])
    [error] = info.value.errors
    assert error.key == "depends_on"
    assert "dependency cycle:" in error.reason
    assert all(name in error.reason for name in ("a", "b", "c"))
    row = conn.execute("SELECT schedule FROM pgflow.jobs WHERE name = 'a'").fetchone()
    assert row == {"schedule": "0 * * * *"}


def test_prune_removes_jobs_not_defined_and_keeps_their_runs(conn: Conn) -> None:
    registry.apply(conn, [spec("keep"), spec("drop")])
    conn.execute("INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger,"
                 " tenant, finished_at) VALUES ('drop', now(), 'succeeded', 1, 'manual',"
                 " 'default', now())")
    result = registry.apply(conn, [spec("keep")], prune=True)
    assert result.pruned == ["drop"]
    assert job_names(conn) == ["keep"]
    assert conn.execute("SELECT count(*) AS n FROM pgflow.runs").fetchone() == {"n": 1}


def test_prune_refuses_to_strand_a_dependent(conn: Conn) -> None:
    registry.apply(conn, [spec("up", schedule="@daily"), spec("down", depends_on=["up"])])
    with pytest.raises(RegistrationError, match="depends on 'up', which this change removes"):
        registry.apply(conn, [spec("down", depends_on=["up"])], prune=True)
    assert job_names(conn) == ["down", "up"]


def test_delete_refuses_while_downstreams_exist(conn: Conn) -> None:
    registry.apply(conn, [spec("up", schedule="@daily"), spec("down", depends_on=["up"])])
    with pytest.raises(Conflict, match="down"):
        registry.delete(conn, "up")
    registry.delete(conn, "down")
    registry.delete(conn, "up")
    assert job_names(conn) == []
    with pytest.raises(NotFound):
        registry.delete(conn, "up")


def test_delete_cancels_unstarted_runs(conn: Conn) -> None:
    registry.apply(conn, [spec("j")])
    conn.execute("INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant)"
                 " VALUES ('j', now(), 'queued', 1, 'manual', 'default')")
    registry.delete(conn, "j")
    assert conn.execute("SELECT state FROM pgflow.runs").fetchone() == {"state": "cancelled"}


def test_toml_loading_names_file_problems(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[jobs.a\ncommand = 'x'\n")
    with pytest.raises(PgflowError, match=r"broken.toml: invalid TOML"):
        registry.load_sources([str(broken)])
    stray = tmp_path / "stray.toml"
    stray.write_text("[job.a]\ncommand = 'x'\n")
    with pytest.raises(PgflowError, match="unknown top-level key"):
        registry.load_sources([str(stray)])
    with pytest.raises(PgflowError, match="cannot read"):
        registry.load_sources([str(tmp_path / "missing.toml")])


def test_same_job_in_two_files_is_an_error(tmp_path: Path) -> None:
    for name in ("one.toml", "two.toml"):
        (tmp_path / name).write_text("[jobs.same]\ncommand = 'x'\n")
    loaded = registry.load_sources([str(tmp_path)])
    assert [e.reason for e in loaded.errors] == [
        f"defined twice ({tmp_path / 'one.toml'} and {tmp_path / 'two.toml'})"]


def test_module_attr_source_uses_the_same_model(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "myflow.py").write_text(
        "import pgflow\n"
        "flow = pgflow.Flow()\n"
        "@flow.job(schedule='@hourly', retry={'max_attempts': 2})\n"
        "def extract(ctx):\n    return None\n"
        "flow.add('load', command=['true'], depends_on=['extract'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    specs = registry.load_sources(["myflow:flow"]).specs
    assert [(s.name, s.entrypoint) for s in specs] == [("extract", "myflow:extract"),
                                                        ("load", None)]
    with pytest.raises(PgflowError, match="cannot load"):
        registry.load_sources(["myflow:nope"])


def test_ten_thousand_jobs_with_dependencies(conn: Conn) -> None:
    specs = [spec(f"root_{i}", schedule="*/5 * * * *") for i in range(2_000)]
    specs += [spec(f"child_{i}", depends_on=[f"root_{i % 2_000}", f"root_{(i + 1) % 2_000}"])
              for i in range(8_000)]
    result = registry.apply(conn, specs)
    assert len(result.created) == 10_000
    counts = conn.execute("SELECT (SELECT count(*) FROM pgflow.jobs) AS jobs,"
                          " (SELECT count(*) FROM pgflow.job_deps) AS deps").fetchone()
    assert counts == {"jobs": 10_000, "deps": 16_000}
    assert registry.apply(conn, specs).unchanged == [s.name for s in specs]
