"""Figure 4: scheduler fan-out. N jobs share one schedule whose next tick T is a few
seconds ahead; a ``--role scheduler`` replica (the leader) creates their runs at T and
worker replicas execute them. Reported relative to T: when all N runs were visible
(polled), their created_at range (transaction start of each scheduling pass), and when
all had finished.

The schedule is the 6-field (leading seconds) daily cron of T itself, so the tick is
seconds away without waiting for a minute boundary and fires once.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from bench.context import Bench, one, register, wait_all_finished, wait_registered
from bench.stats import summary

TARGET_CREATE_S = 1.0
LEAD_S = 8

SPREAD_SQL = """
SELECT count(*) AS runs,
       extract(epoch FROM min(created_at) - %(t)s)::float8 AS first_created_s,
       extract(epoch FROM max(created_at) - %(t)s)::float8 AS last_created_s,
       extract(epoch FROM min(started_at) - %(t)s)::float8 AS first_started_s,
       extract(epoch FROM max(started_at) - %(t)s)::float8 AS last_started_s,
       extract(epoch FROM max(finished_at) - %(t)s)::float8 AS last_finished_s,
       count(*) FILTER (WHERE state = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE logical_time <> %(t)s) AS other_ticks
FROM pgflow.runs"""


def tick_in(conn: Any, lead_s: int) -> datetime:
    """The whole database second ``lead_s`` seconds from now: a tick jobs can be set to."""
    row = one(conn, "SELECT date_trunc('second', now()) + make_interval(secs => %s) AS t",
              (lead_s,))
    tick: datetime = row["t"]
    return tick


def _jobs(n: int, tick: datetime) -> list[dict[str, Any]]:
    schedule = f"{tick.second} {tick.minute} {tick.hour} * * *"
    return [{"name": f"fan_{i:05d}", "schedule": schedule, "timezone": "UTC",
             "entrypoint": "bench.jobs:noop"} for i in range(n)]


def _poll_created(conn: Any, n: int, timeout: float) -> float:
    """Database clock (epoch s) at the first poll that sees all ``n`` runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # The span of ids (two probes of the primary key) before the count (a scan of
        # every run): a count every 10 ms competed with the scheduler it times.
        if one(conn, "SELECT coalesce(max(id) - min(id) + 1, 0) AS span FROM pgflow.runs"
               )["span"] >= n:
            row = one(conn, "SELECT count(*) AS n,"
                            " extract(epoch FROM clock_timestamp())::float8 AS at"
                            " FROM pgflow.runs")
            if row["n"] >= n:
                return float(row["at"])
        time.sleep(0.01)
    raise TimeoutError(f"{n} runs not created within {timeout:g}s")


def measure(b: Bench, n: int, workers: int, concurrency: int) -> dict[str, Any]:
    b.fresh_database()
    with b.connect() as conn, \
            b.replicas("fanout-scheduler", roles=("scheduler",)) as leader, \
            b.replicas("fanout-worker", concurrency=concurrency, count=workers) as started:
        wait_registered(conn, leader + started)
        tick = tick_in(conn, LEAD_S)
        t0 = time.perf_counter()
        register(conn, _jobs(n, tick))
        register_s = time.perf_counter() - t0
        registered_before = one(conn, "SELECT now() < %s AS ok", (tick,))["ok"]
        visible_at = _poll_created(conn, n, timeout=LEAD_S + 60)
        wait_all_finished(conn, n, timeout=300, interval=0.1, alive=leader + started,
                          what="fan-out runs finished")
        spread = one(conn, SPREAD_SQL, {"t": tick})
        delays = _creation_delays(conn, tick)
    all_visible_s = visible_at - tick.timestamp()
    return {
        "jobs": n, "worker_replicas": workers, "concurrency": concurrency,
        "register_s": round(register_s, 3), "registered_before_tick": registered_before,
        "all_runs_visible_after_tick_s": round(all_visible_s, 3),
        **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in spread.items()},
        "created_after_tick_ms": summary(delays, 1),
        "finish_rate_per_s": round(n / spread["last_finished_s"], 1)
        if spread["last_finished_s"] else None,
        "target_create_s": TARGET_CREATE_S,
        "met": all_visible_s <= TARGET_CREATE_S and spread["runs"] == n,
        "method": "N jobs registered with one 6-field cron whose next tick T is ~8 s ahead; "
                  "1 scheduler replica + worker replicas already running; the database is "
                  "polled every 10 ms until all N runs are visible (clock_timestamp - T); "
                  "created_at is now() of each scheduling pass's transaction",
    }


def _creation_delays(conn: Any, tick: datetime) -> list[float]:
    rows = conn.execute("SELECT extract(epoch FROM created_at - %s)::float8 * 1000 AS ms"
                        " FROM pgflow.runs", (tick,)).fetchall()
    return [float(r["ms"]) for r in rows]

