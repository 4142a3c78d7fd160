"""Datasets in a real browser (the system Chromium): from the nav to a dataset's events,
from a consumer's lineage graph to its dataset, and a dataset run's "why it fired"."""

from __future__ import annotations

import re
from typing import Any

from engine import WorkerThread, add_job, wait_for
from test_web_browser import log_in, pytestmark, shot  # noqa: F401
from test_web_datasets import consume
from webhelpers import Conn, ServerThread

from pgflow import datasets, tokens


def test_a_user_follows_events_from_the_nav_to_the_run_they_fired(
        page: Any, server: ServerThread, conn: Conn, db_url: str) -> None:
    add_job(conn, "load", entrypoint="jobfuncs:noop", produces=["orders"])
    add_job(conn, "report", entrypoint="jobfuncs:noop", trigger_on=["orders"])
    event = datasets.emit(conn, "orders", key="2026-01-31", payload={"rows": 1200}).event
    log_in(page, server, tokens.create(conn, "viewer"))
    page.click("header >> text=Datasets")
    page.wait_for_url(re.compile(r"/datasets$"))
    assert "report" in page.inner_text("table") and "1" in page.inner_text("table")
    page.click("table >> text=orders")
    page.wait_for_selector("#events")
    assert "2026-01-31" in page.inner_text("body")
    shot(page, "datasets")

    page.goto(server.url + "/jobs/report")
    page.click('svg a.dataset[data-dataset="orders"]')
    page.wait_for_url(re.compile(r"/datasets\?dataset=orders$"))

    [run_id] = consume(db_url).runs.values()
    worker = WorkerThread(db_url)
    try:
        wait_for(lambda: conn.execute("SELECT state FROM pgflow.runs WHERE id = %s",
                                      (run_id,)).fetchone()["state"] == "succeeded")  # type: ignore[index]
    finally:
        worker.stop()
    page.goto(server.url + f"/runs/{run_id}")
    why = page.inner_text("#trigger-events + table")
    assert str(event["id"]) in why and "2026-01-31" in why and "outside (emit)" in why
    shot(page, "dataset-run")
