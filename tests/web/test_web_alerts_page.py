"""Alerts over HTTP: GET /api/v1/alerts, POST /api/v1/alerts/{name}/test (roles, 404),
the /alerts page, the firing banner on every page (in Chromium), /metrics gauges."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from alerting import Receiver, apply_toml, evaluate_once
from webhelpers import Conn, ServerThread, csrf_of

from pgflow import breakers, tokens

Headers = dict[str, dict[str, str]]
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.close()


@pytest.fixture
def firing(conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    """An alert, and a breaker_opened incident firing."""
    apply_toml(conn, tmp_path / "a.toml", f'[alerts.oncall]\nurl = "{receiver.url()}"\n')
    breakers.open_breaker(conn, "warehouse", "maintenance window", "test")
    assert evaluate_once(db_url).opened == {"breaker_opened": 1}


def test_api_lists_incidents_definitions_and_deliveries(
        client: httpx.Client, as_role: Headers, firing: None) -> None:
    assert client.get("/api/v1/alerts").status_code == 401
    body = client.get("/api/v1/alerts", headers=as_role["viewer"]).json()
    [active] = body["active"]
    assert active["event"] == "breaker_opened" and active["source"] == "warehouse"
    assert active["resolved_at"] is None and "maintenance window" in active["summary"]
    assert [a["name"] for a in body["alerts"]] == ["oncall"]
    status = client.get("/api/v1/status", headers=as_role["viewer"]).json()
    assert status["incidents_firing"] == 1
    [delivery] = body["deliveries"]
    assert (delivery["alert"], delivery["event"], delivery["status"], delivery["delivery"]) == (
        "oncall", "breaker_opened", "firing", "pending")


def test_api_test_send_needs_operator_and_reports_the_answer(
        client: httpx.Client, as_role: Headers, firing: None, receiver: Receiver) -> None:
    denied = client.post("/api/v1/alerts/oncall/test", headers=as_role["viewer"])
    assert denied.status_code == 403
    missing = client.post("/api/v1/alerts/nobody/test", headers=as_role["operator"])
    assert missing.status_code == 404 and "unknown alert 'nobody'" in missing.json()["error"]
    ok = client.post("/api/v1/alerts/oncall/test", headers=as_role["operator"]).json()
    assert ok["ok"] is True and ok["status"] == 200
    assert receiver.bodies()[-1]["id"] == ok["notification"]
    receiver.answers["/hook"] = [500]
    failed = client.post("/api/v1/alerts/oncall/test", headers=as_role["operator"]).json()
    assert failed["ok"] is False and failed["status"] == 500


def test_openapi_documents_the_alert_endpoints(client: httpx.Client) -> None:
    paths = client.get("/api/v1/openapi.json").json()["paths"]
    assert paths["/api/v1/alerts"]["get"]["operationId"] == "listAlerts"
    test = paths["/api/v1/alerts/{name}/test"]["post"]
    assert test["operationId"] == "testAlert" and "404" in test["responses"]


def test_metrics_expose_open_incidents_and_the_backlog(client: httpx.Client,
                                                       firing: None) -> None:
    text = client.get("/metrics").text
    assert 'pgflow_alert_incidents_open{event="breaker_opened"} 1.0' in text
    assert 'pgflow_alert_notifications{delivery="pending"} 1.0' in text


def test_the_send_test_button_needs_a_csrf_token(client: httpx.Client, conn: Conn,
                                                 firing: None, receiver: Receiver) -> None:
    secret = tokens.create(conn, "operator", note="ui")
    login = client.get("/login")
    logged = client.post("/login", data={"token": secret, "csrf": csrf_of(login.text),
                                         "next": "/alerts"})
    assert logged.status_code == 303
    page = client.get("/alerts")
    assert page.status_code == 200 and "breaker_opened" in page.text
    assert 'id="alert-banner"' in page.text
    assert client.post("/alerts/oncall/test", data={}).status_code == 403
    sent = client.post("/alerts/oncall/test", data={"csrf": csrf_of(page.text)})
    assert sent.status_code == 303 and receiver.bodies()[-1]["event"] == "test"


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no system Chromium at /usr/bin/chromium")
def test_banner_on_every_page_and_the_alerts_page_in_a_browser(
        server: ServerThread, conn: Conn, firing: None) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    secret = tokens.create(conn, "viewer", note="browser")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        try:
            page: Any = browser.new_page()
            page.set_default_timeout(15_000)
            page.goto(server.url + "/jobs")
            page.fill("input[name=token]", secret)
            page.click("button[type=submit]")
            page.wait_for_url(re.compile(re.escape(server.url + "/jobs") + "$"))
            banner = page.locator("#alert-banner")
            assert "1 incident(s) firing" in banner.inner_text()
            page.goto(server.url + "/")
            assert page.locator("#alert-banner").is_visible()
            assert "warehouse" in page.locator("#active-incidents").inner_text()
            page.click("#alert-banner a")
            page.wait_for_url(re.compile(r"/alerts$"))
            firing_rows = page.locator("#incidents-firing tr[data-event=breaker_opened]")
            assert firing_rows.count() == 1
            assert "oncall" in page.locator("#alert-definitions").inner_text()
            assert page.locator("#deliveries tr[data-delivery=pending]").count() == 1
            artifacts = Path(__file__).resolve().parents[2] / "test-artifacts"
            artifacts.mkdir(exist_ok=True)
            page.screenshot(path=str(artifacts / "alerts.png"), full_page=True)
        finally:
            browser.close()
