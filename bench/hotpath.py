"""The hot path next to a large finished history: load N finished runs directly
(``INSERT … SELECT generate_series``, secondary indexes rebuilt after the load, which is
what a restore would do), then time every statement a claim, renewal, finish,
dependency hop, reap, tick, backfill release and retention batch runs, with
``EXPLAIN (ANALYZE, BUFFERS)`` inside a transaction that is rolled back.

``seed_active`` creates the same small live workload in every database (queued,
capped, running, pending DAG runs, a backfill, due jobs), so the figures at 0, 1M
and 10M history rows differ only by the history.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from bench.context import register
from pgflow import queue, retention, runs
from pgflow.queries import q
from pgflow.queue import NO_OFFER

Conn = psycopg.Connection[dict[str, Any]]

# Jobs the history belongs to: the live workload's jobs plus many others, so per-job
# lookups (dependency checks, capped counts) see history of their own job.
HISTORY_JOBS = 200
LIVE_TIME = datetime(2031, 1, 1, tzinfo=UTC)  # live runs' logical times (history is older)
WORKER = "bench-hot-worker"
QUEUED = 1000
RUNNING = 200
DAG_RUNS = 100
BACKFILL_PENDING = 1000
SCHEDULED_JOBS = 500

# One finished run per i: ~96 % succeeded, 2 % failed (all but one in 5,000 of them
# acknowledged; the rest are dead letters), 1 % each cancelled and upstream_failed;
# finished over the last %(days)s days, oldest first; attempt rows for every run that ran.
FILL_RUNS = """
INSERT INTO pgflow.runs (job, logical_time, state, attempt, max_attempts, trigger, tenant,
                         priority, params, available_at, acked_at, created_at, started_at,
                         finished_at, backfill_id)
SELECT (%(jobs)s::text[])[1 + i %% %(njobs)s], lt, st,
       CASE WHEN st IN ('cancelled', 'upstream_failed') THEN 0 ELSE 1 END, 3,
       CASE WHEN i %% 50 = 7 THEN 'backfill' WHEN i %% 10 = 3 THEN 'dependency'
            ELSE 'schedule' END,
       'tenant-' || (i %% 8), 0, '{}', fin - interval '5 s',
       CASE WHEN st = 'failed' AND i %% 10000 <> 1 THEN fin END, fin - interval '5 s',
       CASE WHEN st = 'upstream_failed' THEN NULL ELSE fin - interval '2 s' END, fin,
       CASE WHEN i %% 50 = 7 THEN %(backfill_id)s::bigint END
FROM generate_series(1, %(n)s) AS i,
     LATERAL (SELECT timestamptz '1990-01-01' + make_interval(secs => (i / %(njobs)s) * 60) AS lt,
                     now() - make_interval(secs => (%(n)s - i) * %(spread_s)s) AS fin,
                     CASE i %% 100 WHEN 0 THEN 'failed' WHEN 1 THEN 'failed'
                                   WHEN 2 THEN 'cancelled' WHEN 4 THEN 'upstream_failed'
                                   ELSE 'succeeded' END AS st) x
"""
FILL_ATTEMPTS = """
INSERT INTO pgflow.attempts (run_id, attempt, worker_id, started_at, finished_at, outcome,
                             exit_code, error, stdout_tail)
SELECT id, 1, 'history-worker', started_at, finished_at,
       CASE state WHEN 'succeeded' THEN 'succeeded' ELSE 'failed' END,
       CASE state WHEN 'succeeded' THEN 0 ELSE 1 END,
       CASE state WHEN 'failed' THEN 'simulated failure' END,
       'rows loaded: ' || id
FROM pgflow.runs WHERE logical_time < timestamptz '2000-01-01' AND attempt = 1
"""


def history_jobs() -> list[str]:
    return ["noop", "capped", "up", "down", "bf"] + [
        f"hist-{i:03d}" for i in range(HISTORY_JOBS - 5)]


def secondary_indexes(conn: Conn, tables: tuple[str, ...] = ("runs", "attempts")
                      ) -> list[tuple[str, str]]:
    """(name, CREATE INDEX statement) of every index that backs no constraint."""
    rows = conn.execute("""
        SELECT i.indexname, i.indexdef FROM pg_indexes i
        WHERE i.schemaname = 'pgflow' AND i.tablename = ANY(%s)
          AND NOT EXISTS (SELECT 1 FROM pg_constraint c
                          WHERE c.conindid = (quote_ident(i.schemaname) || '.'
                                              || quote_ident(i.indexname))::regclass)
        ORDER BY 1""", (list(tables),)).fetchall()
    return [(r["indexname"], r["indexdef"]) for r in rows]


def load_history(conn: Conn, n: int, *, days: float = 30.0, backfill_id: int | None = None,
                 rebuild_indexes: bool = True, jobs: list[str] | None = None
                 ) -> dict[str, float]:
    """Insert ``n`` finished runs (with their attempts) of ``jobs`` (default
    ``history_jobs()``) finished over the last ``days`` days, then VACUUM ANALYZE. With
    ``rebuild_indexes``, the secondary indexes are dropped for the load and built again
    after it (several times faster)."""
    if n <= 0:
        return {"rows": 0, "load_s": 0.0}
    t0 = time.perf_counter()
    saved = secondary_indexes(conn) if rebuild_indexes else []
    jobs = jobs or history_jobs()
    with conn.transaction():
        for name, _ in saved:
            conn.execute(f"DROP INDEX pgflow.{name}")
        with runs.keys_inserted_after(conn):
            conn.execute(FILL_RUNS, {"jobs": jobs, "njobs": len(jobs), "n": n,
                                     "spread_s": days * 86400 / n, "backfill_id": backfill_id})
        conn.execute(FILL_ATTEMPTS)
    t1 = time.perf_counter()
    conn.execute("SET maintenance_work_mem = '256MB'")
    for _, definition in saved:
        conn.execute(definition)
    t2 = time.perf_counter()
    conn.execute("VACUUM ANALYZE pgflow.runs")
    conn.execute("VACUUM ANALYZE pgflow.attempts")
    return {"rows": n, "insert_s": round(t1 - t0, 1), "index_s": round(t2 - t1, 1),
            "load_s": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------- the live workload


def seed_active(conn: Conn) -> dict[str, Any]:
    """Jobs and live runs every hot statement works on; returns ids for the probes."""
    register(conn, [
        {"name": "noop", "entrypoint": "bench.jobs:noop"},
        {"name": "capped", "entrypoint": "bench.jobs:noop", "max_active_runs": 4},
        {"name": "up", "entrypoint": "bench.jobs:noop"},
        {"name": "down", "entrypoint": "bench.jobs:noop", "depends_on": ["up"]},
        {"name": "bf", "entrypoint": "bench.jobs:noop", "schedule": "* * * * *"},
        *[{"name": f"hist-{i:03d}", "entrypoint": "bench.jobs:noop"}
          for i in range(HISTORY_JOBS - 5)],
        *[{"name": f"tick-{i:04d}", "entrypoint": "bench.jobs:noop", "schedule": "* * * * *"}
          for i in range(SCHEDULED_JOBS)],
    ])
    conn.execute("UPDATE pgflow.jobs SET next_fire_at = now() - interval '1 s'"
                 " WHERE name LIKE 'tick-%%'")
    times = [LIVE_TIME + timedelta(seconds=i) for i in range(QUEUED + RUNNING)]
    _create(conn, ["noop"] * len(times), times)
    _create(conn, ["capped"] * 100, times[:100])
    dag_times = times[:DAG_RUNS]
    _create(conn, ["up"] * DAG_RUNS, dag_times, downstream=True)
    backfill = conn.execute(q("insert_backfill"), {
        "job": "bf", "start": LIVE_TIME, "end": LIVE_TIME + timedelta(days=3),
        "max_concurrency": 4, "downstream": False}).fetchone()
    assert backfill is not None
    _create(conn, ["bf"] * BACKFILL_PENDING,
            [LIVE_TIME + timedelta(minutes=i) for i in range(BACKFILL_PENDING)],
            state="pending", backfill_id=backfill["id"], trigger="backfill")
    # Claim RUNNING noop runs (oldest first) and every `up` run for one worker.
    conn.execute("UPDATE pgflow.runs SET priority = 1 WHERE job = 'up'")
    claimed = conn.execute(q("claim_runs"), {**NO_OFFER, "worker": WORKER,
                                             "limit": RUNNING + DAG_RUNS,
                                             "ttl": 3600.0}).fetchall()
    running = [(r["id"], r["attempt"], r["job"], r["attempt_started_at"].isoformat())
               for r in claimed]
    conn.execute("VACUUM ANALYZE pgflow.runs")
    conn.execute("VACUUM ANALYZE pgflow.jobs")
    return {"running": running, "backfill_id": backfill["id"],
            "pending_down": [r["id"] for r in conn.execute(
                "SELECT id FROM pgflow.runs WHERE job = 'down' AND state = 'pending'")]}


def _create(conn: Conn, jobs: list[str], times: list[datetime], *, downstream: bool = False,
            state: str = "queued", backfill_id: int | None = None,
            trigger: str = "manual") -> None:
    conn.execute(q("create_runs"), {
        "jobs": jobs, "times": times, "trigger": trigger, "params": None,
        "downstream": downstream, "state": state, "priority_offset": 0,
        "backfill_id": backfill_id})


# ---------------------------------------------------------------- probes


def _finish_batch(running: list[tuple[int, int, str, str]], job: str | None,
                  output: str | None = None) -> dict[str, Any]:
    """finish_attempts' parameters (the worker's own encoding) ending 100 attempts of
    ``job``: plain successes (arrays) without ``output``, JSON with it."""
    picked = [r for r in running if job is None or r[2] == job][:100]
    return queue.finish_params([
        queue.Finish(run_id=rid, attempt=attempt, owner=WORKER, state="succeeded",
                     outcome="succeeded", started_at=datetime.fromisoformat(started),
                     exit_code=0, stdout_tail=output)
        for rid, attempt, _, started in picked])


def probes(live: dict[str, Any]) -> dict[str, tuple[list[tuple[str, dict[str, Any]]], str,
                                                     dict[str, Any]]]:
    """name -> (statements run first in the same transaction, the measured query name,
    its parameters)."""
    running = live["running"]
    # Everything the worker owns is held: release=True then gives nothing back (the usual
    # case; a release is a claim whose reply was lost).
    held = {"ids": [r[0] for r in running], "attempts": [r[1] for r in running]}
    ups = _finish_batch(running, "up", output="ok")
    now = None
    return {
        "claim": ([], "claim_runs", {**NO_OFFER, "worker": "probe", "limit": 100, "ttl": 30.0}),
        "capped_waiting": ([], "capped_jobs_waiting", {}),
        "claim_capped": ([("lock_capped_jobs", {"jobs": ["capped"]})], "claim_capped_runs",
                         {"jobs": ["capped"], "worker": "probe", "limit": 4, "ttl": 30.0,
                          "min_priority": None}),
        "renew": ([], "renew_leases", {"worker": WORKER, "ttl": 30.0, "release": False,
                                       **held}),
        "renew_release": ([], "renew_leases", {"worker": WORKER, "ttl": 30.0,
                                               "release": True, **held}),
        "finish_batch": ([], "finish_attempts", _finish_batch(running, "noop")),
        # the same successes as most are written (queue.finish_plain)
        "finish_plain": ([], "finish_attempts", {**_finish_batch(running, "noop"),
                                                 "plain": True}),
        "finish_upstreams": ([], "finish_attempts", ups),
        "dependency_hop": ([("finish_attempts", ups)], "queue_ready_runs",
                           {"ids": live["pending_down"],
                            "finished": [r[0] for r in running if r[2] == "up"]}),
        "reap": ([], "expired_leases", {"limit": 500}),
        "due_jobs": ([], "due_jobs", {"now": datetime.now(UTC),
                                      "horizon": datetime.now(UTC) + timedelta(seconds=2),
                                      "batch": 2500}),
        "tick_dag": ([], "create_runs", {
            "jobs": ["up"] * 10, "times": [LIVE_TIME + timedelta(days=1, seconds=i)
                                          for i in range(10)],
            "trigger": "schedule", "params": None, "downstream": True, "state": "queued",
            "priority_offset": 0, "backfill_id": None}),
        "tick_plain": ([], "create_plain_runs", {
            "jobs": [f"tick-{i:04d}" for i in range(SCHEDULED_JOBS)],
            "times": [LIVE_TIME + timedelta(days=1)] * SCHEDULED_JOBS,
            "trigger": "schedule", "params": None, "only_lone": False}),
        "backfill_release": ([("lock_backfills", {"ids": None})], "release_backfill_runs",
                             {"ids": [live["backfill_id"]]}),
        "backfill_complete": ([], "complete_backfills", {}),
        "retention_batch": ([], "prune_runs", {"now": now, "retention_s": 7 * 86400.0,
                                               "limit": retention.BATCH,
                                               "after_finished": None, "after_id": None}),
    }


def _params_for(sql: str, given: dict[str, Any]) -> dict[str, Any]:
    """Only the parameters the statement names (its text may change under us)."""
    return {name: given.get(name) for name in re.findall(r"%\((\w+)\)[sb]", sql)}


def explain(conn: Conn, before: list[tuple[str, dict[str, Any]]], name: str,
            params: dict[str, Any]) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of one statement after ``before``, all rolled back."""
    with conn.transaction(force_rollback=True):
        for query, args in before:
            conn.execute(q(query), _params_for(q(query), args)).fetchall()
        row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + q(name),
                           _params_for(q(name), params)).fetchone()
    assert row is not None
    plan: dict[str, Any] = row["QUERY PLAN"][0]
    return plan


def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = [node]
    for child in node.get("Plans", []):
        found += nodes(child)
    return found


def measure_once(conn: Conn, live: dict[str, Any], label: str) -> dict[str, Any] | None:
    """One EXPLAIN (ANALYZE, BUFFERS) of the probe ``label``; None if its statement is gone."""
    before, name, params = probes(live)[label]
    try:
        q(name)
    except KeyError:
        return None
    try:
        plan = explain(conn, before, name, params)
    except psycopg.Error as exc:  # a statement changed under the probe: say so, go on
        return {"statement": name, "error": str(exc).strip().splitlines()[0]}
    top = plan["Plan"]
    return {"statement": name, "ms": plan["Planning Time"] + plan["Execution Time"],
            "shared_hit": top.get("Shared Hit Blocks", 0),
            "shared_read": top.get("Shared Read Blocks", 0), "rows": top.get("Actual Rows"),
            "scans": sorted({f"{n['Node Type']}({n.get('Index Name') or n.get('Relation Name')})"
                             for n in nodes(top) if "Relation Name" in n or "Index Name" in n})}


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and min ms of several ``measure_once`` results, with the last one's plan."""
    if any("error" in s for s in samples):
        return next(s for s in samples if "error" in s)
    times = [s["ms"] for s in samples]
    last = samples[-1]
    return {"statement": last["statement"], "ms_median": round(statistics.median(times), 3),
            "ms_min": round(min(times), 3), "reps": len(times),
            "shared_hit": last["shared_hit"], "shared_read": last["shared_read"],
            "rows": last["rows"], "scans": last["scans"]}


def measure_statements(conn: Conn, live: dict[str, Any], reps: int = 5,
                       only: Callable[[str], bool] = lambda name: True) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for label in probes(live):
        if not only(label):
            continue
        samples = [s for _ in range(reps) if (s := measure_once(conn, live, label))]
        figures[label] = summarize(samples) if samples else {"missing": probes(live)[label][1]}
    return figures
