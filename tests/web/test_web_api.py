"""The JSON API against a real server and database: roles, validation, every endpoint."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from engine import add_job, enqueue
from webhelpers import ROLES, Conn, auth, finished_run

from pgflow import breakers, tokens
from pgflow.web._endpoint import Endpoint, TextResponse
from pgflow.web.api import ENDPOINTS
from pgflow.web.openapi import document

T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
Headers = dict[str, dict[str, str]]


@pytest.fixture
def world(conn: Conn) -> dict[str, Any]:
    """Jobs a → b (a hourly, touching the warehouse), c alone, and a dead letter of c."""
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *",
            sources=["warehouse"], tenant="sales")
    add_job(conn, "b", entrypoint="jobfuncs:noop", depends_on=["a"], tenant="sales")
    add_job(conn, "c", entrypoint="jobfuncs:fail")
    dead = finished_run(conn, "c", T0, "failed")
    breakers.open_breaker(conn, "dock", "closed for the test", "tests")
    # An alert "c" whose receiver refuses connections (POST /alerts/c/test answers ok: false).
    conn.execute("INSERT INTO pgflow.alerts (name, url, events, definition)"
                 " VALUES ('c', 'http://127.0.0.1:9/', '{run_failed}', '{}')")
    return {"dead": dead, "queued": enqueue(conn, "a", T0 + timedelta(hours=1))}


def _sample(endpoint: Endpoint, world: dict[str, Any]) -> tuple[str, Any]:
    run_id = world["queued" if endpoint.operation_id == "cancelRun" else "dead"]
    source = "dock" if endpoint.operation_id == "closeBreaker" else "warehouse"
    path = "/api/v1" + endpoint.path.format(name="c", id=run_id, source=source)
    bodies: dict[str, Any] = {
        "putJob": {"entrypoint": "jobfuncs:noop"},
        "triggerJob": {},
        "createBackfill": {"job": "a", "start": T0.isoformat(),
                           "end": (T0 + timedelta(hours=2)).isoformat()},
        "openBreaker": {"reason": "maintenance"},
        "closeBreaker": {},
    }
    return path, bodies.get(endpoint.operation_id)


def _call(client: httpx.Client, endpoint: Endpoint, path: str, body: Any,
          headers: dict[str, str] | None) -> httpx.Response:
    return client.request(endpoint.method, path, headers=headers,
                          content=None if body is None else json.dumps(body))


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=[e.operation_id for e in ENDPOINTS])
def test_every_endpoint_enforces_its_role(client: httpx.Client, as_role: Headers,
                                          world: dict[str, Any], conn: Conn,
                                          endpoint: Endpoint) -> None:
    path, body = _sample(endpoint, world)
    anonymous = _call(client, endpoint, path, body, None)
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"].startswith("Bearer")
    assert anonymous.json()["error"].startswith("authentication required")
    assert _call(client, endpoint, path, body, auth("pgf_not-a-real-token")).status_code == 401
    assert _call(client, endpoint, path, body, {"Authorization": "Basic eDp5"}).status_code == 401
    needed = ROLES.index(endpoint.role or "viewer")
    for role in ROLES[:needed]:
        refused = _call(client, endpoint, path, body, as_role[role])
        assert refused.status_code == 403, (role, refused.text)
        assert f"needs the {endpoint.role} role" in refused.json()["error"]
    allowed = _call(client, endpoint, path, body, as_role[ROLES[needed]])
    assert allowed.status_code in (endpoint.ok, *endpoint.ok_also), allowed.text
    text = issubclass(endpoint.response, TextResponse)  # GET /runs/{id}/logs
    assert allowed.headers["content-type"] == (
        "text/plain; charset=utf-8" if text else "application/json")


def test_a_revoked_token_stops_working_at_once(client: httpx.Client, conn: Conn) -> None:
    secret = tokens.create(conn, "viewer")
    assert client.get("/api/v1/jobs", headers=auth(secret)).status_code == 200
    token_id = tokens.list_tokens(conn)[-1]["id"]
    tokens.revoke(conn, token_id)
    assert client.get("/api/v1/jobs", headers=auth(secret)).status_code == 401


# ---------------------------------------------------------------- jobs


def test_jobs_page_by_cursor_and_filter(client: httpx.Client, as_role: Headers,
                                        world: dict[str, Any], conn: Conn) -> None:
    viewer = as_role["viewer"]
    first = client.get("/api/v1/jobs", params={"limit": 2}, headers=viewer).json()
    assert [j["name"] for j in first["items"]] == ["a", "b"]
    assert first["next_cursor"] == "b"
    second = client.get("/api/v1/jobs", params={"limit": 2, "cursor": "b"}, headers=viewer).json()
    assert [j["name"] for j in second["items"]] == ["c"]
    assert second["next_cursor"] is None
    assert second["items"][0]["latest_state"] == "failed"
    sales = client.get("/api/v1/jobs", params={"tenant": "sales"}, headers=viewer).json()
    assert [j["name"] for j in sales["items"]] == ["a", "b"]
    search = client.get("/api/v1/jobs", params={"q": "C"}, headers=viewer).json()
    assert [j["name"] for j in search["items"]] == ["c"]
    failing = client.get("/api/v1/jobs", params={"state": "failed"}, headers=viewer).json()
    assert [j["name"] for j in failing["items"]] == ["c"]
    assert client.get("/api/v1/jobs", params={"paused": "true"},
                      headers=viewer).json()["items"] == []


def test_get_job_and_a_miss_suggests_a_name(client: httpx.Client, as_role: Headers,
                                            world: dict[str, Any]) -> None:
    job = client.get("/api/v1/jobs/a", headers=as_role["viewer"]).json()
    assert job["downstream"] == ["b"] and job["definition"]["sources"] == ["warehouse"]
    miss = client.get("/api/v1/jobs/bb", headers=as_role["viewer"])
    assert miss.status_code == 404
    assert "did you mean" in miss.json()["error"]


def test_put_job_creates_updates_and_reports_unchanged(client: httpx.Client,
                                                       as_role: Headers, conn: Conn) -> None:
    admin = as_role["admin"]
    body = {"entrypoint": "jobfuncs:noop", "schedule": "*/5 * * * *", "timeout": "2h",
            "retry": {"max_attempts": 4, "backoff": "10s"}}
    created = client.put("/api/v1/jobs/new", json=body, headers=admin)
    assert created.status_code == 201
    assert created.json()["result"] == "created"
    assert created.json()["job"]["definition"]["timeout"] == 7200
    same = client.put("/api/v1/jobs/new", json={**body, "name": "new"}, headers=admin)
    assert (same.status_code, same.json()["result"]) == (200, "unchanged")
    changed = client.put("/api/v1/jobs/new", json={**body, "priority": 5}, headers=admin)
    assert (changed.status_code, changed.json()["result"]) == (200, "updated")
    row = conn.execute("SELECT priority, next_fire_at FROM pgflow.jobs WHERE name = 'new'")
    assert row.fetchone()["priority"] == 5  # type: ignore[index]


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"entrypoint": "jobfuncs:noop", "schedul": "* * * * *"}, "schedul", "did you mean"),
    ({"entrypoint": "jobfuncs:noop", "schedule": "61 * * * *"}, "schedule", "minute"),
    ({"entrypoint": "jobfuncs:noop", "timezone": "Mars/Olympus"}, "timezone", "unknown timezone"),
    ({"command": "true", "entrypoint": "a:b"}, "body", "exactly one"),
    ({"entrypoint": "jobfuncs:noop", "depends_on": ["ghost"]}, "depends_on", "unknown upstream"),
    ({"entrypoint": "jobfuncs:noop", "priority": "5"}, "priority", "integer"),
    ({"entrypoint": "jobfuncs:noop", "priority": 10**30}, "priority", "less than"),
    ({"entrypoint": "jobfuncs:noop", "name": "other"}, "name", "does not match"),
    ({"entrypoint": "jobfuncs:noop", "params": {"k": "a\u0000b"}}, "params.k", "NUL"),
    ([1, 2], "body", "object"),
])
def test_put_job_rejects_what_apply_rejects(client: httpx.Client, as_role: Headers,
                                            conn: Conn, body: Any, field: str,
                                            words: str) -> None:
    response = client.put("/api/v1/jobs/j1", json=body, headers=as_role["admin"])
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert any(d["field"] == field and words in d["message"] for d in detail), detail
    assert conn.execute("SELECT count(*) AS n FROM pgflow.jobs").fetchone()["n"] == 0  # type: ignore[index]


def test_put_job_names_the_cycle(client: httpx.Client, as_role: Headers, conn: Conn) -> None:
    add_job(conn, "x", entrypoint="jobfuncs:noop")
    add_job(conn, "y", entrypoint="jobfuncs:noop", depends_on=["x"])
    response = client.put("/api/v1/jobs/x", json={"entrypoint": "jobfuncs:noop",
                                                  "depends_on": ["y"]},
                          headers=as_role["admin"])
    assert response.status_code == 422
    assert "dependency cycle" in response.json()["error"]


@pytest.mark.parametrize(("content", "status"), [
    (b"{not json", 400), (b"\xff\xfe", 400), (b'{"priority": NaN}', 400), (b"", 422),
    (b"[" * 100_000 + b"]" * 100_000, 400), (b'"text"', 422),
])
def test_malformed_bodies_are_client_errors(client: httpx.Client, as_role: Headers,
                                            content: bytes, status: int) -> None:
    response = client.put("/api/v1/jobs/j1", content=content, headers=as_role["admin"])
    assert response.status_code == status, response.text
    assert response.json()["error"]


def test_a_body_over_one_mebibyte_is_refused(client: httpx.Client, as_role: Headers) -> None:
    big = json.dumps({"entrypoint": "a:b", "params": {"x": "y" * (1 << 20)}})
    assert client.put("/api/v1/jobs/j1", content=big, headers=as_role["admin"]).status_code == 413


def test_delete_job_refuses_while_others_depend_on_it(client: httpx.Client, as_role: Headers,
                                                      world: dict[str, Any]) -> None:
    admin = as_role["admin"]
    refused = client.delete("/api/v1/jobs/a", headers=admin)
    assert refused.status_code == 409 and "downstream" in refused.json()["error"]
    assert client.delete("/api/v1/jobs/b", headers=admin).json() == {"name": "b",
                                                                     "deleted": True}
    assert client.delete("/api/v1/jobs/b", headers=admin).status_code == 404


def test_trigger_pause_and_resume(client: httpx.Client, as_role: Headers,
                                  world: dict[str, Any]) -> None:
    operator = as_role["operator"]
    at = "2026-02-01T00:00:00+01:00"
    run = client.post("/api/v1/jobs/a/trigger", headers=operator,
                      json={"logical_time": at, "params": {"region": "eu"}})
    assert run.status_code == 201
    assert run.json()["logical_time"] == "2026-01-31T23:00:00Z"
    assert run.json()["trigger"] == "manual" and run.json()["state"] == "queued"
    again = client.post("/api/v1/jobs/a/trigger", headers=operator, json={"logical_time": at})
    assert again.status_code == 409 and "already has run" in again.json()["error"]
    dag = client.get("/api/v1/runs", params={"job": "b"}, headers=operator).json()["items"]
    assert [r["state"] for r in dag] == ["pending"]
    assert client.post("/api/v1/jobs/zz/trigger", headers=operator).status_code == 404
    for body, field in (({"logical_time": "yesterday"}, "logical_time"),
                        ({"logical_time": 1700000000}, "logical_time"),
                        ({"params": [1]}, "params"), ({"downstream": "yes"}, "downstream"),
                        ({"extra": 1}, "extra")):
        bad = client.post("/api/v1/jobs/a/trigger", headers=operator, json=body)
        assert bad.status_code == 422, body
        assert bad.json()["detail"][0]["field"] == field
    paused = client.post("/api/v1/jobs/a/pause", headers=operator).json()
    assert paused["paused"] is True
    assert client.post("/api/v1/jobs/a/resume", headers=operator).json()["paused"] is False
    assert client.post("/api/v1/jobs/zz/pause", headers=operator).status_code == 404


# ---------------------------------------------------------------- runs


def test_runs_page_newest_first_by_cursor(client: httpx.Client, as_role: Headers,
                                          conn: Conn) -> None:
    add_job(conn, "r", entrypoint="jobfuncs:noop", tenant="t1")
    ids = [enqueue(conn, "r", T0 + timedelta(minutes=i)) for i in range(5)]
    viewer = as_role["viewer"]
    seen, cursor = [], None
    while True:
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = client.get("/api/v1/runs", params=params, headers=viewer).json()
        seen += [r["id"] for r in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(ids, reverse=True)
    window = client.get("/api/v1/runs", headers=viewer, params={
        "since": (T0 + timedelta(minutes=1)).isoformat(),
        "until": (T0 + timedelta(minutes=3)).isoformat(), "tenant": "t1",
        "trigger": "manual", "state": "queued"}).json()
    assert [r["id"] for r in window["items"]] == [ids[2], ids[1]]


@pytest.mark.parametrize(("params", "field"), [
    ({"state": "done"}, "state"), ({"limit": "0"}, "limit"), ({"limit": "1001"}, "limit"),
    ({"limit": "ten"}, "limit"), ({"cursor": "9" * 40}, "cursor"), ({"cursor": "-1"}, "cursor"),
    ({"since": "yesterday"}, "since"), ({"since": "0001-01-01T00:00:00+01:00"}, "since"),
    ({"job": "bad name"}, "job"), ({"tenant": "x\x00"}, "tenant"), ({"trigger": "cron"}, "trigger"),
])
def test_bad_run_filters_are_400_naming_the_parameter(client: httpx.Client, as_role: Headers,
                                                      params: dict[str, str],
                                                      field: str) -> None:
    response = client.get("/api/v1/runs", params=params, headers=as_role["viewer"])
    assert response.status_code == 400, response.text
    assert response.json()["detail"][0]["field"] == field


def test_run_detail_has_attempts_and_logs(client: httpx.Client, as_role: Headers,
                                          world: dict[str, Any]) -> None:
    run = client.get(f"/api/v1/runs/{world['dead']}", headers=as_role["viewer"]).json()
    assert run["state"] == "failed" and run["job_exists"] is True
    [attempt] = run["attempts"]
    assert attempt["outcome"] == "failed" and attempt["exit_code"] == 1
    assert attempt["stdout_tail"] == "hello from stdout"


@pytest.mark.parametrize(("run_id", "status"), [
    ("999999", 404), ("0", 400), ("-3", 400), ("abc", 400), ("9" * 30, 400),
    ("9223372036854775807", 404), ("9223372036854775808", 400), ("1e3", 400),
])
def test_hostile_run_ids(client: httpx.Client, as_role: Headers, run_id: str,
                         status: int) -> None:
    for method, suffix in (("GET", ""), ("POST", "/retry"), ("POST", "/cancel"),
                           ("POST", "/ack")):
        response = client.request(method, f"/api/v1/runs/{run_id}{suffix}",
                                  headers=as_role["operator"])
        assert response.status_code == status, (method, suffix, response.text)
        assert response.json()["error"]


def test_retry_cancel_ack_follow_the_run_states(client: httpx.Client, as_role: Headers,
                                                world: dict[str, Any], conn: Conn) -> None:
    operator, dead = as_role["operator"], world["dead"]
    acked = client.post(f"/api/v1/runs/{dead}/ack", headers=operator)
    assert acked.status_code == 200 and acked.json()["acked_at"] is not None
    again = client.post(f"/api/v1/runs/{dead}/ack", headers=operator)
    assert again.status_code == 409 and "already acknowledged" in again.json()["error"]
    retried = client.post(f"/api/v1/runs/{dead}/retry", headers=operator).json()
    assert retried["state"] == "queued" and retried["max_attempts"] == 2
    assert client.post(f"/api/v1/runs/{dead}/retry", headers=operator).status_code == 409
    cancelled = client.post(f"/api/v1/runs/{dead}/cancel", headers=operator).json()
    assert cancelled["state"] == "cancelled"
    assert client.post(f"/api/v1/runs/{dead}/cancel", headers=operator).status_code == 409


# ---------------------------------------------------------------- backfills, breakers, status


def test_backfills(client: httpx.Client, as_role: Headers, world: dict[str, Any]) -> None:
    operator = as_role["operator"]
    body = {"job": "a", "start": "2026-01-01T00:00:00Z", "end": "2026-01-01T05:00:00Z",
            "max_concurrency": 3, "downstream": True}
    created = client.post("/api/v1/backfills", json=body, headers=operator)
    assert created.status_code == 201, created.text
    assert created.json()["ticks"] == 5 and created.json()["counts"] == {"pending": 10}
    listed = client.get("/api/v1/backfills", headers=as_role["viewer"]).json()["items"]
    assert [b["id"] for b in listed] == [created.json()["id"]]
    for bad, field in (({**body, "end": body["start"]}, "end"),
                       ({**body, "max_concurrency": 0}, "max_concurrency"),
                       ({**body, "max_concurrency": 2**70}, "max_concurrency"),
                       ({**body, "start": "2026-13-01T00:00:00Z"}, "start"),
                       ({k: v for k, v in body.items() if k != "job"}, "job")):
        response = client.post("/api/v1/backfills", json=bad, headers=operator)
        assert response.status_code == 422, bad
        assert response.json()["detail"][0]["field"] == field
    unscheduled = client.post("/api/v1/backfills", json={**body, "job": "b"}, headers=operator)
    assert unscheduled.status_code == 422 and "no schedule" in unscheduled.json()["error"]
    missing = client.post("/api/v1/backfills", json={**body, "job": "zz"}, headers=operator)
    assert missing.status_code == 404


def test_breakers_open_and_close(client: httpx.Client, as_role: Headers,
                                 world: dict[str, Any], conn: Conn) -> None:
    operator = as_role["operator"]
    listed = client.get("/api/v1/breakers", headers=as_role["viewer"]).json()["items"]
    assert [{k: b[k] for k in ("source", "state", "reason", "changed_at", "changed_by",
                                "jobs", "failures", "held_runs")} for b in listed[1:]] == [
        {"source": "warehouse", "state": "closed", "reason": None, "changed_at": None,
         "changed_by": None, "jobs": 1, "failures": 0, "held_runs": 0}]
    assert listed[0]["source"] == "dock" and listed[0]["state"] == "open"
    opened = client.post("/api/v1/breakers/warehouse/open", json={"reason": "maintenance"},
                         headers=operator).json()
    assert opened["state"] == "open" and opened["reason"] == "maintenance"
    assert opened["changed_by"] == "token 2 (operator, operator for tests)"
    twice = client.post("/api/v1/breakers/warehouse/open", headers=operator)
    assert twice.status_code == 409 and "already open" in twice.json()["error"]
    status = client.get("/api/v1/status", headers=as_role["viewer"]).json()
    assert status["open_breakers"] == ["dock", "warehouse"]
    closed = client.post("/api/v1/breakers/warehouse/close", headers=operator).json()
    assert closed["state"] == "closed"
    assert client.post("/api/v1/breakers/warehouse/close", headers=operator).status_code == 409
    assert client.post("/api/v1/breakers/nowhere/close", headers=operator).status_code == 404
    assert client.post("/api/v1/breakers/bad%20name/open", headers=operator).status_code == 400


def test_status_reports_queue_and_dead_letters(client: httpx.Client, as_role: Headers,
                                               world: dict[str, Any], conn: Conn) -> None:
    enqueue(conn, "a", T0)
    status = client.get("/api/v1/status", headers=as_role["viewer"]).json()
    assert status["queue"]["by_state"]["queued"] == 2
    assert status["queue"]["dead_letters"] == 1
    assert status["leader"] is None and status["replicas"] == []


def test_unknown_paths_and_methods_answer_json(client: httpx.Client, as_role: Headers) -> None:
    missing = client.get("/api/v1/nothing", headers=as_role["viewer"])
    assert missing.status_code == 404 and missing.json()["error"].startswith("no such endpoint")
    wrong = client.patch("/api/v1/jobs/a", headers=as_role["admin"])
    assert wrong.status_code == 405 and "PATCH" in wrong.json()["error"]


def test_openapi_documents_every_endpoint_and_status(client: httpx.Client) -> None:
    doc = client.get("/api/v1/openapi.json").json()
    assert doc == json.loads(json.dumps(document()))
    assert doc["openapi"] == "3.1.0"
    for endpoint in ENDPOINTS:
        operation = doc["paths"]["/api/v1" + endpoint.path][endpoint.method.lower()]
        assert operation["operationId"] == endpoint.operation_id
        documented = set(operation["responses"])
        assert {str(endpoint.ok), "401", "403", "503"} <= documented
        assert operation["security"] == [{"bearerAuth": []}]
    refs = json.dumps(doc).count('"$ref": "#/components/schemas/')
    assert refs > 0
    for name in json.dumps(doc).split('"#/components/schemas/')[1:]:
        assert name.split('"')[0] in doc["components"]["schemas"]


def test_non_ascii_digits_are_not_ids(client: httpx.Client, as_role: Headers) -> None:
    response = client.get("/api/v1/runs/\u0661\u0662", headers=as_role["viewer"])
    assert response.status_code == 400


def test_a_definition_read_back_can_be_put_again(client: httpx.Client, as_role: Headers,
                                                 world: dict[str, Any]) -> None:
    definition = client.get("/api/v1/jobs/a", headers=as_role["viewer"]).json()["definition"]
    again = client.put("/api/v1/jobs/a", json=definition, headers=as_role["admin"])
    assert (again.status_code, again.json()["result"]) == (200, "unchanged")
