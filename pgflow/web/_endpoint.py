"""The JSON API's plumbing: one ``Endpoint`` value per operation drives routing,
authentication, parameter and body validation, error mapping and the OpenAPI document,
so what is documented is what is enforced.

Status codes: 400 a parameter or the JSON itself is malformed; 401 no or unknown token;
403 the token's role is too low; 404 no such object; 409 the object's state forbids
the action; 413 body over 1 MiB; 422 the body is well-formed JSON that the schema or
the domain rejects (each offending field in ``detail``); 503 the database is unreachable.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout
from pydantic import AwareDatetime as _AwareDatetime
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from pgflow import tokens
from pgflow.errors import Conflict, InvalidInput, NotFound, PgflowError
from pgflow.spec import RegistrationError
from pgflow.web._state import Conn, WebState, web_state
from pgflow.web.auth import bearer_secret
from pgflow.web.models import ISO_TIME, Error, ErrorDetail

MAX_BODY = 1 << 20
log = logging.getLogger("pgflow.web")


class ApiError(Exception):
    def __init__(self, status: int, message: str,
                 detail: list[tuple[str | None, str]] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail or []
        self.headers = headers or {}


@dataclass(frozen=True)
class Param:
    """A path or query parameter; ``schema`` (JSON Schema) is also its validation."""

    name: str
    where: str
    schema: dict[str, Any]
    description: str = ""
    required: bool = False


@dataclass
class Call:
    conn: Conn
    identity: tokens.Identity | None
    args: dict[str, Any]
    body: Any
    state: WebState


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    operation_id: str
    summary: str
    role: str | None
    handler: Callable[[Call], tuple[int, BaseModel] | Response]
    response: type[BaseModel]  # a TextResponse: the handler returns a Response itself
    ok: int = 200
    ok_also: tuple[int, ...] = ()  # other success codes with the same body
    params: tuple[Param, ...] = ()
    body: type[BaseModel] | None = None
    body_schema: dict[str, Any] | None = None  # a raw body (PUT /jobs) with its own schema
    body_required: bool = False
    errors: tuple[int, ...] = field(default=())

    def statuses(self) -> list[int]:
        codes = set(self.errors) | {503}
        if self.role is not None:
            codes |= {401, 403}
        if self.params:
            codes.add(400)
        if self.body is not None or self.body_schema is not None:
            codes |= {400, 413, 422}
        return sorted(codes)


class TextResponse(BaseModel):
    """Marks an endpoint whose success body is plain text (OpenAPI: ``text/plain``,
    with the ``headers`` named here)."""

    headers: dict[str, str] = {}


# ---------------------------------------------------------------- parameters

_INT = re.compile(r"^[+-]?[0-9]{1,40}$")
_DATETIME = TypeAdapter(_AwareDatetime)


def parse_param(param: Param, raw: str) -> Any:
    """The value of ``raw`` as ``param.schema`` types it; ApiError 400 when it does not fit."""
    schema = param.schema

    def bad(reason: str) -> ApiError:
        return ApiError(400, f"invalid parameter {param.name!r}: {reason}",
                        [(param.name, reason)])

    if "\x00" in raw:
        raise bad("must not contain NUL characters")
    kind = schema.get("type")
    if kind == "integer":
        if not _INT.match(raw.strip()):
            raise bad(f"expected an integer, got {_show(raw)}")
        value = int(raw)
        low, high = schema.get("minimum"), schema.get("maximum")
        if (low is not None and value < low) or (high is not None and value > high):
            raise bad(f"must be between {low} and {high}, got {_show(raw)}")
        return value
    if kind == "boolean":
        if raw not in ("true", "false"):
            raise bad(f"expected true or false, got {_show(raw)}")
        return raw == "true"
    if schema.get("format") == "date-time":
        try:
            if not ISO_TIME.match(raw):
                raise ValueError(raw)
            moment = _DATETIME.validate_python(raw)
            moment.astimezone(UTC)
        except (ValueError, OverflowError):
            raise bad(f"expected an ISO 8601 time with offset, e.g. 2026-01-31T12:00:00Z,"
                      f" got {_show(raw)}") from None
        return moment
    if "enum" in schema and raw not in schema["enum"]:
        raise bad(f"expected one of {', '.join(schema['enum'])}, got {_show(raw)}")
    if len(raw) < schema.get("minLength", 0) or len(raw) > schema.get("maxLength", 1000):
        raise bad(f"must be {schema.get('minLength', 0)} to {schema.get('maxLength', 1000)}"
                  " characters long")
    if "pattern" in schema and not re.search(schema["pattern"], raw):
        raise bad("must start with a letter or digit and use only letters, digits,"
                  " '_', '.', '-'" if "A-Za-z0-9" in schema["pattern"]
                  else f"must match {schema['pattern']}")
    if _unencodable(raw):
        raise bad("must be valid UTF-8 text")
    return raw


def _show(raw: str) -> str:
    return repr(raw if len(raw) <= 40 else raw[:37] + "...")


def _unencodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# ---------------------------------------------------------------- bodies


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def load_json(body: bytes) -> Any:
    """The JSON value of ``body``; ApiError 400 when it is not JSON."""
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ApiError(400, f"the request body is not valid JSON: {reason}",
                       [("body", reason)]) from None


def check_storable(value: Any, path: str = "") -> None:
    """PostgreSQL text and jsonb cannot hold NUL characters or lone surrogates: refuse
    them up front, naming the field, instead of failing in the database."""
    if isinstance(value, str):
        if "\x00" in value or _unencodable(value):
            raise ApiError(422, f"invalid value at {path or 'body'}: text must be valid UTF-8"
                           " without NUL characters",
                           [(path or "body", "text must be valid UTF-8 without NUL characters")])
    elif isinstance(value, dict):
        for key, item in value.items():
            check_storable(key, path)
            check_storable(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_storable(item, f"{path}.{i}" if path else str(i))


def validation_details(exc: ValidationError) -> list[tuple[str | None, str]]:
    details: list[tuple[str | None, str]] = []
    for error in exc.errors():
        loc = ".".join(str(part) for part in error["loc"]) or None
        details.append((loc, str(error["msg"]).removeprefix("Value error, ")))
    return details


def parse_body(endpoint: Endpoint, body: bytes) -> Any:
    if not body.strip():
        if endpoint.body_required:
            raise ApiError(422, "a JSON request body is required", [("body", "required")])
        body = b"{}"
    value = load_json(body)
    check_storable(value)
    if endpoint.body is None:
        if not isinstance(value, dict):
            raise ApiError(422, "the request body must be a JSON object",
                           [("body", "expected an object")])
        return value
    try:
        return endpoint.body.model_validate_json(body, strict=True)
    except ValidationError as exc:
        details = validation_details(exc)
        raise ApiError(422, "invalid request body: " + "; ".join(
            f"{f}: {m}" if f else m for f, m in details), details) from None


# ---------------------------------------------------------------- responses


def json_response(status: int, model: BaseModel, headers: dict[str, str] | None = None
                  ) -> Response:
    return Response(model.model_dump_json(), status_code=status,
                    media_type="application/json", headers=headers)


def error_response(status: int, message: str,
                   detail: list[tuple[str | None, str]] | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = Error(error=message,
                 detail=[ErrorDetail(field=f, message=m) for f, m in (detail or [])])
    return json_response(status, body, headers)


def mapped_error(exc: Exception) -> Response:
    """The response for an exception raised while serving an API call."""
    if isinstance(exc, ApiError):
        return error_response(exc.status, exc.message, exc.detail, exc.headers)
    if isinstance(exc, RegistrationError):
        detail: list[tuple[str | None, str]] = [
            (e.key or "body", f"job {e.job!r}: {e.reason}") for e in exc.errors]
        summary = "; ".join(str(e) for e in exc.errors)
        return error_response(422, f"invalid job definition, nothing applied: {summary}", detail)
    if isinstance(exc, NotFound):
        return error_response(404, str(exc))
    if isinstance(exc, Conflict):
        return error_response(409, str(exc))
    if isinstance(exc, InvalidInput | PgflowError):
        return error_response(422, str(exc), [(None, str(exc))])
    if isinstance(exc, PoolTimeout | psycopg.OperationalError):
        return error_response(503, "the database is unavailable; try again shortly",
                              headers={"Retry-After": "5"})
    if isinstance(exc, psycopg.errors.DataError):
        return error_response(400, f"the database rejected a value: {_first_line(exc)}")
    if isinstance(exc, psycopg.errors.IntegrityError):
        return error_response(409, f"conflicting change: {_first_line(exc)}")
    log.exception("internal error serving an API call")
    return error_response(500, f"internal error: {type(exc).__name__}")


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# ---------------------------------------------------------------- serving


def authenticate(conn: Conn, request: Request, role: str) -> tokens.Identity:
    secret = bearer_secret(request.headers.get("authorization"))
    challenge = {"WWW-Authenticate": 'Bearer realm="pgflow"'}
    if secret is None:
        raise ApiError(401, "authentication required: send 'Authorization: Bearer <token>'"
                       " (create one with 'pgflow token create --role viewer')",
                       headers=challenge)
    identity = tokens.verify(conn, secret)
    if identity is None:
        raise ApiError(401, "unknown or revoked token", headers=challenge)
    if not identity.allows(role):
        raise ApiError(403, f"this needs the {role} role; your token is {identity.role}")
    return identity


def _serve(endpoint: Endpoint, request: Request, body: bytes) -> Response:
    state = web_state(request)
    try:
        with state.connection() as conn:
            identity = None
            if endpoint.role is not None:
                identity = authenticate(conn, request, endpoint.role)
            args: dict[str, Any] = {}
            for param in endpoint.params:
                source = request.path_params if param.where == "path" else request.query_params
                raw = source.get(param.name)
                if raw is None:
                    if param.required:
                        raise ApiError(400, f"missing parameter {param.name!r}",
                                       [(param.name, "required")])
                    args[param.name] = param.schema.get("default")
                    continue
                args[param.name] = parse_param(param, raw)
            parsed = None
            if endpoint.body is not None or endpoint.body_schema is not None:
                if len(body) > MAX_BODY:
                    raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
                parsed = parse_body(endpoint, body)
            result = endpoint.handler(Call(conn, identity, args, parsed, state))
        if isinstance(result, Response):
            return result
        status, model = result
        return json_response(status, model)
    except Exception as exc:  # every failure becomes a JSON error (mapped_error logs bugs)
        return mapped_error(exc)


def asgi_endpoint(endpoint: Endpoint) -> Callable[[Request], Any]:
    async def serve(request: Request) -> Response:
        body = b""
        if endpoint.body is not None or endpoint.body_schema is not None:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY:
                    return error_response(413, f"the request body is larger than {MAX_BODY}"
                                          " bytes")
                chunks.append(chunk)
            body = b"".join(chunks)
        return await run_in_threadpool(_serve, endpoint, request, body)

    serve.__name__ = endpoint.operation_id
    return serve
