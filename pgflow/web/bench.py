"""Server time of the admin pages with 10,000 jobs and 1,000,000 runs (``make bench``).

``bench_web(url)`` seeds the database at ``url`` once (a rerun reuses the data), serves
the web app with uvicorn on a free loopback port, logs in with a token like a user,
and requests each page repeatedly, reading the app's own ``Server-Timing`` header
(time until the response starts: queries plus rendering). The dashboard is measured
twice: as served (its aggregates are cached 5 s per replica, so most requests are
hits) and with the cache expired before every request (the incremental per-minute
read), plus the very first computation (24 hours of runs read at once).

    python -m pgflow.web.bench postgresql://localhost/scratch
"""

from __future__ import annotations

import json
import random
import re
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from tempfile import mkdtemp
from typing import Any

import httpx
import uvicorn

from pgflow import db, migrate, registry, runs, tokens
from pgflow.config import load_settings
from pgflow.spec import JobSpec
from pgflow.web._state import WebState
from pgflow.web.app import create_app
from pgflow.web.pages import _compute_dashboard

JOBS = 10_000
RUNS_PER_JOB = 100
CHAIN = 10  # every 10 jobs form a chain: one scheduled root and nine dependents
TENANTS = 20

_RUNS = """
INSERT INTO pgflow.runs (job, logical_time, state, attempt, max_attempts, trigger, tenant,
                         created_at, available_at, started_at, finished_at)
SELECT j.name, t.at,
       CASE WHEN k = 0 AND j.h %% 50 = 0 THEN 'queued'
            WHEN (j.h + k) %% 33 = 0 THEN 'failed' ELSE 'succeeded' END,
       CASE WHEN k = 0 AND j.h %% 50 = 0 THEN 0 ELSE 1 END, 3,
       CASE WHEN j.root THEN 'schedule' ELSE 'dependency' END, j.tenant, t.at, t.at,
       CASE WHEN k = 0 AND j.h %% 50 = 0 THEN NULL ELSE t.at + make_interval(secs => j.h %% 60) END,
       CASE WHEN k = 0 AND j.h %% 50 = 0 THEN NULL
            ELSE t.at + make_interval(secs => j.h %% 60 + 5 + (j.h + k * 7) %% 300) END
FROM (SELECT name, tenant, schedule IS NOT NULL AS root, abs(hashtext(name)) AS h
      FROM pgflow.jobs) j
CROSS JOIN generate_series(0, %(runs)s - 1) AS k
CROSS JOIN LATERAL (SELECT date_trunc('hour', now()) - make_interval(hours => k) AS at) t
"""

_ATTEMPTS = """
INSERT INTO pgflow.attempts (run_id, attempt, worker_id, started_at, finished_at, outcome,
                             exit_code, error)
SELECT id, 1, 'bench-worker', started_at, finished_at,
       CASE state WHEN 'succeeded' THEN 'succeeded' ELSE 'failed' END,
       CASE state WHEN 'succeeded' THEN 0 ELSE 1 END,
       CASE state WHEN 'failed' THEN 'bench: simulated failure' END
FROM pgflow.runs WHERE attempt = 1
"""


def seed(url: str, jobs: int = JOBS, runs_per_job: int = RUNS_PER_JOB,
         say: Callable[[str], None] = print) -> bool:
    """Register ``jobs`` jobs and ``jobs * runs_per_job`` runs (with attempts) unless the
    database already has that many jobs. Returns whether it seeded."""
    conn = db.connect(url)
    try:
        if migrate.pending(conn):
            migrate.migrate(conn)
        have = conn.execute("SELECT count(*) AS n FROM pgflow.jobs").fetchone()
        if have and have["n"] >= jobs:
            return False
        started = time.perf_counter()
        specs = []
        for i in range(jobs):
            keys: dict[str, Any] = {"name": f"job-{i:05d}", "entrypoint": "bench:noop",
                                    "tenant": f"tenant-{i % TENANTS:02d}"}
            if i % CHAIN:
                keys["depends_on"] = [f"job-{i - 1:05d}"]
            else:
                keys["schedule"] = "0 * * * *"
                keys["sources"] = [f"source-{i % 7}"]
            specs.append(JobSpec.model_validate(keys))
        registry.apply(conn, specs)
        say(f"registered {jobs} jobs in {time.perf_counter() - started:.1f}s")
        started = time.perf_counter()
        with runs.keys_inserted_after(conn):
            conn.execute(_RUNS, {"runs": runs_per_job})
        conn.execute(_ATTEMPTS)
        conn.execute("VACUUM ANALYZE pgflow.runs")
        conn.execute("VACUUM ANALYZE pgflow.attempts")
        conn.execute("VACUUM ANALYZE pgflow.jobs")
        say(f"inserted {jobs * runs_per_job:,} runs and their attempts in"
            f" {time.perf_counter() - started:.1f}s")
        return True
    finally:
        conn.close()


class _Serve:
    def __init__(self, app: Any) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _figures(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p95 = ordered[max(0, round(0.95 * len(ordered)) - 1)]
    return {"n": len(ordered), "p50_ms": round(statistics.median(ordered), 1),
            "p95_ms": round(p95, 1), "max_ms": round(ordered[-1], 1)}


def _server_ms(response: httpx.Response) -> float:
    assert response.status_code == 200, (response.request.url, response.status_code)
    match = re.search(r"dur=([\d.]+)", response.headers["server-timing"])
    assert match
    return float(match.group(1))


def bench_web(url: str, requests: int = 40, *, jobs: int = JOBS,
              runs_per_job: int = RUNS_PER_JOB) -> dict[str, Any]:
    """p50/p95/max server time (ms) of the dashboard, jobs list, job detail (a root's with
    its pipeline trend and grid), DAG run (Gantt) and the API's runs page, after
    seeding ``jobs`` jobs with ``runs_per_job`` runs each (once per database)."""
    seed(url, jobs, runs_per_job)
    conn = db.connect(url)
    secret = tokens.create(conn, "viewer", note="bench")
    names = [r["name"] for r in conn.execute("SELECT name FROM pgflow.jobs ORDER BY name")]
    conn.close()
    settings = load_settings({"PGFLOW_HOME": mkdtemp(prefix="pgflow-bench-")}, database_url=url)
    app = create_app(url, settings, secret=b"bench-secret-0123456789")
    state: WebState = app.state.web
    rng = random.Random(7)
    results: dict[str, Any] = {"jobs": len(names)}
    with _Serve(app) as base, httpx.Client(base_url=base, timeout=60) as http:
        form = http.get("/login").text
        csrf = re.search(r'name="csrf" value="([^"]+)"', form)
        assert csrf
        http.post("/login", data={"token": secret, "csrf": csrf.group(1)})
        state.minutes.clear()
        state.cache.clear()
        first = _server_ms(http.get("/"))
        results["dashboard_first_ever_ms"] = round(first, 1)
        served = []
        for _ in range(requests):
            served.append(_server_ms(http.get("/")))
            time.sleep(0.25)
        results["dashboard"] = _figures(served)
        expired = []
        for _ in range(requests):
            state.cache.clear()
            expired.append(_server_ms(http.get("/")))
        results["dashboard_cache_expired"] = _figures(expired)
        pages = []
        for i in range(requests):
            choice = i % 4
            params = ({} if choice == 0 else {"after": rng.choice(names)} if choice == 1
                      else {"q": f"{rng.randrange(100):02d}"} if choice == 2
                      else {"tenant": f"tenant-{rng.randrange(TENANTS):02d}",
                            "state": "failed"})
            pages.append(_server_ms(http.get("/jobs", params=params)))
        results["jobs_list"] = _figures(pages)
        details = [_server_ms(http.get(f"/jobs/{rng.choice(names)}")) for _ in range(requests)]
        results["job_detail"] = _figures(details)
        roots = names[::CHAIN]  # a root's page adds its DAG's end-to-end trend and grid
        results["root_job_detail"] = _figures(
            [_server_ms(http.get(f"/jobs/{rng.choice(roots)}")) for _ in range(requests)])
        results["dag_run"] = _figures(  # the Gantt chart of the latest DAG run
            [_server_ms(http.get(f"/jobs/{rng.choice(roots)}/dag")) for _ in range(requests)])
        api = [_server_ms(http.get("/api/v1/runs", params={"limit": 100},
                                   headers={"Authorization": f"Bearer {secret}"}))
               for _ in range(requests // 2)]
        results["api_runs_page"] = _figures(api)
        with state.connection() as conn:  # the dashboard's statement alone, cold
            state.minutes.clear()
            started = time.perf_counter()
            _compute_dashboard(conn, state)
            results["dashboard_compute_cold_ms"] = round(
                (time.perf_counter() - started) * 1000, 1)
    return results


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m pgflow.web.bench postgresql://.../scratch_database")
    print(json.dumps(bench_web(argv[0]), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])

