"""What a Python entrypoint job receives, and the errors it may raise."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


class PermanentError(Exception):
    """Raise from a job to fail the run at once, without retries."""


class SourceUnavailable(Exception):
    """Raise from a job when an external system is down (the exit-75 equivalent)."""

    def __init__(self, source: str, message: str = "") -> None:
        super().__init__(message or f"source {source!r} is unavailable")
        self.source = source


@dataclass
class Context:
    """One attempt of one run, as seen by the job's code.

    ``cancelled`` is set when the attempt must stop (operator cancel, timeout, lost
    lease, shutdown). Async jobs are also cancelled with ``CancelledError``; sync
    jobs run in a thread and should poll ``cancelled`` in long loops.
    """

    run_id: int
    job: str
    logical_time: datetime
    attempt: int
    params: dict[str, Any]
    logger: Any
    cancelled: threading.Event = field(default_factory=threading.Event)
