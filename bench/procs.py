"""Processes: ``pgflow serve`` replicas started for a measurement, and what /proc says
about their CPU time and memory (and about the cluster's postgres processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

_CLK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def parent_pid(pid: int) -> int:
    return int(_stat_fields(pid)[1])


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a live process (0 when it is gone)."""
    try:
        fields = _stat_fields(pid)
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK


def memory_kib(pid: int, key: str = "VmRSS") -> int:
    """A /proc/<pid>/status memory line in KiB: VmRSS (now) or VmHWM (peak)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def children_cpu(parent: int) -> dict[int, float]:
    """pid -> CPU seconds of ``parent`` and its live children (a postmaster's backends)."""
    sample = {parent: cpu_seconds(parent)}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if parent_pid(int(entry)) == parent:
                    sample[int(entry)] = cpu_seconds(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return sample


def cpu_delta(parent: int, before: dict[int, float]) -> float:
    """CPU seconds spent by ``parent``'s family since ``before`` (per-pid deltas)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in children_cpu(parent).items())


@dataclass
class Replica:
    """One ``pgflow serve`` process."""

    process: subprocess.Popen[bytes]
    roles: tuple[str, ...]
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def rss_kib(self) -> int:
        return memory_kib(self.pid, "VmRSS")

    def peak_rss_kib(self) -> int:
        return memory_kib(self.pid, "VmHWM")

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"replica {self.roles} exited with {self.process.returncode}:"
                               f" {tail}")


def start_replicas(url: str, project: Path, logdir: Path, tag: str, *,
                   roles: Sequence[str] = ("worker",), concurrency: int = 16, count: int = 1,
                   env: dict[str, str] | None = None) -> list[Replica]:
    """Start ``count`` replicas in the project root (so ``bench.jobs`` imports)."""
    argv = [sys.executable, "-m", "pgflow", "serve", "--concurrency", str(concurrency),
            "--log-level", "warning", "--grace", "2s"]
    for role in roles:
        argv += ["--role", role]
    full_env = {**os.environ, "PGFLOW_DATABASE_URL": url, "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(project),
                                                            os.environ.get("PYTHONPATH")])),
                **(env or {})}
    replicas = []
    for i in range(count):
        log = logdir / f"{tag}-{i}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(argv, cwd=project, env=full_env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        replicas.append(Replica(process, tuple(roles), log))
    return replicas


def stop_replicas(replicas: Sequence[Replica], timeout: float = 30.0) -> list[int]:
    """SIGTERM (graceful drain), SIGKILL after ``timeout``; returns the exit codes."""
    for replica in replicas:
        if replica.process.poll() is None:
            replica.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    codes = []
    for replica in replicas:
        try:
            codes.append(replica.process.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            replica.process.kill()
            codes.append(replica.process.wait())
    return codes


def wait_until(condition: Callable[[], object], *, timeout: float, interval: float = 0.05,
               alive: Sequence[Replica] = (), what: str = "condition") -> float:
    """Poll ``condition`` until it is truthy; returns the time.time() it was first seen."""
    deadline = time.monotonic() + timeout
    while not condition():
        for replica in alive:
            replica.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:g}s")
        time.sleep(interval)
    return time.time()


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)  # idle + iowait


def wait_for_quiet(min_idle: float = 0.9, window_s: float = 1.0,
                   timeout_s: float = 60.0) -> float:
    """Wait until the machine's CPUs were at least ``min_idle`` idle over one ``window_s``
    (what the figures before left running, autovacuum and checkpoints, has settled), at
    most ``timeout_s``; returns the idle fraction of the last window."""
    deadline = time.monotonic() + timeout_s
    while True:
        idle0, total0 = _cpu_times()
        time.sleep(window_s)
        idle1, total1 = _cpu_times()
        idle = (idle1 - idle0) / max(1, total1 - total0)
        if idle >= min_idle or time.monotonic() >= deadline:
            return round(idle, 3)
