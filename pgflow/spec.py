"""The job definition model: one pydantic model for TOML, Python and the HTTP API.

Validation here is per job (types, ranges, cron, timezone, names). Checks that
need the whole graph (unknown upstream, cycles, schedules of roots) live in
``pgflow.dag``. A ``SpecError`` is one problem; a ``RegistrationError`` reports
all of them at once, from ``Flow.add`` or from a registration.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pgflow.cron import CronError, load_timezone, parse_cron
from pgflow.duration import parse_duration
from pgflow.errors import PgflowError

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
NAME_RE = re.compile(NAME_PATTERN)
ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

Seconds = Annotated[float, BeforeValidator(parse_duration)]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=NAME_PATTERN)]


class RetryPolicy(BaseModel):
    """How failed attempts are retried: exponential backoff with full jitter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_attempts: int = Field(default=3, ge=1, le=1000)
    backoff: Seconds = Field(default=30.0)
    max_backoff: Seconds = Field(default=3600.0)
    jitter: bool = True
    no_retry_exit_codes: list[Annotated[int, Field(ge=0, le=255)]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _cap_not_below_base(self) -> RetryPolicy:
        if self.max_backoff < self.backoff:
            raise ValueError("max_backoff must be at least backoff")
        return self


class JobSpec(BaseModel):
    """One job definition (SPEC §3). Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name
    schedule: str | None = None
    timezone: str = "UTC"
    command: list[Annotated[str, Field(max_length=32768)]] | Annotated[
        str, Field(min_length=1, max_length=32768)
    ] | None = None
    entrypoint: str | None = None
    tenant: Name = "default"
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    timeout: Seconds | None = None
    deadline: Seconds | None = None  # a run not succeeded by logical time + this: deadline_missed
    max_active_runs: int | None = Field(default=None, ge=1, le=1_000_000)
    catchup: Literal["latest", "all", "none"] = "latest"
    sources: list[Name] = Field(default_factory=list, max_length=100)
    params: dict[str, Any] = Field(default_factory=dict)
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    depends_on: list[Name] = Field(default_factory=list, max_length=10_000)
    # Datasets (SPEC §4b): updated by a succeeded run; a run when new events hold.
    produces: list[Name] = Field(default_factory=list, max_length=1000)
    trigger_on: list[Name] | None = Field(default=None, max_length=1000)
    trigger_mode: Literal["all", "any"] | None = None

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        load_timezone(value)
        return value

    @field_validator("entrypoint")
    @classmethod
    def _module_colon_attr(cls, value: str | None) -> str | None:
        if value is not None and not ENTRYPOINT_RE.match(value):
            raise ValueError("expected 'module.path:function', e.g. 'etl.orders:extract'")
        return value

    @field_validator("command")
    @classmethod
    def _non_empty_argv(cls, value: list[str] | str | None) -> list[str] | str | None:
        if isinstance(value, list) and (not value or not value[0]):
            raise ValueError("an argv list needs at least the program name")
        if value is not None and "\x00" in "".join(value):
            raise ValueError("must not contain NUL characters")
        return value

    @field_validator("timeout")
    @classmethod
    def _positive_timeout(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError("timeout must be longer than 0s")
        return value

    @field_validator("deadline")
    @classmethod
    def _positive_deadline(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError("deadline must be longer than 0s")
        return value

    @field_validator("depends_on", "sources", "produces", "trigger_on")
    @classmethod
    def _no_repeats(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        repeated = sorted({v for v in value if value.count(v) > 1})
        if repeated:
            raise ValueError(f"lists {', '.join(repeated)} more than once")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> JobSpec:
        problems: list[tuple[str | None, str]] = []
        if (self.command is None) == (self.entrypoint is None):
            problems.append((None, "exactly one of 'command' or 'entrypoint' is required"))
        if self.schedule is not None:
            try:
                parse_cron(self.schedule, self.timezone)
            except CronError as exc:
                problems.append(("schedule", str(exc)))
        if self.schedule is not None and self.depends_on:
            problems.append((
                "schedule",
                "a job with depends_on inherits its upstreams' logical times and cannot have"
                " its own schedule (remove 'schedule')",
            ))
        problems += self._trigger_problems()
        if problems:
            raise _Problems(problems)
        return self

    def _trigger_problems(self) -> list[tuple[str | None, str]]:
        if self.trigger_on is None:
            if self.trigger_mode is not None:
                return [("trigger_mode", "only applies to a job with trigger_on")]
            return []
        problems: list[tuple[str | None, str]] = []
        if not self.trigger_on:
            problems.append(("trigger_on", "must name at least one dataset"))
        if self.schedule is not None:
            problems.append(("schedule", "a dataset-triggered job (trigger_on) cannot also"
                                         " have a schedule (remove one of them)"))
        if self.depends_on:
            problems.append(("depends_on", "a dataset-triggered job (trigger_on) is a root:"
                                           " it cannot have depends_on"))
        return problems

    @property
    def dataset_mode(self) -> str:
        """``all`` or ``any`` (the default ``all``)."""
        return self.trigger_mode or "all"

    def definition(self) -> dict[str, Any]:
        """The canonical JSON form, stored and compared to detect unchanged jobs. The
        dataset keys appear only when set, so jobs registered before they existed keep
        their definition (and stay "unchanged")."""
        document = self.model_dump(mode="json")
        for key, unset in _OPTIONAL_KEYS.items():
            if document.get(key) == unset:
                del document[key]
        return document


_OPTIONAL_KEYS: dict[str, Any] = {"produces": [], "trigger_on": None, "trigger_mode": None}


class _Problems(ValueError):
    """Every cross-key problem of one job, each with the key it belongs to."""

    def __init__(self, items: list[tuple[str | None, str]]) -> None:
        super().__init__("; ".join(message for _, message in items))
        self.items = items


class SpecError(BaseModel):
    """One problem with one definition: reported as ``job 'x': key: reason`` (or
    ``tenant 'x'``, ``source 'x'``: ``kind`` says which table it is from)."""

    job: str
    key: str | None
    reason: str
    kind: str = "job"

    def __str__(self) -> str:
        where = f"{self.kind} {self.job!r}" + (f": {self.key}" if self.key else "")
        return f"{where}: {self.reason}"


class RegistrationError(PgflowError):
    """Every problem found in a registration; nothing was applied."""

    def __init__(self, errors: Sequence[SpecError], source: str = "") -> None:
        self.errors = list(errors)
        where = f" in {source}" if source else ""
        # One line, as every CLI error: the problems are separated by "; ".
        problems = "; ".join(str(error).replace("\n", " ") for error in self.errors)
        super().__init__(f"{len(self.errors)} problem(s){where}, nothing applied: {problems}")


_FIELDS = sorted(set(JobSpec.model_fields) - {"name"})
_RETRY_FIELDS = sorted(RetryPolicy.model_fields)


def _did_you_mean(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
    hint = f", did you mean {close[0]!r}?" if close else f" (known keys: {', '.join(options)})"
    return f"unknown key{hint}"


did_you_mean = _did_you_mean


def _describe(job: str, error: Any) -> list[SpecError]:
    ctx_error = (error.get("ctx") or {}).get("error")
    if isinstance(ctx_error, _Problems):
        return [SpecError(job=job, key=key, reason=reason) for key, reason in ctx_error.items]
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc) or None
    reason = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        options = _RETRY_FIELDS if loc[:1] == ["retry"] else _FIELDS
        reason = _did_you_mean(loc[-1], options)
    elif error["type"] == "string_pattern_mismatch":
        reason = "must start with a letter or digit and use only letters, digits, '_', '.', '-'"
    if key and key.startswith("command."):
        key = "command"
    return [SpecError(job=job, key=key, reason=reason)]


def parse_job(name: str, raw: Any) -> tuple[JobSpec | None, list[SpecError]]:
    """Validate one raw definition; return the spec or every error found in it."""
    if not isinstance(raw, dict):
        return None, [SpecError(job=name, key=None, reason="must be a table of keys")]
    if "name" in raw and raw["name"] != name:
        return None, [SpecError(job=name, key="name", reason="does not match the job's name")]
    try:
        return JobSpec.model_validate({**raw, "name": name}), []
    except ValidationError as exc:
        return None, [found for e in exc.errors() for found in _describe(name, e)]
