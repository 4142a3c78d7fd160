"""Figure 5: a replica's memory with 1,000 concurrent sleeping entrypoint runs
(``--concurrency 1000``): async runs (tasks on the loop) and sync runs (threads)."""

from __future__ import annotations

import time
from typing import Any

from bench.context import Bench, count_runs, enqueue, register, wait_registered

IDLE_SETTLE_S = 1.0


def measure_one(b: Bench, kind: str, runs: int, seconds: float) -> dict[str, Any]:
    job = f"sleep_{kind}"
    b.fresh_database()
    with b.connect() as conn, b.replicas(f"memory-{kind}", concurrency=runs) as started:
        register(conn, [{"name": job, "entrypoint": f"bench.jobs:{job}"}])
        wait_registered(conn, started)
        time.sleep(IDLE_SETTLE_S)
        replica = started[0]
        idle_kib = replica.rss_kib()
        enqueue(conn, job, runs, params={"seconds": seconds})
        most_running, rss_max = 0, idle_kib
        deadline = time.monotonic() + seconds * 3 + 30
        while count_runs(conn, ("succeeded",)) < runs:
            replica.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{runs} sleeping runs not finished")
            most_running = max(most_running, count_runs(conn, ("running",)))
            rss_max = max(rss_max, replica.rss_kib())
            time.sleep(0.2)
        peak_kib = replica.peak_rss_kib()
        threads = _threads(replica.pid)
    return {
        "kind": kind, "runs": runs, "sleep_s": seconds, "concurrency": runs,
        "max_running_seen": most_running,
        "idle_rss_mib": round(idle_kib / 1024, 1),
        "peak_rss_mib": round(max(peak_kib, rss_max) / 1024, 1),
        "per_run_kib": round((max(peak_kib, rss_max) - idle_kib) / runs, 1),
        "threads_after": threads,
    }


def _threads(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return 0


def measure(b: Bench, runs: int, seconds: float, kinds: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in kinds:
        try:
            results[kind] = {"ok": True, **measure_one(b, kind, runs, seconds)}
        except Exception as exc:  # recorded; the other kind still runs
            results[kind] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    results["method"] = ("1 replica `--role worker --concurrency N`, idle RSS after start, "
                         "then N runs of a job that sleeps (asyncio.sleep / time.sleep in the "
                         "replica's thread pool); peak = VmHWM of the replica process")
    return results
