"""Dataset triggers (issue 13): event -> consumer run start latency with an idle
replica, and a burst of 10,000 events consumed by the right number of runs.

* latency: one ``pgflow serve --role scheduler --role worker`` replica, idle; events of
  one dataset emitted one at a time (``pgflow.datasets.emit``: its own transaction,
  like ``pgflow emit`` or the API); the consumer's body (``bench.jobs:record_start``)
  writes ``time.time()`` when it starts; latency = start - time just before the emit.
  The path: emit commits -> NOTIFY wakes the leader -> its dataset pass creates the run
  and consumes the event in one transaction -> NOTIFY wakes the worker -> claim.
* burst, paused: 10,000 events emitted from 4 connections while the consumer is paused,
  then resumed: exactly one run must consume all of them (time from resume to that run
  succeeded).
* burst, live: 10,000 events from 4 connections while the consumer runs: its runs never
  overlap (a run waits for the previous one), every event is consumed by exactly one
  run, and the time from the last emit to every event consumed and every run finished.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from bench import procs
from bench.context import Bench, one, register, wait_registered
from bench.stats import summary
from pgflow import datasets, db, registry

BURST = 10_000
EMITTERS = 4
WARMUP = 3


def _starts(path: Path) -> list[float]:
    return [float(line.split()[1]) for line in path.read_text().splitlines() if line.strip()]


def _wait_leader(conn: Any) -> None:
    procs.wait_until(lambda: one(conn, "SELECT count(*) AS n FROM pgflow.leader"
                                       " WHERE heartbeat_at > now() - interval '5 seconds'")["n"],
                     timeout=60, what="a scheduling leader")


def _latency(conn: Any, path: Path, n: int) -> list[float]:
    """Emit ``n`` events one at a time, each after the previous run started (idle)."""
    latencies = []
    for i in range(WARMUP + n):
        seen = len(_starts(path))
        time.sleep(0.05)  # the replica is idle again
        before = time.time()
        datasets.emit(conn, "bench_lat")
        procs.wait_until(lambda seen=seen: len(_starts(path)) > seen, timeout=30,  # type: ignore[misc]
                         interval=0.001, what="dataset run started")
        if i >= WARMUP:
            latencies.append((_starts(path)[seen] - before) * 1000)
    return latencies


def _burst(url: str, dataset: str, total: int) -> float:
    """``total`` emits from ``EMITTERS`` connections at once; returns the wall time."""
    def emitter(count: int) -> None:
        with db.connect(url) as conn:
            for _ in range(count):
                datasets.emit(conn, dataset)

    share = [total // EMITTERS + (i < total % EMITTERS) for i in range(EMITTERS)]
    threads = [threading.Thread(target=emitter, args=(k,)) for k in share]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - t0


def _consumption(conn: Any, job: str) -> dict[str, Any]:
    return one(conn, """
        SELECT (SELECT count(*) FROM pgflow.runs WHERE job = %(job)s) AS runs,
               (SELECT count(*) FROM pgflow.runs WHERE job = %(job)s
                AND state NOT IN ('succeeded', 'failed', 'cancelled')) AS active,
               (SELECT count(*) FROM pgflow.dataset_deliveries WHERE job = %(job)s
                AND run_id IS NOT NULL) AS consumed,
               (SELECT count(DISTINCT event_id) FROM pgflow.dataset_deliveries
                WHERE job = %(job)s AND run_id IS NOT NULL) AS distinct_consumed,
               (SELECT count(*) FROM pgflow.dataset_deliveries WHERE job = %(job)s
                AND run_id IS NULL) AS waiting,
               (SELECT max(finished_at) FROM pgflow.runs WHERE job = %(job)s) AS last_finish,
               (SELECT count(*) FROM pgflow.runs a JOIN pgflow.runs b
                  ON a.job = b.job AND a.id < b.id AND b.started_at < a.finished_at
                WHERE a.job = %(job)s) AS overlapping""", {"job": job})


def _drained(conn: Any, job: str, events: int) -> bool:
    row = _consumption(conn, job)
    return bool(row["consumed"] == events and row["active"] == 0 and row["runs"] > 0)


def measure(b: Bench, n: int, burst: int = BURST) -> dict[str, Any]:
    url = b.fresh_database()
    path = b.logdir / "datasets.starts"
    path.write_text("")
    with b.connect() as conn:
        register(conn, [
            {"name": "ds_lat", "entrypoint": "bench.jobs:record_start",
             "trigger_on": ["bench_lat"]},
            {"name": "ds_paused", "entrypoint": "bench.jobs:noop", "trigger_on": ["burst_a"]},
            {"name": "ds_live", "entrypoint": "bench.jobs:noop", "trigger_on": ["burst_b"],
             "trigger_mode": "any"},
        ])
        registry.set_paused(conn, "ds_paused", True)
        with b.replicas("datasets", roles=("scheduler", "worker"), concurrency=16,
                        env={"BENCH_LAT_FILE": str(path)}) as started:
            wait_registered(conn, started)
            _wait_leader(conn)
            latencies = _latency(conn, path, n)

            paused_emit_s = _burst(url, "burst_a", burst)
            resumed = time.perf_counter()
            registry.set_paused(conn, "ds_paused", False)
            procs.wait_until(lambda: _drained(conn, "ds_paused", burst), timeout=120,
                             alive=started, what="paused burst consumed")
            resume_to_done_s = time.perf_counter() - resumed
            paused = _consumption(conn, "ds_paused")

            live_emit_s = _burst(url, "burst_b", burst)
            after_last = time.perf_counter()
            procs.wait_until(lambda: _drained(conn, "ds_live", burst), timeout=120,
                             alive=started, what="live burst consumed")
            live_drain_s = time.perf_counter() - after_last
            live = _consumption(conn, "ds_live")
    ms = summary(latencies)
    return {
        "latency": {"n": n, "ms": ms,
                    "method": "1 idle replica (scheduler + worker); an emit every time the"
                              " previous run started (+50 ms); start - time before emit"},
        "burst_paused": {
            "events": burst, "emitters": EMITTERS, "emit_wall_s": round(paused_emit_s, 2),
            "emits_per_s": round(burst / paused_emit_s),
            "runs": paused["runs"], "expected_runs": 1,
            "consumed": paused["consumed"], "distinct_consumed": paused["distinct_consumed"],
            "resume_to_run_finished_s": round(resume_to_done_s, 2)},
        "burst_live": {
            "events": burst, "emitters": EMITTERS, "emit_wall_s": round(live_emit_s, 2),
            "emits_per_s": round(burst / live_emit_s),
            "runs": live["runs"], "overlapping_runs": live["overlapping"],
            "consumed": live["consumed"], "distinct_consumed": live["distinct_consumed"],
            "last_emit_to_all_consumed_and_finished_s": round(live_drain_s, 2)},
        "exactly_once": (paused["runs"] == 1 and paused["distinct_consumed"] == burst
                         and live["distinct_consumed"] == live["consumed"] == burst
                         and live["overlapping"] == 0),
    }
