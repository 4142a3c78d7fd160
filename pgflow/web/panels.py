"""The dashboard's named panels: recent failures, running runs with their age, and
the most-failing and slowest jobs of the last 24 hours, each row linking to its run
or job.

Design note. The page must cost the same at 1,000 runs a day as at 250,000, so no
panel aggregates the day's runs. Failures come from ``runs_failed_idx`` (only failed
runs are in it: the day's failures, index-only, at most ``FAILURES_SCAN`` of them).
Running runs are the live ones. The slowest jobs are the slowest runs per job of each
closed hour, counted once into ``pgflow.slow_hours`` (``SLOW_ROLLUP_HOURS`` hours per
dashboard computation, newest first, so a fresh installation fills its day within
minutes of dashboards), plus the runs of the current hour read live: the top jobs by
their longest run over the day are exactly among the hourly tops (see the migration
0015_pipeline_ui.sql), so merging 25 short lists gives the day's answer.

Measured with the web bench's 10,000 jobs and 1,000,000 runs (240,000 of them finished
in the last 24 hours, 7,300 failed), ``EXPLAIN (ANALYZE, BUFFERS)``: aggregating the
day's runs directly took 366 ms (215,000 buffers); the panels' statement takes about
25 ms (9,000 buffers, nearly all the current hour's runs), and counting one closed
hour into slow_hours about 50 ms, once per hour per cluster. The whole dashboard,
recomputed on every request, stays at p95 80 ms (``python -m pgflow.web.bench``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from pgflow.queries import q

Conn = psycopg.Connection[dict[str, Any]]

ROWS = 10
FAILURES_SCAN = 20_000
SLOW_ROLLUP_HOURS = 1
SETTLE_S = 120  # an hour is counted once it ended this long ago (see web_rollup_minutes)


def dashboard_panels(conn: Conn) -> dict[str, Any]:
    """The rows of every panel (times as datetimes)."""
    conn.execute(q("web_rollup_slow_hours"), {"settle_s": SETTLE_S, "limit": SLOW_ROLLUP_HOURS,
                                              "per_hour": ROWS})
    row = conn.execute(q("web_dashboard_panels"), {
        "settle_s": SETTLE_S, "limit": ROWS, "per_hour": ROWS,
        "failures_scan": FAILURES_SCAN}).fetchone()
    assert row is not None
    return {
        "failures": [_times(f, "logical_time", "finished_at", "acked_at")
                     for f in row["failures"]],
        "failing": [_times(j, "last_failed_at") for j in row["failing"]],
        "failures_day": row["failures_day"],
        "failures_capped": row["failures_day"] >= FAILURES_SCAN,
        "running_total": row["running_total"],
        "running": [_times(r, "logical_time", "attempt_started_at") for r in row["running"]],
        "slowest": slowest_jobs([*row["slow_hours"], row["slow_live"]], ROWS),
    }


def slowest_jobs(lists: list[list[dict[str, Any]]], limit: int) -> list[dict[str, Any]]:
    """Merge per-hour lists of ``{job, run_id, state, seconds}``: each job's slowest run,
    the ``limit`` slowest jobs first."""
    best: dict[str, dict[str, Any]] = {}
    for entries in lists:
        for entry in entries:
            seen = best.get(entry["job"])
            if seen is None or (entry["seconds"], -entry["run_id"]) > (seen["seconds"],
                                                                      -seen["run_id"]):
                best[entry["job"]] = entry
    ranked = sorted(best.values(), key=lambda e: (-e["seconds"], e["job"]))
    return ranked[:limit]


def _times(entry: dict[str, Any], *keys: str) -> dict[str, Any]:
    for key in keys:
        if entry.get(key) is not None:
            entry[key] = datetime.fromisoformat(entry[key])
    return entry
