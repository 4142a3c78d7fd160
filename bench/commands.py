"""Figure: command jobs — what one command attempt costs next to a bare spawn.

(a) spawn floor: ``sh -c true`` started from one asyncio loop, at most 128 at once,
    stdout and stderr captured through pipes (what any command runner needs);
(b) N command jobs (``command = "true"``) due in ONE tick (a six-field cron of a
    second a few seconds ahead, firing once) on 2 replicas playing scheduler, worker
    and reaper at concurrency 64: runs/s from the tick to the last finish, its ratio
    to (a), and CPU ms per attempt of the replica processes and everything they
    started (utime + stime of the live processes plus cutime + cstime, the CPU of
    reaped descendants: per-attempt supervisors and the commands themselves);
(c) wall time of ``pgflow jobs list`` while 30 command jobs tick every second on
    three replicas.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime
from typing import Any

from bench import procs
from bench.context import Bench, one, register, wait_registered
from bench.fanout import tick_in

FLOOR_N = 2000
FLOOR_CONCURRENCY = 128
TICK_LEAD_S = 8
TARGET_RATIO = 0.5
TARGET_CLI_S = 1.0
_CLK = os.sysconf("SC_CLK_TCK")

SPAN_SQL = """
SELECT count(*) FILTER (WHERE state = 'succeeded') AS succeeded,
       count(*) AS runs,
       extract(epoch FROM max(finished_at) - %(t)s)::float8 AS last_finished_s,
       extract(epoch FROM min(started_at) - %(t)s)::float8 AS first_started_s
FROM pgflow.runs"""


# ---------------------------------------------------------------- (a) floor


async def _spawn_floor(n: int, concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one_spawn() -> None:
        async with gate:
            process = await asyncio.create_subprocess_exec(
                "sh", "-c", "true", stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            await process.communicate()

    t0 = time.perf_counter()
    await asyncio.gather(*(one_spawn() for _ in range(n)))
    return n / (time.perf_counter() - t0)


# ---------------------------------------------------------------- CPU of a family


def _family_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants, including what their reaped
    children used (cutime/cstime)."""
    total = 0.0
    for member in [pid, *_descendants(pid)]:
        try:
            with open(f"/proc/{member}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15]) / _CLK
    return total


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents.setdefault(procs.parent_pid(int(entry)), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


# ---------------------------------------------------------------- (b) one tick


def _tick_jobs(n: int, tick: datetime) -> list[dict[str, Any]]:
    schedule = f"{tick.second} {tick.minute} {tick.hour} * * *"
    return [{"name": f"cmd_{i:05d}", "schedule": schedule, "timezone": "UTC",
             "command": "true", "retry": {"max_attempts": 1}} for i in range(n)]


def _one_tick(b: Bench, n: int, replicas: int, concurrency: int) -> dict[str, Any]:
    b.fresh_database()
    roles = ("scheduler", "worker", "reaper")
    with b.connect() as conn, \
            b.replicas("commands-tick", roles=roles, concurrency=concurrency,
                       count=replicas) as started:
        wait_registered(conn, started)
        tick = tick_in(conn, TICK_LEAD_S)
        register(conn, _tick_jobs(n, tick))
        if not one(conn, "SELECT now() < %s AS ok", (tick,))["ok"]:
            raise RuntimeError("registration outlasted the tick lead")
        cpu0 = sum(_family_cpu(r.pid) for r in started)
        procs.wait_until(lambda: one(conn, "SELECT count(*) AS n FROM pgflow.runs WHERE state"
                                           " IN ('succeeded', 'failed')")["n"] >= n,
                         timeout=600, interval=0.1, alive=started, what="command runs finished")
        cpu = sum(_family_cpu(r.pid) for r in started) - cpu0
        span = one(conn, SPAN_SQL, {"t": tick})
    last = float(span["last_finished_s"])
    return {"jobs": n, "replicas": replicas, "concurrency": concurrency,
            "succeeded": span["succeeded"], "runs": span["runs"],
            "first_started_after_tick_s": round(float(span["first_started_s"]), 3),
            "last_finished_after_tick_s": round(last, 3),
            "runs_per_s": round(n / last, 1),
            "cpu_ms_per_attempt": round(1000 * cpu / n, 3)}


# ---------------------------------------------------------------- (c) CLI under load


def _cli_under_load(b: Bench, jobs: int, replicas: int, calls: int) -> dict[str, Any]:
    b.fresh_database()
    definitions = [{"name": f"every_s_{i:02d}", "schedule": "* * * * * *", "timezone": "UTC",
                    "command": "true", "catchup": "none", "retry": {"max_attempts": 1}}
                   for i in range(jobs)]
    env = {**os.environ, "PGFLOW_DATABASE_URL": b.url}
    with b.connect() as conn, \
            b.replicas("commands-cli", roles=("scheduler", "worker", "reaper"),
                       concurrency=16, count=replicas) as started:
        wait_registered(conn, started)
        register(conn, definitions)
        time.sleep(3.0)  # a steady state of ticks, not the first one
        walls = []
        for _ in range(calls):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "pgflow", "jobs", "list"], cwd=b.project,
                           env=env, check=True, capture_output=True, timeout=120)
            walls.append(time.perf_counter() - t0)
        ran = one(conn, "SELECT count(*) AS n FROM pgflow.runs WHERE state = 'succeeded'")["n"]
    return {"jobs_every_second": jobs, "replicas": replicas, "calls": calls,
            "wall_s_median": round(statistics.median(walls), 3),
            "wall_s_max": round(max(walls), 3), "runs_succeeded_meanwhile": ran}


def _idle_cli(b: Bench, calls: int) -> float:
    env = {**os.environ, "PGFLOW_DATABASE_URL": b.url}
    walls = []
    for _ in range(calls):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pgflow", "jobs", "list"], cwd=b.project,
                       env=env, check=True, capture_output=True, timeout=60)
        walls.append(time.perf_counter() - t0)
    return round(statistics.median(walls), 3)


# ---------------------------------------------------------------- the figure


def measure(b: Bench, n: int = 2000, replicas: int = 2, concurrency: int = 64,
            cli_jobs: int = 30, cli_replicas: int = 3, cli_calls: int = 5) -> dict[str, Any]:
    floor = asyncio.run(_spawn_floor(FLOOR_N, FLOOR_CONCURRENCY))
    tick = _one_tick(b, n, replicas, concurrency)
    idle = _idle_cli(b, 3)
    cli = _cli_under_load(b, cli_jobs, cli_replicas, cli_calls)
    ratio = tick["runs_per_s"] / floor
    return {
        "spawn_floor_per_s": round(floor, 1), "one_tick": tick,
        "ratio_to_floor": round(ratio, 3), "target_ratio": TARGET_RATIO,
        "cli_idle_wall_s_median": idle, "cli_under_load": cli, "target_cli_s": TARGET_CLI_S,
        "met": ratio >= TARGET_RATIO and cli["wall_s_max"] < TARGET_CLI_S,
        "method": f"(a) {FLOOR_N} `sh -c true` from one asyncio loop, <= {FLOOR_CONCURRENCY} "
                  "at once, stdout/stderr piped; (b) N jobs with command 'true' and one "
                  "6-field cron firing ~8 s after registration, replicas with roles "
                  "scheduler+worker+reaper already running; runs/s = N / (last finished_at "
                  "- tick); CPU = utime+stime+cutime+cstime of the replicas and their live "
                  "descendants from /proc, after registration -> all finished; (c) "
                  "`python -m pgflow jobs list` wall time, sequential calls, 3 s after 30 "
                  "every-second command jobs were registered on 3 replicas",
    }
