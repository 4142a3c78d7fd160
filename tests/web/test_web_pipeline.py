"""The pages that name things and show pipelines: the dashboard's panels (failures,
running runs, most-failing and slowest jobs, queue health), the DAG-run Gantt with its
critical path and end-to-end time, and the root job's end-to-end trend and grid."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import httpx
import pytest
from engine import add_job, enqueue
from pipelinehelpers import JOBS, T0, diamond, diamond_run, rows_of
from test_web_pages import login
from webhelpers import Conn, finished_run

from pgflow.web import dag_history, gantt, panels, svg


@pytest.fixture
def viewer(client: httpx.Client, secrets_by_role: dict[str, str]) -> httpx.Client:
    login(client, secrets_by_role["viewer"])
    return client


def _section(html: str, section_id: str) -> str:
    match = re.search(rf'<section id="{section_id}">(.*?)</section>', html, re.S)
    assert match, f"no section {section_id}"
    return match.group(1)


# ---------------------------------------------------------------- dashboard


def test_the_dashboard_names_failures_running_runs_and_the_days_worst_jobs(
        conn: Conn, viewer: httpx.Client) -> None:
    add_job(conn, "nightly_extract", entrypoint="jobfuncs:noop")
    add_job(conn, "flaky_load", entrypoint="jobfuncs:noop")
    add_job(conn, "slow_model", entrypoint="jobfuncs:noop")
    old = finished_run(conn, "nightly_extract", T0, "failed", error="old failure")
    conn.execute("UPDATE pgflow.runs SET finished_at = now() - interval '3 days'"
                 " WHERE id = %s", (old,))
    failed = [finished_run(conn, "flaky_load", T0 + timedelta(hours=i), "failed",
                           error=f"ConnectionError: warehouse #{i}") for i in range(3)]
    slow = finished_run(conn, "slow_model", T0, "succeeded", seconds=4242.0)
    running = enqueue(conn, "nightly_extract", T0 + timedelta(days=1))
    conn.execute("UPDATE pgflow.runs SET state = 'running', attempt = 1, lease_owner = 'w-7',"
                 " lease_expires_at = now() + interval '1 min', started_at = now()"
                 " - interval '95 s', attempt_started_at = now() - interval '95 s'"
                 " WHERE id = %s", (running,))

    html = viewer.get("/").text
    recent = _section(html, "recent-failures")
    for run_id in failed:
        assert f'href="/runs/{run_id}"' in recent
    assert "ConnectionError: warehouse #2" in recent and 'href="/jobs/flaky_load"' in recent
    # The latest failure first; one three days old still shows (the latest ten do).
    assert recent.index(f"/runs/{failed[2]}") < recent.index(f"/runs/{failed[0]}")
    assert f"/runs/{old}" in recent

    now_running = _section(html, "running-runs")
    assert f'href="/runs/{running}"' in now_running and "w-7" in now_running
    assert "1m35s" in now_running or "1m36s" in now_running

    failing = _section(html, "most-failing")
    assert 'href="/jobs/flaky_load"' in failing and ">3</a>" in failing
    assert "nightly_extract" not in failing  # its failure is older than 24 hours
    assert 'id="failures-day">3<' in failing

    slowest = _section(html, "slowest-jobs")
    assert slowest.index("slow_model") < slowest.index("flaky_load")
    assert f'href="/runs/{slow}"' in slowest and "1h10m" in slowest


def test_the_slowest_jobs_come_from_counted_hours_and_the_live_hour(conn: Conn) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop")
    add_job(conn, "b", entrypoint="jobfuncs:noop")
    now = conn.execute("SELECT date_trunc('hour', now()) AS h").fetchone()["h"]  # type: ignore[index]
    # Finished runs over the last day: a's slowest (500 s) five hours ago, b's now.
    for i, (job, hours_ago, seconds) in enumerate(
            [("a", 5, 500.0), ("a", 5, 20.0), ("b", 5, 300.0), ("b", 0, 900.0),
             ("a", 30, 9999.0)]):
        end = now - timedelta(hours=hours_ago) + timedelta(seconds=30)
        conn.execute("INSERT INTO pgflow.runs (job, logical_time, state, attempt, max_attempts,"
                     " trigger, tenant, created_at, started_at, finished_at)"
                     " VALUES (%s, %s, 'succeeded', 1, 1, 'manual', 'default', %s, %s, %s)",
                     (job, T0 + timedelta(seconds=i), end - timedelta(seconds=seconds),
                      end - timedelta(seconds=seconds), end))
    data = panels.dashboard_panels(conn)
    # One hour per computation, the newest closed one first (ended 2 minutes ago).
    newest = conn.execute("SELECT date_trunc('hour', now() - interval '120 s')"
                          " - interval '1 hour' AS h").fetchone()["h"]  # type: ignore[index]
    first = conn.execute("SELECT hour FROM pgflow.slow_hours").fetchall()
    assert [r["hour"] for r in first] == [newest]
    for _ in range(25):
        data = panels.dashboard_panels(conn)
    counted = conn.execute("SELECT count(*) AS n FROM pgflow.slow_hours").fetchone()
    assert counted is not None and counted["n"] >= 23  # the day's closed hours, once each
    assert [(s["job"], s["seconds"]) for s in data["slowest"]] == [("b", 900.0), ("a", 500.0)]


def test_merging_hourly_tops_keeps_each_jobs_slowest_run() -> None:
    hours = [[{"job": "a", "run_id": 1, "state": "succeeded", "seconds": 5.0},
              {"job": "b", "run_id": 2, "state": "failed", "seconds": 3.0}],
             [{"job": "b", "run_id": 7, "state": "succeeded", "seconds": 9.0}], []]
    merged = panels.slowest_jobs(hours, 10)
    assert [(m["job"], m["run_id"]) for m in merged] == [("b", 7), ("a", 1)]
    assert panels.slowest_jobs(hours, 1) == [hours[1][0]]


def test_the_dashboard_shows_queue_health(conn: Conn, viewer: httpx.Client) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop")
    conn.execute("ANALYZE pgflow.runs")
    health = _section(viewer.get("/").text, "queue-health")
    for table in ("runs", "attempts", "jobs", "replicas", "leader"):
        assert f'data-table="{table}"' in health
    assert 'id="oldest-xact"' in health and 'id="xmin-horizon"' in health


def test_queue_health_names_the_transaction_that_holds_the_horizon(
        conn: Conn, db_url: str, viewer: httpx.Client) -> None:
    import psycopg

    with psycopg.connect(db_url, autocommit=False,
                         application_name="stuck-report") as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pgflow.jobs").fetchone()
        conn.execute("CREATE TEMP TABLE burn AS SELECT 1")  # an xid after the snapshot
        html = _section(viewer.get("/").text, "queue-health")
        assert re.search(r'id="oldest-xact"[^>]*>[^<]*pid \d+ \(stuck-report\)', html)
        assert re.search(r'id="xmin-horizon"[^>]*>\d+ transactions old, held by session'
                         r' \d+ \(stuck-report\)', html)


# ---------------------------------------------------------------- DAG run


def test_the_dag_run_page_draws_one_bar_per_run_and_the_critical_path(
        conn: Conn, viewer: httpx.Client) -> None:
    diamond(conn)
    ids = diamond_run(conn, T0)
    html = viewer.get("/jobs/extract/dag", params={"at": T0.isoformat()}).text
    bars = re.findall(r'<g class="gantt-run[^"]*" data-run="(\d+)"', html)
    assert sorted(map(int, bars)) == sorted(ids.values())
    assert html.count('class="run-bar"') == 4 and 'class="wait-bar"' in html
    critical = set(map(int, re.findall(r'data-run="(\d+)" data-state="[a-z_]+"'
                                       r' data-critical="1"', html)))
    assert critical == {ids["extract"], ids["enrich"], ids["load"]}
    path = re.search(r'id="critical-path">(.*?)</dd>', html, re.S)
    assert path and re.sub(r"<[^>]+>", "", path.group(1)) == "extract → enrich → load"
    assert re.search(r'id="end-to-end"><b>7\.250 s</b>', html)
    assert "10:00:06.400" in html  # load's start, to the millisecond


def test_critical_path_and_end_to_end_of_a_dag_run(conn: Conn) -> None:
    diamond(conn)
    ids = diamond_run(conn, T0)
    rows = rows_of(ids, conn)
    now = T0 + timedelta(hours=1)
    bars = gantt.bars(rows)
    assert gantt.critical_path(bars, now) == [ids["extract"], ids["enrich"], ids["load"]]
    ready = {b.job: b.ready_at for b in bars}
    assert ready["load"] == T0 + timedelta(seconds=6)  # when enrich, the later upstream, ended
    assert gantt.end_to_end(rows, now) == (7.25, True)
    assert gantt.precise_seconds(1.2344) == "1.234 s" and gantt.precise_seconds(75) == "1m15s"


def test_a_large_dag_run_draws_a_bounded_gantt_with_its_critical_path(conn: Conn) -> None:
    diamond(conn)
    ids = diamond_run(conn, T0)
    bars = gantt.bars(rows_of(ids, conn))
    path = gantt.critical_path(bars, T0 + timedelta(hours=1))
    drawn = gantt.shown_bars(bars, path, 3)
    assert {b.run_id for b in drawn} == set(path)  # clean (not critical) is left out
    assert [b.job for b in gantt.shown_bars(bars, path, 10)] == [b.job for b in bars]


def test_a_dag_run_still_running_counts_to_now(conn: Conn) -> None:
    diamond(conn)
    ids = diamond_run(conn, T0)
    conn.execute("UPDATE pgflow.runs SET state = 'running', finished_at = NULL,"
                 " lease_owner = 'w', lease_expires_at = now(), attempt_started_at = started_at"
                 " WHERE id = %s", (ids["load"],))
    rows = rows_of(ids, conn)
    now = T0 + timedelta(seconds=20)
    assert gantt.end_to_end(rows, now) == (20.0, False)
    assert gantt.critical_path(gantt.bars(rows), now)[-1] == ids["load"]


# ---------------------------------------------------------------- root job page


def test_the_root_job_page_shows_the_end_to_end_trend_and_the_grid(
        conn: Conn, viewer: httpx.Client) -> None:
    diamond(conn)
    runs: list[dict[str, int]] = []
    for i in range(30):  # 30 logical times: the latest 25 are shown
        runs.append(diamond_run(conn, T0 + timedelta(hours=i), scale=1 + i % 5,
                                load_state="failed" if i == 29 else "succeeded"))
    html = viewer.get("/jobs/extract").text
    pipeline = _section(html, "pipeline")
    assert len(re.findall(r'class="trend-bar"', pipeline)) == 25
    assert pipeline.count('data-state="failed"') == 2  # the trend bar and the grid cell
    # Of the 24 succeeded DAG runs (i = 5..28), end to end 7.25 s x (1 + i % 5).
    delivered = sorted(7.25 * (1 + i % 5) for i in range(5, 29))
    p50, p95 = svg.percentile(delivered, 0.5), svg.percentile(delivered, 0.95)
    assert f'id="e2e-p50">{gantt.precise_seconds(p50 or 0)}<' in pipeline
    assert f'id="e2e-p95">{gantt.precise_seconds(p95 or 0)}<' in pipeline
    grid = re.search(r'<table class="dag-grid".*?</table>', pipeline, re.S)
    assert grid
    cells = re.findall(r'<a class="cell" data-state="([a-z_]+)" href="/runs/(\d+)"', grid.group(0))
    shown = {run_id for dag in runs[5:] for run_id in dag.values()}
    assert len(cells) == 25 * len(JOBS) and {int(c[1]) for c in cells} == shown
    rows = re.findall(r'<tr><td><a href="/jobs/([a-z]+)">', grid.group(0))
    assert rows[0] == "extract" and rows[-1] == "load"
    # A dependent job's page has no pipeline section; a lone job neither.
    assert 'id="pipeline"' not in viewer.get("/jobs/load").text


def test_the_grid_reads_a_bounded_slice(conn: Conn) -> None:
    diamond(conn)
    for i in range(3):
        diamond_run(conn, T0 + timedelta(hours=i))
    now = T0 + timedelta(days=1)
    data: dict[str, Any] | None = dag_history.history(conn, "extract", now)
    assert data is not None and len(data["times"]) == 3 and data["measured"] == 3
    assert dag_history.history(conn, "clean", now) is not None  # any job names its DAG
    add_job(conn, "alone", entrypoint="jobfuncs:noop")
    assert dag_history.history(conn, "alone", now) is None


def test_the_days_failures_are_counted_over_a_bounded_scan(
        conn: Conn, monkeypatch: pytest.MonkeyPatch) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop")
    add_job(conn, "b", entrypoint="jobfuncs:noop")
    for i, job in enumerate(["a", "a", "b", "b", "b"]):
        finished_run(conn, job, T0 + timedelta(minutes=i), "failed")
    full = panels.dashboard_panels(conn)
    assert [(j["job"], j["failures"]) for j in full["failing"]] == [("b", 3), ("a", 2)]
    assert full["failures_day"] == 5 and not full["failures_capped"]
    monkeypatch.setattr(panels, "FAILURES_SCAN", 3)
    capped = panels.dashboard_panels(conn)
    assert capped["failures_capped"] and capped["failures_day"] == 3
    assert sum(j["failures"] for j in capped["failing"]) == 3
