"""Settings from the environment (``PGFLOW_*``) and command-line flags.

Flags win over the environment; the environment wins over defaults. The
environment mapping is injectable so tests never touch ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from pgflow.dbconfig import check_url, default_home
from pgflow.duration import parse_duration
from pgflow.errors import ConfigError
from pgflow.live import DEFAULT_LOG_LIMIT, MIN_LOG_LIMIT, parse_size

Seconds = Annotated[float, BeforeValidator(parse_duration)]
Bytes = Annotated[int, BeforeValidator(parse_size)]


# The scheduler leader heartbeats at least this often (pgflow.leader); a lease TTL
# must be longer, or standbys depose every leader between two of its heartbeats.
LEADER_HEARTBEAT_S = 1.0
DEFAULT_CONCURRENCY = 16
# Finished runs are deleted this long after they finished (pgflow.retention).
DEFAULT_RETENTION_S = 30 * 86400.0
MAX_CONCURRENCY = 100_000


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PGFLOW_", extra="ignore", frozen=True)

    database_url: str | None = Field(default=None, description="libpq URL; unset = embedded")
    pooler_url: str | None = Field(
        default=None, description="libpq URL of a transaction-mode PgBouncer; unset = direct")
    home: Path = Field(default_factory=default_home, description="data folder")
    lease_ttl: Seconds = Field(default=30.0, gt=0, description="lease length without heartbeat")
    bind: str = Field(default="127.0.0.1:8080", description="host:port of the web role")
    health_bind: str | None = Field(
        default=None, description="host:port of /healthz and /readyz without the web role")
    concurrency: int = Field(default=DEFAULT_CONCURRENCY, ge=1, le=MAX_CONCURRENCY,
                             description="runs one replica executes at once")
    log_format: Literal["auto", "json", "console"] = Field(
        default="auto", description="auto: console on a terminal, JSON otherwise")
    retention: Seconds = Field(default=DEFAULT_RETENTION_S, gt=0,
                               description="how long finished runs are kept")
    log_limit: Bytes = Field(default=DEFAULT_LOG_LIMIT, ge=MIN_LOG_LIMIT, le=1024**3,
                             description="output kept per attempt (pgflow.live)")
    public_url: str | None = Field(
        default=None, description="base URL of the UI, for links in alerts; default http://BIND")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # load_settings reads the (injectable) environment itself and passes it in.
        return (init_settings,)

    @field_validator("database_url", "pooler_url")
    @classmethod
    def _url_scheme(cls, value: str | None) -> str | None:
        return check_url(value)

    @field_validator("lease_ttl")
    @classmethod
    def _longer_than_heartbeat(cls, value: float) -> float:
        if value <= LEADER_HEARTBEAT_S:
            raise ValueError(f"must be longer than the leader's {LEADER_HEARTBEAT_S:g} s heartbeat")
        return value

    @field_validator("bind")
    @classmethod
    def _host_port(cls, value: str) -> str:
        split_bind(value)
        return value

    @field_validator("health_bind")
    @classmethod
    def _health_host_port(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        split_bind(value)
        return value

    @field_validator("public_url")
    @classmethod
    def _http_base(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError("expected a URL starting with http:// or https://")
        return value.rstrip("/")

    @property
    def ui_url(self) -> str:
        """Where the UI is reached: ``public_url``, else ``http://<bind>``."""
        return self.public_url or f"http://{self.bind}"

    @field_validator("home")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()


def split_bind(value: str) -> tuple[str, int]:
    """``host:port`` → (host, port); raise ValueError for anything else."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port such as 127.0.0.1:8080, got {value!r}")
    return host.strip("[]"), int(port)


def load_settings(
    environ: Mapping[str, str] | None = None, **overrides: Any
) -> Settings:
    """Settings from ``environ`` (default ``os.environ``) with flag ``overrides`` on top.

    Raises ConfigError naming the setting and the bad value.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name in Settings.model_fields:
        key = f"PGFLOW_{name.upper()}"
        if key in env:
            values[name] = env[key]
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Settings(**values)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0]) if error["loc"] else "?"
        reason = str(error["msg"]).removeprefix("Value error, ")
        flag = name in overrides and overrides[name] is not None
        source = "flag --" + name.replace("_", "-") if flag else "PGFLOW_" + name.upper()
        raise ConfigError(f"invalid setting {source}={values.get(name)!r}: {reason}") from None
