"""pgflow: scheduled ETL jobs with dependencies and retries, coordinated by PostgreSQL only.

The names below are imported on first access (module ``__getattr__``): ``import pgflow``
stays cheap for the command line, and ``pgflow.Flow`` or ``pgflow.PermanentError``
work as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pgflow.context import Context, PermanentError, SourceUnavailable
    from pgflow.flow import Flow
    from pgflow.spec import JobSpec, RetryPolicy

_EXPORTS = {
    "Context": "pgflow.context",
    "PermanentError": "pgflow.context",
    "SourceUnavailable": "pgflow.context",
    "Flow": "pgflow.flow",
    "JobSpec": "pgflow.spec",
    "RetryPolicy": "pgflow.spec",
}

__all__ = ["Context", "Flow", "JobSpec", "PermanentError", "RetryPolicy", "SourceUnavailable",
           "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pgflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
