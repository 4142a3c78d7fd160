"""The dashboard's named panels and the pipeline views in a real browser (the system
Chromium driven by Playwright): a failed job is named on the dashboard and links to
its run; the DAG-run Gantt has one bar per run and marks the critical path; the root
job's grid links each cell to its run. Screenshots go to test-artifacts/."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from engine import add_job
from pipelinehelpers import JOBS, T0, diamond, diamond_run
from test_web_browser import log_in, pytestmark, shot  # noqa: F401 - fixtures
from webhelpers import Conn, ServerThread, finished_run

from pgflow import tokens


def test_the_dashboard_names_a_failed_job_and_links_to_its_run(
        page: Any, server: ServerThread, conn: Conn) -> None:
    add_job(conn, "nightly_orders", entrypoint="jobfuncs:noop")
    add_job(conn, "fine_job", entrypoint="jobfuncs:noop")
    finished_run(conn, "fine_job", T0, "succeeded", seconds=12.0)
    dead = finished_run(conn, "nightly_orders", T0, "failed",
                        error="psycopg.OperationalError: warehouse is down")
    log_in(page, server, tokens.create(conn, "viewer"))
    failures = page.locator("#recent-failures")
    assert "nightly_orders" in failures.inner_text()
    assert "warehouse is down" in failures.inner_text()
    assert "nightly_orders" in page.locator("#most-failing").inner_text()
    assert page.locator("#slowest-jobs").inner_text().index("fine_job") >= 0
    assert page.locator("#queue-health tr[data-table=runs]").is_visible()
    shot(page, "dashboard-panels")
    failures.locator(f"a.run-link:has-text('{dead}')").click()
    page.wait_for_url(f"{server.url}/runs/{dead}")
    assert page.locator("h1").inner_text().startswith(f"Run {dead} of nightly_orders")


def test_the_gantt_has_one_bar_per_run_and_marks_the_critical_path(
        page: Any, server: ServerThread, conn: Conn) -> None:
    diamond(conn)
    ids = diamond_run(conn, T0)
    log_in(page, server, tokens.create(conn, "viewer"), "/jobs/extract")
    page.click("a:has-text('DAG run')")
    gantt = page.locator("svg.gantt")
    assert gantt.is_visible()
    assert gantt.locator("rect.run-bar").count() == len(JOBS)
    assert gantt.locator("g.gantt-run").count() == len(JOBS)
    assert gantt.locator("rect.wait-bar").count() >= 1
    critical = {int(g.get_attribute("data-run"))
                for g in gantt.locator("g.gantt-run[data-critical='1']").all()}
    assert critical == {ids["extract"], ids["enrich"], ids["load"]}
    assert page.locator("#critical-path").inner_text() == "extract → enrich → load"
    assert page.locator("#end-to-end").inner_text().startswith("7.250 s")
    shot(page, "dag-run-gantt")
    gantt.locator(f"g.gantt-run[data-run='{ids['clean']}'] a").click()
    page.wait_for_url(f"{server.url}/runs/{ids['clean']}")
    assert "0.800 s from first start to finish" in page.locator("#run-durations").inner_text()


def test_the_root_job_shows_its_trend_and_a_grid_that_links_to_runs(
        page: Any, server: ServerThread, conn: Conn) -> None:
    diamond(conn)
    dag_runs = [diamond_run(conn, T0 + timedelta(hours=i), scale=1 + i % 3,
                            load_state="failed" if i == 4 else "succeeded") for i in range(6)]
    log_in(page, server, tokens.create(conn, "viewer"), "/jobs/extract")
    assert page.locator("svg.trend rect.trend-bar").count() == 6
    assert page.locator("svg.trend line.p50").count() == 1
    assert page.locator("svg.trend line.p95").count() == 1
    grid = page.locator("#dag-grid")
    assert grid.locator("a.cell").count() == 6 * len(JOBS)
    assert grid.locator("a.cell[data-state=failed]").count() == 1
    shot(page, "pipeline-grid")
    grid.locator("a.cell[data-state=failed]").click()
    page.wait_for_url(f"{server.url}/runs/{dag_runs[4]['load']}")
