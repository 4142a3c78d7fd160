"""The admin pages' forms (POST): login, logout, and every operator or admin action.

Each action checks, in order: a live session, the session's CSRF token (403 without
it), the role (403), then acts through the same domain functions as the CLI and the
API and redirects (303) back with a flash message saying what happened.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from pgflow import backfill, breakers, registry, runs, tokens
from pgflow.errors import InvalidInput, PgflowError
from pgflow.spec import NAME_RE
from pgflow.web._endpoint import ApiError, check_storable
from pgflow.web._session import (
    Viewer,
    error_page,
    local_path,
    read_form_lists,
    render,
    set_flash,
    viewer_of,
)
from pgflow.web._state import Conn, web_state
from pgflow.web.auth import (
    LOGIN_COOKIE,
    LOGIN_TTL_S,
    SESSION_COOKIE,
    SESSION_TTL_S,
    csrf_matches,
    new_session,
)
from pgflow.web.models import ISO_TIME
from pgflow.web.pages import _path_id, _path_name

Form = dict[str, list[str]]
Act = Callable[[Conn, Viewer, Request, Form], tuple[str, str | None]]
MAX_BULK = 500
_TIME = TypeAdapter(datetime)


def field(form: Form, name: str) -> str:
    values = form.get(name)
    return values[-1].strip() if values else ""


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


def _forbidden(request: Request, message: str, viewer: Viewer | None = None) -> Response:
    return error_page(request, 403, message, viewer)


def action(role: str, act: Act) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        form = await read_form_lists(request)
        if form is None:
            return error_page(request, 413, "the form is too large")
        return await run_in_threadpool(_run, request, form, role, act)

    endpoint.__name__ = act.__name__
    return endpoint


def _run(request: Request, form: Form, role: str, act: Act) -> Response:
    state = web_state(request)
    back = local_path(field(form, "next"), request.url.path.rsplit("/", 1)[0] or "/")
    with state.connection() as conn:
        viewer = viewer_of(conn, request, state)
        if viewer is None or not csrf_matches(viewer.csrf, field(form, "csrf")):
            return _forbidden(request, "missing or invalid CSRF token: reload the page and"
                              " submit the form again (log in again if your session ended)",
                              viewer)
        if not viewer.identity.allows(role):
            return _forbidden(request, f"this needs the {role} role; you are logged in as"
                              f" {viewer.identity.role}", viewer)
        try:
            message, target = act(conn, viewer, request, form)
            kind = "ok"
        except PgflowError as exc:
            message, target, kind = str(exc), None, "error"
    response = RedirectResponse(local_path(target, back) if target else back, 303)
    set_flash(response, state, message, kind)
    return response


# ---------------------------------------------------------------- login


def _login_form(request: Request, error: str | None, status: int) -> Response:
    state = web_state(request)
    nonce = secrets.token_urlsafe(24)
    response = render(request, "login.html", None, {
        "title": "Log in", "login_csrf": nonce, "error": error,
        "next": local_path(request.query_params.get("next"))}, status=status)
    response.set_cookie(LOGIN_COOKIE, state.signer.sign("login", {"n": nonce}, LOGIN_TTL_S),
                        max_age=LOGIN_TTL_S, httponly=True, samesite="lax",
                        secure=_secure(request), path="/")
    return response


def login_page(request: Request) -> Response:
    state = web_state(request)
    with state.connection() as conn:
        if viewer_of(conn, request, state) is not None:
            return RedirectResponse(local_path(request.query_params.get("next")), 303)
    return _login_form(request, None, 200)


async def login_submit(request: Request) -> Response:
    form = await read_form_lists(request)
    if form is None:
        return error_page(request, 413, "the form is too large")
    return await run_in_threadpool(_login, request, form)


def _login(request: Request, form: Form) -> Response:
    state = web_state(request)
    started = state.signer.unsign("login", request.cookies.get(LOGIN_COOKIE))
    if started is None or not csrf_matches(str(started.get("n", "")), field(form, "csrf")):
        return _forbidden(request, "missing or invalid CSRF token: open the login page again")
    with state.connection() as conn:
        identity = tokens.verify(conn, field(form, "token"))
    if identity is None:
        return _login_form(request, "unknown or revoked token", 401)
    cookie, _ = new_session(state.signer, identity)
    response = RedirectResponse(local_path(field(form, "next")), 303)
    response.set_cookie(SESSION_COOKIE, cookie, max_age=SESSION_TTL_S, httponly=True,
                        samesite="lax", secure=_secure(request), path="/")
    response.delete_cookie(LOGIN_COOKIE, path="/")
    return response


def _logout(conn: Conn, viewer: Viewer, request: Request, form: Form) -> tuple[str, str | None]:
    return "logged out", "/login"


async def logout(request: Request) -> Response:
    response: Response = await action("viewer", _logout)(request)
    if response.status_code == 303:
        response.delete_cookie(SESSION_COOKIE, path="/")
    return response


# ---------------------------------------------------------------- jobs


def _pause(conn: Conn, viewer: Viewer, request: Request, form: Form) -> tuple[str, str | None]:
    name = _path_name(request)
    registry.set_paused(conn, name, True)
    return f"job {name} paused", None


def _resume(conn: Conn, viewer: Viewer, request: Request, form: Form) -> tuple[str, str | None]:
    name = _path_name(request)
    registry.set_paused(conn, name, False)
    return f"job {name} resumed", None


def _parse_time(text: str) -> datetime | None:
    if not text:
        return None
    try:
        if not ISO_TIME.match(text):
            raise ValueError(text)
        moment = _TIME.validate_python(text)
        moment = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
        moment.astimezone(UTC)
    except (ValueError, ValidationError, OverflowError):
        raise InvalidInput(f"expected an ISO 8601 time such as 2026-01-31T12:00:00Z,"
                           f" got {text[:40]!r}") from None
    return moment


def _trigger(conn: Conn, viewer: Viewer, request: Request, form: Form) -> tuple[str, str | None]:
    name = _path_name(request)
    params: dict[str, Any] | None = None
    raw = field(form, "params")
    if raw:
        try:
            params = json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        except (ValueError, RecursionError):
            raise InvalidInput("params must be a JSON object such as {\"region\": \"eu\"}"
                               ) from None
        if not isinstance(params, dict):
            raise InvalidInput("params must be a JSON object such as {\"region\": \"eu\"}")
        try:
            check_storable(params, "params")
        except ApiError as exc:
            raise InvalidInput(exc.message) from None
    run_id = runs.trigger(conn, name, _parse_time(field(form, "logical_time")), params,
                          downstream=bool(field(form, "downstream")))
    return f"run {run_id} of {name} created", f"/runs/{run_id}"


def _delete(conn: Conn, viewer: Viewer, request: Request, form: Form) -> tuple[str, str | None]:
    name = _path_name(request)
    registry.delete(conn, name)
    return f"job {name} deleted; its runs stay in the history", "/jobs"


# ---------------------------------------------------------------- runs


def _run_action(verb: str) -> Act:
    def act(conn: Conn, viewer: Viewer, request: Request, form: Form) -> tuple[str, str | None]:
        run_id = _path_id(request)
        if verb == "retry":
            return runs.retry_message(run_id, runs.retry(conn, run_id)), f"/runs/{run_id}"
        if verb == "rerun":
            from pgflow import rerun

            row = rerun.rerun(conn, run_id, downstream=bool(field(form, "downstream")))
            return rerun.rerun_message(run_id, row), f"/runs/{run_id}"
        if verb == "cancel":
            result = runs.cancel(conn, run_id)
            return f"run {run_id}: {result['outcome']}", f"/runs/{run_id}"
        runs.ack(conn, run_id)
        return f"run {run_id} acknowledged", None

    act.__name__ = f"run_{verb}"
    return act


def _bulk(conn: Conn, viewer: Viewer, request: Request, form: Form) -> tuple[str, str | None]:
    verb = field(form, "action")
    if verb not in ("retry", "ack"):
        raise InvalidInput("choose retry or acknowledge")
    ids = [v for v in form.get("ids", [])
           if v.isascii() and v.isdigit() and 0 < int(v) < 2**63]
    if not ids:
        raise InvalidInput("select at least one run")
    if len(ids) > MAX_BULK:
        raise InvalidInput(f"select at most {MAX_BULK} runs at once")
    done, refused = [], []
    for run_id in map(int, ids):
        try:
            (runs.retry if verb == "retry" else runs.ack)(conn, run_id)
            done.append(run_id)
        except PgflowError as exc:
            refused.append(str(exc))
    what = "queued for retry" if verb == "retry" else "acknowledged"
    message = f"{len(done)} run(s) {what}"
    if refused:
        message += f"; {len(refused)} refused: " + "; ".join(refused[:3])
    return message, "/dead-letters"


# ---------------------------------------------------------------- backfills, breakers


def _backfill(conn: Conn, viewer: Viewer, request: Request, form: Form) -> tuple[str, str | None]:
    job = field(form, "job")
    if job and not NAME_RE.fullmatch(job):
        raise InvalidInput(f"no job named {job[:60]!r}")
    start, end = _parse_time(field(form, "start")), _parse_time(field(form, "end"))
    if not job or start is None or end is None:
        raise InvalidInput("a backfill needs a job, a start and an end")
    if start >= end:
        raise InvalidInput("start must be before end")
    reprocess = field(form, "reprocess") or "none"
    if reprocess not in ("none", "failed", "all"):
        raise InvalidInput("reprocess must be none, failed or all")
    limit = field(form, "max_concurrency") or "2"
    if not limit.isdigit() or not 1 <= int(limit) <= 10_000:
        raise InvalidInput("max concurrency must be a number from 1 to 10000")
    created = backfill.create(conn, job, start, end, max_concurrency=int(limit),
                              downstream=bool(field(form, "downstream")), reprocess=reprocess)
    again = f" {created['reprocessed']} re-run," if created["reprocessed"] else ""
    return (f"backfill {created['id']} of {job}: {created['created']} run(s) created,{again}"
            f" {created['skipped']} tick(s) already had a run"), "/backfills"


def _backfill_cancel(conn: Conn, viewer: Viewer, request: Request, form: Form
                     ) -> tuple[str, str | None]:
    backfill_id = _path_id(request, "backfill")
    backfill.show(conn, backfill_id)
    result = backfill.cancel(conn, backfill_id)
    return (f"backfill {backfill_id} cancelled: {result['cancelled']} run(s) cancelled,"
            f" {result['stopping']} stopping"), "/backfills"


def _source(request: Request) -> str:
    source = request.path_params["source"]
    breakers.check_source(source)
    return str(source)


def _breaker_open(conn: Conn, viewer: Viewer, request: Request, form: Form
                  ) -> tuple[str, str | None]:
    source = _source(request)
    breakers.open_breaker(conn, source, field(form, "reason") or None, viewer.identity.actor)
    return f"breaker of {source} opened: its jobs' runs are held back", "/breakers"


def _breaker_close(conn: Conn, viewer: Viewer, request: Request, form: Form
                   ) -> tuple[str, str | None]:
    source = _source(request)
    breakers.close_breaker(conn, source, field(form, "reason") or None, viewer.identity.actor)
    return f"breaker of {source} closed", "/breakers"


pause_job = action("operator", _pause)
resume_job = action("operator", _resume)
trigger_job = action("operator", _trigger)
delete_job = action("admin", _delete)
retry_run = action("operator", _run_action("retry"))
cancel_run = action("operator", _run_action("cancel"))
rerun_run = action("operator", _run_action("rerun"))
ack_run = action("operator", _run_action("ack"))
bulk_dead_letters = action("operator", _bulk)
create_backfill = action("operator", _backfill)
cancel_backfill = action("operator", _backfill_cancel)
open_breaker = action("operator", _breaker_open)
close_breaker = action("operator", _breaker_close)

