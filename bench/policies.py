"""Figure: policies (issue 11) — tenants, caps and breakers in the claim.

- ``throughput``: no-op runs through one replica, without policies and with tenants
  (weights), sources and closed breakers configured but not binding for the measured
  job (``configured``), and with a non-binding cap on its tenant (``capped``: its runs
  take the capped claim path). Ratios against ``none``; the target is >= 0.9 for
  ``configured``.
- ``claim``: ``EXPLAIN (ANALYZE, BUFFERS)`` of ``claim_runs`` (limit 100, rolled back)
  over 1,000 claimable runs, alone, next to 50,000 runs held by an open breaker, and
  with 10 tenants x 10,000 queued runs: ms per claim and shared buffers.
- ``latency``: a small tenant's trigger -> start (created_at -> started_at, database
  clock) while a big tenant has 10,000 queued runs, p50/p99.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import psycopg

from bench import procs, throughput
from bench.context import Bench, any_unfinished, count_runs, enqueue, floats, register
from pgflow import registry
from pgflow.policies import Policies, SourceSpec, TenantSpec
from pgflow.queries import q
from pgflow.queue import NO_OFFER


def _policies(conn: Any, tenants: list[TenantSpec], sources: list[SourceSpec]) -> None:
    registry.apply(conn, [], policies=Policies(tenants, sources))


def _throughput(b: Bench, n: int, concurrency: int, mode: str) -> dict[str, Any]:
    b.fresh_database()
    with b.connect() as conn:
        job: dict[str, Any] = dict(throughput.NOOP)
        if mode != "none":
            job.update(tenant="main", sources=["warehouse"])
            register(conn, [job, {"name": "other", "entrypoint": "bench.jobs:noop",
                                  "tenant": "other", "sources": ["crm"]}])
            _policies(conn, [
                TenantSpec(name="main", weight=2,
                           max_concurrency=1_000_000 if mode == "capped" else None),
                TenantSpec(name="other", weight=1, max_concurrency=5)],
                [SourceSpec(name="warehouse", failure_threshold=3),
                 SourceSpec(name="crm", max_concurrency=2)])
            conn.execute("INSERT INTO pgflow.breakers (source, state) VALUES"
                         " ('warehouse', 'closed'), ('crm', 'closed')")
        else:
            register(conn, [job])
        t0 = time.perf_counter()
        enqueue(conn, "noop", n)
        enqueue_s = time.perf_counter() - t0
    b.cluster.checkpoint()
    postmaster = b.cluster.postmaster_pid()
    with b.connect() as conn:
        pg0 = procs.children_cpu(postmaster)
        t_launch = time.time()
        with b.replicas(f"policies-{mode}", concurrency=concurrency, count=1) as started:
            t_seen = procs.wait_until(lambda: not any_unfinished(conn), timeout=600,
                                      interval=0.25, alive=started, what="all runs finished")
            worker_cpu = sum(r.cpu_seconds() for r in started)
            peak_rss = max(r.peak_rss_kib() for r in started)
            pg_cpu = procs.cpu_delta(postmaster, pg0)
        return throughput._result(conn, n, 1, concurrency, enqueue_s, t_launch, t_seen,
                                  worker_cpu, pg_cpu, peak_rss)


def _explain(conn: Any, repeat: int = 7) -> dict[str, Any]:
    best: dict[str, Any] | None = None
    for _ in range(repeat):
        with conn.transaction():
            row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + q("claim_runs"),
                               {**NO_OFFER, "worker": "bench", "limit": 100,
                                "ttl": 30.0}).fetchone()
            raise psycopg.Rollback()
        plan = row["QUERY PLAN"][0]
        total = plan["Planning Time"] + plan["Execution Time"]
        if best is None or total < best["ms"]:
            best = {"ms": round(total, 3), "execution_ms": round(plan["Execution Time"], 3),
                    "shared_hit": plan["Plan"].get("Shared Hit Blocks", 0),
                    "shared_read": plan["Plan"].get("Shared Read Blocks", 0),
                    "claimed": plan["Plan"].get("Actual Rows")}
    assert best is not None
    return best


def _claim_cost(b: Bench) -> dict[str, Any]:
    b.fresh_database()
    out: dict[str, Any] = {}
    with b.connect() as conn:
        jobs: list[dict[str, Any]] = [
            {"name": "noop", "entrypoint": "bench.jobs:noop"},
            {"name": "heldjob", "entrypoint": "bench.jobs:noop", "sources": ["down"]}]
        jobs += [{"name": f"t{i}", "entrypoint": "bench.jobs:noop", "tenant": f"tenant{i}"}
                 for i in range(10)]
        register(conn, jobs)
        enqueue(conn, "noop", 1000, chunk=1000)
        conn.execute("ANALYZE pgflow.runs")
        out["baseline_1000_claimable"] = _explain(conn)
        conn.execute("INSERT INTO pgflow.breakers (source, state, opened_at, manual)"
                     " VALUES ('down', 'open', now(), true)")
        conn.execute(q("breaker_hold_runs"), {"sources": ["down"]})
        enqueue(conn, "heldjob", 50_000, chunk=10_000)  # created held: the job is held
        conn.execute("ANALYZE pgflow.runs")
        held = count_runs(conn, ("queued",), "heldjob")
        out["with_50000_held"] = {**_explain(conn), "held_runs": held}
        conn.execute("DELETE FROM pgflow.runs WHERE job = 'heldjob'")
        conn.execute("DELETE FROM pgflow.breakers")
        for i in range(10):
            enqueue(conn, f"t{i}", 10_000, chunk=10_000)
        conn.execute("VACUUM ANALYZE pgflow.runs")
        out["with_10_tenants_x_10000"] = _explain(conn)
    base = out["baseline_1000_claimable"]["ms"]
    out["ratio_held_vs_baseline"] = round(out["with_50000_held"]["ms"] / base, 2)
    out["ratio_tenants_vs_baseline"] = round(out["with_10_tenants_x_10000"]["ms"] / base, 2)
    return out


def _latency(b: Bench, triggers: int, concurrency: int) -> dict[str, Any]:
    b.fresh_database()
    with b.connect() as conn:
        register(conn, [{"name": "big", "entrypoint": "bench.jobs:sleep_async", "tenant": "big",
                         "params": {"seconds": 0.5}},
                        {"name": "small", "entrypoint": "bench.jobs:noop", "tenant": "small"}])
        enqueue(conn, "big", 10_000, chunk=10_000)
        with b.replicas("policies-latency", concurrency=concurrency) as started:
            procs.wait_until(lambda: count_runs(conn, ("running",), "big") >= concurrency // 2,
                             timeout=60, interval=0.05, alive=started, what="big tenant running")
            for i in range(triggers):
                enqueue(conn, "small", 1, first=i)
                time.sleep(0.1)
            procs.wait_until(lambda: count_runs(conn, ("succeeded",), "small") == triggers,
                             timeout=120, interval=0.05, alive=started, what="small runs done")
            big_queued = count_runs(conn, ("queued",), "big")
        waits = sorted(floats(conn, "SELECT extract(epoch FROM started_at - created_at) * 1000"
                                    " FROM pgflow.runs WHERE job = 'small'"))
    p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))]
    return {"triggers": triggers, "concurrency": concurrency, "big_queued_at_end": big_queued,
            "p50_ms": round(statistics.median(waits), 1), "p99_ms": round(p99, 1),
            "max_ms": round(waits[-1], 1)}


def measure(b: Bench, n: int = 5000, concurrency: int = 500, triggers: int = 30
            ) -> dict[str, Any]:
    runs = {mode: _throughput(b, n, concurrency, mode) for mode in ("none", "configured",
                                                                    "capped")}
    base = runs["none"]["jobs_per_s"]
    tp = {mode: {"jobs_per_s": r["jobs_per_s"], "ratio": round(r["jobs_per_s"] / base, 3),
                 "pg_cpu_ms_per_job": r["pg_cpu_ms_per_job"]} for mode, r in runs.items()}
    return {"throughput": tp, "claim": _claim_cost(b),
            "latency": _latency(b, triggers, 50)}


