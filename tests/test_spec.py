from typing import Any

import pytest

from pgflow.spec import JobSpec, SpecError, parse_job


def errors_of(raw: Any, name: str = "job1") -> list[SpecError]:
    spec, errors = parse_job(name, raw)
    assert spec is None
    return errors


def test_full_definition_round_trips() -> None:
    spec, errors = parse_job("extract_orders", {
        "schedule": "0 * * * *", "timezone": "Europe/Berlin",
        "command": ["python", "etl/extract.py"], "tenant": "sales", "priority": 3,
        "timeout": "2h", "max_active_runs": 4, "catchup": "all", "sources": ["warehouse"],
        "params": {"region": "eu"},
        "retry": {"max_attempts": 5, "backoff": "30s", "max_backoff": "1h", "jitter": True,
                  "no_retry_exit_codes": [2]},
    })
    assert errors == [] and spec is not None
    assert spec.timeout == 7200 and spec.retry.max_backoff == 3600
    assert JobSpec.model_validate(spec.definition()) == spec


def test_defaults() -> None:
    spec, _ = parse_job("j", {"command": "echo hi"})
    assert spec is not None
    assert (spec.tenant, spec.timezone, spec.catchup, spec.retry.max_attempts) == (
        "default", "UTC", "latest", 3)


def test_unknown_key_suggests_the_right_one() -> None:
    [error] = errors_of({"command": "x", "schedul": "* * * * *"})
    assert error.key == "schedul"
    assert "did you mean 'schedule'" in error.reason


def test_unknown_retry_key_suggests_within_retry() -> None:
    [error] = errors_of({"command": "x", "retry": {"max_attempt": 3}})
    assert error.key == "retry.max_attempt"
    assert "max_attempts" in error.reason


@pytest.mark.parametrize("raw", [{}, {"command": "x", "entrypoint": "m:f"}])
def test_exactly_one_of_command_or_entrypoint(raw: dict[str, Any]) -> None:
    [error] = errors_of(raw)
    assert "exactly one of 'command' or 'entrypoint'" in error.reason


def test_bad_cron_is_reported_on_schedule() -> None:
    [error] = errors_of({"command": "x", "schedule": "61 * * * *"})
    assert error.key == "schedule"
    assert "61 * * * *" in error.reason


def test_bad_timezone_is_reported_on_timezone() -> None:
    [error] = errors_of({"command": "x", "schedule": "0 * * * *", "timezone": "Mars/Olympus"})
    assert error.key == "timezone"


def test_dependent_with_schedule_is_rejected() -> None:
    [error] = errors_of({"command": "x", "schedule": "0 * * * *", "depends_on": ["a"]})
    assert error.key == "schedule" and "depends_on" in error.reason


def test_several_problems_of_one_job_are_all_reported() -> None:
    errors = errors_of({"command": 5, "priority": "high", "catchup": "sometimes", "bogus": 1})
    assert {e.key for e in errors} >= {"command", "priority", "catchup", "bogus"}


@pytest.mark.parametrize("name", ["", "-lead", "a b", "a;DROP TABLE jobs", "x" * 129, "é",
                                  "../etc", "a\nb", "'quote'"])
def test_hostile_names_are_rejected(name: str) -> None:
    errors = errors_of({"command": "x"}, name=name)
    assert errors[0].key == "name"


def test_sql_metacharacters_in_params_and_commands_are_plain_data() -> None:
    spec, errors = parse_job("j", {
        "command": "echo '; DROP TABLE pgflow.jobs; --'",
        "params": {"q": "'); DELETE FROM pgflow.runs; --", "nested": {"$1": "%s"}},
    })
    assert errors == [] and spec is not None


@pytest.mark.parametrize(
    ("raw", "key"),
    [({"command": []}, "command"), ({"command": ["python", "a\x00b"]}, "command"),
     ({"entrypoint": "not a path"}, "entrypoint"), ({"command": "x", "timeout": "0s"}, "timeout"),
     ({"command": "x", "max_active_runs": 0}, "max_active_runs"),
     ({"command": "x", "retry": {"backoff": "1h", "max_backoff": "1m"}}, "retry"),
     ({"command": "x", "retry": {"no_retry_exit_codes": [300]}}, "retry.no_retry_exit_codes.0"),
     ({"command": "x", "depends_on": ["a", "a"]}, "depends_on"),
     ({"command": "x", "sources": ["bad name"]}, "sources.0")],
)
def test_per_key_validation(raw: dict[str, Any], key: str) -> None:
    errors = errors_of(raw)
    assert key in {e.key for e in errors}, errors


def test_error_renders_job_and_key() -> None:
    assert str(SpecError(job="a", key="schedule", reason="bad")) == "job 'a': schedule: bad"


def test_non_table_definition() -> None:
    [error] = errors_of("command = x")
    assert "table" in error.reason
