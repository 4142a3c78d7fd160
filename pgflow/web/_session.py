"""The UI's request plumbing: who is looking (session cookie), in which time zone,
rendering templates, flash messages, and turning failures into error pages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, tzinfo
from typing import Any
from urllib.parse import parse_qs, quote

import psycopg
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from markupsafe import Markup
from psycopg_pool import PoolTimeout
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.templating import Jinja2Templates

from pgflow import tokens
from pgflow.alerts import outbox
from pgflow.cron import CronError, load_timezone
from pgflow.errors import NotFound, PgflowError
from pgflow.web import svg
from pgflow.web._state import Conn, WebState, web_state
from pgflow.web.auth import FLASH_COOKIE, SESSION_COOKIE
from pgflow.web.gantt import precise_seconds

TZ_COOKIE = "pgflow_tz"
MAX_FORM = 256 * 1024

# The one script: optional, it only turns the "local time" link into the browser's zone.
LOCAL_TZ_SCRIPT = (
    "document.querySelectorAll('a[data-local-tz]').forEach(function(a){try{"
    "a.href=a.href.replace('zone=local','zone='+encodeURIComponent("
    "Intl.DateTimeFormat().resolvedOptions().timeZone));}catch(e){}});")


@dataclass(frozen=True)
class Viewer:
    identity: tokens.Identity
    csrf: str
    zone: tzinfo
    zone_name: str

    @property
    def can_operate(self) -> bool:
        return self.identity.allows("operator")

    @property
    def can_admin(self) -> bool:
        return self.identity.allows("admin")


def _environment() -> Environment:
    env = Environment(loader=PackageLoader("pgflow.web", "templates"),
                      autoescape=select_autoescape(["html"]), undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["dur"] = lambda s: "-" if s is None else svg.human_seconds(float(s))
    env.filters["dur_precise"] = lambda s: "-" if s is None else precise_seconds(float(s))
    env.filters["colour"] = svg.colour
    env.filters["seg"] = lambda s: quote(str(s), safe="")
    env.filters["qs"] = lambda s: quote(str(s), safe="")
    env.globals["local_tz_script"] = LOCAL_TZ_SCRIPT
    return env


templates = Jinja2Templates(env=_environment())


def zone_of(request: Request) -> tuple[tzinfo, str]:
    name = request.cookies.get(TZ_COOKIE, "UTC")
    if name in ("", "UTC"):
        return UTC, "UTC"
    try:
        return load_timezone(name), name
    except CronError:
        return UTC, "UTC"


def viewer_of(conn: Conn, request: Request, state: WebState) -> Viewer | None:
    session = state.signer.unsign("session", request.cookies.get(SESSION_COOKIE))
    if session is None or not isinstance(session.get("tid"), int):
        return None
    identity = tokens.live(conn, session["tid"])
    if identity is None:
        return None
    zone, name = zone_of(request)
    return Viewer(identity, str(session.get("csrf", "")), zone, name)


def local_path(target: str | None, default: str = "/") -> str:
    """``target`` if it is a path on this site (no open redirects), else ``default``."""
    if (not target or not target.startswith("/") or target.startswith("//") or "\\" in target
            or any(ord(c) < 32 for c in target)):
        return default
    return target


def here(request: Request) -> str:
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def time_formatter(zone: tzinfo, zone_name: str, *, millis: bool = False
                   ) -> Callable[[datetime | None], Markup]:
    """``t(moment)`` for templates: to the second, or to the millisecond (``tms``)."""
    def show(moment: datetime | None) -> Markup:
        if moment is None:
            return Markup("-")
        local = moment.astimezone(zone)
        suffix = "UTC" if zone_name == "UTC" else local.strftime("%Z") or zone_name
        return Markup('<time datetime="{}">{} {}</time>').format(
            moment.astimezone(UTC).isoformat().replace("+00:00", "Z"),
            local.strftime("%Y-%m-%d %H:%M:%S")
            + (f".{local.microsecond // 1000:03d}" if millis else ""), suffix)

    return show


def render(request: Request, template: str, viewer: Viewer | None, context: dict[str, Any],
           *, status: int = 200, refresh: int | None = None) -> Response:
    state = web_state(request)
    flash = state.signer.unsign("flash", request.cookies.get(FLASH_COOKIE))
    zone, zone_name = (viewer.zone, viewer.zone_name) if viewer else zone_of(request)
    base = {
        "viewer": viewer, "flash": flash, "refresh": refresh, "here": here(request),
        "t": time_formatter(zone, zone_name), "zone_name": zone_name,
        "tms": time_formatter(zone, zone_name, millis=True),
        "csrf": viewer.csrf if viewer else "", "nav": request.url.path,
    }
    response = templates.TemplateResponse(request, template, {**base, **context},
                                          status_code=status)
    if flash is not None:
        response.delete_cookie(FLASH_COOKIE, path="/")
    return response


def error_page(request: Request, status: int, message: str, viewer: Viewer | None = None
               ) -> Response:
    titles = {400: "Bad request", 403: "Forbidden", 404: "Not found", 405: "Method not allowed",
              413: "Too large", 503: "Database unavailable"}
    return render(request, "error.html", viewer, {
        "title": titles.get(status, "Error"), "status": status, "message": message},
        status=status)


def page(request: Request, template: str,
         build: Callable[[Conn, Viewer], dict[str, Any] | Response],
         *, refresh: Callable[[dict[str, Any]], int | None] | None = None) -> Response:
    """Serve a GET page to a logged-in viewer (others go to /login first)."""
    state = web_state(request)
    viewer: Viewer | None = None
    try:
        with state.connection() as conn:
            viewer = viewer_of(conn, request, state)
            if viewer is None:
                return RedirectResponse("/login?next=" + quote(here(request), safe=""), 303)
            context = build(conn, viewer)
            if isinstance(context, dict):  # the firing-incident banner (pgflow.alerts)
                context.setdefault("firing", outbox.banner(conn))
    except NotFound as exc:
        return error_page(request, 404, str(exc), viewer)
    except PgflowError as exc:
        return error_page(request, 400, str(exc), viewer)
    except (PoolTimeout, psycopg.OperationalError):
        return error_page(request, 503, "the database is unavailable; this page retries"
                          " when you reload it", viewer)
    if isinstance(context, Response):
        return context
    return render(request, template, viewer, context,
                  refresh=refresh(context) if refresh else None)


async def read_form_lists(request: Request) -> dict[str, list[str]] | None:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_FORM:
            return None
        chunks.append(chunk)
    if "application/x-www-form-urlencoded" not in request.headers.get("content-type", ""):
        return {}
    return parse_qs(b"".join(chunks).decode("utf-8", "replace"), keep_blank_values=True)


def set_flash(response: Response, state: WebState, message: str, kind: str) -> None:
    value = state.signer.sign("flash", {"m": message[:600], "k": kind}, 60)
    response.set_cookie(FLASH_COOKIE, value, max_age=60, httponly=True, samesite="lax",
                        path="/")
