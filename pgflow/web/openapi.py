"""``GET /api/v1/openapi.json``: OpenAPI 3.1 built from the same ``Endpoint`` table
and pydantic models that serve and validate the API."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic.json_schema import models_json_schema

from pgflow import __version__
from pgflow.web import dataset_views
from pgflow.web._endpoint import Endpoint, TextResponse
from pgflow.web.api import ENDPOINTS, job_definition_schema, retry_schema
from pgflow.web.models import REQUEST_MODELS, RESPONSE_MODELS

PREFIX = "/api/v1"
REF = "#/components/schemas/{model}"

_REASONS = {
    200: "OK", 201: "Created", 400: "Malformed parameter or JSON",
    401: "No token, or an unknown or revoked one", 403: "The token's role is too low",
    404: "Not found", 409: "The object's current state forbids this",
    413: "Body larger than 1 MiB", 422: "The body is invalid (each field in detail)",
    503: "The database is unavailable",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _operation(endpoint: Endpoint) -> dict[str, Any]:
    role = endpoint.role
    operation: dict[str, Any] = {
        "operationId": endpoint.operation_id,
        "summary": endpoint.summary,
        "tags": [endpoint.path.split("/")[1]],
        "description": f"Requires the {role} role (or higher)." if role else "Open.",
        "x-pgflow-role": role,
        "security": [{"bearerAuth": []}] if role else [],
    }
    parameters = []
    for param in endpoint.params:
        parameters.append({"name": param.name, "in": param.where,
                           "required": param.where == "path" or param.required,
                           "description": param.description, "schema": param.schema})
    if parameters:
        operation["parameters"] = parameters
    if endpoint.body is not None:
        operation["requestBody"] = {"required": endpoint.body_required, "content": {
            "application/json": {"schema": _ref(endpoint.body.__name__)}}}
    elif endpoint.body_schema is not None:
        name = endpoint.body_schema["$ref"]
        operation["requestBody"] = {"required": endpoint.body_required, "content": {
            "application/json": {"schema": _ref(name)}}}
    responses: dict[str, Any] = {}
    for code in (endpoint.ok, *endpoint.ok_also):
        responses[str(code)] = _json(_ref(endpoint.response.__name__), _REASONS[code])
    if issubclass(endpoint.response, TextResponse):
        headers = endpoint.response.model_fields["headers"].default
        responses[str(endpoint.ok)] = {
            "description": endpoint.response.__doc__ or _REASONS[endpoint.ok],
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "headers": {name: {"description": text, "schema": {"type": "string"}}
                        for name, text in headers.items()}}
    for code in endpoint.statuses():
        if str(code) not in responses:
            responses[str(code)] = _json(_ref("Error"), _REASONS[code])
    operation["responses"] = responses
    return operation


@cache
def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the JSON API."""
    pairs = [(m, "validation") for m in (*REQUEST_MODELS, *dataset_views.REQUEST_MODELS)]
    pairs += [(m, "serialization") for m in (*RESPONSE_MODELS, *dataset_views.RESPONSE_MODELS)]
    _, definitions = models_json_schema(pairs, ref_template=REF)  # type: ignore[arg-type]
    schemas: dict[str, Any] = definitions["$defs"]
    schemas["JobDefinition"] = job_definition_schema(REF)
    schemas["RetryPolicy"] = retry_schema()
    paths: dict[str, dict[str, Any]] = {}
    for endpoint in ENDPOINTS:
        paths.setdefault(PREFIX + endpoint.path, {})[endpoint.method.lower()] = (
            _operation(endpoint))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pgflow",
            "version": __version__,
            "description": (
                "Jobs, runs, backfills, circuit breakers and cluster status of a pgflow"
                " cluster. Authenticate with 'Authorization: Bearer <token>' (pgflow token"
                " create --role viewer|operator|admin). Errors are"
                ' {"error": "...", "detail": [{"field": ..., "message": ...}]}.'),
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                               "description": "A pgflow API token."}},
        },
    }
