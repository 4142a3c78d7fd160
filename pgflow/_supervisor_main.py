"""The command supervisor process: ``python -I -S _supervisor_main.py FD REPLICA_PID``.

One per replica, started by ``pgflow.supervisor`` (the design note is there). It
imports only the standard library, talks to its replica over the SOCK_SEQPACKET
socket ``FD`` (one JSON message per packet, pipe ends attached with SCM_RIGHTS) and
runs a single-threaded loop over that socket, a self-pipe for signals and a heap of
timers:

- ``start``: posix_spawn the command in a new session (its own process group,
  pgid = pid) with stdin /dev/null and the replica's pipes as stdout/stderr; reply
  ``started`` with the pid, or ``error`` if it cannot be spawned;
- SIGCHLD: ``waitid(WNOWAIT)`` sees a main process exit without reaping it, the
  whole group is SIGKILLed while the unreaped leader still pins its pgid (so the
  kill cannot hit a recycled group), then it is reaped and ``exited`` is sent with
  the exit status and why the supervisor killed it, if it did;
- deadlines: the lease deadline (CLOCK_MONOTONIC, moved by ``extend``) gets SIGTERM
  ``grace`` before it and SIGKILL at it; the job's timeout gets SIGTERM, then
  SIGKILL ``KILL_GRACE_S`` later; ``stop`` is SIGTERM then SIGKILL after the grace,
  or SIGKILL at once;
- EOF on the socket (the replica died), SIGTERM, SIGHUP or the parent-death signal
  (PR_SET_PDEATHSIG, a backup for EOF): SIGKILL every group and exit.

It never waits on the replica: messages to it are queued and sent when the socket
is writable, so a frozen replica cannot stop a deadline from being enforced.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import itertools
import json
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any

KILL_GRACE_S = 5.0
MAX_PACKET = 256 * 1024
MAX_FDS = 4  # stdout, stderr, control, and a memfd for a large request
CONTROL_FD = 3  # the command's PGFLOW_CONTROL pipe (/dev/fd/3)
PR_SET_PDEATHSIG = 1
# Dispositions a command must not inherit (Python ignores SIGPIPE and SIGXFSZ; the
# others have handlers here, which exec resets anyway).
_DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGTERM,
                    signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                    signal.SIGUSR2)
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * 4)

Message = dict[str, Any]


class Attempt:
    """One running command: its main process (the group leader) and its deadlines."""

    __slots__ = ("deadline", "force_kill_at", "grace", "key", "killed", "pid", "reason",
                 "scheduled", "term_sent", "timeout_at")

    def __init__(self, key: int, pid: int, deadline: float | None, timeout_at: float | None,
                 grace: float) -> None:
        self.key = key
        self.pid = pid
        self.deadline = deadline  # the lease deadline: SIGKILL at it
        self.timeout_at = timeout_at
        self.grace = grace  # SIGTERM this long before the lease deadline
        self.reason: str | None = None  # why the supervisor ended it: timeout|deadline|stop
        self.term_sent = False
        self.force_kill_at: float | None = None
        self.killed = False
        self.scheduled: float | None = None  # the one timer entry that is current

    def next_action(self) -> float | None:
        if self.killed:
            return None
        times = []
        if self.deadline is not None:
            times.append(self.deadline)
            if not self.term_sent:
                times.append(self.deadline - self.grace)
        if self.timeout_at is not None and not self.term_sent:
            times.append(self.timeout_at)
        if self.force_kill_at is not None:
            times.append(self.force_kill_at)
        return min(times) if times else None


class Supervisor:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.base_env = dict(os.environ)
        self.devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.attempts: dict[int, Attempt] = {}  # by pid
        self.by_key: dict[int, Attempt] = {}
        self.timers: list[tuple[float, int, int]] = []  # (when, seq, key), a heap
        self.seq = itertools.count()
        self.outbox: list[bytes] = []
        self.running = True

    # ------------------------------------------------------------ messages out

    def send(self, message: Message) -> None:
        self.outbox.append(json.dumps(message, separators=(",", ":")).encode())

    def flush(self) -> None:
        while self.outbox:
            try:
                self.sock.send(self.outbox[0])
            except BlockingIOError:
                return
            except OSError:  # the replica is gone
                self.running = False
                self.outbox.clear()
                return
            del self.outbox[0]

    # ------------------------------------------------------------ messages in

    def receive(self) -> None:
        while self.running:
            try:
                data, ancillary, flags, _ = self.sock.recvmsg(MAX_PACKET, _ANCILLARY,
                                                              socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                return
            except OSError:
                self.running = False
                return
            fds = _fds(ancillary)
            if not data and not fds:
                self.running = False  # EOF: the replica died
                return
            try:
                if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    raise ValueError("truncated request")
                self.handle(json.loads(data), fds)
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def handle(self, message: Message, fds: list[int]) -> None:
        if message.get("memfd"):  # a large request travels in a memfd (the last fd)
            with os.fdopen(os.dup(fds[-1]), "rb") as body:
                message = json.loads(body.read())
        op = message["op"]
        if op == "start":
            self.start(message, fds)
        elif op == "extend":
            self.extend(message["key"], message["deadline"])
        elif op == "stop":
            self.stop(message["key"], bool(message.get("kill")))

    def start(self, message: Message, fds: list[int]) -> None:
        key: int = message["key"]
        now = time.monotonic()
        deadline: float | None = message.get("deadline")
        timeout: float | None = message.get("timeout")
        if deadline is not None and deadline <= now:
            self.send({"op": "exited", "key": key, "status": None, "reason": "deadline"})
            return
        argv: list[str] = message["argv"]
        if not argv:
            self.send({"op": "error", "key": key, "message": "cannot start an empty command"})
            return
        actions = [(os.POSIX_SPAWN_DUP2, self.devnull, 0), (os.POSIX_SPAWN_DUP2, fds[0], 1),
                   (os.POSIX_SPAWN_DUP2, fds[1], 2)]
        if message.get("control"):
            control = fds[2]
            if control <= CONTROL_FD:  # dup2 onto itself would keep close-on-exec
                control = fcntl.fcntl(control, fcntl.F_DUPFD_CLOEXEC, 10)
                os.close(fds[2])
                fds[2] = control  # closed with the others once the request is handled
            actions.append((os.POSIX_SPAWN_DUP2, control, CONTROL_FD))
        try:
            pid = os.posix_spawnp(
                argv[0], argv, {**self.base_env, **message["env"]}, file_actions=actions,
                setsid=True, setsigmask=(), setsigdef=_DEFAULT_SIGNALS)
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            self.send({"op": "error", "key": key,
                       "message": f"cannot start {argv[0]!r}: {reason}"})
            return
        grace = 0.0 if deadline is None else min(KILL_GRACE_S, (deadline - now) / 4)
        attempt = Attempt(key, pid, deadline, None if timeout is None else now + timeout,
                          grace)
        self.attempts[pid] = attempt
        self.by_key[key] = attempt
        self.send({"op": "started", "key": key, "pid": pid})
        self.schedule(attempt)

    def extend(self, key: int, deadline: float | None) -> None:
        attempt = self.by_key.get(key)
        if attempt is not None and deadline is not None and not attempt.killed:
            attempt.deadline = deadline
            self.act(attempt, time.monotonic())

    def stop(self, key: int, kill: bool) -> None:
        attempt = self.by_key.get(key)
        if attempt is None or attempt.killed:
            return
        attempt.reason = attempt.reason or "stop"
        if kill:
            self.kill(attempt)
        elif not attempt.term_sent:
            self.terminate(attempt, time.monotonic() + KILL_GRACE_S)

    # ------------------------------------------------------------ deadlines

    def schedule(self, attempt: Attempt) -> None:
        when = attempt.next_action()
        if when != attempt.scheduled:
            attempt.scheduled = when
            if when is not None:
                heapq.heappush(self.timers, (when, next(self.seq), attempt.key))

    def run_timers(self) -> None:
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            when, _, key = heapq.heappop(self.timers)
            attempt = self.by_key.get(key)
            if attempt is not None and attempt.scheduled == when:
                attempt.scheduled = None
                self.act(attempt, now)

    def act(self, attempt: Attempt, now: float) -> None:
        """Do what is due for ``attempt`` at ``now``, then set its next timer."""
        if attempt.killed:
            return
        lease_over = attempt.deadline is not None and now >= attempt.deadline
        if lease_over or (attempt.force_kill_at is not None and now >= attempt.force_kill_at):
            if lease_over:
                attempt.reason = attempt.reason or "deadline"
            self.kill(attempt)
        elif not attempt.term_sent and attempt.timeout_at is not None \
                and now >= attempt.timeout_at:
            attempt.reason = attempt.reason or "timeout"
            self.terminate(attempt, now + KILL_GRACE_S)
        elif not attempt.term_sent and attempt.deadline is not None \
                and now >= attempt.deadline - attempt.grace:
            attempt.reason = attempt.reason or "deadline"
            self.terminate(attempt, attempt.deadline)
        else:
            self.schedule(attempt)

    def terminate(self, attempt: Attempt, kill_at: float) -> None:
        attempt.term_sent = True
        attempt.force_kill_at = kill_at
        _signal_group(attempt.pid, signal.SIGTERM)
        self.schedule(attempt)

    def kill(self, attempt: Attempt) -> None:
        attempt.killed = True
        _signal_group(attempt.pid, signal.SIGKILL)

    # ------------------------------------------------------------ children

    def reap(self) -> None:
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid == 0:
                return
            pid = info.si_pid
            # The leader is a zombie, not reaped yet: its pid, hence the pgid, is still
            # taken, so this kill reaches only what the command forked.
            _signal_group(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            attempt = self.attempts.pop(pid, None)
            if attempt is not None:
                del self.by_key[attempt.key]
                self.send({"op": "exited", "key": attempt.key,
                           "status": os.waitstatus_to_exitcode(status),
                           "reason": attempt.reason})

    def kill_all(self) -> None:
        for pid in self.attempts:
            _signal_group(pid, signal.SIGKILL)

    # ------------------------------------------------------------ loop

    def serve(self, wakeup: int) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ, "sock")
        selector.register(wakeup, selectors.EVENT_READ, "wakeup")
        writing = False
        try:
            while self.running and not _stopping:
                timeout = None
                if self.timers:
                    timeout = max(0.0, self.timers[0][0] - time.monotonic())
                for selected, events in selector.select(timeout):
                    if selected.data == "wakeup":
                        _drain(wakeup)
                    elif events & selectors.EVENT_READ:
                        self.receive()
                self.reap()
                self.run_timers()
                self.flush()
                if bool(self.outbox) != writing and self.running:
                    writing = bool(self.outbox)
                    mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0)
                    selector.modify(self.sock, mask, "sock")
        finally:
            self.kill_all()


_stopping = False


def _on_stop(_signum: int, _frame: object) -> None:
    global _stopping
    _stopping = True


def _on_child(_signum: int, _frame: object) -> None:
    """Nothing to do here: the wake-up fd wakes the loop, which reaps."""


def _fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True)
                    for i in range(0, usable, 4)]
    return fds


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


def main() -> None:
    fd, replica_pid = int(sys.argv[1]), int(sys.argv[2])
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    sock.setblocking(False)
    wake_r, wake_w = os.pipe()
    for end in (wake_r, wake_w):
        os.set_blocking(end, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, _on_child)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _on_stop)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != replica_pid:  # the replica died before prctl took effect
        return
    Supervisor(sock).serve(wake_r)


if __name__ == "__main__":
    main()
