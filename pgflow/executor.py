"""Running one attempt: a command in its own process group, or a Python callable.

An ``Execution`` runs to an ``AttemptResult``. ``stop(outcome)`` ends it early
(cancel, lost lease, shutdown): a command's whole process group gets SIGTERM,
then SIGKILL after a short grace; an async callable is cancelled; a sync
callable (in a thread) is told through ``ctx.cancelled`` and abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import signal
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pgflow.context import Context, PermanentError, SourceUnavailable
from pgflow.retry import EX_TEMPFAIL, FAILED, SUCCEEDED, TIMED_OUT

TAIL_BYTES = 64 * 1024
# Each command runs under this supervisor: it kills the command's whole process group
# if the replica dies (even by kill -9).
_SUPERVISOR = str(Path(__file__).with_name("_supervise.py"))
KILL_GRACE_S = 5.0


@dataclass(frozen=True)
class AttemptResult:
    outcome: str
    exit_code: int | None = None
    error: str | None = None
    stdout_tail: str | None = None
    stderr_tail: str | None = None
    permanent: bool = False
    unavailable_source: str | None = None


@dataclass(frozen=True)
class Job:
    """What an execution needs to know about the run it executes."""

    run_id: int
    job: str
    logical_time: datetime
    attempt: int
    params: dict[str, Any] | str  # the JSON text as claimed, or a dict
    command: list[str] | str | None
    entrypoint: str | None
    timeout_s: float | None


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
    def __init__(self, job: Job, logger: Any, threads: Executor | None = None) -> None:
        self.job = job
        self.logger = logger
        self.threads = threads
        self.ctx = Context(job.run_id, job.job, job.logical_time, job.attempt, job.params, logger)
        self._stop_outcome: str | None = None
        self._stopped: asyncio.Event | None = None  # commands wait on it
        self._work: asyncio.Future[Any] | None = None  # callables: cancelled to stop

    @property
    def stop_outcome(self) -> str | None:
        return self._stop_outcome

    def stop(self, outcome: str) -> None:
        """End the attempt early; the first reason given wins."""
        if self._stop_outcome is None:
            self._stop_outcome = outcome
            self.ctx.cancelled.set()
            if self._stopped is not None:
                self._stopped.set()
            if self._work is not None:
                self._work.cancel()

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

    def environment(self) -> dict[str, str]:
        return {
            **os.environ,
            "PGFLOW_RUN_ID": str(self.job.run_id),
            "PGFLOW_JOB": self.job.job,
            "PGFLOW_LOGICAL_TIME": iso_utc(self.job.logical_time),
            "PGFLOW_ATTEMPT": str(self.job.attempt),
            "PGFLOW_PARAMS": self.ctx.params_json,
        }

    async def _run_command(self, command: list[str] | str) -> AttemptResult:
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else command
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", _SUPERVISOR, str(os.getpid()), *argv,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self.environment(), start_new_session=True,
            )
        except OSError as exc:
            return AttemptResult(FAILED, error=f"cannot start the supervisor: {exc}")
        self._stopped = asyncio.Event()
        if self._stop_outcome is not None:
            self._stopped.set()
        out, err = Tail(), Tail()
        readers = asyncio.gather(_pump(process.stdout, out), _pump(process.stderr, err))
        waiter = asyncio.ensure_future(process.wait())
        stopper = asyncio.ensure_future(self._stopped.wait())
        done, _ = await asyncio.wait({waiter, stopper}, timeout=self.job.timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        timed_out = not done
        if waiter not in done:
            await _terminate(process)
        stopper.cancel()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(readers, timeout=KILL_GRACE_S)
        code = await waiter
        return _command_result(code, timed_out, self.job.timeout_s, out.text(), err.text())

    # ------------------------------------------------------------ callables

    async def _run_callable(self, entrypoint: str) -> AttemptResult:
        try:
            function = load_entrypoint(entrypoint)
        except Exception as exc:
            return AttemptResult(FAILED, error=f"cannot load {entrypoint}: {exc}")
        if inspect.iscoroutinefunction(function) and self.job.timeout_s is None:
            return await self._run_inline(function)
        if inspect.iscoroutinefunction(function):
            self._work = asyncio.ensure_future(function(self.ctx))
        else:
            self.ctx.cancelled  # noqa: B018 - make the event here, before the job's thread runs
            self._work = asyncio.wrap_future(_submit(self.threads, function, self.ctx))
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
        task = asyncio.current_task()
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


def iso_utc(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat()


_entrypoints: dict[str, Callable[..., Any]] = {}


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
    return function


def _submit(threads: Executor | None, function: Callable[..., Any], ctx: Context) -> Any:
    if threads is None:
        return asyncio.get_running_loop().run_in_executor(None, function, ctx)
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


def _command_result(code: int, timed_out: bool, timeout_s: float | None, stdout: str,
                    stderr: str) -> AttemptResult:
    if timed_out:
        return AttemptResult(TIMED_OUT, None, f"timed out after {timeout_s:g}s", stdout, stderr)
    if code == 0:
        return AttemptResult(SUCCEEDED, 0, None, stdout, stderr)
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return AttemptResult(FAILED, None, f"killed by {name}", stdout, stderr)
    reason = "source unavailable (exit 75)" if code == EX_TEMPFAIL else f"exited with code {code}"
    if code == 127 and stderr.startswith("cannot start "):
        reason = stderr.strip().splitlines()[0]
    return AttemptResult(FAILED, code, reason, stdout, stderr)


async def _pump(stream: asyncio.StreamReader | None, tail: Tail) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        tail.write(chunk)


async def _terminate(process: asyncio.subprocess.Process) -> None:
    """SIGTERM the process group, SIGKILL it if it is still there after the grace."""
    _signal_group(process.pid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(process.wait()), timeout=KILL_GRACE_S)
    _signal_group(process.pid, signal.SIGKILL)  # also reaps children that outlived the leader


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
