"""Figure 9: web server times, measured by ``pgflow.web.bench.bench_web(url)`` (the web
issue's benchmark: it seeds the database at ``url``, serves the app itself and times
the admin pages). Called with a fresh benchmark database; "not available" when the
module is missing."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from bench.context import Bench


def _bench_function() -> Callable[..., Any] | None:
    try:
        if importlib.util.find_spec("pgflow.web.bench") is None:
            return None
    except ImportError:
        return None
    function = getattr(importlib.import_module("pgflow.web.bench"), "bench_web", None)
    return function if callable(function) else None


def measure(b: Bench) -> dict[str, Any]:
    function = _bench_function()
    if function is None:
        return {"available": False, "note": "not available (no pgflow/web/bench.py bench_web)"}
    if b.quick:
        return {"available": False, "note": "skipped in --quick (seeding takes ~50 s)"}
    url = b.fresh_database()
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON document
        result = function(url)
    return {"available": True, "result": result,
            "method": "pgflow.web.bench.bench_web(<fresh benchmark database url>)"}
