"""Running one attempt: a command in its own process group, or a Python callable.

An ``Execution`` runs to an ``AttemptResult``. ``stop(outcome)`` ends it early
(cancel, lost lease, shutdown): a command's whole process group gets SIGTERM,
then SIGKILL after a short grace (at once for a lost lease); an async callable is
cancelled; a sync callable (in a thread) is told through ``ctx.cancelled`` and
abandoned.

Commands run under the replica's supervisor process (``pgflow.supervisor`` explains
it): the attempt ends when the command's main process exits, its whole group is
killed then, and the supervisor kills it at its lease deadline (``deadline`` at the
start, moved by ``extend`` after each renewal) even if the replica is frozen.
Their environment is ``pgflow.environment.job_base`` plus the run's variables.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import os
import signal
import tempfile
import traceback
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pgflow import supervisor
from pgflow.context import Context, PermanentError, SourceUnavailable
from pgflow.environment import job_base
from pgflow.live import CONTROL_PATH, DEFAULT_LOG_LIMIT, LiveOutput
from pgflow.retry import EX_TEMPFAIL, FAILED, LOST, SUCCEEDED, TIMED_OUT
from pgflow.supervisor import KILL_GRACE_S, Exit

__all__ = ["KILL_GRACE_S", "AttemptResult", "Execution", "Job"]

TAIL_BYTES = 64 * 1024
MAX_EVENTS_ENV_BYTES = 100 * 1024


# These two are made for every run: not frozen (queue.Finish says why), never mutated.
@dataclass(slots=True)
class AttemptResult:
    outcome: str
    exit_code: int | None = None
    error: str | None = None
    stdout_tail: str | None = None
    stderr_tail: str | None = None
    permanent: bool = False
    unavailable_source: str | None = None


@dataclass(slots=True)
class Job:
    """What an execution needs to know about the run it executes (the worker builds it
    positionally, in this field order)."""

    run_id: int
    job: str
    logical_time: datetime
    attempt: int
    params: dict[str, Any] | str  # the JSON text as claimed, or a dict
    command: list[str] | str | None
    entrypoint: str | None
    timeout_s: float | None
    checkpoint: str | None = None  # JSON text an earlier attempt stored (pgflow.live)
    trigger_events: str | None = None  # a dataset run's consumed events, JSON text


class Tail:
    """The last ``limit`` bytes written to a stream."""

    def __init__(self, limit: int = TAIL_BYTES) -> None:
        self.limit = limit
        self.data = bytearray()

    def write(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * self.limit:
            del self.data[: len(self.data) - self.limit]

    def text(self) -> str:
        return bytes(self.data[-self.limit :]).decode("utf-8", errors="replace")


class Execution:
    # A sync callable's thread. Python cannot kill a thread: after a timeout or a stop
    # the attempt ends without it, and the worker counts the thread against its
    # capacity until the function really returns (see pgflow.worker).
    thread: Future[Any] | None = None
    # The task that runs ``run()``, when its creator says so (the worker: it saves an
    # asyncio.current_task() per run); found by asking asyncio otherwise.
    task: asyncio.Task[Any] | None = None

    def __init__(self, job: Job, logger: Any, threads: Executor | None = None, *,
                 deadline: float | None = None, log_limit: int = DEFAULT_LOG_LIMIT) -> None:
        """``deadline``: the lease deadline (``time.monotonic()``) at the start; None
        means none (tests). Only commands enforce it (the supervisor kills them).
        ``live`` gathers what the attempt reports while it runs (pgflow.live)."""
        self.job = job
        self.logger = logger
        self.threads = threads
        self._log_limit = log_limit
        self.ctx = Context(job.run_id, job.job, job.logical_time, job.attempt, job.params, logger,
                           job.trigger_events, checkpoint_json=job.checkpoint,
                           report=job.command is None)
        self._events_file: str | None = None  # trigger events too big for the environment
        self._stop_outcome: str | None = None
        self._deadline = deadline
        self._command: supervisor.Command | None = None  # a running command
        self._work: asyncio.Future[Any] | None = None  # callables: cancelled to stop

    @property
    def live(self) -> LiveOutput | None:
        """What the attempt reported and the worker has not stored yet; None while a
        Python job reported nothing (pgflow.live)."""
        return self.ctx.reported

    @property
    def stop_outcome(self) -> str | None:
        return self._stop_outcome

    def stop(self, outcome: str) -> None:
        """End the attempt early; the first reason given wins."""
        if self._stop_outcome is None:
            self._stop_outcome = outcome
            self.ctx.cancelled.set()
            if self._command is not None:
                # A lost lease means the retry may already run elsewhere: no grace.
                self._command.stop(kill=outcome == LOST)
            if self._work is not None:
                self._work.cancel()

    def extend(self, deadline: float) -> None:
        """The lease was renewed: its new deadline (``time.monotonic()``). A running
        command is killed by its supervisor when the deadline passes unextended; a
        Python callable ignores it."""
        self._deadline = deadline
        if self._command is not None:
            self._command.extend(deadline)

    async def run(self) -> AttemptResult:
        if self.job.command is not None:
            result = await self._run_command(self.job.command)
        elif self.job.entrypoint is not None:
            result = await self._run_callable(self.job.entrypoint)
        else:
            result = AttemptResult(FAILED, error="job definition was deleted", permanent=True)
        if self._stop_outcome is not None and result.outcome != SUCCEEDED:
            return AttemptResult(self._stop_outcome, result.exit_code, result.error or
                                 f"stopped: {self._stop_outcome}", result.stdout_tail,
                                 result.stderr_tail)
        return result

    # ------------------------------------------------------------ commands

    def variables(self) -> dict[str, str]:
        """The run's own variables, on top of the base environment of every command."""
        return {
            "PGFLOW_RUN_ID": str(self.job.run_id),
            "PGFLOW_JOB": self.job.job,
            "PGFLOW_LOGICAL_TIME": iso_utc(self.job.logical_time),
            "PGFLOW_ATTEMPT": str(self.job.attempt),
            "PGFLOW_PARAMS": self.ctx.params_json,
            "PGFLOW_CONTROL": CONTROL_PATH,
            **checkpoint_variables(self.job.checkpoint),
            **self._trigger_variables(),
        }

    def _trigger_variables(self) -> dict[str, str]:
        """PGFLOW_TRIGGER_EVENTS for a dataset run; a list too big for one environment
        variable (Linux caps one at 128 KiB) goes to a file named by
        PGFLOW_TRIGGER_EVENTS_FILE instead."""
        if self.job.trigger_events is None:
            return {}
        if self._events_file is not None:
            return {"PGFLOW_TRIGGER_EVENTS_FILE": self._events_file}
        text = compact_events(self.job.trigger_events)
        if len(text.encode("utf-8")) <= MAX_EVENTS_ENV_BYTES:
            return {"PGFLOW_TRIGGER_EVENTS": text}
        fd, self._events_file = tempfile.mkstemp(prefix="pgflow-events-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        return {"PGFLOW_TRIGGER_EVENTS_FILE": self._events_file}

    def _remove_events_file(self) -> None:
        if self._events_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._events_file)
            self._events_file = None

    def environment(self) -> dict[str, str]:
        """The whole environment a command of this attempt gets."""
        return {**job_base(os.environ), **self.variables()}

    async def _run_command(self, command: list[str] | str) -> AttemptResult:
        if self._stop_outcome is not None:  # e.g. claimed with a cancel already requested
            return AttemptResult(self._stop_outcome, error="stopped before the command started")
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        out, err = Tail(), Tail()
        live = LiveOutput(self._log_limit)
        self.ctx.attach(live)

        def on_out(chunk: bytes) -> None:
            out.write(chunk)
            live.write("stdout", chunk)

        def on_err(chunk: bytes) -> None:
            err.write(chunk)
            live.write("stderr", chunk)

        variables = self.variables()
        try:
            self._command = supervisor.for_loop().start(
                argv, variables, self._deadline, self.job.timeout_s, on_out, on_err,
                live.control, live.end_control)
        except OSError as exc:
            self._remove_events_file()
            return AttemptResult(FAILED, error=f"cannot start the command supervisor: {exc}")
        try:
            ended = await self._command.wait()
        finally:
            self._command = None
            live.end_control()
            if "PGFLOW_CHECKPOINT_FILE" in variables:
                with contextlib.suppress(OSError):
                    os.unlink(variables["PGFLOW_CHECKPOINT_FILE"])
            self._remove_events_file()
        return _command_result(ended, self.job.timeout_s, out.text(), err.text())

    # ------------------------------------------------------------ callables

    async def _run_callable(self, entrypoint: str) -> AttemptResult:
        try:
            function = load_entrypoint(entrypoint)
        except Exception as exc:
            return AttemptResult(FAILED, error=f"cannot load {entrypoint}: {exc}")
        is_async = entrypoint in _async_entrypoints
        if is_async and self.job.timeout_s is None:
            return await self._run_inline(function)
        if is_async:
            self._work = asyncio.ensure_future(function(self.ctx))
        else:
            self.ctx.cancelled  # noqa: B018 - make the event here, before the job's thread runs
            self.thread = _submit(self.threads, function, self.ctx)
            self._work = asyncio.wrap_future(self.thread)
        if self._stop_outcome is not None:
            self._work.cancel()
        work = self._work
        if self.job.timeout_s is not None:
            done, _ = await asyncio.wait({work}, timeout=self.job.timeout_s)
            if not done:
                self.ctx.cancelled.set()
                work.cancel()  # async: CancelledError in the job; sync: ctx.cancelled is set
                return AttemptResult(TIMED_OUT, error=f"timed out after {self.job.timeout_s:g}s")
        try:
            await work
        except asyncio.CancelledError:
            if work.cancelled() and self._stop_outcome is not None:
                return AttemptResult(self._stop_outcome)
            raise
        except BaseException:
            pass
        return _callable_result(work.exception())

    async def _run_inline(self, function: Callable[..., Any]) -> AttemptResult:
        """An async job without a timeout runs in this very task (no task per run):
        ``stop`` cancels the task, and the cancellation is taken back here."""
        task = self.task or asyncio.current_task()
        self._work = task
        if self._stop_outcome is not None:
            return AttemptResult(self._stop_outcome)
        try:
            await function(self.ctx)
        except asyncio.CancelledError:
            if self._stop_outcome is not None and task is not None and task.cancelling():
                task.uncancel()
                return AttemptResult(self._stop_outcome)
            raise
        except Exception as exc:
            return _callable_result(exc)
        finally:
            self._work = None
        return AttemptResult(SUCCEEDED)


# An environment string longer than this cannot be passed to exec (MAX_ARG_STRLEN is
# 128 KiB on Linux): a larger checkpoint is handed over in a file instead.
ENV_CHECKPOINT_MAX = 96 * 1024


def checkpoint_variables(checkpoint: str | None) -> dict[str, str]:
    """``PGFLOW_CHECKPOINT`` (JSON) when an earlier attempt stored one; a checkpoint too
    large for the environment goes in a private file named by ``PGFLOW_CHECKPOINT_FILE``
    (and ``PGFLOW_CHECKPOINT`` is then unset)."""
    if checkpoint is None:
        return {}
    if len(checkpoint.encode()) <= ENV_CHECKPOINT_MAX:
        return {"PGFLOW_CHECKPOINT": checkpoint}
    fd, path = tempfile.mkstemp(prefix="pgflow-checkpoint-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(checkpoint)
    return {"PGFLOW_CHECKPOINT_FILE": path}


def compact_events(events_json: str) -> str:
    """The claim's JSON text of a run's events, as compact JSON."""
    return json.dumps(json.loads(events_json), separators=(",", ":"), ensure_ascii=False)


def iso_utc(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat()


_entrypoints: dict[str, Callable[..., Any]] = {}
_async_entrypoints: set[str] = set()  # those whose callable is a coroutine function


def load_entrypoint(entrypoint: str) -> Callable[..., Any]:
    function = _entrypoints.get(entrypoint)
    if function is None:
        module_name, _, attr = entrypoint.partition(":")
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
        if not callable(target):
            raise TypeError(f"{entrypoint} is not callable")
        function = _entrypoints[entrypoint] = target
        if inspect.iscoroutinefunction(function):  # asked once, not on every run
            _async_entrypoints.add(entrypoint)
    return function


_default_threads: ThreadPoolExecutor | None = None


def _submit(threads: Executor | None, function: Callable[..., Any],
            ctx: Context) -> Future[Any]:
    global _default_threads
    if threads is None:  # an Execution made without the worker's pool (tests)
        _default_threads = _default_threads or ThreadPoolExecutor(thread_name_prefix="pgflow-job")
        threads = _default_threads
    return threads.submit(function, ctx)


def _callable_result(exc: BaseException | None) -> AttemptResult:
    if exc is None:
        return AttemptResult(SUCCEEDED)
    trace = "".join(traceback.format_exception(exc))[-TAIL_BYTES:]
    if isinstance(exc, PermanentError):
        return AttemptResult(FAILED, error=f"PermanentError: {exc}", stderr_tail=trace,
                             permanent=True)
    if isinstance(exc, SourceUnavailable):
        return AttemptResult(FAILED, exit_code=EX_TEMPFAIL, error=str(exc), stderr_tail=trace,
                             unavailable_source=exc.source)
    return AttemptResult(FAILED, error=f"{type(exc).__name__}: {exc}", stderr_tail=trace)


def _command_result(ended: Exit, timeout_s: float | None, stdout: str,
                    stderr: str) -> AttemptResult:
    if ended.reason == "timeout":
        return AttemptResult(TIMED_OUT, None, f"timed out after {timeout_s:g}s", stdout, stderr)
    if ended.reason == "deadline":
        return AttemptResult(LOST, None, "the lease deadline passed without a renewal: the"
                             " supervisor killed the command", stdout, stderr)
    if ended.reason == "error":  # exec failed: the shell's "command not found" status
        message = ended.error or "cannot start the command"
        return AttemptResult(FAILED, 127, message, stdout, f"{stderr}{message}\n")
    if ended.status is None:
        return AttemptResult(FAILED, None, ended.error or "the command was lost", stdout,
                             stderr)
    code = ended.status
    if code == 0:
        return AttemptResult(SUCCEEDED, 0, None, stdout, stderr)
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return AttemptResult(FAILED, None, f"killed by {name}", stdout, stderr)
    reason = "source unavailable (exit 75)" if code == EX_TEMPFAIL else f"exited with code {code}"
    return AttemptResult(FAILED, code, reason, stdout, stderr)
