"""Command attempts run under one supervisor process per replica.

Why a supervisor. Two jobs cannot be done from the replica itself: a command must
die with its replica even after ``kill -9``, and it must die at its lease deadline
even while the replica is frozen (SIGSTOP, a long GC pause, a VM stall), so that it
never overlaps the retry another replica starts once the lease expired. Both need a
process that does not share the replica's fate. Starting one Python interpreter per
attempt did that at ~30 ms of CPU per attempt; this module starts ONE small
stdlib-only process per replica (``pgflow/_supervisor_main.py``, lazily, at the first
command of an event loop) and the per-attempt cost is a ``posix_spawn`` there.

The conversation. A SOCK_SEQPACKET socketpair, one JSON object per packet:
``start(key, argv, env, deadline, timeout, control)`` with the write ends of the
attempt's stdout and stderr pipes (and, with ``control``, of its control pipe, the
command's fd 3: pgflow.live) attached (SCM_RIGHTS; the replica creates the pipes and
keeps the read ends, so output is still read by the replica's event loop),
``extend(key, deadline)`` and ``stop(key, kill)``; the supervisor answers
``started(key, pid)``, ``exited(key, status, reason)`` or ``error(key, message)``.
``env`` holds only the run's own variables: the supervisor was started with the
scrubbed base environment (``pgflow.environment.job_base``), computed once.

Process groups. Each command is the leader of a new session (so of its own process
group). The attempt ends when that main process exits: the supervisor sees the
exit without reaping it (``waitid(WNOWAIT)``), SIGKILLs the whole group while the
zombie still pins the pgid, then reaps it and reports the status at once. The
replica then takes what is already in the pipes and closes them: it does not wait
for EOF, so a background child that kept stdout open (``sleep 300 & echo started``)
does not hold the attempt, and it is dead anyway. A descendant that calls setsid()
itself leaves the group and escapes this kill: that is accepted (nothing short of
cgroups or a PID namespace catches it) and documented.

Deadlines. The worker passes each attempt's lease deadline as a ``time.monotonic()``
value (CLOCK_MONOTONIC is system-wide on Linux, so both processes read the same
clock), at the start and again after every renewal that succeeded
(``Execution.extend``). The worker measures it from before it sent the renewal, so
it is never later than the expiry the database recorded. The supervisor sends
SIGTERM ``grace`` before the deadline and SIGKILL at it, where ``grace`` is a quarter
of the lease left at the start, at most ``KILL_GRACE_S`` (TTL 30 s: TERM 5 s before;
TTL 2 s: 0.5 s before; renewals every TTL/3 keep it from firing while the worker is
healthy). So the whole group is dead at the deadline, before the reaper can see the
lease expire, whatever the replica is doing. The job's timeout is enforced there
too (SIGTERM, SIGKILL ``KILL_GRACE_S`` later, outcome ``timed_out``), and so are
stops (cancel, shutdown: SIGTERM then SIGKILL after the grace; a lost lease:
SIGKILL at once).

Failure. The supervisor lives in its own session, so ``kill -STOP -<replica pgid>``
does not freeze it, and never blocks on the replica (replies queue while the
replica is frozen). When the replica dies, the supervisor reads EOF (or gets
SIGTERM from PR_SET_PDEATHSIG, a backup), SIGKILLs every group and exits. When the
supervisor dies, the replica reads EOF: it SIGKILLs the groups whose pids it was
told, fails their attempts with an error naming the supervisor (outcome
``failed``), and the next command starts a new supervisor. A command spawned in
the instant between ``posix_spawn`` and its ``started`` reply of a supervisor that
is then killed is not known to the replica and is not killed (the reply normally
reaches the replica's socket buffer before the supervisor could die).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from pgflow.environment import job_base

KILL_GRACE_S = 5.0  # SIGTERM -> SIGKILL, also in _supervisor_main
INLINE_LIMIT = 64 * 1024  # larger start requests travel in a memfd
_READ = 65536

Sink = Callable[[bytes], None]


@dataclass(frozen=True)
class Exit:
    """How a command attempt ended. ``status`` is the exit code (negative: killed by
    that signal) or None when it never ran or was lost with the supervisor;
    ``reason`` says why the supervisor ended it: timeout, deadline, stop, error
    (could not start) or supervisor (the supervisor died)."""

    status: int | None
    reason: str | None = None
    error: str | None = None


class Command:
    """One command attempt as the replica sees it: its pipes, its pid once known, and
    its exit. Made by ``Supervisor.start``."""

    def __init__(self, supervisor: Supervisor, key: int, out: int, err: int, on_out: Sink,
                 on_err: Sink, control: int | None = None, on_control: Sink | None = None,
                 on_control_end: Callable[[], None] | None = None) -> None:
        self._supervisor = supervisor
        self.key = key
        self.pid: int | None = None
        self._exit: asyncio.Future[Exit] = asyncio.get_running_loop().create_future()
        self._pipes = {out: on_out, err: on_err}
        self._control_end = (control, on_control_end)
        if control is not None and on_control is not None:
            self._pipes[control] = on_control
        loop = asyncio.get_running_loop()
        for fd in self._pipes:
            loop.add_reader(fd, self._read, fd)

    def extend(self, deadline: float) -> None:
        """A new lease deadline (monotonic seconds)."""
        if not self._exit.done():
            self._supervisor.send({"op": "extend", "key": self.key, "deadline": deadline})

    def stop(self, kill: bool = False) -> None:
        """SIGTERM the group, SIGKILL after the grace; ``kill``: SIGKILL at once."""
        if not self._exit.done():
            self._supervisor.send({"op": "stop", "key": self.key, "kill": kill})

    async def wait(self) -> Exit:
        """The exit, once the main process ended; output already in the pipes is read,
        the pipes are closed (no wait for EOF). Cancelled: the group is killed."""
        try:
            return await asyncio.shield(self._exit)
        except asyncio.CancelledError:
            self.stop(kill=True)
            raise
        finally:
            self._close_pipes()

    def _read(self, fd: int) -> None:
        try:
            chunk = os.read(fd, _READ)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self._pipes[fd](chunk)
        else:
            self._close(fd)

    def _close_pipes(self) -> None:
        for fd in list(self._pipes):
            with contextlib.suppress(BlockingIOError, OSError):
                while chunk := os.read(fd, _READ):
                    self._pipes[fd](chunk)
            self._close(fd)

    def _close(self, fd: int) -> None:
        if self._pipes.pop(fd, None) is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
            control, on_end = self._control_end
            if fd == control and on_end is not None:
                on_end()

    def _ended(self, result: Exit) -> None:
        if not self._exit.done():
            self._exit.set_result(result)


class Supervisor:
    """The replica's end of one supervisor process."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", *_program(), str(theirs.fileno()),
                 str(os.getpid())],
                pass_fds=[theirs.fileno()], env=job_base(os.environ),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True)  # SIGSTOP of the replica's group leaves it running
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self._keys = itertools.count(1)
        self._commands: dict[int, Command] = {}
        self._outbox: list[tuple[bytes, list[int]]] = []
        self.dead = False
        asyncio.get_running_loop().add_reader(ours.fileno(), self._readable)

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self, argv: list[str], env: dict[str, str], deadline: float | None,
              timeout: float | None, on_out: Sink, on_err: Sink,
              on_control: Sink | None = None,
              on_control_end: Callable[[], None] | None = None) -> Command:
        """Spawn ``argv`` with the base environment plus ``env``; output goes to the
        sinks, and with ``on_control`` what the command writes to its fd 3 (the
        ``PGFLOW_CONTROL`` pipe) goes there. Raises OSError when the pipes cannot be
        made."""
        made: list[int] = []
        try:
            for _ in range(3 if on_control is not None else 2):
                made += os.pipe()
        except OSError:
            _close_all(made)
            raise
        reads, writes = made[0::2], made[1::2]
        for fd in reads:
            os.set_blocking(fd, False)
        control = reads[2] if on_control is not None else None
        command = Command(self, next(self._keys), reads[0], reads[1], on_out, on_err, control,
                          on_control, on_control_end)
        self._commands[command.key] = command
        self.send({"op": "start", "key": command.key, "argv": argv, "env": env,
                   "deadline": deadline, "timeout": timeout,
                   "control": on_control is not None}, writes)
        return command

    def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        """Queue ``message`` with ``fds`` attached; the fds are closed once sent."""
        data = json.dumps(message, separators=(",", ":")).encode()
        owned = list(fds or ())
        if self.dead:
            _close_all(owned)
            return
        if len(data) > INLINE_LIMIT:
            owned.append(_memfd(data))
            data = b'{"memfd":true}'
        self._outbox.append((data, owned))
        if len(self._outbox) == 1:
            self._flush()

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._outbox and not self.dead:
            data, fds = self._outbox[0]
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))
                         ] if fds else []
            try:
                self._sock.sendmsg([data], ancillary)
            except BlockingIOError:
                loop.add_writer(self._sock.fileno(), self._writable)
                return
            except OSError:
                self._died()
                return
            del self._outbox[0]
            _close_all(fds)

    def _writable(self) -> None:
        asyncio.get_running_loop().remove_writer(self._sock.fileno())
        self._flush()

    def _readable(self) -> None:
        while not self.dead:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._died()
                return
            self._reply(json.loads(data))

    def _reply(self, message: dict[str, Any]) -> None:
        command = self._commands.get(message["key"])
        if command is None:
            return
        op = message["op"]
        if op == "started":
            command.pid = int(message["pid"])
            return
        del self._commands[command.key]
        if op == "exited":
            command._ended(Exit(message["status"], message.get("reason")))
        else:
            command._ended(Exit(None, "error", str(message.get("message"))))

    def _died(self) -> None:
        """EOF: the supervisor is gone. Kill what it ran and fail those attempts."""
        if self.dead:
            return
        self._let_go()
        status = _reap(self.process)
        error = (f"the command supervisor (pid {self.pid}) died ({_describe(status)}):"
                 " the command was killed")
        for command in self._commands.values():
            if command.pid is not None:  # the supervisor cannot kill them any more
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(command.pid, signal.SIGKILL)
            command._ended(Exit(None, "supervisor", error))
        self._commands.clear()

    def close(self) -> None:
        """Let the supervisor go (shutdown): on EOF it kills what still runs and exits."""
        if self.dead:
            return
        self._let_go()
        _reap(self.process)
        for command in self._commands.values():
            command._ended(Exit(None, "supervisor", "the replica is shutting down"))
        self._commands.clear()

    def _let_go(self) -> None:
        self.dead = True
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sock.fileno())
        loop.remove_writer(self._sock.fileno())
        self._sock.close()
        for _, fds in self._outbox:
            _close_all(fds)
        self._outbox.clear()


_supervisors: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Supervisor] = \
    weakref.WeakKeyDictionary()


def for_loop() -> Supervisor:
    """The running event loop's supervisor, started now if it has none or it died."""
    loop = asyncio.get_running_loop()
    current = _supervisors.get(loop)
    if current is None or current.dead:
        current = _supervisors[loop] = Supervisor()
    return current


def close_for_loop() -> None:
    """Stop the running loop's supervisor, if it has one (shutdown)."""
    current = _supervisors.pop(asyncio.get_running_loop(), None)
    if current is not None:
        current.close()


def _program() -> list[str]:
    path = Path(__file__).with_name("_supervisor_main.py")
    if path.is_file():
        return [str(path)]
    # Packed (zip): hand the interpreter the source itself.
    return ["-c", resources.files("pgflow").joinpath("_supervisor_main.py").read_text()]


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("pgflow-start", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _reap(process: subprocess.Popen[bytes], timeout: float = 2.0) -> int:
    """The status of a supervisor that exits (it read EOF, or we did); SIGKILL if it
    lingers, so no zombie is left."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _describe(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}"
