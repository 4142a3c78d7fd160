"""Figure 7: the dependency engine. A chain of no-op jobs (hop latency: upstream
finished_at -> downstream started_at) and a wide fan-out/fan-in DAG run (total time,
and how often the fan-in run was evaluated)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from bench import procs
from bench.context import EPOCH, Bench, floats, one, register, wait_registered
from bench.stats import summary
from pgflow import runs

TARGET_P50_MS = 20.0
TARGET_P99_MS = 100.0
NOOP = "bench.jobs:noop"

HOPS_SQL = """
SELECT extract(epoch FROM d.started_at - u.finished_at)::float8 * 1000
FROM pgflow.runs u
JOIN pgflow.job_deps dep ON dep.upstream = u.job
JOIN pgflow.runs d ON d.job = dep.job AND d.logical_time = u.logical_time
WHERE u.job LIKE 'chain\\_%%'"""
CHAIN_SQL = """
SELECT extract(epoch FROM max(finished_at) - min(created_at))::float8 AS s
FROM pgflow.runs WHERE job LIKE 'chain\\_%%' GROUP BY logical_time"""
FAN_SQL = """
WITH mids AS (SELECT * FROM pgflow.runs WHERE job LIKE 'fan\\_mid\\_%%'),
     root AS (SELECT * FROM pgflow.runs WHERE job = 'fan_root'),
     sink AS (SELECT * FROM pgflow.runs WHERE job = 'fan_sink')
SELECT (SELECT count(*) FROM mids) AS mids,
       (SELECT count(*) FROM mids WHERE state = 'succeeded') AS mids_succeeded,
       (SELECT count(DISTINCT finished_at) FROM mids) AS mid_finish_transactions,
       extract(epoch FROM (SELECT finished_at FROM sink) - (SELECT created_at FROM root))::float8
           AS total_s,
       extract(epoch FROM (SELECT min(started_at) FROM mids)
                          - (SELECT finished_at FROM root))::float8 * 1000 AS fan_out_first_ms,
       extract(epoch FROM (SELECT max(started_at) FROM mids)
                          - (SELECT finished_at FROM root))::float8 * 1000 AS fan_out_last_ms,
       extract(epoch FROM (SELECT started_at FROM sink)
                          - (SELECT max(finished_at) FROM mids))::float8 * 1000 AS fan_in_hop_ms,
       (SELECT state FROM sink) AS sink_state,
       (SELECT trigger FROM sink) AS sink_trigger,
       (SELECT attempt FROM sink) AS sink_attempt,
       (SELECT count(*) FROM pgflow.attempts a JOIN sink ON a.run_id = sink.id)
           AS sink_attempt_rows"""


def chain_jobs(length: int) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = [{"name": "chain_000", "entrypoint": NOOP}]
    jobs += [{"name": f"chain_{i:03d}", "entrypoint": NOOP, "depends_on": [f"chain_{i - 1:03d}"]}
             for i in range(1, length)]
    return jobs


def fan_jobs(width: int) -> list[dict[str, Any]]:
    mids = [f"fan_mid_{i:04d}" for i in range(width)]
    return ([{"name": "fan_root", "entrypoint": NOOP}]
            + [{"name": m, "entrypoint": NOOP, "depends_on": ["fan_root"]} for m in mids]
            + [{"name": "fan_sink", "entrypoint": NOOP, "depends_on": mids}])


def _run_dag(conn: Any, root: str, last: str, offset: int, replicas: list[procs.Replica],
             timeout: float) -> None:
    when = EPOCH + timedelta(seconds=offset)
    runs.trigger(conn, root, when)
    procs.wait_until(lambda: one(conn, "SELECT count(*) AS n FROM pgflow.runs WHERE job = %s"
                                       " AND logical_time = %s AND state = 'succeeded'",
                                 (last, when))["n"] == 1,
                     timeout=timeout, interval=0.05, alive=replicas, what=f"{root} DAG run")


def measure(b: Bench, chain: int, chain_runs: int, width: int, workers: int,
            concurrency: int) -> dict[str, Any]:
    b.fresh_database()
    with b.connect() as conn:
        register(conn, chain_jobs(chain) + fan_jobs(width))
        with b.replicas("deps", concurrency=concurrency, count=workers) as started:
            wait_registered(conn, started)
            for k in range(chain_runs):
                _run_dag(conn, "chain_000", f"chain_{chain - 1:03d}", k, started, timeout=120)
            _run_dag(conn, "fan_root", "fan_sink", 0, started, timeout=300)
        hops = floats(conn, HOPS_SQL)
        chain_s = floats(conn, CHAIN_SQL)
        fan = one(conn, FAN_SQL)
    hop = summary(hops, 2)
    return {
        "chain": {
            "length": chain, "dag_runs": chain_runs, "hops": len(hops), "hop_ms": hop,
            "dag_run_total_s": summary(chain_s, 3),
            "targets": {"p50_ms": TARGET_P50_MS, "p99_ms": TARGET_P99_MS},
            "met": (hop["p50"] or 1e9) <= TARGET_P50_MS and (hop["p99"] or 1e9)
            <= TARGET_P99_MS,
        },
        "fan_out_fan_in": {
            "width": width, **{k: (round(v, 3) if isinstance(v, float) else v)
                               for k, v in fan.items()},
            "fan_in_evaluations": fan["mid_finish_transactions"],
            "fan_in_evaluations_per_upstream": round(
                fan["mid_finish_transactions"] / max(fan["mids"], 1), 3),
            "bounded": fan["mid_finish_transactions"] <= fan["mids"]
            and fan["sink_attempt_rows"] == 1 and fan["sink_state"] == "succeeded",
        },
        "worker_replicas": workers, "concurrency": concurrency,
        "method": "runs.trigger(root) creates the whole DAG run (downstreams pending); hop = "
                  "downstream started_at - upstream finished_at (now() of the claim and "
                  "finish transactions). The fan-in run is evaluated once per finish "
                  "transaction that completed one of its upstreams (it is locked and "
                  "re-checked there), so evaluations = distinct finished_at of the upstreams; "
                  "it went pending -> queued once (one attempt, trigger 'dependency')",
    }
