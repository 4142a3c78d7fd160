"""The web role's Starlette application: JSON API, admin pages, health and metrics.

Concurrency: endpoints that touch the database are plain functions that Starlette runs
in its thread pool, each borrowing a connection from one ``psycopg_pool`` pool per
app (opened on startup, closed on shutdown). Only body reading is async.
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from prometheus_client import CONTENT_TYPE_LATEST
from psycopg_pool import PoolTimeout
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pgflow import migrate, tokens
from pgflow.config import Settings
from pgflow.metrics import Metrics
from pgflow.web import actions, alerts_page, dataset_views, pages
from pgflow.web._endpoint import asgi_endpoint, error_response
from pgflow.web._session import LOCAL_TZ_SCRIPT, error_page
from pgflow.web._state import WebState, new_pool, web_state
from pgflow.web.api import ENDPOINTS
from pgflow.web.auth import Signer, bearer_secret, is_loopback, load_secret
from pgflow.web.openapi import PREFIX, document

_SCRIPT_HASH = base64.b64encode(hashlib.sha256(LOCAL_TZ_SCRIPT.encode()).digest()).decode()
CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:;"
       f" script-src 'sha256-{_SCRIPT_HASH}'; form-action 'self'; frame-ancestors 'none';"
       " base-uri 'none'")


class SecurityHeaders:
    """Headers every response gets (and ``Server-Timing``: the time the app took until
    the response started); HTML also gets a strict Content-Security-Policy."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        started = time.perf_counter()

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                took = (time.perf_counter() - started) * 1000
                headers.append((b"server-timing", f"app;dur={took:.1f}".encode()))
                names = {name.lower() for name, _ in headers}
                extra = [(b"x-content-type-options", b"nosniff"),
                         (b"referrer-policy", b"same-origin"), (b"x-frame-options", b"DENY")]
                content_type = dict(headers).get(b"content-type", b"")
                if content_type.startswith(b"text/html"):
                    extra += [(b"content-security-policy", CSP.encode()),
                              (b"cache-control", b"no-store")]
                headers += [(k, v) for k, v in extra if k not in names]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)


# ---------------------------------------------------------------- open endpoints


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def readyz(request: Request) -> Response:
    state = web_state(request)
    try:
        with state.pool.connection(timeout=3.0) as conn:
            waiting = migrate.pending(conn)
    except (PoolTimeout, psycopg.Error) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return JSONResponse({"status": "unavailable", "reason": f"database: {reason}"}, 503)
    if waiting:
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in waiting)
        return JSONResponse({"status": "unavailable",
                             "reason": f"pending migrations: {names} (run 'pgflow db migrate')"},
                            503)
    return JSONResponse({"status": "ready"})


def metrics_endpoint(request: Request) -> Response:
    """Open to loopback clients; others need a token of any role."""
    state = web_state(request)
    if not is_loopback(request.client.host if request.client else None):
        secret = bearer_secret(request.headers.get("authorization"))
        try:
            with state.connection() as conn:
                identity = tokens.verify(conn, secret) if secret else None
        except (PoolTimeout, psycopg.Error):
            return Response("database unavailable\n", 503, media_type="text/plain")
        if identity is None:
            return Response("metrics need 'Authorization: Bearer <token>' from"
                            " non-loopback clients\n", 401, media_type="text/plain",
                            headers={"WWW-Authenticate": 'Bearer realm="pgflow"'})
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def openapi_json(request: Request) -> Response:
    return JSONResponse(document())


# ---------------------------------------------------------------- errors


def _is_api(request: Request) -> bool:
    return request.url.path.startswith(PREFIX + "/") or request.url.path == PREFIX


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path (Starlette's own Allow header names
    only the first route that matched the path)."""
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE and isinstance(route, Route) and route.methods:
            methods |= route.methods
    return ", ".join(sorted(methods))


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = _allowed_methods(request)
    if _is_api(request):
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed here"}.get(
                       exc.status_code, str(exc.detail))
        return error_response(exc.status_code, message, headers=headers)
    message = {404: f"there is no page at {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(
                   exc.status_code, str(exc.detail))
    response = error_page(request, exc.status_code, message)
    response.headers.update(headers)
    return response


async def server_error(request: Request, exc: Exception) -> Response:
    unavailable = isinstance(exc, PoolTimeout | psycopg.OperationalError)
    status = 503 if unavailable else 500
    message = ("the database is unavailable; try again shortly" if unavailable
               else f"internal error: {type(exc).__name__}")
    if _is_api(request):
        return error_response(status, message)
    return Response(f"{status} {message}\n", status, media_type="text/plain")


# ---------------------------------------------------------------- the app


def routes() -> list[Route]:
    p, a = pages, actions
    return [
        Route("/healthz", healthz), Route("/readyz", readyz),
        Route("/metrics", metrics_endpoint),
        Route(PREFIX + "/openapi.json", openapi_json),
        *(Route(PREFIX + e.path, asgi_endpoint(e), methods=[e.method]) for e in ENDPOINTS),
        Route("/", p.dashboard),
        Route("/login", a.login_page, methods=["GET"]),
        Route("/login", a.login_submit, methods=["POST"]),
        Route("/logout", a.logout, methods=["POST"]),
        Route("/prefs/tz", p.tz_page),
        Route("/jobs", p.jobs),
        Route("/jobs/{name}", p.job_page),
        Route("/jobs/{name}/dag", p.dag_page),
        Route("/jobs/{name}/pause", a.pause_job, methods=["POST"]),
        Route("/jobs/{name}/resume", a.resume_job, methods=["POST"]),
        Route("/jobs/{name}/trigger", a.trigger_job, methods=["POST"]),
        Route("/jobs/{name}/delete", a.delete_job, methods=["POST"]),
        Route("/runs", p.runs_page),
        Route("/runs/{id}", p.run_page),
        Route("/runs/{id}/retry", a.retry_run, methods=["POST"]),
        Route("/runs/{id}/cancel", a.cancel_run, methods=["POST"]),
        Route("/runs/{id}/rerun", a.rerun_run, methods=["POST"]),
        Route("/runs/{id}/ack", a.ack_run, methods=["POST"]),
        Route("/dead-letters", p.dead_letters_page, methods=["GET"]),
        Route("/dead-letters", a.bulk_dead_letters, methods=["POST"]),
        Route("/backfills", p.backfills_page, methods=["GET"]),
        Route("/backfills", a.create_backfill, methods=["POST"]),
        Route("/backfills/{id}/cancel", a.cancel_backfill, methods=["POST"]),
        Route("/replicas", p.replicas_page),
        Route("/breakers", p.breakers_page),
        Route("/alerts", alerts_page.alerts_page),
        Route("/alerts/{name}/test", alerts_page.test_alert, methods=["POST"]),
        Route("/breakers/{source}/open", a.open_breaker, methods=["POST"]),
        Route("/breakers/{source}/close", a.close_breaker, methods=["POST"]),
        Route("/tenants", p.tenants_page),
        Route("/datasets", dataset_views.datasets_page),
    ]


def create_app(url: str, settings: Settings, *, secret: bytes | None = None,
               pool_size: int = 10, pooled: bool = False) -> Starlette:
    """The web role's app for the database at ``url``.

    ``secret`` signs session cookies; by default it is ``PGFLOW_SECRET_KEY`` or
    ``$PGFLOW_HOME/secret`` (created on first use), so replicas sharing either agree.
    """
    pool = new_pool(url, pool_size, pooled=pooled)
    state = WebState(url=url, settings=settings,
                     signer=Signer(secret if secret is not None else load_secret(settings.home)),
                     pool=pool, metrics=Metrics(pool.connection, settings.lease_ttl))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        pool.open(wait=False)
        try:
            yield {}
        finally:
            await run_in_threadpool(pool.close, 5.0)

    app = Starlette(routes=routes(), lifespan=lifespan, exception_handlers={
        HTTPException: http_error, Exception: server_error})
    app.state.web = state
    app.add_middleware(SecurityHeaders)
    return app
