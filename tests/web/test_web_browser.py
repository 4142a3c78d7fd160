"""The admin UI in a real browser: the system Chromium driven by Playwright.

A user logs in with a token, opens a job and sees its lineage graph and duration
histogram, triggers a run and watches it succeed (an in-process worker runs it),
retries a dead letter, and switches times to local. Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from engine import WorkerThread, add_job
from webhelpers import Conn, ServerThread, finished_run

from pgflow import tokens
from pgflow.web import svg

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="no system Chromium at /usr/bin/chromium"
    " (apt-get install -y chromium)")


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def log_in(page: Any, server: ServerThread, secret: str, target: str = "/") -> None:
    page.goto(server.url + target)
    assert "/login" in page.url
    page.fill("input[name=token]", secret)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(re.escape(server.url + target) + r"$"))


@pytest.fixture
def pipeline(conn: Conn) -> dict[str, Any]:
    add_job(conn, "extract", entrypoint="jobfuncs:noop", schedule="0 * * * *", tenant="sales",
            sources=["warehouse"])
    add_job(conn, "transform", entrypoint="jobfuncs:noop", depends_on=["extract"],
            tenant="sales")
    add_job(conn, "report", entrypoint="jobfuncs:noop", depends_on=["transform"])
    for i in range(30):
        at = T0 + timedelta(hours=i)
        finished_run(conn, "extract", at, "succeeded", seconds=1 + i % 7)
        # transform fails at hours 5, 15 and 25; report's dead letter is at T0, behind a
        # transform that succeeded (a retry behind a failed upstream is refused).
        finished_run(conn, "transform", at, "succeeded" if i % 10 != 5 else "failed",
                     seconds=20 + 3 * (i % 11))
    dead = finished_run(conn, "report", T0, "failed", error="ValueError: empty report")
    return {"dead": dead}


@pytest.fixture
def worker(db_url: str) -> Iterator[WorkerThread]:
    running = WorkerThread(db_url, concurrency=2, worker_id="browser-test-worker")
    yield running
    running.stop()


def test_open_a_job_and_see_its_lineage_and_histogram(page: Any, server: ServerThread,
                                                      pipeline: dict[str, Any],
                                                      conn: Conn) -> None:
    log_in(page, server, tokens.create(conn, "viewer"))
    assert page.locator("h1").inner_text() == "Dashboard"
    shot(page, "dashboard")
    page.click("header a:has-text('Jobs')")
    page.fill("input[name=q]", "trans")
    page.click("button:has-text('Filter')")
    page.click("table.jobs a:has-text('transform')")
    page.wait_for_url(server.url + "/jobs/transform")
    graph = page.locator("svg.graph")
    assert graph.is_visible()
    nodes = {n.get_attribute("data-job"): n.get_attribute("data-state")
             for n in graph.locator("a.node").all()}
    assert nodes == {"extract": "succeeded", "transform": "succeeded", "report": "failed"}
    assert graph.locator("path.edge").count() == 2
    histogram = page.locator("svg.histogram")
    assert histogram.is_visible()
    assert histogram.locator("rect.bar").count() >= 5
    assert histogram.locator("line.p50").count() == 1
    assert histogram.locator("line.p95").count() == 1
    durations = sorted(20.0 + 3 * (i % 11) for i in range(30) if i % 10 != 5)
    assert page.locator("#p95").inner_text() == svg.human_seconds(
        svg.percentile(durations, 0.95) or 0)
    assert page.locator("#success-rate").inner_text().startswith("90.0%")
    assert "Trigger run" not in page.content()  # a viewer gets no action forms
    shot(page, "job-detail")
    graph.locator("a.node[data-job=report]").click()
    page.wait_for_url(server.url + "/jobs/report")
    assert page.locator("svg.graph a.node").count() == 3


def test_trigger_a_run_and_watch_it_succeed(page: Any, server: ServerThread,
                                            pipeline: dict[str, Any], conn: Conn,
                                            worker: WorkerThread) -> None:
    log_in(page, server, tokens.create(conn, "operator"), "/jobs/extract")
    page.fill("#trigger-form input[name=logical_time]", "2026-06-01T00:00:00Z")
    page.click("#trigger-form button[type=submit]")
    page.wait_for_url(re.compile(r"/runs/\d+$"))
    assert "created" in page.locator(".flash.ok").inner_text()
    run_url = page.url
    # The page refreshes itself every few seconds while the run is active.
    page.locator("#run-state [data-state=succeeded]").wait_for(timeout=40_000)
    assert page.locator("table.attempts").inner_text().count("succeeded") == 1
    assert page.locator("svg.timeline rect.attempt").count() == 1
    shot(page, "run-succeeded")
    # The trigger started the DAG run: downstream jobs follow at the same logical time.
    page.click("a:has-text('DAG run')")
    for job in ("transform", "report"):
        page.locator(f"svg.graph a.node[data-job={job}][data-state=succeeded]").wait_for(
            timeout=40_000)
    shot(page, "dag-run")
    assert run_url.startswith(server.url)


def test_retry_a_dead_letter(page: Any, server: ServerThread, pipeline: dict[str, Any],
                             conn: Conn, worker: WorkerThread) -> None:
    dead = pipeline["dead"]
    log_in(page, server, tokens.create(conn, "operator"), "/dead-letters")
    assert "ValueError: empty report" in page.locator("table.dead").inner_text()
    shot(page, "dead-letters")
    page.check(f"input[name=ids][value='{dead}']")
    page.click("button:has-text('Retry selected')")
    page.wait_for_url(server.url + "/dead-letters")
    assert page.locator(".flash.ok").inner_text() == "1 run(s) queued for retry"
    assert page.locator(f"input[name=ids][value='{dead}']").count() == 0
    page.goto(f"{server.url}/runs/{dead}")
    page.locator("#run-state [data-state=succeeded]").wait_for(timeout=40_000)
    assert page.locator("table.attempts tr").count() == 3  # header, the failure, the retry
    shot(page, "dead-letter-retried")


def test_local_time_with_and_without_javascript(browser: Any, server: ServerThread,
                                                pipeline: dict[str, Any], conn: Conn) -> None:
    secret = tokens.create(conn, "viewer")
    path = f"/runs/{pipeline['dead']}"
    scripted = browser.new_context(timezone_id="Asia/Tokyo").new_page()
    log_in(scripted, server, secret, path)
    assert "2026-01-05 10:00:00 UTC" in scripted.content()
    scripted.click("a[data-local-tz]")
    scripted.wait_for_url(server.url + path)
    assert "2026-01-05 19:00:00 JST" in scripted.content()
    shot(scripted, "local-time")
    scripted.context.close()
    plain = browser.new_context(java_script_enabled=False).new_page()
    log_in(plain, server, secret, path)
    plain.click("a[data-local-tz]")
    plain.fill("input[name=zone]", "Europe/Berlin")
    plain.click("button:has-text('Use this zone')")
    plain.wait_for_url(server.url + path)
    assert "2026-01-05 11:00:00 CET" in plain.content()
    plain.context.close()


def test_every_page_works_without_javascript(browser: Any, server: ServerThread,
                                             pipeline: dict[str, Any], conn: Conn) -> None:
    plain = browser.new_context(java_script_enabled=False).new_page()
    log_in(plain, server, tokens.create(conn, "admin"))
    for label in ("Jobs", "Runs", "Dead letters", "Backfills", "Replicas", "Breakers",
                  "Tenants", "Dashboard"):
        plain.click(f"header a:has-text('{label}')")
        assert plain.locator("h1").inner_text().startswith(
            label if label != "Breakers" else "Circuit breakers")
    plain.click("header a:has-text('Breakers')")
    plain.fill("input[name=reason]", "maintenance window")
    plain.click("button:has-text('Open')")
    assert "maintenance window" in plain.locator("table").inner_text()
    shot(plain, "breakers")
    plain.context.close()
