"""Figure 8: production start delay while a 10,000-tick backfill drains.

A production job fires every second (6-field cron); its start delay is started_at -
logical_time (scheduler wake-up + enqueue + claim). It is measured for a window
without a backfill, then ``pgflow backfill`` creates a 10,000-tick backfill of
another job (capped) and the delay is measured again while it drains. The
backfill's overlap (from attempts) must never exceed its cap.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import datetime
from typing import Any

from bench.context import Bench, floats, one, register, wait_registered
from bench.stats import summary

PROD = {"name": "prod", "schedule": "* * * * * *", "entrypoint": "bench.jobs:noop"}
HIST = {"name": "hist", "schedule": "* * * * *", "entrypoint": "bench.jobs:sleep_async",
        "params": {"seconds": 0.05}}
START, END = "2001-01-01T00:00:00+00:00", "2001-01-07T22:40:00+00:00"  # 10,000 minutes

DELAY_SQL = """
SELECT extract(epoch FROM started_at - logical_time)::float8 * 1000 FROM pgflow.runs
WHERE job = 'prod' AND logical_time >= %s AND logical_time < %s AND started_at IS NOT NULL"""
BACKFILL_SQL = """
SELECT count(*) AS runs,
       count(*) FILTER (WHERE state = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE state = 'pending') AS pending,
       count(*) FILTER (WHERE state IN ('queued', 'running', 'retrying')) AS in_flight
FROM pgflow.runs WHERE backfill_id IS NOT NULL AND job = 'hist'"""
# Most backfill attempts running at once: a sweep over attempt start/end events.
OVERLAP_SQL = """
WITH spans AS (
    SELECT a.started_at AS at, 1 AS d FROM pgflow.attempts a
    JOIN pgflow.runs r ON r.id = a.run_id WHERE r.backfill_id IS NOT NULL
    UNION ALL
    SELECT a.finished_at, -1 FROM pgflow.attempts a
    JOIN pgflow.runs r ON r.id = a.run_id WHERE r.backfill_id IS NOT NULL
)
SELECT coalesce(max(running), 0) AS most FROM (
    SELECT sum(d) OVER (ORDER BY at, d ROWS UNBOUNDED PRECEDING) AS running FROM spans) s"""


def _db_now(conn: Any) -> datetime:
    now: datetime = one(conn, "SELECT now() AS t")["t"]
    return now


def _window(conn: Any, seconds: float) -> tuple[datetime, datetime]:
    start = _db_now(conn)
    time.sleep(seconds)
    return start, _db_now(conn)


def _backfill_cli(b: Bench, args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgflow", "backfill", *args], cwd=b.project,
                          capture_output=True, text=True,
                          env={**os.environ, "PGFLOW_DATABASE_URL": b.url})


def _start_backfill(b: Bench, cap: int) -> dict[str, Any]:
    """``pgflow backfill hist --start .. --end .. --max-concurrency cap`` (the SPEC's form);
    if the CLI rejects that order, the same options before the name."""
    options = ["--start", START, "--end", END, "--max-concurrency", str(cap), "--json"]
    t0 = time.perf_counter()
    done = _backfill_cli(b, ["hist", *options])
    contract_form_ok = done.returncode == 0
    if not contract_form_ok and "No such command" in done.stderr:
        t0 = time.perf_counter()
        done = _backfill_cli(b, [*options, "hist"])
    if done.returncode:
        raise RuntimeError(f"pgflow backfill: {done.stderr.strip()[-500:]}")
    return {"backfill_cli_wall_s": round(time.perf_counter() - t0, 2),
            "backfill_cli_output": done.stdout.strip()[-300:],
            "backfill_cli_spec_form_ok": contract_form_ok}


def _delays(conn: Any, window: tuple[datetime, datetime]) -> dict[str, Any]:
    # Ticks near the window's end may not have started when it closes: wait a little.
    time.sleep(1.0)
    return summary(floats(conn, DELAY_SQL, window), 1)


def measure(b: Bench, window_s: float, cap: int, concurrency: int) -> dict[str, Any]:
    b.fresh_database()
    with b.connect() as conn:
        register(conn, [PROD, HIST])
        with b.replicas("backfill-scheduler", roles=("scheduler",)) as leader, \
                b.replicas("backfill-worker", concurrency=concurrency) as started:
            wait_registered(conn, leader + started)
            time.sleep(2.0)  # let the first ticks settle
            quiet = _window(conn, window_s)
            t_cli = _db_now(conn)
            cli = _start_backfill(b, cap)
            creating = (t_cli, _db_now(conn))
            draining = _window(conn, window_s)
            delays = {"without_backfill_ms": _delays(conn, quiet),
                      "while_backfill_created_ms": _delays(conn, creating),
                      "while_backfill_drains_ms": _delays(conn, draining)}
            progress = one(conn, BACKFILL_SQL)
            drained_s = (_db_now(conn) - creating[1]).total_seconds()
        overlap = one(conn, OVERLAP_SQL)["most"]
    return {
        "window_s": window_s, "backfill_ticks": 10_000, "cap": cap,
        "worker_concurrency": concurrency, **cli, **delays,
        "backfill_progress_at_end": progress,
        "backfill_released": progress["runs"] - progress["pending"],
        "backfill_drain_per_s": round(progress["succeeded"] / drained_s, 2),
        "backfill_max_overlap": overlap, "cap_respected": overlap <= cap,
        "method": "prod fires every second (6-field cron) on 1 scheduler + 1 worker replica; "
                  "delay = started_at - logical_time for ticks in each window: without "
                  "backfill, while `pgflow backfill hist` (10,000 minute ticks, cap) creates "
                  "its runs, and while it drains; hist runs sleep 50 ms",
    }
