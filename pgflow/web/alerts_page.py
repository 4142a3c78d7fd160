"""The ``/alerts`` page and its "send test" action (the banner: ``outbox.banner``)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pgflow.alerts import outbox
from pgflow.errors import NotFound, PgflowError
from pgflow.spec import NAME_RE
from pgflow.web._session import Viewer, page
from pgflow.web._state import Conn, web_state
from pgflow.web.actions import Form, action


def alerts_page(request: Request) -> Response:
    def build(conn: Conn, viewer: Viewer) -> dict[str, Any]:
        report = outbox.overview(conn, limit=100)
        undelivered = [d for d in report["deliveries"] if d["delivery"] != "delivered"]
        return {"title": "Alerts", "r": report, "undelivered": undelivered}

    return page(request, "alerts.html", build, refresh=lambda _: 15)


def _test(conn: Conn, viewer: Viewer, request: Request, form: Form) -> tuple[str, str | None]:
    name = str(request.path_params["name"])
    if not NAME_RE.fullmatch(name):
        raise NotFound(f"unknown alert {name[:60]!r}")
    result = outbox.send_test(conn, name, web_state(request).settings.ui_url)
    if not result.answer.ok:
        raise PgflowError(f"test notification to alert {name} failed: {result.answer.describe()}")
    return f"test notification sent to alert {name}: HTTP {result.answer.status}", "/alerts"


test_alert = action("operator", _test)
