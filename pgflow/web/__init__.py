"""The web role: JSON API (``/api/v1``), admin pages, ``/healthz``, ``/readyz``, ``/metrics``.

``create_app`` builds the Starlette app; ``run_web`` serves it inside ``pgflow serve``;
``check_bind_allowed`` refuses a non-loopback bind while no admin token exists.
"""

from pgflow.web.app import create_app
from pgflow.web.auth import check_bind_allowed
from pgflow.web.server import run_web

__all__ = ["check_bind_allowed", "create_app", "run_web"]
