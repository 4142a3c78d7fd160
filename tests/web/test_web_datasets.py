"""Datasets on the web: the API (roles, idempotent emits, bad bodies), the /datasets
page, why a run fired on its page and in the API, lineage dataset nodes, metrics."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import psycopg
import pytest
from engine import add_job
from test_web_metrics import scrape, value
from test_web_pages import login
from webhelpers import Conn

from pgflow import datasets
from pgflow.metrics import Metrics
from pgflow.web.openapi import document

Headers = dict[str, dict[str, str]]


def consume(url: str) -> datasets.ConsumePass:
    """One leader dataset pass, on a thread of its own (the browser's loop may run here)."""
    async def once() -> datasets.ConsumePass:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as aconn:
            return await datasets.consume(aconn)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, once()).result()


@pytest.fixture
def world(conn: Conn) -> None:
    add_job(conn, "load", entrypoint="jobfuncs:noop", produces=["orders"])
    add_job(conn, "report", entrypoint="jobfuncs:noop", trigger_on=["orders", "customers"])
    add_job(conn, "publish", entrypoint="jobfuncs:noop", depends_on=["report"])


def emit(client: httpx.Client, headers: dict[str, str], name: str, body: Any) -> httpx.Response:
    return client.post(f"/api/v1/datasets/{name}/events", headers=headers,
                       content=body if isinstance(body, str) else json.dumps(body))


def test_emit_creates_then_returns_the_keyed_event(client: httpx.Client, as_role: Headers,
                                                   world: None, conn: Conn) -> None:
    first = emit(client, as_role["operator"], "orders", {"key": "day-1", "payload": {"rows": 5}})
    assert first.status_code == 201, first.text
    event = first.json()
    assert (event["dataset"], event["key"], event["payload"], event["created"],
            event["consumers"]) == ("orders", "day-1", {"rows": 5}, True, 1)
    again = emit(client, as_role["operator"], "orders", {"key": "day-1", "payload": {"x": 1}})
    assert again.status_code == 200
    assert again.json() == {**event, "created": False}
    plain = emit(client, as_role["operator"], "orders", "")
    assert plain.status_code == 201 and plain.json()["payload"] == {}
    assert conn.execute("SELECT count(*) AS n FROM pgflow.dataset_events").fetchone() == {"n": 2}


def test_emit_needs_the_operator_role(client: httpx.Client, as_role: Headers,
                                      world: None, conn: Conn) -> None:
    assert emit(client, {}, "orders", {}).status_code == 401
    refused = emit(client, as_role["viewer"], "orders", {})
    assert refused.status_code == 403 and "operator" in refused.json()["error"]
    assert client.get("/api/v1/datasets", headers=as_role["viewer"]).status_code == 200
    assert emit(client, as_role["admin"], "orders", {}).status_code == 201
    assert conn.execute("SELECT count(*) AS n FROM pgflow.dataset_events").fetchone() == {"n": 1}


@pytest.mark.parametrize(("name", "body", "status", "field"), [
    ("orders", "{not json", 400, "body"),
    ("orders", [1, 2], 422, "body"),
    ("orders", {"payload": [1]}, 422, "payload"),
    ("orders", {"payload": "text"}, 422, "payload"),
    ("orders", {"key": ""}, 422, "key"),
    ("orders", {"key": 7}, 422, "key"),
    ("orders", {"key": "k" * 513}, 422, "key"),
    ("orders", {"colour": "red"}, 422, "colour"),
    ("orders", {"payload": {"blob": "x" * 70_000}}, 422, None),
    ("bad%20name", {}, 400, "name"),
    ("-leading", {}, 400, "name"),
    ("x" * 129, {}, 400, "name"),
])
def test_bad_emits_are_client_errors_naming_the_field(
        client: httpx.Client, as_role: Headers, world: None, conn: Conn, name: str, body: Any,
        status: int, field: str | None) -> None:
    response = emit(client, as_role["operator"], name, body)
    assert response.status_code == status, response.text
    error = response.json()
    if field is not None:
        assert field in json.dumps(error), error
    assert conn.execute("SELECT count(*) AS n FROM pgflow.dataset_events").fetchone() == {"n": 0}


def test_list_datasets(client: httpx.Client, as_role: Headers, world: None,
                       conn: Conn) -> None:
    datasets.emit(conn, "orders", key="k")
    items = client.get("/api/v1/datasets", headers=as_role["viewer"]).json()["items"]
    by_name = {d["dataset"]: d for d in items}
    assert by_name["orders"]["producers"] == ["load"]
    assert by_name["orders"]["consumers"] == [
        {"job": "report", "mode": "all", "paused": False, "waiting": 1}]
    assert by_name["orders"]["last_event"]["key"] == "k"
    assert by_name["customers"]["last_event"] is None


def test_a_dataset_run_shows_why_it_fired(client: httpx.Client, as_role: Headers, world: None,
                                          conn: Conn, db_url: str,
                                          secrets_by_role: dict[str, str]) -> None:
    first = datasets.emit(conn, "orders", key="batch-7", payload={"rows": 70}).event
    second = datasets.emit(conn, "customers").event
    [run_id] = consume(db_url).runs.values()
    detail = client.get(f"/api/v1/runs/{run_id}", headers=as_role["viewer"]).json()
    assert detail["trigger"] == "dataset"
    listed = client.get("/api/v1/runs?trigger=dataset", headers=as_role["viewer"]).json()
    assert [r["id"] for r in listed["items"]] == [run_id]
    assert [(e["id"], e["dataset"], e["key"]) for e in detail["trigger_events"]] == [
        (first["id"], "orders", "batch-7"), (second["id"], "customers", None)]
    login(client, secrets_by_role["viewer"])
    page = client.get(f"/runs/{run_id}").text
    assert "Why it fired: 2 dataset events" in page
    assert "batch-7" in page and "outside (emit)" in page and '"rows": 70' in page


def test_datasets_page_and_lineage_nodes(client: httpx.Client, world: None, conn: Conn,
                                         secrets_by_role: dict[str, str]) -> None:
    datasets.emit(conn, "orders", payload={"n": 1})
    login(client, secrets_by_role["viewer"])
    listing = client.get("/datasets")
    assert listing.status_code == 200
    for needle in ("orders", "customers", 'href="/jobs/load"', "outside only", ": 1"):
        assert needle in listing.text, needle
    assert 'href="/datasets"' in listing.text  # the nav link
    one = client.get("/datasets?dataset=orders").text
    assert "Recent events of orders" in one and '"n": 1' in one
    assert client.get("/datasets?dataset=bad%20name").status_code == 400
    graph = client.get("/jobs/report").text
    assert 'data-dataset="orders"' in graph and 'data-dataset="customers"' in graph
    assert 'data-job="load"' in graph and 'data-job="publish"' in graph  # producer, DAG
    assert 'href="/datasets?dataset=orders"' in graph
    producer = client.get("/jobs/load").text
    assert 'data-dataset="orders"' in producer and 'data-job="report"' in producer


def test_metrics_count_events_recorded_and_waiting(world: None, conn: Conn) -> None:
    datasets.emit(conn, "orders")
    datasets.emit(conn, "orders")

    @contextmanager
    def lend() -> Any:
        yield conn

    samples = scrape(Metrics(lend, lease_ttl=30.0, settle_s=0.0))
    assert value(samples, "pgflow_dataset_events", dataset="orders") == 2
    assert value(samples, "pgflow_dataset_events_waiting", dataset="orders", job="report") == 2


def test_openapi_documents_the_dataset_endpoints() -> None:
    paths = document()["paths"]
    assert "get" in paths["/api/v1/datasets"]
    emit_op = paths["/api/v1/datasets/{name}/events"]["post"]
    assert {"200", "201", "400", "403", "422"} <= set(emit_op["responses"])
