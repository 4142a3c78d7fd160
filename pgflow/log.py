"""Structured logs on stderr (structlog): JSON lines for machines, or a readable
console rendering when a person is watching (stderr is a terminal)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
FORMATS = ("auto", "json", "console")


def renders_console(log_format: str, stream: Any = None) -> bool:
    """Whether ``log_format`` (auto|json|console) means the console renderer."""
    if log_format == "auto":
        stream = sys.stderr if stream is None else stream
        isatty = getattr(stream, "isatty", None)
        return bool(isatty and isatty())
    return log_format == "console"


def configure(level: str = "info", log_format: str = "auto") -> None:
    console = renders_console(log_format)
    renderer: Any = (structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()) if console
                     else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            # The console renderer shows tracebacks itself, readably.
            *([] if console else [structlog.processors.format_exc_info]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(**bound: Any) -> Any:
    return structlog.get_logger("pgflow").bind(**bound)


class LazyLogger:
    """A logger bound to ``fields`` only when first used: most runs never log, and
    binding costs more than the rest of a no-op run's bookkeeping."""

    __slots__ = ("_base", "_bound", "_fields")

    def __init__(self, base: Any, fields: dict[str, Any]) -> None:
        self._base = base
        self._fields = fields
        self._bound: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._bound is None:
            self._bound = self._base.bind(**self._fields)
        return getattr(self._bound, name)
