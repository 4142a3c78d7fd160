from pathlib import Path

import pytest

from pgflow.config import load_settings
from pgflow.errors import ConfigError


def test_defaults_without_environment() -> None:
    settings = load_settings({})
    assert settings.database_url is None
    assert settings.lease_ttl == 30
    assert settings.bind == "127.0.0.1:8080"
    assert settings.home == Path.home() / ".local" / "share" / "pgflow"


def test_environment_values_and_durations() -> None:
    settings = load_settings({
        "PGFLOW_DATABASE_URL": "postgresql://u@db/x",
        "PGFLOW_LEASE_TTL": "2m",
        "PGFLOW_HOME": "/srv/pgflow",
        "PGFLOW_BIND": "0.0.0.0:9000",
    })
    assert settings.database_url == "postgresql://u@db/x"
    assert settings.lease_ttl == 120
    assert settings.home == Path("/srv/pgflow")
    assert settings.bind == "0.0.0.0:9000"


def test_flags_override_environment() -> None:
    settings = load_settings({"PGFLOW_LEASE_TTL": "2m"}, lease_ttl="45s")
    assert settings.lease_ttl == 45


def test_environment_is_injected_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGFLOW_LEASE_TTL", "99")
    assert load_settings({}).lease_ttl == 30


@pytest.mark.parametrize(
    ("env", "named"),
    [({"PGFLOW_LEASE_TTL": "soon"}, "PGFLOW_LEASE_TTL"),
     ({"PGFLOW_LEASE_TTL": "0"}, "PGFLOW_LEASE_TTL"),
     ({"PGFLOW_LEASE_TTL": "1"}, "PGFLOW_LEASE_TTL"),
     ({"PGFLOW_LEASE_TTL": "0.5s"}, "PGFLOW_LEASE_TTL"),
     ({"PGFLOW_CONCURRENCY": "0"}, "PGFLOW_CONCURRENCY"),
     ({"PGFLOW_CONCURRENCY": "many"}, "PGFLOW_CONCURRENCY"),
     ({"PGFLOW_LOG_FORMAT": "xml"}, "PGFLOW_LOG_FORMAT"),
     ({"PGFLOW_BIND": "localhost"}, "PGFLOW_BIND"),
     ({"PGFLOW_BIND": "localhost:99999"}, "PGFLOW_BIND"),
     ({"PGFLOW_DATABASE_URL": "mysql://x"}, "PGFLOW_DATABASE_URL")],
)
def test_invalid_values_name_the_setting_in_one_line(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    message = str(info.value)
    assert named in message and "\n" not in message


def test_invalid_flag_is_named_as_a_flag() -> None:
    with pytest.raises(ConfigError, match="--lease-ttl"):
        load_settings({}, lease_ttl="x")


def test_a_lease_ttl_the_leader_cannot_heartbeat_within_says_why() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"PGFLOW_LEASE_TTL": "1s"})
    assert str(info.value) == ("invalid setting PGFLOW_LEASE_TTL='1s': must be longer than"
                               " the leader's 1 s heartbeat")
    assert load_settings({"PGFLOW_LEASE_TTL": "1.5"}).lease_ttl == 1.5


def test_concurrency_and_log_format_come_from_the_environment() -> None:
    settings = load_settings({"PGFLOW_CONCURRENCY": "64", "PGFLOW_LOG_FORMAT": "console"})
    assert settings.concurrency == 64 and settings.log_format == "console"
    assert load_settings({}).concurrency == 16 and load_settings({}).log_format == "auto"
    assert load_settings({"PGFLOW_CONCURRENCY": "64"}, concurrency=8).concurrency == 8
