"""The admin pages over HTTP (no browser): login, sessions, CSRF, roles, every page."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from engine import add_job, enqueue
from webhelpers import Conn, csrf_of, finished_run

from pgflow import tokens
from pgflow.web.auth import SESSION_COOKIE

T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)


def login(client: httpx.Client, secret: str) -> str:
    """Log in with ``secret``; return the session's CSRF token."""
    form = client.get("/login")
    assert form.status_code == 200
    done = client.post("/login", data={"token": secret, "csrf": csrf_of(form.text),
                                       "next": "/jobs"})
    assert done.status_code == 303 and done.headers["location"] == "/jobs"
    return csrf_of(client.get("/jobs").text)


@pytest.fixture
def world(conn: Conn) -> dict[str, Any]:
    add_job(conn, "extract", entrypoint="jobfuncs:noop", schedule="0 * * * *",
            sources=["warehouse"], tenant="sales")
    add_job(conn, "transform", entrypoint="jobfuncs:noop", depends_on=["extract"],
            tenant="sales")
    add_job(conn, "report", entrypoint="jobfuncs:noop", depends_on=["transform"])
    ok = [finished_run(conn, "extract", T0 + timedelta(hours=i), "succeeded", seconds=2 + i)
          for i in range(5)]
    dead = finished_run(conn, "transform", T0, "failed", error="KeyError: 'region'")
    return {"ok": ok, "dead": dead}


def test_pages_need_a_session(client: httpx.Client) -> None:
    for path in ("/", "/jobs", "/jobs/x", "/runs/1", "/dead-letters", "/replicas"):
        response = client.get(path)
        assert response.status_code == 303
        assert response.headers["location"].startswith("/login?next=")


def test_login_sets_a_signed_httponly_lax_cookie(client: httpx.Client,
                                                 secrets_by_role: dict[str, str]) -> None:
    form = client.get("/login")
    assert "csp" not in form.headers and "default-src 'none'" in form.headers[
        "content-security-policy"]
    no_csrf = client.post("/login", data={"token": secrets_by_role["viewer"]})
    assert no_csrf.status_code == 403
    wrong = client.post("/login", data={"token": "pgf_wrong", "csrf": csrf_of(form.text)})
    assert wrong.status_code == 401 and "unknown or revoked token" in wrong.text
    form = client.get("/login")
    done = client.post("/login", data={"token": secrets_by_role["viewer"],
                                       "csrf": csrf_of(form.text), "next": "//evil.example"})
    assert done.status_code == 303 and done.headers["location"] == "/"
    cookie = next(h for h in done.headers.get_list("set-cookie")
                  if h.startswith(SESSION_COOKIE))
    assert "HttpOnly" in cookie and "SameSite=lax" in cookie and "Path=/" in cookie
    assert client.get("/").status_code == 200


def test_a_tampered_or_revoked_session_goes_back_to_login(client: httpx.Client,
                                                          conn: Conn) -> None:
    secret = tokens.create(conn, "viewer")
    login(client, secret)
    value = client.cookies[SESSION_COOKIE]
    client.cookies.set(SESSION_COOKIE, value[:-2] + ("AA" if value[-2:] != "AA" else "BB"))
    assert client.get("/jobs").status_code == 303
    client.cookies.set(SESSION_COOKIE, value)
    assert client.get("/jobs").status_code == 200
    tokens.revoke(conn, tokens.list_tokens(conn)[-1]["id"])
    assert client.get("/jobs").status_code == 303


FORMS = ["/jobs/extract/pause", "/jobs/extract/resume", "/jobs/extract/trigger",
         "/jobs/report/delete", "/runs/{dead}/retry", "/runs/{dead}/cancel", "/runs/{dead}/ack",
         "/dead-letters", "/backfills", "/backfills/1/cancel", "/breakers/warehouse/open",
         "/breakers/warehouse/close", "/logout"]


@pytest.mark.parametrize("form", FORMS)
def test_every_form_without_a_csrf_token_is_403(client: httpx.Client, world: dict[str, Any],
                                                secrets_by_role: dict[str, str], conn: Conn,
                                                form: str) -> None:
    csrf = login(client, secrets_by_role["admin"])
    path = form.format(dead=world["dead"])
    before = conn.execute("SELECT count(*) AS n, sum(id) AS s FROM pgflow.runs").fetchone()
    tampered = csrf[:-1] + ("y" if csrf.endswith("x") else "x")
    for data in ({}, {"csrf": ""}, {"csrf": tampered}, {"csrf": csrf * 2}):
        response = client.post(path, data={**data, "ids": str(world["dead"]),
                                           "action": "retry"})
        assert response.status_code == 403, (data, response.status_code)
        assert "CSRF" in response.text
    assert conn.execute("SELECT count(*) AS n, sum(id) AS s FROM pgflow.runs").fetchone() == before
    assert client.get("/jobs").status_code == 200  # still logged in


def test_a_viewer_cannot_act_even_with_a_valid_token(client: httpx.Client,
                                                     world: dict[str, Any],
                                                     secrets_by_role: dict[str, str]) -> None:
    csrf = login(client, secrets_by_role["viewer"])
    page = client.get("/jobs/extract").text
    assert "Trigger run" not in page and "Pause" not in page
    response = client.post("/jobs/extract/pause", data={"csrf": csrf})
    assert response.status_code == 403 and "needs the operator role" in response.text
    operator = httpx.Client(base_url=str(client.base_url), follow_redirects=False)
    csrf = login(operator, secrets_by_role["operator"])
    deleted = operator.post("/jobs/report/delete", data={"csrf": csrf})
    assert deleted.status_code == 403 and "needs the admin role" in deleted.text
    operator.close()


def test_every_page_renders(client: httpx.Client, world: dict[str, Any],
                            secrets_by_role: dict[str, str], conn: Conn) -> None:
    login(client, secrets_by_role["viewer"])
    enqueue(conn, "report", T0)
    pages = {
        "/": ["Dashboard", "Runs finished per minute", 'id="dead-letters">1<',
              "dead letter(s) need retry", "No scheduling leader"],
        "/jobs": ["extract", "transform", "3 matching"],
        "/jobs?q=trans&state=failed": ["transform", "1 matching"],
        "/jobs?tenant=sales&state=paused": ["No jobs match"],
        "/jobs/extract": ['class="graph"', 'data-job="report"', 'class="histogram"', "p95",
                          "100.0%", "Next fire times".lower()],
        f"/runs/{world['dead']}": ["KeyError: &#39;region&#39;", "hello from stdout",
                                   'class="timeline"'],
        "/runs": ["transform", "extract"],
        "/runs?state=failed&job=transform": [f">{world['dead']}<"],
        "/dead-letters": ["KeyError", f'value="{world["dead"]}"'],
        "/backfills": ["No backfills yet"],
        "/replicas": ["No leader"],
        "/breakers": ["warehouse"],
        "/tenants": ["sales", "default"],
        f"/jobs/extract/dag?at={T0.isoformat().replace('+', '%2B')}": ['class="graph"',
                                                                         "transform"],
        "/jobs/transform/dag": ["DAG run of"],
    }
    for path, needles in pages.items():
        response = client.get(path)
        assert response.status_code == 200, (path, response.text[:500])
        for needle in needles:
            assert needle in response.text, (path, needle)


@pytest.mark.parametrize(("path", "status"), [
    ("/jobs/nope", 404), ("/runs/999", 404), ("/runs/abc", 404), ("/runs/" + "9" * 40, 404),
    ("/jobs?state=bogus", 400), ("/runs?cursor=-1", 400), ("/no/such/page", 404),
    ("/jobs/extract/dag?at=yesterday", 400), ("/jobs/bad%20name", 404),
])
def test_bad_pages_are_html_errors(client: httpx.Client, world: dict[str, Any],
                                   secrets_by_role: dict[str, str], path: str,
                                   status: int) -> None:
    login(client, secrets_by_role["viewer"])
    response = client.get(path)
    assert response.status_code == status
    assert response.headers["content-type"].startswith("text/html")


def _flash(client: httpx.Client, response: httpx.Response) -> str:
    assert response.status_code == 303, response.text
    page = client.get(response.headers["location"]).text
    match = re.search(r'<div class="flash (\w+)" role="status">([^<]*)</div>', page)
    assert match, page[:2000]
    return f"{match.group(1)}: {match.group(2)}"


def test_operator_actions(client: httpx.Client, world: dict[str, Any],
                          secrets_by_role: dict[str, str], conn: Conn) -> None:
    csrf = login(client, secrets_by_role["operator"])
    assert _flash(client, client.post("/jobs/extract/pause", data={
        "csrf": csrf, "next": "/jobs/extract"})) == "ok: job extract paused"
    trigger = client.post("/jobs/extract/trigger", data={
        "csrf": csrf, "logical_time": "2026-03-01T00:00:00Z", "params": '{"region": "eu"}',
        "downstream": "1"})
    run_id = int(trigger.headers["location"].rsplit("/", 1)[1])
    assert _flash(client, trigger) == f"ok: run {run_id} of extract created"
    again = client.post("/jobs/extract/trigger", data={
        "csrf": csrf, "logical_time": "2026-03-01T00:00:00Z", "next": "/jobs/extract"})
    assert _flash(client, again).startswith("error: job &#39;extract&#39; already has run")
    bad = client.post("/jobs/extract/trigger", data={"csrf": csrf, "params": "[1]",
                                                     "next": "/jobs/extract"})
    assert _flash(client, bad).startswith("error: params must be a JSON object")
    assert _flash(client, client.post(f"/runs/{run_id}/cancel", data={"csrf": csrf})) == (
        f"ok: run {run_id}: cancelled")
    bulk = client.post("/dead-letters", data={"csrf": csrf, "action": "retry",
                                              "ids": [str(world["dead"]), str(run_id)]})
    assert _flash(client, bulk).startswith("ok: 2 run(s) queued for retry")
    assert _flash(client, client.post("/breakers/warehouse/open", data={
        "csrf": csrf, "reason": "upgrade"})).startswith("ok: breaker of warehouse opened")
    assert "upgrade" in client.get("/breakers").text
    assert _flash(client, client.post("/breakers/warehouse/close", data={"csrf": csrf})) == (
        "ok: breaker of warehouse closed")
    backfill = client.post("/backfills", data={
        "csrf": csrf, "job": "extract", "start": "2026-02-01T00:00:00Z",
        "end": "2026-02-01T03:00:00Z", "max_concurrency": "2"})
    assert _flash(client, backfill).startswith("ok: backfill 1 of extract: 3 run(s) created")
    assert _flash(client, client.post("/backfills/1/cancel", data={"csrf": csrf})).startswith(
        "ok: backfill 1 cancelled")
    assert _flash(client, client.post("/logout", data={"csrf": csrf})) == "ok: logged out"
    assert client.get("/jobs").status_code == 303


def test_admin_deletes_a_job(client: httpx.Client, world: dict[str, Any],
                             secrets_by_role: dict[str, str], conn: Conn) -> None:
    csrf = login(client, secrets_by_role["admin"])
    assert "Delete job" in client.get("/jobs/report").text
    response = client.post("/jobs/report/delete", data={"csrf": csrf})
    assert response.headers["location"] == "/jobs"
    assert conn.execute("SELECT count(*) AS n FROM pgflow.jobs").fetchone()["n"] == 2  # type: ignore[index]


def test_times_in_utc_or_a_chosen_zone(client: httpx.Client, world: dict[str, Any],
                                       secrets_by_role: dict[str, str]) -> None:
    login(client, secrets_by_role["viewer"])
    path = f"/runs/{world['dead']}"
    assert "2026-01-05 10:00:00 UTC" in client.get(path).text
    local = client.get("/prefs/tz", params={"zone": "local", "next": path})
    assert local.status_code == 200 and 'name="zone"' in local.text
    assert client.get("/prefs/tz", params={"zone": "Mars/Base"}).status_code == 400
    chosen = client.get("/prefs/tz", params={"zone": "Asia/Tokyo", "next": path})
    assert chosen.status_code == 303 and chosen.headers["location"] == path
    assert "2026-01-05 19:00:00 JST" in client.get(path).text
    assert client.get("/prefs/tz", params={"zone": "UTC", "next": "https://evil.example/"}
                      ).headers["location"] == "/"


def test_health_readiness_and_metrics_access(client: httpx.Client, conn: Conn,
                                             secrets_by_role: dict[str, str]) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}
    local = client.get("/metrics")
    assert local.status_code == 200 and "pgflow_database_up 1.0" in local.text
    remote = {"X-Forwarded-For": "203.0.113.9"}
    assert client.get("/metrics", headers=remote).status_code == 401
    viewer = {**remote, "Authorization": f"Bearer {secrets_by_role['viewer']}"}
    assert client.get("/metrics", headers=viewer).status_code == 200
    conn.execute("DELETE FROM pgflow.schema_migrations WHERE version ="
                 " (SELECT max(version) FROM pgflow.schema_migrations)")
    not_ready = client.get("/readyz")
    assert not_ready.status_code == 503
    assert "pending migrations" in not_ready.json()["reason"]


def test_hostile_form_values_are_refused_not_crashes(client: httpx.Client,
                                                     world: dict[str, Any],
                                                     secrets_by_role: dict[str, str]) -> None:
    csrf = login(client, secrets_by_role["operator"])
    cases = [
        ("/jobs/extract/trigger", {"params": '{"a": "\\ud800"}'}, "error: invalid value"),
        ("/jobs/extract/trigger", {"params": '{"a": "x\\u0000"}'}, "error: invalid value"),
        ("/jobs/extract/trigger", {"params": "[" * 50_000}, "error: params must be"),
        ("/jobs/extract/trigger", {"logical_time": "0001-01-01T00:00:00+01:00"},
         "error: expected an ISO 8601 time"),
        ("/backfills", {"job": "a\x00b", "start": "2026-01-01T00:00:00Z",
                        "end": "2026-01-02T00:00:00Z"}, "error: no job named"),
        ("/backfills", {"job": "extract", "start": "2026-01-02T00:00:00Z",
                        "end": "2026-01-01T00:00:00Z"}, "error: start must be before end"),
        ("/dead-letters", {"action": "retry", "ids": "\u0661\u0662"},
         "error: select at least one run"),
        ("/breakers/warehouse/open", {"reason": "x\x00"}, "error: a reason is plain text"),
    ]
    for path, data, flash in cases:
        response = client.post(path, data={"csrf": csrf, "next": "/jobs/extract", **data})
        assert _flash(client, response).startswith(flash), (path, data)
    assert client.get("/runs/\u0661\u0662").status_code == 404
