"""The JSON API's request and response bodies (pydantic), and their OpenAPI schemas.

Requests are validated strictly (``model_validate_json(..., strict=True)``): what
the JSON Schema in ``/api/v1/openapi.json`` rejects, the server rejects too, so a
fuzzer's "wrong type" bodies get a 422 instead of being coerced.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter

from pgflow.runs import RUN_STATES
from pgflow.spec import NAME_PATTERN

RunState = Literal["pending", "queued", "running", "retrying", "succeeded", "failed",
                   "cancelled", "upstream_failed"]
Trigger = Literal["schedule", "manual", "dependency", "backfill", "dataset"]
Outcome = Literal["succeeded", "failed", "timed_out", "lost", "cancelled", "interrupted"]
assert set(RunState.__args__) == set(RUN_STATES)  # type: ignore[attr-defined]

NEXT_CURSOR = "Pass as ?cursor= for the next page; null at the end."
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=NAME_PATTERN)]


def _storable(value: datetime) -> datetime:
    """Naive means UTC; the instant must fit in years 1..9999 once in UTC (what the
    database round-trips)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    try:
        value.astimezone(UTC)
    except OverflowError:
        raise ValueError("is out of range once converted to UTC") from None
    return value


_LAX_TIME: TypeAdapter[datetime] = TypeAdapter(datetime)
ISO_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}")


def _iso_only(value: Any) -> Any:
    """ISO 8601 text only (no numbers of seconds), parsed here: strict mode then takes
    the datetime as it is."""
    if isinstance(value, str):
        if not ISO_TIME.match(value):
            raise ValueError("expected an ISO 8601 time such as 2026-01-31T12:00:00Z")
        return _LAX_TIME.validate_python(value)
    return value


Instant = Annotated[datetime, BeforeValidator(_iso_only), AfterValidator(_storable)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Out(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------- errors


class ErrorDetail(_Out):
    field: str | None = Field(description="The offending field (dotted path), if any.")
    message: str


class Error(_Out):
    """Every error response: a one-line summary and, for invalid input, each problem."""

    error: str
    detail: list[ErrorDetail] = Field(default_factory=list)


# ---------------------------------------------------------------- jobs


class JobSummary(_Out):
    name: str
    tenant: str
    schedule: str | None
    timezone: str
    paused: bool
    priority: int
    next_fire_at: datetime | None
    depends_on: list[str]
    latest_run_id: int | None = None
    latest_state: RunState | None = None


class JobList(_Out):
    items: list[JobSummary]
    next_cursor: str | None = Field(description=NEXT_CURSOR)


class Job(_Out):
    name: str
    tenant: str
    schedule: str | None
    timezone: str
    paused: bool
    next_fire_at: datetime | None
    depends_on: list[str]
    downstream: list[str]
    definition: dict[str, Any] = Field(description="The definition as registered (SPEC §3).")
    created_at: datetime
    updated_at: datetime


class JobApplied(_Out):
    result: Literal["created", "updated", "unchanged"]
    job: Job


class JobDeleted(_Out):
    name: str
    deleted: bool = True


# ---------------------------------------------------------------- runs


class Run(_Out):
    id: int
    job: str
    logical_time: datetime
    state: RunState
    attempt: int
    max_attempts: int
    trigger: Trigger
    tenant: str
    priority: int
    cancel_requested: bool
    acked_at: datetime | None
    backfill_id: int | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    progress: float | None = Field(
        default=None, description="Latest progress the job reported (0 to 1), if any.")
    progress_message: str | None = Field(
        default=None, description="The message of the latest progress report.")


class RunList(_Out):
    items: list[Run]
    next_cursor: str | None = Field(description=NEXT_CURSOR)


class Attempt(_Out):
    attempt: int
    worker_id: str
    started_at: datetime
    finished_at: datetime | None
    outcome: Outcome | None = Field(description="null while the attempt is running.")
    exit_code: int | None
    error: str | None
    stdout_tail: str | None
    stderr_tail: str | None


class TriggerEvent(_Out):
    id: int
    dataset: str
    key: str | None
    payload: dict[str, Any]
    created_at: datetime
    producer_run_id: int | None


class RunDetail(Run):
    params: dict[str, Any]
    available_at: datetime
    lease_owner: str | None
    lease_expires_at: datetime | None
    job_exists: bool
    attempts: list[Attempt]
    progress_at: datetime | None = None
    checkpoint_attempt: int | None = Field(
        default=None, description="The attempt that stored the run's checkpoint, if any.")
    checkpoint_at: datetime | None = None
    trigger_events: list[TriggerEvent] = Field(
        default_factory=list, description="The dataset events a dataset run consumed.")


class TriggerRequest(_In):
    logical_time: Instant | None = Field(
        default=None, description="The time the run is for (naive = UTC; default: now).")
    params: dict[str, Any] | None = Field(default=None, description="Merged over the job's params.")
    downstream: bool = Field(default=True, description="Start the job's downstream DAG run too.")


# ---------------------------------------------------------------- backfills


class Backfill(_Out):
    id: int
    job: str
    range_start: datetime
    range_end: datetime
    max_concurrency: int
    downstream: bool
    state: Literal["running", "completed", "cancelled"]
    ticks: int
    skipped: int
    created_at: datetime
    finished_at: datetime | None
    counts: dict[str, int] = Field(description="Runs of this backfill by state.")


class BackfillList(_Out):
    items: list[Backfill]


class BackfillRequest(_In):
    job: Name
    start: Instant = Field(description="First logical time (inclusive).")
    end: Instant = Field(description="Last logical time (exclusive).")
    max_concurrency: int = Field(default=2, ge=1, le=10_000)
    downstream: bool = False
    reprocess: Literal["none", "failed", "all"] = Field(
        default="none", description="Existing ticks: skip them (none), re-run the failed"
                                    " ones, or re-run all finished ones.")


class RerunRequest(_In):
    downstream: bool = Field(default=False, description="Also run the downstream runs at the"
                                                        " same logical time again, after it.")


# ---------------------------------------------------------------- breakers


class Breaker(_Out):
    source: str
    state: Literal["open", "closed", "half_open"]
    reason: str | None
    changed_at: datetime | None
    changed_by: str | None
    jobs: int = Field(description="Jobs that list this source.")
    failures: int = Field(default=0, description="Consecutive source-unavailable attempts.")
    opened_at: datetime | None = None
    cooldown_s: float | None = Field(default=None, description="Cooldown of this opening.")
    manual: bool = Field(default=False, description="Opened by hand: no probe, stays open.")
    probe_run: int | None = Field(default=None, description="The half-open breaker's probe.")
    half_open_at: datetime | None = None
    failure_threshold: int = 3
    base_cooldown_s: float = 60.0
    max_concurrency: int | None = None
    held_runs: int = Field(default=0, description="Runs held by this breaker.")


class BreakerList(_Out):
    items: list[Breaker]


class Tenant(_Out):
    name: str
    weight: float = Field(description="Share of worker slots when tenants compete.")
    max_concurrency: int | None = Field(description="Cluster-wide cap on running runs.")
    defined: bool = Field(description="Has a [tenants] entry (else the defaults).")
    jobs: int
    running: int
    queued: int
    held: int = Field(description="Queued runs held by a breaker.")


class TenantList(_Out):
    items: list[Tenant]


class BreakerChange(_In):
    reason: str | None = Field(default=None, max_length=1000)


# ---------------------------------------------------------------- status


class Replica(_Out):
    id: str
    host: str
    pid: int
    roles: list[str]
    version: str
    concurrency: int
    stopping: bool
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_age_s: float
    alive: bool


class Leader(_Out):
    replica_id: str
    term: int
    elected_at: datetime
    heartbeat_at: datetime
    heartbeat_age_s: float
    stale: bool


class Depth(_Out):
    state: RunState
    tenant: str
    runs: int


class Queue(_Out):
    by_state: dict[str, int]
    by_tenant: list[Depth]
    dead_letters: int


class Status(_Out):
    replicas: list[Replica]
    leader: Leader | None
    queue: Queue
    open_breakers: list[str]
    incidents_firing: int = Field(default=0, description="Alert incidents firing now.")


REQUEST_MODELS: tuple[type[BaseModel], ...] = (TriggerRequest, BackfillRequest, BreakerChange,
                                                RerunRequest)
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    Error, JobList, Job, JobApplied, JobDeleted, RunList, Run, RunDetail, BackfillList, Backfill,
    BreakerList, Breaker, TenantList, Tenant, Status)


# ---------------------------------------------------------------- alerts (pgflow/alerts)


class Incident(_Out):
    id: int
    event: str = Field(description="run_failed, deadline_missed, breaker_opened, backlog,"
                                   " failure_rate, no_leader or replica_lost.")
    key: str = Field(description="What it is about: a job, a run id, a source, a replica,"
                                 " or 'cluster'.")
    job: str | None = None
    tenant: str | None = None
    run_id: int | None = None
    source: str | None = None
    runs: list[int] = Field(description="The runs involved (a failure streak's dead letters).")
    summary: str
    opened_at: datetime
    updated_at: datetime
    resolved_at: datetime | None = Field(description="Null while firing.")


class AlertDefinition(_Out):
    name: str
    format: str
    url: str | None = Field(description="Null when the URL is read from url_env (a secret).")
    url_env: str | None = None
    secret_env: str | None = None
    events: list[str]
    jobs: list[str]
    tenants: list[str]


class Delivery(_Out):
    id: str = Field(description="The notification id sent as `id` on every try.")
    alert: str
    event: str
    status: str = Field(description="firing or resolved.")
    delivery: str = Field(description="pending, delivered or given_up (undelivered).")
    created_at: datetime
    delivered_at: datetime | None = None
    attempts: int
    last_status: int | None = None
    last_error: str | None = None
    summary: str | None = None


class AlertOverview(_Out):
    active: list[Incident] = Field(description="Incidents firing now.")
    recent: list[Incident] = Field(description="Recent incidents, newest first.")
    alerts: list[AlertDefinition]
    deliveries: list[Delivery] = Field(description="The delivery log, newest first.")


class AlertTestResult(_Out):
    notification: str
    ok: bool
    status: int | None = Field(description="HTTP status the receiver answered.")
    error: str | None = Field(description="Why there was no answer (timeout, refused...).")


RESPONSE_MODELS += (AlertOverview, AlertTestResult)
