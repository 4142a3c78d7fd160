"""The JSON API under ``/api/v1`` (SPEC §6): one ``Endpoint`` per operation.

Roles: a viewer reads everything; an operator also triggers, pauses and resumes
jobs, retries, cancels and acknowledges runs, starts backfills and opens or closes
breakers; an admin also registers (PUT) and deletes jobs, which runs code on workers.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from pgflow import backfill, breakers, datasets, live, policies, registry, rerun, runs, status
from pgflow.alerts import outbox
from pgflow.errors import NotFound
from pgflow.queries import q
from pgflow.spec import NAME_PATTERN, JobSpec, parse_job
from pgflow.web import dataset_views
from pgflow.web._endpoint import (
    ApiError,
    Call,
    Endpoint,
    Param,
    TextResponse,
    validation_details,
)
from pgflow.web.models import (
    AlertOverview,
    AlertTestResult,
    Backfill,
    BackfillList,
    BackfillRequest,
    Breaker,
    BreakerChange,
    BreakerList,
    Job,
    JobApplied,
    JobDeleted,
    JobList,
    JobSummary,
    RerunRequest,
    Run,
    RunDetail,
    RunList,
    Status,
    Tenant,
    TenantList,
    TriggerRequest,
)

MAX_ID = 2**63 - 1
NAME_SCHEMA = {"type": "string", "minLength": 1, "maxLength": 128, "pattern": NAME_PATTERN}
STATES = list(runs.RUN_STATES)
TRIGGERS = ["schedule", "manual", "dependency", "backfill", "dataset"]

JOB_NAME = Param("name", "path", NAME_SCHEMA, "The job's name.", required=True)
RUN_ID = Param("id", "path", {"type": "integer", "minimum": 1, "maximum": MAX_ID},
               "The run's id.", required=True)
SOURCE = Param("source", "path", NAME_SCHEMA, "The external source's name.", required=True)


def _limit(default: int, maximum: int) -> Param:
    return Param("limit", "query", {"type": "integer", "minimum": 1, "maximum": maximum,
                                    "default": default}, "Page size.")


# ---------------------------------------------------------------- jobs


def job_model(conn: Any, name: str) -> Job:
    row = conn.execute(q("get_job"), {"name": name}).fetchone()
    if row is None:
        raise NotFound(runs.unknown_job_message(conn, name))
    return Job.model_validate(row)


def list_jobs(call: Call) -> tuple[int, BaseModel]:
    a = call.args
    rows = call.conn.execute(q("web_jobs_page"), {
        "after": a["cursor"], "search": a["q"], "tenant": a["tenant"], "paused": a["paused"],
        "state": a["state"], "limit": a["limit"]}).fetchall()
    items = [JobSummary.model_validate(row) for row in rows]
    cursor = items[-1].name if len(items) == a["limit"] else None
    return 200, JobList(items=items, next_cursor=cursor)


def get_job(call: Call) -> tuple[int, BaseModel]:
    return 200, job_model(call.conn, call.args["name"])


# The definition as JSON Schema: the JobSpec model's, where the name comes from the path
# (a body may repeat it) and durations take "30s"-style strings as well as seconds.
_DURATION = {"anyOf": [{"type": "number", "minimum": 0},
                       {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*[smhd]?\s*$"}]}


def job_definition_schema(ref_template: str) -> dict[str, Any]:
    schema = JobSpec.model_json_schema(ref_template=ref_template)
    schema.pop("$defs", None)
    schema["required"] = []
    schema["title"] = "JobDefinition"
    schema["description"] = (
        "A job definition (SPEC §3): exactly one of command or entrypoint; a job with"
        " depends_on has no schedule. Cron, timezone and the dependency graph are checked"
        " on registration (422 names every offending field).")
    props = schema["properties"]
    props["name"]["description"] = ("Optional: the path names the job; if given (as in a"
                                    " definition read back from GET) it must match.")
    props["timeout"] = {"anyOf": [*_DURATION["anyOf"], {"type": "null"}], "default": None}
    props["entrypoint"]["anyOf"][0]["pattern"] = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"
    return schema


def retry_schema() -> dict[str, Any]:
    from pgflow.spec import RetryPolicy

    schema = RetryPolicy.model_json_schema()
    for key in ("backoff", "max_backoff"):
        schema["properties"][key] = {**_DURATION, "default": schema["properties"][key]["default"]}
    return schema


def put_job(call: Call) -> tuple[int, BaseModel]:
    name, raw = call.args["name"], call.body
    spec, errors = parse_job(name, raw)
    if spec is not None:
        try:  # what lax validation coerced ("5" for 5) the documented schema rejects
            JobSpec.model_validate_json(json.dumps({**raw, "name": name}), strict=True)
        except ValidationError as exc:
            details = validation_details(exc)
            raise ApiError(422, "invalid job definition: " + "; ".join(
                f"{f}: {m}" for f, m in details), details) from None
    result = registry.apply(call.conn, [spec] if spec else [], invalid=errors,
                            source=f"PUT /api/v1/jobs/{name}")
    outcome: Literal["created", "updated", "unchanged"] = (
        "created" if result.created else "updated" if result.updated else "unchanged")
    return (201 if outcome == "created" else 200), JobApplied(
        result=outcome, job=job_model(call.conn, name))


def delete_job(call: Call) -> tuple[int, BaseModel]:
    registry.delete(call.conn, call.args["name"])
    return 200, JobDeleted(name=call.args["name"])


def pause_job(call: Call) -> tuple[int, BaseModel]:
    registry.set_paused(call.conn, call.args["name"], True)
    return 200, job_model(call.conn, call.args["name"])


def resume_job(call: Call) -> tuple[int, BaseModel]:
    registry.set_paused(call.conn, call.args["name"], False)
    return 200, job_model(call.conn, call.args["name"])


def trigger_job(call: Call) -> tuple[int, BaseModel]:
    body: TriggerRequest = call.body
    run_id = runs.trigger(call.conn, call.args["name"], body.logical_time, body.params,
                          downstream=body.downstream)
    return 201, run_model(call.conn, run_id)


# ---------------------------------------------------------------- runs


def run_row(conn: Any, run_id: int) -> dict[str, Any]:
    row = conn.execute(q("web_run"), {"id": run_id}).fetchone()
    if row is None:
        raise NotFound(f"no run {run_id}")
    return dict(row)


def run_model(conn: Any, run_id: int) -> Run:
    return Run.model_validate(run_row(conn, run_id))


def list_runs(call: Call) -> tuple[int, BaseModel]:
    a = call.args
    before = int(a["cursor"]) if a["cursor"] is not None else None
    rows, cursor = runs.page_runs(call.conn, limit=a["limit"], before=before, job=a["job"],
                             state=a["state"], tenant=a["tenant"], trigger=a["trigger"],
                             since=a["since"], until=a["until"])
    items = [Run.model_validate(row) for row in rows]
    return 200, RunList(items=items, next_cursor=None if cursor is None else str(cursor))


def get_run(call: Call) -> tuple[int, BaseModel]:
    row = run_row(call.conn, call.args["id"])
    row["attempts"] = call.conn.execute(q("run_attempts"), {"id": row["id"]}).fetchall()
    if row["trigger"] == "dataset":
        row["trigger_events"] = datasets.run_events(call.conn, row["id"])[0]
    return 200, RunDetail.model_validate(row)


def retry_run(call: Call) -> tuple[int, BaseModel]:
    runs.retry(call.conn, call.args["id"])
    return 200, run_model(call.conn, call.args["id"])


def rerun_run(call: Call) -> tuple[int, BaseModel]:
    body: RerunRequest = call.body or RerunRequest()
    rerun.rerun(call.conn, call.args["id"], downstream=body.downstream)
    return 200, run_model(call.conn, call.args["id"])


class RunLogs(TextResponse):
    """The attempt's output from ``offset`` on (stdout, stderr and pgflow's notes as they
    arrived; a dropped middle shows as a marker line), as UTF-8 text."""

    headers: dict[str, str] = {
        "X-Pgflow-Next-Offset": "The offset to ask for next (bytes of the attempt's output).",
        "X-Pgflow-Attempt": "The attempt shown.",
        "X-Pgflow-Running": "true while the attempt runs: more output may come.",
    }


def run_logs(call: Call) -> Response:
    page = live.read_output(call.conn, call.args["id"], call.args["attempt"],
                            call.args["offset"])
    return Response(page.data, media_type="text/plain; charset=utf-8", headers={
        "X-Pgflow-Next-Offset": str(page.next_offset), "X-Pgflow-Attempt": str(page.attempt),
        "X-Pgflow-Running": "true" if page.running else "false", "Cache-Control": "no-store"})


def cancel_run(call: Call) -> tuple[int, BaseModel]:
    runs.cancel(call.conn, call.args["id"])
    return 200, run_model(call.conn, call.args["id"])


def ack_run(call: Call) -> tuple[int, BaseModel]:
    runs.ack(call.conn, call.args["id"])
    return 200, run_model(call.conn, call.args["id"])


# ---------------------------------------------------------------- backfills, breakers, status


def list_backfills(call: Call) -> tuple[int, BaseModel]:
    rows = backfill.list_backfills(call.conn, limit=call.args["limit"])
    return 200, BackfillList(items=[Backfill.model_validate(r) for r in rows])


def create_backfill(call: Call) -> tuple[int, BaseModel]:
    body: BackfillRequest = call.body
    if body.start >= body.end:
        raise ApiError(422, "start must be before end", [("end", "must be after start")])
    created = backfill.create(call.conn, body.job, body.start, body.end,
                              max_concurrency=body.max_concurrency, downstream=body.downstream,
                              reprocess=body.reprocess)
    return 201, Backfill.model_validate(backfill.show(call.conn, created["id"]))


def list_breakers(call: Call) -> tuple[int, BaseModel]:
    rows = breakers.list_breakers(call.conn)
    return 200, BreakerList(items=[Breaker.model_validate(r) for r in rows])


def _actor(call: Call) -> str | None:
    return call.identity.actor if call.identity else None


def open_breaker(call: Call) -> tuple[int, BaseModel]:
    body: BreakerChange = call.body
    row = breakers.open_breaker(call.conn, call.args["source"], body.reason, _actor(call))
    return 200, Breaker.model_validate(row)


def close_breaker(call: Call) -> tuple[int, BaseModel]:
    body: BreakerChange = call.body
    row = breakers.close_breaker(call.conn, call.args["source"], body.reason, _actor(call))
    return 200, Breaker.model_validate(row)


def list_tenants(call: Call) -> tuple[int, BaseModel]:
    rows = policies.list_tenants(call.conn)
    return 200, TenantList(items=[Tenant.model_validate(r) for r in rows])


def get_status(call: Call) -> tuple[int, BaseModel]:
    report = status.cluster_status(call.conn, call.state.settings.lease_ttl)
    report["open_breakers"] = breakers.open_sources(call.conn)
    report["incidents_firing"] = outbox.firing(call.conn)["firing"]
    return 200, Status.model_validate(report)


def list_alerts(call: Call) -> tuple[int, BaseModel]:
    return 200, AlertOverview.model_validate(outbox.overview(call.conn,
                                                             limit=call.args["limit"]))


def test_alert(call: Call) -> tuple[int, BaseModel]:
    result = outbox.send_test(call.conn, call.args["name"], call.state.settings.ui_url)
    answer = result.answer
    return 200, AlertTestResult(notification=result.notification_id, ok=answer.ok,
                                status=answer.status, error=answer.error)


# ---------------------------------------------------------------- the table

_STR = {"type": "string", "minLength": 1, "maxLength": 128}

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("GET", "/jobs", "listJobs", "List jobs by name, with each one's latest run.",
             "viewer", list_jobs, JobList, params=(
                 Param("q", "query", {"type": "string", "maxLength": 200},
                       "Only names containing this text (case-insensitive)."),
                 Param("tenant", "query", NAME_SCHEMA, "Only this tenant's jobs."),
                 Param("paused", "query", {"type": "boolean"}, "Only paused (or unpaused) jobs."),
                 Param("state", "query", {"type": "string", "enum": STATES},
                       "Only jobs whose latest run is in this state."),
                 _limit(100, 1000),
                 Param("cursor", "query", _STR, "next_cursor of the previous page."))),
    Endpoint("GET", "/jobs/{name}", "getJob", "One job's definition and state.", "viewer",
             get_job, Job, params=(JOB_NAME,), errors=(404,)),
    Endpoint("PUT", "/jobs/{name}", "putJob",
             "Register or update a job (same validation as 'pgflow apply'; admin).", "admin",
             put_job, JobApplied, params=(JOB_NAME,), body_schema={"$ref": "JobDefinition"},
             body_required=True, ok_also=(201,)),
    Endpoint("DELETE", "/jobs/{name}", "deleteJob",
             "Delete a job; its runs stay, unstarted ones are cancelled (admin).", "admin",
             delete_job, JobDeleted, params=(JOB_NAME,), errors=(404, 409)),
    Endpoint("POST", "/jobs/{name}/trigger", "triggerJob",
             "Create a manual run (and its downstream DAG run).", "operator", trigger_job, Run,
             ok=201, params=(JOB_NAME,), body=TriggerRequest, errors=(404, 409)),
    Endpoint("POST", "/jobs/{name}/pause", "pauseJob", "Stop scheduling a job.", "operator",
             pause_job, Job, params=(JOB_NAME,), errors=(404,)),
    Endpoint("POST", "/jobs/{name}/resume", "resumeJob", "Resume a paused job.", "operator",
             resume_job, Job, params=(JOB_NAME,), errors=(404,)),
    Endpoint("GET", "/runs", "listRuns",
             "List runs, newest first, filtered, by pages. Follow next_cursor until it is"
             " null: with filters that need a scan (tenant, trigger, since/until, job with"
             " state) a page looks at a bounded slice of history and may hold fewer runs"
             " than limit, even none, before the last page.",
             "viewer", list_runs, RunList, params=(
                 Param("job", "query", NAME_SCHEMA, "Only this job's runs."),
                 Param("state", "query", {"type": "string", "enum": STATES},
                       "Only runs in this state."),
                 Param("tenant", "query", NAME_SCHEMA, "Only this tenant's runs."),
                 Param("trigger", "query", {"type": "string", "enum": TRIGGERS},
                       "Only runs created this way."),
                 Param("since", "query", {"type": "string", "format": "date-time"},
                       "Only logical times at or after this."),
                 Param("until", "query", {"type": "string", "format": "date-time"},
                       "Only logical times before this."),
                 _limit(100, 1000),
                 Param("cursor", "query", {"type": "string", "pattern": r"^[0-9]{1,19}$"},
                       "next_cursor of the previous page."))),
    Endpoint("GET", "/runs/{id}", "getRun", "One run with its attempts and log tails.",
             "viewer", get_run, RunDetail, params=(RUN_ID,), errors=(404,)),
    Endpoint("POST", "/runs/{id}/retry", "retryRun",
             "Queue a failed or cancelled run again, with a fresh attempt budget.", "operator",
             retry_run, Run, params=(RUN_ID,), errors=(404, 409)),
    Endpoint("POST", "/runs/{id}/rerun", "rerunRun",
             "Run a finished run again as its next attempt, from a clean start (no"
             " checkpoint); with downstream, its downstream runs at the same logical time run"
             " again after it. Refused (409) while the run or a downstream run is active.",
             "operator", rerun_run, Run, params=(RUN_ID,), body=RerunRequest,
             errors=(404, 409)),
    Endpoint("GET", "/runs/{id}/logs", "getRunLogs",
             "An attempt's output, live while it runs: text from byte offset on; continue"
             " from X-Pgflow-Next-Offset while X-Pgflow-Running is true.", "viewer", run_logs,
             RunLogs, params=(
                 RUN_ID,
                 Param("attempt", "query", {"type": "integer", "minimum": 1,
                                            "maximum": 2**31 - 1},
                       "The attempt (default: the latest)."),
                 Param("offset", "query", {"type": "integer", "minimum": 0, "maximum": 2**62,
                                           "default": 0},
                       "Byte offset in the attempt's output to start from.")),
             errors=(404,)),
    Endpoint("POST", "/runs/{id}/cancel", "cancelRun",
             "Cancel a run (a running one is stopped by its worker).", "operator", cancel_run,
             Run, params=(RUN_ID,), errors=(404, 409)),
    Endpoint("POST", "/runs/{id}/ack", "ackRun",
             "Acknowledge a failed run (it leaves the dead letters).", "operator", ack_run, Run,
             params=(RUN_ID,), errors=(404, 409)),
    Endpoint("GET", "/backfills", "listBackfills", "Backfills, newest first.", "viewer",
             list_backfills, BackfillList, params=(_limit(100, 1000),)),
    Endpoint("POST", "/backfills", "createBackfill",
             "Backfill a scheduled job over [start, end).", "operator", create_backfill,
             Backfill, ok=201, body=BackfillRequest, body_required=True, errors=(404,)),
    Endpoint("GET", "/breakers", "listBreakers",
             "Circuit breakers of every known source, open first.", "viewer", list_breakers,
             BreakerList),
    Endpoint("POST", "/breakers/{source}/open", "openBreaker",
             "Open a source's breaker: its jobs' runs are held back.", "operator",
             open_breaker, Breaker, params=(SOURCE,), body=BreakerChange, errors=(409,)),
    Endpoint("POST", "/breakers/{source}/close", "closeBreaker",
             "Close a source's breaker.", "operator", close_breaker, Breaker,
             params=(SOURCE,), body=BreakerChange, errors=(404, 409)),
    Endpoint("GET", "/tenants", "listTenants",
             "Tenants (defined or used by a job): weight, cap, running and queued runs.",
             "viewer", list_tenants, TenantList),
    Endpoint("GET", "/alerts", "listAlerts",
             "Alert incidents (firing and recent), alert definitions and the delivery log.",
             "viewer", list_alerts, AlertOverview, params=(_limit(50, 500),)),
    Endpoint("POST", "/alerts/{name}/test", "testAlert",
             "Send a test notification to an alert now; says what the receiver answered"
             " (ok false: see status or error).", "operator", test_alert, AlertTestResult,
             params=(Param("name", "path", NAME_SCHEMA, "The alert's name.", required=True),),
             errors=(404,)),
    Endpoint("GET", "/status", "getStatus",
             "Replicas, the scheduling leader, queue depth and open breakers.", "viewer",
             get_status, Status),
)

# Datasets (pgflow/web/dataset_views.py): GET /datasets, POST /datasets/{name}/events.
ENDPOINTS = (*ENDPOINTS, *dataset_views.ENDPOINTS)
