"""Figure: command-line start-up. Wall time of ``pgflow --help`` and ``pgflow jobs list``
(the console script users run, and ``python -m pgflow``), sequential calls, median of N,
against a database with ``jobs`` registered jobs and no replica running. The interpreter's
own start-up (``python -c pass``) is reported beside them: it is part of every call."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import procs
from bench.context import Bench, register

TARGET_S = 0.25


def _wall(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=cwd, env=env, check=True, capture_output=True, timeout=60)
    return time.perf_counter() - t0


def _median_s(argv: list[str], env: dict[str, str], cwd: Path, calls: int) -> dict[str, float]:
    _wall(argv, env, cwd)  # warm the page cache
    walls = [_wall(argv, env, cwd) for _ in range(calls)]
    return {"median_s": round(statistics.median(walls), 4), "min_s": round(min(walls), 4),
            "max_s": round(max(walls), 4)}


def measure(b: Bench, calls: int = 11, jobs: int = 50) -> dict[str, Any]:
    b.fresh_database()
    with b.connect() as conn:
        register(conn, [{"name": f"cli_{i:03d}", "schedule": "0 * * * *",
                         "entrypoint": "bench.jobs:noop"} for i in range(jobs)])
    env = {**os.environ, "PGFLOW_DATABASE_URL": b.url}
    script = str(Path(sys.executable).parent / "pgflow")
    commands = {"help": [script, "--help"], "jobs_list": [script, "jobs", "list"],
                "help_python_m": [sys.executable, "-m", "pgflow", "--help"],
                "jobs_list_python_m": [sys.executable, "-m", "pgflow", "jobs", "list"],
                "python_startup": [sys.executable, "-c", "pass"]}
    # The target is for an idle machine: the figures before this one leave autovacuum and
    # checkpoints running for a while (the 1-minute load average was 0.7-1.6 here).
    idle_before = procs.wait_for_quiet()
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    walls = {name: _median_s(argv, env, b.project, calls) for name, argv in commands.items()}
    worst = max(walls["help"]["median_s"], walls["jobs_list"]["median_s"])
    return {**walls, "calls": calls, "jobs": jobs, "loadavg_before": loadavg,
            "cpu_idle_before": idle_before,
            "target_s": TARGET_S, "met": worst < TARGET_S,
            "method": f"once the CPUs were 90 % idle over 1 s (at most 60 s of waiting), "
                      f"sequential subprocess calls (one warm-up, then {calls}), median wall "
                      "time; `pgflow` console script of the venv and `python -m pgflow`; "
                      f"{jobs} jobs registered, no replica running"}
