"""Figure 2: no-op entrypoint runs through the full lifecycle (claim, lease, run, finish
with attempt history), the anchors' method: enqueue N first, then start the replicas;
jobs/s = N / (first started_at -> last finished_at) from pgflow's own timestamps."""

from __future__ import annotations

import time
from typing import Any

from bench import procs
from bench.context import (
    Bench,
    any_unfinished,
    count_runs,
    each_configuration,
    enqueue,
    floats,
    one,
    register,
)
from bench.stats import decile_rates

NOOP = {"name": "noop", "entrypoint": "bench.jobs:noop"}

WINDOW_SQL = """
SELECT extract(epoch FROM min(started_at))::float8 AS first,
       extract(epoch FROM max(finished_at))::float8 AS last,
       count(*) FILTER (WHERE state = 'succeeded') AS done
FROM pgflow.runs"""
DONE_TIMES_SQL = ("SELECT extract(epoch FROM finished_at) FROM pgflow.runs"
                  " WHERE state = 'succeeded' ORDER BY finished_at")
ATTEMPTS_SQL = """
SELECT count(*) AS attempts, count(DISTINCT worker_id) AS workers,
       count(DISTINCT finished_at) AS finish_transactions
FROM pgflow.attempts"""


def measure_one(b: Bench, n: int, replicas: int, concurrency: int,
                timeout_s: float = 600) -> dict[str, Any]:
    b.fresh_database()
    with b.connect() as conn:
        register(conn, [NOOP])
        t0 = time.perf_counter()
        enqueue(conn, "noop", n)
        enqueue_s = time.perf_counter() - t0
        queued = count_runs(conn, ("queued",))
    if queued != n:
        raise RuntimeError(f"expected {n} queued runs, found {queued}")
    b.cluster.checkpoint()
    postmaster = b.cluster.postmaster_pid()
    tag = f"throughput-r{replicas}-c{concurrency}"
    with b.connect() as conn:
        pg0 = procs.children_cpu(postmaster)
        t_launch = time.time()
        with b.replicas(tag, concurrency=concurrency, count=replicas) as started:
            t_seen = procs.wait_until(lambda: not any_unfinished(conn), timeout=timeout_s,
                                      interval=0.25, alive=started, what="all runs finished")
            worker_cpu = sum(r.cpu_seconds() for r in started)
            peak_rss = max(r.peak_rss_kib() for r in started)
            pg_cpu = procs.cpu_delta(postmaster, pg0)
        return _result(conn, n, replicas, concurrency, enqueue_s, t_launch, t_seen,
                       worker_cpu, pg_cpu, peak_rss)


def _result(conn: Any, n: int, replicas: int, concurrency: int, enqueue_s: float,
            t_launch: float, t_seen: float, worker_cpu: float, pg_cpu: float,
            peak_rss: int) -> dict[str, Any]:
    window = one(conn, WINDOW_SQL)
    done = int(window["done"])
    first, last = float(window["first"]), float(window["last"])
    deciles = decile_rates(first, last, floats(conn, DONE_TIMES_SQL))
    history = one(conn, ATTEMPTS_SQL)
    return {
        "n": n, "replicas": replicas, "concurrency": concurrency, "done": done,
        "enqueue_batch_per_s": round(n / enqueue_s, 1),
        "db_window_s": round(last - first, 3),
        "jobs_per_s": round(done / (last - first), 1),
        "wall_jobs_per_s_incl_startup": round(done / (t_seen - t_launch), 1),
        "startup_s": round(first - t_launch, 3),
        "per_tenth_of_window_per_s": deciles,
        "worker_cpu_ms_per_job": round(1000 * worker_cpu / done, 4),
        "pg_cpu_ms_per_job": round(1000 * pg_cpu / done, 4),
        "replica_peak_rss_mib": round(peak_rss / 1024, 1),
        "attempt_rows": history["attempts"],
        "finish_transactions": history["finish_transactions"],
        "runs_per_finish_transaction": round(history["attempts"]
                                             / max(history["finish_transactions"], 1), 1),
    }


def measure(b: Bench, n: int, replica_counts: list[int],
            concurrencies: list[int]) -> dict[str, Any]:
    runs = each_configuration(measure_one, b, n, replica_counts, concurrencies)
    ok = [r for r in runs if r["ok"]]
    best = max(ok, key=lambda r: r["jobs_per_s"], default=None)
    best_by_replicas = {
        str(k): max((r["jobs_per_s"] for r in ok if r["replicas"] == k), default=None)
        for k in replica_counts}
    return {"runs": runs, "best": best and _brief(best), "best_by_replicas": best_by_replicas,
            "method": "N no-op async entrypoint runs created queued (create_dag_runs, 1,000 "
                      "per transaction), CHECKPOINT, then `pgflow serve --role worker` "
                      "replicas started; jobs/s = N / (min started_at -> max finished_at). "
                      "CPU from /proc: replica processes (incl. start-up and imports) and the "
                      "cluster's postgres processes"}


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("replicas", "concurrency", "jobs_per_s", "worker_cpu_ms_per_job",
            "pg_cpu_ms_per_job")
    return {k: run[k] for k in keys}
