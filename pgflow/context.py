"""What a Python entrypoint job receives, and the errors it may raise."""

from __future__ import annotations

import json
import threading
from datetime import datetime
from typing import Any

from pgflow.live import LiveOutput, check_progress, encode_checkpoint


class PermanentError(Exception):
    """Raise from a job to fail the run at once, without retries."""


class SourceUnavailable(Exception):
    """Raise from a job when an external system is down (the exit-75 equivalent)."""

    def __init__(self, source: str, message: str = "") -> None:
        super().__init__(message or f"source {source!r} is unavailable")
        self.source = source


_MAKING = threading.Lock()


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

    __slots__ = ("_cancelled", "_checkpoint_json", "_events", "_events_json", "_live",
                 "_params", "_params_json", "_report", "attempt", "job", "logger",
                 "logical_time", "run_id")

    def __init__(self, run_id: int, job: str, logical_time: datetime, attempt: int,
                 params: dict[str, Any] | str, logger: Any,
                 trigger_events: list[dict[str, Any]] | str | None = None, *,
                 checkpoint_json: str | None = None, live: LiveOutput | None = None,
                 report: bool = False) -> None:
        """``live``: where reports go (a command's); ``report``: make one at the first
        report (a Python job's: most never report, and skip its cost)."""
        self._checkpoint_json = checkpoint_json
        self._live = live
        self._report = report
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

    @property
    def last_checkpoint(self) -> Any:
        """The checkpoint an earlier attempt of this run stored (``checkpoint``), or None
        on a first attempt and after ``runs rerun``."""
        return None if self._checkpoint_json is None else json.loads(self._checkpoint_json)

    def progress(self, fraction: float | None, message: str | None = None) -> None:
        """Report how far the job is (0 to 1) and what it does. Cheap: only the latest
        report is kept, and stored with the next flush (every ~2 s). ValueError for a
        fraction outside 0..1 or a message that is not a string."""
        fraction, message = check_progress(fraction, message)
        live = self.live_output
        if live is not None:
            live.progress(fraction, message)

    def checkpoint(self, value: Any) -> None:
        """Store ``value`` (JSON, at most 1 MiB) with the run: a later attempt of this run
        starts with it as ``last_checkpoint``. Stored with the next flush (every ~2 s)
        and at the latest before the attempt's result, only while this attempt holds its
        lease. ValueError when ``value`` is not JSON or too large."""
        text = encode_checkpoint(value)
        live = self.live_output
        if live is not None:
            live.checkpoint(text)

    @property
    def live_output(self) -> LiveOutput | None:
        """Where this attempt's reports wait for the worker's next flush (pgflow.live)."""
        if self._live is None and self._report:
            with _MAKING:  # a job may report from several threads at once
                if self._live is None:
                    self._live = LiveOutput()
        return self._live

    @property
    def reported(self) -> LiveOutput | None:
        """``live_output`` if it exists (the worker looks without making one)."""
        return self._live

    def attach(self, live: LiveOutput) -> None:
        self._live = live

    def __repr__(self) -> str:
        return (f"Context(run_id={self.run_id}, job={self.job!r}, attempt={self.attempt},"
                f" logical_time={self.logical_time.isoformat()})")
