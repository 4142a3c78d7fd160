"""``[alerts.NAME]`` (SPEC §3): where notifications go and which ones.

Validated like ``[tenants]``/``[sources]`` (``pgflow.policies`` parses the table and
``registry.apply`` writes it in the same transaction as the jobs).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pgflow.alerts import EVENTS
from pgflow.spec import NAME_PATTERN

Name = Annotated[str, Field(min_length=1, max_length=128, pattern=NAME_PATTERN)]
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
Event = Literal["run_failed", "run_recovered", "deadline_missed", "breaker_opened",
                "breaker_closed", "backlog", "failure_rate", "no_leader", "replica_lost"]
_GLOB_CHARS = re.compile(r"^[A-Za-z0-9_.\-*?\[\]!]+$")


class AlertSpec(BaseModel):
    """One webhook receiver and the notifications it wants."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name
    url: str | None = Field(default=None, max_length=2048)
    url_env: str | None = None
    format: Literal["json", "slack"] = "json"
    events: list[Event] = Field(default_factory=lambda: list(EVENTS),  # type: ignore[arg-type]
                                min_length=1)
    jobs: list[str] = Field(default_factory=list, max_length=1000)
    tenants: list[Name] = Field(default_factory=list, max_length=1000)
    secret_env: str | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            check_url(value)
        return value

    @field_validator("url_env", "secret_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not ENV_NAME.match(value):
            raise ValueError("must be an environment variable name (letters, digits, '_')")
        return value

    @field_validator("jobs")
    @classmethod
    def _globs(cls, value: list[str]) -> list[str]:
        for glob in value:
            glob_regex(glob)
        return value

    @field_validator("events")
    @classmethod
    def _no_repeated_events(cls, value: list[str]) -> list[str]:
        repeated = sorted({v for v in value if value.count(v) > 1})
        if repeated:
            raise ValueError(f"lists {', '.join(repeated)} more than once")
        return value

    @model_validator(mode="after")
    def _one_url(self) -> AlertSpec:
        if (self.url is None) == (self.url_env is None):
            raise ValueError("exactly one of 'url' or 'url_env' is required")
        return self

    def definition(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def row(self) -> dict[str, Any]:
        return {**self.definition(), "jobs_regex": [glob_regex(g) for g in self.jobs]}


def check_url(value: str) -> None:
    """Raise ValueError unless ``value`` is an http(s) URL with a host."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"URL scheme must be http or https, got {parts.scheme or 'none'!r}")
    if not parts.hostname:
        raise ValueError("URL has no host")
    if any(c.isspace() for c in value):
        raise ValueError("URL must not contain spaces")


def glob_regex(glob: str) -> str:
    """A job-name glob (``*``, ``?``, ``[abc]``, ``[!abc]``) as an anchored regex that
    Python and PostgreSQL read alike; ValueError for a glob that is not one."""
    if not glob or len(glob) > 128 or not _GLOB_CHARS.match(glob):
        raise ValueError(f"{glob!r} is not a glob of job names (letters, digits, '_', '.',"
                         " '-', and * ? [...])")
    out, i = ["^"], 0
    while i < len(glob):
        c = glob[i]
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            end = glob.find("]", i + 2 if glob[i + 1:i + 2] in ("!", "]") else i + 1)
            if end < 0:
                raise ValueError(f"glob {glob!r} has an unclosed '['")
            body = glob[i + 1:end]
            negate = body.startswith("!")
            body = body[1:] if negate else body
            if not body:
                raise ValueError(f"glob {glob!r} has an empty '[]'")
            escaped = body.replace("\\", "\\\\").replace("]", "\\]").replace("^", "\\^")
            out.append(f"[{'^' if negate else ''}{escaped}]")
            i = end
        elif c == "]" or c == "!":
            if c == "]":
                raise ValueError(f"glob {glob!r} has a ']' without '['")
            out.append("!")
        else:
            out.append(re.escape(c))
        i += 1
    out.append("$")
    return "".join(out)
