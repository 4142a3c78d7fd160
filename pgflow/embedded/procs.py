"""What the server's processes are doing, read from /proc: alive, dying, zombie, gone.

A SIGKILLed postmaster may linger as a zombie and leave backends behind, so "is it running"
has several answers: the pid is taken (:func:`pid_exists`), it still holds files
(lingering), or it is alive and not on its way out (:func:`pid_alive`). Every PostgreSQL
process works in its data directory, which is how :func:`processes_in` finds a cluster's
processes; :func:`wait_for_exit` waits for them to go. Without /proc, ``kill(pid, 0)`` is all
there is.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from pgflow.embedded.osuser import server_uid

EXIT_WAIT_SECONDS = 10.0

_PF_EXITING = 0x4  # task flag in /proc/<pid>/stat: do_exit() has begun
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def has_proc() -> bool:
    return Path("/proc/self").exists()


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, flags) of a process from /proc, or None if it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[6])


def pid_exists(pid: int) -> bool:
    """The pid is taken, possibly by a zombie."""
    if has_proc():
        return _proc_stat(pid) is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lingering(pid: int) -> bool:
    """Exists and is not a zombie: it may still hold files and shared memory."""
    if not has_proc():
        return pid_exists(pid)
    info = _proc_stat(pid)
    return info is not None and info[0] not in ("Z", "X")


def pid_alive(pid: int) -> bool:
    """Lingering and not on its way out (SIGKILLed, or already exiting)."""
    if not has_proc():
        return pid_exists(pid)
    info = _proc_stat(pid)
    if info is None or info[0] in ("Z", "X") or info[2] & _PF_EXITING:
        return False
    return not _sigkill_pending(pid)


def _sigkill_pending(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    masks = re.findall(r"^(?:SigPnd|ShdPnd):\s+([0-9a-fA-F]+)", status, re.MULTILINE)
    return any(int(mask, 16) & _SIGKILL_BIT for mask in masks)


def child_pids(pid: int) -> set[int]:
    children: set[int] = set()
    for entry in _proc_pids():
        info = _proc_stat(entry)
        if info is not None and info[1] == pid:
            children.add(entry)
    return children


def _proc_pids() -> list[int]:
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []


def processes_in(directory: Path) -> set[int] | None:
    """Lingering processes whose working directory is `directory`; None if we cannot tell.

    Every PostgreSQL process works in its data directory, so this finds a dying postmaster
    and backends orphaned by its crash (each backend is its own process group leader).
    """
    if not has_proc():
        return None
    uid = server_uid()
    found: set[int] = set()
    for pid in _proc_pids():
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except PermissionError:
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    return None  # could be one of ours
            continue
        except OSError:
            continue
        if cwd == str(directory) and _lingering(pid):
            found.add(pid)
    return found


def proc_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def wait_for_exit(pids: Iterable[int], timeout: float = EXIT_WAIT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    waiting = set(pids)
    while waiting and time.monotonic() < deadline:
        waiting = {pid for pid in waiting if _lingering(pid)}
        if waiting:
            time.sleep(0.02)
