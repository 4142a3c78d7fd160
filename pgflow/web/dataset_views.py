"""Datasets on the web: ``GET /api/v1/datasets``, ``POST /api/v1/datasets/{name}/events``
(SPEC §6) and the ``/datasets`` page. The ledger itself is ``pgflow.datasets``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response

from pgflow import datasets
from pgflow.spec import NAME_PATTERN
from pgflow.web._endpoint import Call, Endpoint, Param
from pgflow.web._session import Viewer, page
from pgflow.web._state import Conn
from pgflow.web.models import _In, _Out

DATASET_NAME = Param("name", "path", {"type": "string", "minLength": 1, "maxLength": 128,
                                      "pattern": NAME_PATTERN},
                     "The dataset's name (the job-name rules).", required=True)


class EmitRequest(_In):
    key: str | None = Field(default=None, min_length=1, max_length=datasets.MAX_KEY_LENGTH,
                            description="Idempotency key: the same (dataset, key) twice"
                                        " records one event (200 with the existing one).")
    payload: dict[str, Any] | None = Field(
        default=None, description="A JSON object for the consuming runs (at most 64 KiB).")


class DatasetEvent(_Out):
    id: int
    dataset: str
    key: str | None
    run_id: int | None = Field(description="The producing run; null when emitted from outside.")
    payload: dict[str, Any]
    created_at: datetime
    consumers: int = Field(description="Jobs the event was delivered to.")
    created: bool = Field(description="false: the key already had this event; nothing new.")


class Consumer(_Out):
    job: str
    mode: str = Field(description="all | any (trigger_mode)")
    paused: bool
    waiting: int = Field(description="Events of this dataset not consumed by the job yet.")


class LastEvent(_Out):
    id: int
    key: str | None
    run_id: int | None
    created_at: datetime


class Dataset(_Out):
    dataset: str
    producers: list[str]
    consumers: list[Consumer]
    last_event: LastEvent | None


class DatasetList(_Out):
    items: list[Dataset]


REQUEST_MODELS: tuple[type[BaseModel], ...] = (EmitRequest,)
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (DatasetEvent, DatasetList)


def list_datasets(call: Call) -> tuple[int, BaseModel]:
    rows = datasets.overview(call.conn)
    return 200, DatasetList(items=[Dataset.model_validate(row) for row in rows])


def emit_event(call: Call) -> tuple[int, BaseModel]:
    body: EmitRequest = call.body
    emitted = datasets.emit(call.conn, call.args["name"], body.key, body.payload)
    event = DatasetEvent.model_validate({**emitted.event, "created": emitted.created})
    return (201 if emitted.created else 200), event


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("GET", "/datasets", "listDatasets",
             "Datasets: producers, consumers with their waiting events, the last event.",
             "viewer", list_datasets, DatasetList),
    Endpoint("POST", "/datasets/{name}/events", "emitDatasetEvent",
             "Record that a dataset was updated: jobs with trigger_on it react (201; 200 when"
             " the key already had an event, which is returned).", "operator", emit_event,
             DatasetEvent, ok=201, ok_also=(200,), params=(DATASET_NAME,), body=EmitRequest,
             errors=(422,)),
)


def datasets_page(request: Request) -> Response:
    def build(conn: Conn, viewer: Viewer) -> dict[str, Any]:
        rows = datasets.overview(conn)
        for row in rows:
            if row["last_event"]:
                row["last_event"]["created_at"] = datetime.fromisoformat(
                    row["last_event"]["created_at"])
        chosen = request.query_params.get("dataset")
        recent: list[dict[str, Any]] = []
        if chosen:
            datasets.check_name(chosen)
            recent = datasets.recent_events(conn, chosen, limit=50)
        return {"title": "Datasets", "rows": rows, "chosen": chosen, "recent": recent}

    return page(request, "datasets.html", build, refresh=lambda _: 10)
