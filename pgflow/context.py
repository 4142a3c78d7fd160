"""What a Python entrypoint job receives, and the errors it may raise."""

from __future__ import annotations

import json
import threading
from datetime import datetime
from typing import Any


class PermanentError(Exception):
    """Raise from a job to fail the run at once, without retries."""


class SourceUnavailable(Exception):
    """Raise from a job when an external system is down (the exit-75 equivalent)."""

    def __init__(self, source: str, message: str = "") -> None:
        super().__init__(message or f"source {source!r} is unavailable")
        self.source = source


class Context:
    """One attempt of one run, as seen by the job's code.

    ``cancelled`` is set when the attempt must stop (operator cancel, timeout, lost
    lease, shutdown). Async jobs are also cancelled with ``CancelledError``; sync
    jobs run in a thread and should poll ``cancelled`` in long loops: a thread cannot
    be killed, so one that ignores it runs on after its attempt ended, and keeps its
    worker slot until it returns.

    ``params`` may be given as the JSON text the database returned: it is decoded on
    first use, and the cancellation event is made on first use too (most no-op-sized
    runs never touch either, and both cost more than the rest of their bookkeeping).
    """

    __slots__ = ("_cancelled", "_events", "_events_json", "_params", "_params_json", "attempt",
                 "job", "logger", "logical_time", "run_id")

    def __init__(self, run_id: int, job: str, logical_time: datetime, attempt: int,
                 params: dict[str, Any] | str, logger: Any,
                 trigger_events: list[dict[str, Any]] | str | None = None) -> None:
        self.run_id = run_id
        self.job = job
        self.logical_time = logical_time
        self.attempt = attempt
        self.logger = logger
        self._params: dict[str, Any] | None = params if isinstance(params, dict) else None
        self._params_json = params if isinstance(params, str) else None
        self._cancelled: threading.Event | None = None
        self._events = trigger_events if isinstance(trigger_events, list) else None
        self._events_json = trigger_events if isinstance(trigger_events, str) else None

    @property
    def params(self) -> dict[str, Any]:
        if self._params is None:
            self._params = json.loads(self._params_json or "{}")
        return self._params

    @property
    def params_json(self) -> str:
        if self._params_json is None:
            self._params_json = json.dumps(self._params)
        return self._params_json

    @property
    def trigger_events(self) -> list[dict[str, Any]]:
        """The dataset events a dataset-triggered run consumed (``{dataset, id, key,
        payload}``, oldest first); empty for other runs."""
        if self._events is None:
            self._events = json.loads(self._events_json or "[]")
        return self._events

    @property
    def cancelled(self) -> threading.Event:
        # Made on the event loop's thread before a sync job's thread can look (see
        # Execution), so the job and the loop always share one event.
        if self._cancelled is None:
            self._cancelled = threading.Event()
        return self._cancelled

    def __repr__(self) -> str:
        return (f"Context(run_id={self.run_id}, job={self.job!r}, attempt={self.attempt},"
                f" logical_time={self.logical_time.isoformat()})")
