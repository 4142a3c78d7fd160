"""Figure "history": millions of runs a day with retention, and a hot path that ignores
history.

(a) ``day``: "a day in minutes". Two ``pgflow serve`` replicas (scheduler, worker and
reaper roles; one of them leads and prunes) run with ``PGFLOW_RETENTION`` of a few
seconds while an injector creates no-op runs at a steady rate (``create_plain_runs``,
one statement per 0.1 s) until N runs went in. Every 5 s it samples what finished
(pruned + still present), the backlog, the table; every second a probe times the
claim statement on the server (``EXPLAIN ANALYZE`` of ``claim_runs`` limit 10 in a
rolled-back transaction, so it claims nothing). Reported: sustained runs/s, the
probe's claim p50/p99 in the first and the last minute, the queue wait (created ->
started) of the runs finished in those minutes, table/index sizes, dead tuples and
HOT updates at the end, the pruning rate, and the counts that prove nothing was lost
(injected = pruned + present, every one succeeded once). ``BENCH_DAY_RUNS`` and
``BENCH_DAY_RATE`` size it (default 1,000,000 at 3,000/s; --quick: 60,000).

(b) ``hot_path``: one database per history size (0, 1,000,000, and 10,000,000 unless
``BENCH_HISTORY_MAX`` says less; --quick: 0 and 200,000), each with the same live
workload and that many finished runs loaded directly (``INSERT … SELECT
generate_series``, secondary indexes rebuilt after the load); every hot statement is
timed in 7 round-robin rounds across the databases (``bench/hotpath.py``), and a prune
of 100,000 runs is timed. Side by side.

(c) ``pages`` (not in --quick): the web bench's 10,000 jobs and 1,000,000 runs plus
finished runs up to ``BENCH_HISTORY_MAX`` in all, then the web bench's pages and every
other admin page and API listing, server time (``Server-Timing``).

``BENCH_HISTORY_PARTS`` (default ``day,hot_path,pages``) picks the parts.
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg

from bench import hotpath, procs
from bench.context import EPOCH, Bench, one, register, wait_registered
from bench.stats import pct, summary
from pgflow import db, migrate, retention
from pgflow.queries import q
from pgflow.queue import NO_OFFER

NOOP = {"name": "noop", "entrypoint": "bench.jobs:noop"}
ROLES = ("scheduler", "worker", "reaper")
SAMPLE_S = 5.0
PROBE_S = 1.0
CHUNK_S = 0.1

TABLE_SQL = """
SELECT c.relname AS table, pg_relation_size(c.oid) AS heap_bytes,
       pg_indexes_size(c.oid) AS index_bytes, pg_total_relation_size(c.oid) AS total_bytes,
       s.n_live_tup, s.n_dead_tup, s.n_tup_ins, s.n_tup_upd, s.n_tup_hot_upd, s.n_tup_del,
       s.autovacuum_count, s.autoanalyze_count
FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.relnamespace = 'pgflow'::regnamespace AND c.relname IN ('runs', 'attempts')
ORDER BY 1"""
SAMPLE_SQL = """
SELECT extract(epoch FROM clock_timestamp())::float8 AS t,
       (SELECT count(*) FROM pgflow.runs WHERE state = 'succeeded') AS present,
       (SELECT count(*) FROM pgflow.runs
        WHERE state IN ('pending', 'queued', 'retrying') OR state = 'running') AS unfinished,
       (SELECT coalesce(max(pruned_runs), 0) FROM pgflow.retention) AS pruned,
       (SELECT count(*) FROM pgflow.runs
        WHERE finished_at < now() - make_interval(secs => %(retention_s)s)) AS past_retention,
       pg_total_relation_size('pgflow.runs') AS runs_bytes,
       (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'pgflow.runs'::regclass)
           AS runs_dead,
       (SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (
                   ORDER BY extract(epoch FROM started_at - created_at) * 1000)
        FROM pgflow.runs WHERE finished_at >= now() - make_interval(secs => %(window_s)s)
          AND finished_at IS NOT NULL) AS wait_ms"""


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# ---------------------------------------------------------------- (a) a day in minutes


class _Injector(threading.Thread):
    """Creates ``n`` queued no-op runs at ``rate``/s, one statement every CHUNK_S."""

    def __init__(self, url: str, n: int, rate: float) -> None:
        super().__init__(daemon=True)
        self.url, self.n, self.rate = url, n, rate
        self.injected = 0
        self.started_at = self.ended_at = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with db.connect(self.url) as conn:
                self.started_at = time.monotonic()
                tick = 0
                while self.injected < self.n:
                    due = self.started_at + tick * CHUNK_S
                    if (delay := due - time.monotonic()) > 0:
                        time.sleep(delay)
                    want = min(self.n, round((tick + 1) * CHUNK_S * self.rate)) - self.injected
                    if want > 0:
                        times = [EPOCH + timedelta(seconds=self.injected + i)
                                 for i in range(want)]
                        conn.execute(q("create_plain_runs"), {
                            "jobs": ["noop"] * want, "times": times, "trigger": "manual",
                            "params": None, "only_lone": False}, binary=True)
                        self.injected += want
                    tick += 1
                self.ended_at = time.monotonic()
        except BaseException as exc:  # reported by the figure
            self.error = exc


class _Probe(threading.Thread):
    """Server time of the claim statement, once a second, claiming nothing."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, float]] = []  # (time.time(), ms)
        self.stop = threading.Event()

    def run(self) -> None:
        with db.connect(self.url) as conn:
            while not self.stop.wait(PROBE_S):
                with conn.transaction(force_rollback=True):
                    row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + q("claim_runs"), {
                        **NO_OFFER,
                        "worker": "bench-probe", "limit": 10, "ttl": 30.0}).fetchone()
                assert row is not None
                plan = row["QUERY PLAN"][0]
                self.samples.append((time.time(), plan["Planning Time"]
                                     + plan["Execution Time"]))


def _window(samples: list[tuple[float, float]], start: float, end: float) -> dict[str, Any]:
    values = [ms for t, ms in samples if start <= t < end]
    return summary(values, 3)


def measure_day(b: Bench, n: int, rate: float, retention_s: float = 10.0,
                replicas: int = 2, concurrency: int = 200) -> dict[str, Any]:
    url = b.fresh_database()
    with b.connect() as conn:
        register(conn, [NOOP])
    env = {"PGFLOW_RETENTION": f"{retention_s:g}s"}
    injector = _Injector(url, n, rate)
    probe = _Probe(url)
    samples: list[dict[str, Any]] = []
    with b.connect() as conn, b.replicas("history-day", roles=ROLES, concurrency=concurrency,
                                         count=replicas, env=env) as started:
        wait_registered(conn, started)
        t_start = time.time()
        injector.start()
        probe.start()
        deadline = time.monotonic() + n / rate * 3 + 120
        while True:
            samples.append(one(conn, SAMPLE_SQL, _sample_args(retention_s)))
            last = samples[-1]
            if injector.error is not None:
                raise RuntimeError(f"injector failed: {injector.error}")
            if not injector.is_alive() and last["unfinished"] == 0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"runs not finished in time: {last}")
            for replica in started:
                replica.check_alive()
            time.sleep(SAMPLE_S)
        t_done = time.time()
        # Let retention catch up with what finished last, then read the end state.
        procs.wait_until(lambda: one(conn, SAMPLE_SQL, _sample_args(retention_s))[
            "past_retention"] == 0, timeout=120, alive=started, what="retention caught up")
        probe.stop.set()
        probe.join(10)
        final = one(conn, SAMPLE_SQL, _sample_args(retention_s))
        tables = {r["table"]: r for r in conn.execute(TABLE_SQL).fetchall()}
        lost = one(conn, """
            SELECT (SELECT count(*) FROM pgflow.runs WHERE state <> 'succeeded') AS not_succeeded,
                   (SELECT count(*) FROM pgflow.attempts WHERE outcome <> 'succeeded')
                       AS failed_attempts,
                   (SELECT count(*) FROM pgflow.runs r WHERE NOT EXISTS (
                        SELECT 1 FROM pgflow.attempts a WHERE a.run_id = r.id))
                       AS runs_without_attempt,
                   (SELECT count(*) FROM pgflow.attempts) AS attempts""")
        leader = one(conn, "SELECT * FROM pgflow.retention")
    return _day_result(n, rate, retention_s, replicas, concurrency, injector, probe, samples,
                       final, tables, lost, leader, t_start, t_done)


def _sample_args(retention_s: float) -> dict[str, Any]:
    return {"retention_s": retention_s, "window_s": SAMPLE_S}


def _waits(samples: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """Queue wait (created -> started) of the runs finished in [start, end): the median
    of the per-sample p50 and the highest per-sample p99."""
    inside = [s["wait_ms"] for s in samples if start <= s["t"] < end and s["wait_ms"]]
    if not inside:
        return {"samples": 0}
    return {"samples": len(inside), "p50_ms": round(statistics.median(w[0] for w in inside), 1),
            "p99_ms_max": round(max(w[1] for w in inside), 1)}


def _rates(samples: list[dict[str, Any]]) -> list[float]:
    """Finished runs/s between consecutive samples (pruned + still present)."""
    out = []
    for a, b in itertools.pairwise(samples):
        done = (b["pruned"] + b["present"]) - (a["pruned"] + a["present"])
        out.append(done / max(b["t"] - a["t"], 1e-6))
    return out


def _day_result(n: int, rate: float, retention_s: float, replicas: int, concurrency: int,
                injector: _Injector, probe: _Probe, samples: list[dict[str, Any]],
                final: dict[str, Any], tables: dict[str, Any], lost: dict[str, Any],
                leader: dict[str, Any], t_start: float, t_done: float) -> dict[str, Any]:
    rates = _rates(samples)
    steady = rates[1:-1] or rates
    inject_s = max(injector.ended_at - injector.started_at, 1e-6)
    runs_table = tables.get("runs", {})
    upd = runs_table.get("n_tup_upd") or 0
    present = int(final["present"])
    pruned = int(final["pruned"])
    peak_past = max(int(s["past_retention"]) for s in samples)
    return {
        "runs": n, "target_rate_per_s": rate, "retention_s": retention_s,
        "replicas": replicas, "concurrency": concurrency,
        "injected": injector.injected, "inject_rate_per_s": round(injector.injected / inject_s, 1),
        "wall_s": round(t_done - t_start, 1),
        "sustained_runs_per_s": {
            "overall": round((pruned + present) / max(t_done - t_start, 1e-6), 1),
            "median_5s": round(statistics.median(steady), 1) if steady else None,
            "p10_5s": round(pct(steady, 10) or 0, 1), "p90_5s": round(pct(steady, 90) or 0, 1)},
        "claim_probe_ms": {
            "first_minute": _window(probe.samples, t_start, t_start + 60),
            "last_minute": _window(probe.samples, t_done - 60, t_done),
            "all": summary([ms for _, ms in probe.samples], 3)},
        "queue_wait": {"first_minute": _waits(samples, t_start, t_start + 60),
                       "last_minute": _waits(samples, t_done - 60, t_done + 1)},
        "queue_depth_max": max(int(s["unfinished"]) for s in samples),
        "past_retention_max": peak_past,
        "runs_table_bytes": {"max": max(int(s["runs_bytes"]) for s in samples),
                             "mid": int(samples[len(samples) // 2]["runs_bytes"]),
                             "end": int(final["runs_bytes"])},
        "tables_at_end": tables,
        "hot_update_ratio_runs": round((runs_table.get("n_tup_hot_upd") or 0) / upd, 4)
        if upd else None,
        "pruned": pruned, "present_at_end": present,
        "pruning_runs_per_s": round(pruned / max(t_done - t_start, 1e-6), 1),
        "leader_retention": leader,
        "nothing_lost": {
            "injected_equals_pruned_plus_present": injector.injected == pruned + present,
            "runs_deleted_by_postgres": int(runs_table.get("n_tup_del") or 0),
            **lost},
        "method": "2 replicas (scheduler+worker+reaper) with PGFLOW_RETENTION; an injector "
                  "creates queued no-op runs with create_plain_runs every 0.1 s at the target "
                  "rate; 5 s samples of pruned (pgflow.retention) + present succeeded runs; "
                  "claim probe = server planning+execution ms of EXPLAIN ANALYZE claim_runs "
                  "limit 10, rolled back, once a second",
    }


# ---------------------------------------------------------------- (b) hot path vs history


def measure_hot_path(b: Bench, sizes: list[int], reps: int = 7,
                     prune_rows: int = 100_000) -> dict[str, Any]:
    """One database per history size, loaded once; then ``reps`` rounds, each timing every
    statement once in every database (round-robin, so a burst of load from elsewhere on
    the machine hits all sizes alike, not one)."""
    databases: dict[int, tuple[psycopg.Connection[Any], dict[str, Any]]] = {}
    results: dict[str, Any] = {}
    try:
        for size in sizes:
            name = f"pgflow_bench_history_{size}"
            url = b.cluster.reset_database(name)
            conn = db.connect(url)
            migrate.migrate(conn)
            live = hotpath.seed_active(conn)
            loaded = hotpath.load_history(conn, size, backfill_id=live["backfill_id"])
            databases[size] = (conn, live)
            results[str(size)] = {"load": loaded}
        b.cluster.checkpoint()
        samples: dict[int, dict[str, list[dict[str, Any]]]] = {s: {} for s in sizes}
        labels = list(hotpath.probes(databases[sizes[0]][1]))
        for _ in range(reps):
            for label in labels:
                for size, (conn, live) in databases.items():
                    if (found := hotpath.measure_once(conn, live, label)) is not None:
                        samples[size].setdefault(label, []).append(found)
        for size, (conn, _) in databases.items():
            result = results[str(size)]
            result["statements"] = {label: hotpath.summarize(found)
                                    for label, found in samples[size].items()}
            result["tables"] = {r["table"]: {"total_mib": round(r["total_bytes"] / 2**20, 1),
                                             "index_mib": round(r["index_bytes"] / 2**20, 1)}
                                for r in conn.execute(TABLE_SQL).fetchall()}
            result["prune"] = _prune_rate(conn, size, prune_rows)
    finally:
        for size, (conn, _) in databases.items():
            conn.close()
            with b.cluster.admin() as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "pgflow_bench_history_{size}" WITH (FORCE)')
    return {"by_history_rows": results, "side_by_side_ms": _side_by_side(results),
            "method": "one database per size, each with the same live workload (1,000 queued, "
                      "200 running, capped, DAG, backfill, 500 due jobs) plus N finished runs "
                      "(INSERT ... SELECT generate_series, indexes rebuilt, VACUUM ANALYZE); "
                      f"{reps} round-robin rounds of EXPLAIN (ANALYZE, BUFFERS) of each "
                      "statement in a rolled-back transaction (planning + execution ms; "
                      "median and min); prune: retention.run_once over the oldest finished "
                      "runs, batch 2,000"}


def _prune_rate(conn: psycopg.Connection[Any], size: int, rows: int) -> dict[str, Any] | None:
    """Time a prune of about ``rows`` of the oldest finished runs (history spans 30 days)."""
    if size < 10 * retention.BATCH:
        return None
    keep_days = 30 * (1 - min(rows, size // 2) / size)
    started = time.perf_counter()
    found = retention.run_once(conn, keep_days * 86400, max_batches=max(1, rows // retention.BATCH))
    seconds = time.perf_counter() - started
    return {"deleted": found.deleted, "batches": found.batches, "seconds": round(seconds, 2),
            "runs_per_s": round(found.deleted / max(seconds, 1e-6), 1),
            "ms_per_batch": round(1000 * seconds / max(found.batches, 1), 1)}


def _side_by_side(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """label -> {history rows: (median ms, min ms)}."""
    table: dict[str, dict[str, Any]] = {}
    for size, result in results.items():
        for label, figure in result["statements"].items():
            table.setdefault(label, {})[size] = (figure.get("ms_median", figure.get("error")),
                                                 figure.get("ms_min"))
        if result["prune"]:
            table.setdefault("prune_runs_per_s", {})[size] = result["prune"]["runs_per_s"]
    return table


# ---------------------------------------------------------------- (c) pages at 10M runs

PAGES = ["/dead-letters", "/backfills", "/tenants", "/replicas", "/runs",
         "/runs?state=failed", "/runs?job=job-00042", "/runs?tenant=tenant-03",
         "/jobs?state=failed", "/jobs/job-00042/dag"]
API = ["/api/v1/runs?limit=100", "/api/v1/runs?state=succeeded&limit=100",
       "/api/v1/runs?state=cancelled&limit=100", "/api/v1/runs?job=job-00042&limit=100",
       "/api/v1/runs?tenant=tenant-03&limit=100", "/api/v1/runs?trigger=manual&limit=100",
       "/api/v1/jobs?limit=100", "/api/v1/backfills", "/api/v1/status"]


def measure_pages(b: Bench, total_runs: int, requests: int = 10) -> dict[str, Any]:
    """The web bench (``pgflow.web.bench``: 10,000 jobs, 1,000,000 runs) plus
    ``total_runs - 1,000,000`` finished runs of the same jobs loaded directly, then the
    web bench's pages and every other listing page and API listing, server time."""
    from pgflow.web import bench as web_bench

    name = "pgflow_bench_history_pages"
    url = b.cluster.reset_database(name)
    try:
        web_bench.seed(url, say=lambda line: None)
        with db.connect(url) as conn:
            jobs = [r["name"] for r in conn.execute("SELECT name FROM pgflow.jobs")]
            loaded = hotpath.load_history(conn, max(0, total_runs - 1_000_000), jobs=jobs)
            runs = one(conn, "SELECT count(*) AS n FROM pgflow.runs")["n"]
            a_run = one(conn, "SELECT max(id) AS id FROM pgflow.runs")["id"]
        b.cluster.checkpoint()
        figures: dict[str, Any] = {"runs": runs, "load": loaded,
                                   "web_bench": web_bench.bench_web(url)}
        figures["pages"] = _time_pages(url, [*PAGES, f"/runs/{a_run}"], API, requests)
        worst = max(f["p95_ms"] for f in figures["pages"].values())
        figures["worst_page_p95_ms"] = worst
        return figures
    finally:
        with b.cluster.admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _time_pages(url: str, pages: list[str], api: list[str], requests: int
                ) -> dict[str, Any]:
    import re
    from tempfile import mkdtemp

    import httpx

    from pgflow import tokens
    from pgflow.config import load_settings
    from pgflow.web import bench as web_bench
    from pgflow.web.app import create_app

    with db.connect(url) as conn:
        secret = tokens.create(conn, "viewer", note="bench history")
    settings = load_settings({"PGFLOW_HOME": mkdtemp(prefix="pgflow-bench-")},
                             database_url=url)
    app = create_app(url, settings, secret=b"bench-secret-0123456789")
    found: dict[str, Any] = {}
    with web_bench._Serve(app) as base, httpx.Client(base_url=base, timeout=60) as http:
        form = http.get("/login").text
        csrf = re.search(r'name="csrf" value="([^"]+)"', form)
        assert csrf
        http.post("/login", data={"token": secret, "csrf": csrf.group(1)})
        auth = {"Authorization": f"Bearer {secret}"}
        for path in pages + api:
            headers = auth if path.startswith("/api/") else {}
            found[path] = web_bench._figures([web_bench._server_ms(http.get(path, headers=headers))
                                              for _ in range(requests)])
    return found


# ---------------------------------------------------------------- the figure


def measure(b: Bench) -> dict[str, Any]:
    quick = b.quick
    n = _env_int("BENCH_DAY_RUNS", 60_000 if quick else 1_000_000)
    rate = float(os.environ.get("BENCH_DAY_RATE", 3000))
    top = _env_int("BENCH_HISTORY_MAX", 200_000 if quick else 10_000_000)
    sizes = sorted({0, min(top, 1_000_000), top})
    only = os.environ.get("BENCH_HISTORY_PARTS", "day,hot_path,pages").split(",")
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "day": lambda: measure_day(b, n, rate),
        "hot_path": lambda: measure_hot_path(b, sizes),
        "pages": lambda: measure_pages(b, top)}
    result: dict[str, Any] = {}
    for name, run in parts.items():
        if name not in only or (name == "pages" and quick):
            continue
        try:
            result[name] = run()
        except Exception as exc:  # recorded; the other parts still run
            result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return result
