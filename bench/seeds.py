"""Figure: the seeds' fan-out on full replicas (issue 16, target 1). N no-op entrypoint
jobs share one 6-field cron tick T; every replica plays scheduler, worker and reaper (one
leads scheduling, all execute), at each concurrency and replica count. Reported per
configuration: when all N runs were visible (polled) and their created_at range relative
to T, runs/s = N / (T -> last finished_at) and N / (first started_at -> last finished_at)
(the anchors' window), and CPU ms per run of the replicas and of PostgreSQL.
``bench/report.py`` divides the best runs/s by PgQueuer's best of the same run.

The web role is left out: it serves no request here, and several replicas on one host
would need one bind address each."""

from __future__ import annotations

import time
from typing import Any

from bench import procs
from bench.context import (
    Bench,
    each_configuration,
    one,
    register,
    wait_all_finished,
    wait_registered,
)
from bench.fanout import SPREAD_SQL, _jobs, _poll_created, tick_in

ROLES = ("scheduler", "worker", "reaper")
TARGET_CREATE_S = 1.0
TARGET_VS_PGQUEUER = 1.5


def _lead_s(n: int) -> int:
    """Seconds between registering and the tick: registration of N jobs must fit."""
    return 8 if n <= 2000 else 15


def measure_one(b: Bench, n: int, replicas: int, concurrency: int) -> dict[str, Any]:
    b.fresh_database()
    postmaster = b.cluster.postmaster_pid()
    tag = f"seeds-r{replicas}-c{concurrency}"
    with b.connect() as conn, \
            b.replicas(tag, roles=ROLES, concurrency=concurrency, count=replicas) as started:
        wait_registered(conn, started)
        tick = tick_in(conn, _lead_s(n))
        register(conn, _jobs(n, tick))
        if not one(conn, "SELECT now() < %s AS ok", (tick,))["ok"]:
            raise RuntimeError("registration outlasted the tick lead")
        time.sleep(max(0.0, tick.timestamp() - time.time() - 1.0))  # let registration settle
        cpu0 = sum(r.cpu_seconds() for r in started)
        pg0 = procs.children_cpu(postmaster)
        visible_at = _poll_created(conn, n, timeout=120)
        wait_all_finished(conn, n, timeout=600, interval=0.05, alive=started,
                          what="seed runs finished")
        cpu = sum(r.cpu_seconds() for r in started) - cpu0
        pg_cpu = procs.cpu_delta(postmaster, pg0)
        spread = one(conn, SPREAD_SQL, {"t": tick})
    last, first_start = float(spread["last_finished_s"]), float(spread["first_started_s"])
    visible = visible_at - tick.timestamp()
    return {
        "jobs": n, "replicas": replicas, "concurrency": concurrency,
        "runs": spread["runs"], "succeeded": spread["succeeded"],
        "other_ticks": spread["other_ticks"],
        "all_runs_visible_after_tick_s": round(visible, 3),
        "first_created_after_tick_s": round(float(spread["first_created_s"]), 3),
        "last_created_after_tick_s": round(float(spread["last_created_s"]), 3),
        "first_started_after_tick_s": round(first_start, 3),
        "last_finished_after_tick_s": round(last, 3),
        "runs_per_s": round(n / last, 1),
        "runs_per_s_from_first_start": round(n / max(last - first_start, 1e-6), 1),
        # CPU from ~1 s before the tick until all finished (idle loops included).
        "replica_cpu_ms_per_run": round(1000 * cpu / n, 4),
        "pg_cpu_ms_per_run": round(1000 * pg_cpu / n, 4),
        "created_within_target": visible <= TARGET_CREATE_S and spread["runs"] == n,
    }


def measure(b: Bench, n: int, replica_counts: list[int],
            concurrencies: list[int]) -> dict[str, Any]:
    runs = each_configuration(measure_one, b, n, replica_counts, concurrencies)
    ok = [r for r in runs if r["ok"]]
    best = max(ok, key=lambda r: r["runs_per_s"], default=None)
    return {
        "runs": runs,
        "best": best and {k: best[k] for k in ("replicas", "concurrency", "runs_per_s",
                                               "runs_per_s_from_first_start",
                                               "all_runs_visible_after_tick_s")},
        "worst_visible_after_tick_s": max((r["all_runs_visible_after_tick_s"] for r in ok),
                                          default=None),
        "target_create_s": TARGET_CREATE_S, "target_vs_pgqueuer": TARGET_VS_PGQUEUER,
        "method": "N jobs, one 6-field cron firing ~15 s after registration; replicas "
                  "(roles scheduler+worker+reaper) running before; runs/s = N / (T -> last "
                  "finished_at); visible = first 10 ms poll seeing all N runs "
                  "(clock_timestamp - T); CPU from /proc over the tick",
    }
