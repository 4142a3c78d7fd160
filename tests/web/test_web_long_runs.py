"""Long runs over HTTP (SPEC §4e, §6): the logs endpoint with byte offsets, re-runs,
backfill reprocessing, progress on the run, and the run page in a real browser."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine import WorkerThread, add_job, enqueue, wait_for
from test_web_browser import CHROMIUM, log_in, shot
from webhelpers import Conn, ServerThread, finished_run

from pgflow import tokens

T0 = datetime(2026, 4, 1, tzinfo=UTC)


def store_output(conn: Conn, run_id: int, attempt: int, chunks: list[tuple[int, bytes]]) -> None:
    for pos, data in chunks:
        conn.execute("INSERT INTO pgflow.run_output (run_id, attempt, pos, stream, data)"
                     " VALUES (%s, %s, %s, 'stdout', %s)", (run_id, attempt, pos, data))


def test_logs_by_offset_with_the_next_offset_in_a_header(
        client: httpx.Client, as_role: dict[str, dict[str, str]], conn: Conn) -> None:
    add_job(conn, "api-logs", command=["true"])
    run_id = finished_run(conn, "api-logs", T0, "succeeded")
    # A head, a dropped middle (bytes 12..99), a tail.
    store_output(conn, run_id, 1, [(0, b"first line\n"), (100, b"last line\n")])
    url = f"/api/v1/runs/{run_id}/logs"
    got = client.get(url, headers=as_role["viewer"])
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
    assert got.text.startswith("first line\n") and got.text.endswith("last line\n")
    assert "89 bytes of output dropped" in got.text
    assert got.headers["x-pgflow-next-offset"] == "110"
    assert (got.headers["x-pgflow-attempt"], got.headers["x-pgflow-running"]) == ("1", "false")
    part = client.get(url, params={"offset": 6, "attempt": 1}, headers=as_role["viewer"])
    assert part.text.startswith("line\n")
    rest = client.get(url, params={"offset": 105}, headers=as_role["viewer"])
    assert (rest.text, rest.headers["x-pgflow-next-offset"]) == ("line\n", "110")
    done = client.get(url, params={"offset": 110}, headers=as_role["viewer"])
    assert (done.text, done.headers["x-pgflow-next-offset"]) == ("", "110")


def test_logs_of_a_running_attempt_and_of_tails_only(
        client: httpx.Client, as_role: dict[str, dict[str, str]], conn: Conn) -> None:
    add_job(conn, "api-live", command=["true"])
    running = enqueue(conn, "api-live", T0)
    conn.execute("UPDATE pgflow.runs SET state = 'running', attempt = 1, lease_owner = 'w',"
                 " lease_expires_at = now() + interval '1 minute', attempt_started_at = now(),"
                 " started_at = now() WHERE id = %s", (running,))
    store_output(conn, running, 1, [(0, b"so far\n")])
    got = client.get(f"/api/v1/runs/{running}/logs", headers=as_role["viewer"])
    assert (got.text, got.headers["x-pgflow-running"]) == ("so far\n", "true")
    short = finished_run(conn, "api-live", T0 + timedelta(hours=1), "failed")
    tails = client.get(f"/api/v1/runs/{short}/logs", headers=as_role["viewer"])
    assert tails.text == "hello from stdout\nwarning on stderr"


@pytest.mark.parametrize(("query", "status", "field"), [
    ({"offset": "-1"}, 400, "offset"), ({"offset": "abc"}, 400, "offset"),
    ({"attempt": "0"}, 400, "attempt"), ({"attempt": "7"}, 404, None),
])
def test_logs_bad_input_is_a_json_error(client: httpx.Client,
                                        as_role: dict[str, dict[str, str]], conn: Conn,
                                        query: dict[str, str], status: int,
                                        field: str | None) -> None:
    add_job(conn, "api-bad", command=["true"])
    run_id = finished_run(conn, "api-bad", T0, "succeeded")
    got = client.get(f"/api/v1/runs/{run_id}/logs", params=query, headers=as_role["viewer"])
    assert got.status_code == status
    body = got.json()
    assert body["error"]
    if field:
        assert body["detail"][0]["field"] == field


def test_logs_need_a_token_and_unknown_runs_are_404(
        client: httpx.Client, as_role: dict[str, dict[str, str]]) -> None:
    assert client.get("/api/v1/runs/1/logs").status_code == 401
    missing = client.get("/api/v1/runs/424242/logs", headers=as_role["viewer"])
    assert missing.status_code == 404 and "no run 424242" in missing.json()["error"]


def test_rerun_over_the_api(client: httpx.Client, as_role: dict[str, dict[str, str]],
                            conn: Conn) -> None:
    add_job(conn, "api-up", command=["true"])
    add_job(conn, "api-down", command=["true"], depends_on=["api-up"])
    up = finished_run(conn, "api-up", T0, "succeeded")
    down = finished_run(conn, "api-down", T0, "succeeded")
    conn.execute("UPDATE pgflow.runs SET checkpoint = '{\"n\": 1}', progress = 1"
                 " WHERE id = %s", (up,))
    url = f"/api/v1/runs/{up}/rerun"
    assert client.post(url, headers=as_role["viewer"]).status_code == 403
    assert client.post(url, json={"downstream": "yes"},
                       headers=as_role["operator"]).status_code == 422
    got = client.post(url, json={"downstream": True}, headers=as_role["operator"])
    assert got.status_code == 200, got.text
    assert (got.json()["state"], got.json()["progress"]) == ("queued", None)
    row = conn.execute("SELECT state, checkpoint FROM pgflow.runs WHERE id = %s",
                       (down,)).fetchone()
    assert row == {"state": "pending", "checkpoint": None}
    assert conn.execute("SELECT checkpoint FROM pgflow.runs WHERE id = %s",
                        (up,)).fetchone()["checkpoint"] is None
    again = client.post(url, headers=as_role["operator"])
    assert again.status_code == 409 and "only a finished run" in again.json()["error"]
    assert client.post("/api/v1/runs/999999/rerun",
                       headers=as_role["operator"]).status_code == 404


def test_backfill_reprocess_over_the_api(client: httpx.Client,
                                         as_role: dict[str, dict[str, str]],
                                         conn: Conn) -> None:
    add_job(conn, "api-daily", command=["true"], schedule="0 0 * * *", catchup="none")
    failed = finished_run(conn, "api-daily", T0, "failed")
    body = {"job": "api-daily", "start": T0.isoformat(),
            "end": (T0 + timedelta(days=2)).isoformat(), "reprocess": "sometimes"}
    bad = client.post("/api/v1/backfills", json=body, headers=as_role["operator"])
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "reprocess"
    made = client.post("/api/v1/backfills", json={**body, "reprocess": "failed"},
                       headers=as_role["operator"])
    assert made.status_code == 201, made.text
    row = conn.execute("SELECT state, trigger, backfill_id FROM pgflow.runs WHERE id = %s",
                       (failed,)).fetchone()
    assert row == {"state": "pending", "trigger": "backfill", "backfill_id": made.json()["id"]}


def test_run_detail_carries_progress(client: httpx.Client,
                                     as_role: dict[str, dict[str, str]], conn: Conn) -> None:
    add_job(conn, "api-progress", command=["true"])
    run_id = finished_run(conn, "api-progress", T0, "succeeded")
    conn.execute("UPDATE pgflow.runs SET progress = 0.25, progress_message = 'a quarter',"
                 " progress_at = now() WHERE id = %s", (run_id,))
    got = client.get(f"/api/v1/runs/{run_id}", headers=as_role["viewer"]).json()
    assert (got["progress"], got["progress_message"]) == (0.25, "a quarter")
    listed = client.get("/api/v1/runs", params={"job": "api-progress"},
                        headers=as_role["viewer"]).json()
    assert listed["items"][0]["progress"] == 0.25
    spec = client.get("/api/v1/openapi.json").json()
    logs = spec["paths"]["/api/v1/runs/{id}/logs"]["get"]
    assert "X-Pgflow-Next-Offset" in logs["responses"]["200"]["headers"]
    assert "/api/v1/runs/{id}/rerun" in spec["paths"]


# ---------------------------------------------------------------- the browser


@pytest.fixture
def worker(db_url: str) -> Any:
    running = WorkerThread(db_url, concurrency=2, worker_id="long-runs-browser")
    yield running
    running.stop()


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no system Chromium")
def test_the_run_page_shows_live_output_and_a_progress_bar(
        page: Any, server: ServerThread, conn: Conn, worker: Any, tmp_path: Path) -> None:
    go = tmp_path / "go"
    script = ('echo "{\\"progress\\": 0.4, \\"message\\": \\"loading\\"}" > "$PGFLOW_CONTROL";'
              f' i=0; while [ ! -e {go} ]; do i=$((i+1)); echo "line $i"; sleep 0.2; done')
    add_job(conn, "watched", command=["/bin/sh", "-c", script])
    run_id = enqueue(conn, "watched")
    wait_for(lambda: conn.execute("SELECT progress FROM pgflow.runs WHERE id = %s",
                                  (run_id,)).fetchone()["progress"] == 0.4 or None, timeout=20)
    log_in(page, server, tokens.create(conn, "viewer"), f"/runs/{run_id}")
    assert "line 1\n" in page.locator("#live-output").inner_text()
    bar = page.locator("#run-progress progress")
    assert bar.get_attribute("value") == "0.4"
    assert "loading" in page.locator("#run-progress").inner_text()
    first = page.locator("#live-output").inner_text()
    # The page refreshes itself while the run runs: the output grows.
    wait_for(lambda: len(page.locator("#live-output").inner_text()) > len(first) or None,
             timeout=20)
    shot(page, "run-live-output")
    page.goto(server.url + "/runs?state=running")
    assert page.locator("table.runs progress.run-progress").count() == 1
    page.goto(server.url + "/")  # the dashboard's running runs
    assert page.locator("#running-runs progress.run-progress").get_attribute("value") == "0.4"
    go.touch()
