"""Figure 3: enqueue-to-start latency with an idle worker, the anchors' method: runs
triggered one at a time (``pgflow.runs.trigger``) at a fixed rate; the job body
writes ``time.time()`` when it starts; latency = start - time just before the call."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench import procs
from bench.context import EPOCH, Bench, register, wait_registered
from bench.stats import summary
from pgflow import runs

LAT_JOB = {"name": "lat", "entrypoint": "bench.jobs:record_start"}
TARGET_P50_MS = 3.0
TARGET_P99_MS = 5.0
WARMUP = 5


def _starts(path: Path) -> dict[int, float]:
    found = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value:
            found[int(key)] = float(value)
    return found


def _wait_started(path: Path, run_ids: set[int], timeout: float) -> None:
    procs.wait_until(lambda: run_ids <= _starts(path).keys(), timeout=timeout,
                     what="latency runs started")


def _trigger_paced(conn: Any, n: int, rate: float) -> dict[int, tuple[float, float]]:
    """Trigger ``n`` runs at ``rate``/s; run id -> (time before call, time after)."""
    submits = {}
    t0 = time.time() + 0.05
    for i in range(n):
        delay = t0 + i / rate - time.time()
        if delay > 0:
            time.sleep(delay)
        before = time.time()
        run_id = runs.trigger(conn, "lat", EPOCH + timedelta(seconds=WARMUP + i))
        submits[run_id] = (before, time.time())
    return submits


def measure(b: Bench, n: int, rate: float, concurrency: int = 16) -> dict[str, Any]:
    b.fresh_database()
    path = b.logdir / "latency.starts"
    path.write_text("")
    with b.connect() as conn:
        register(conn, [LAT_JOB])
        with b.replicas("latency", concurrency=concurrency,
                        env={"BENCH_LAT_FILE": str(path)}) as started:
            wait_registered(conn, started)
            warm = {runs.trigger(conn, "lat", EPOCH + timedelta(seconds=i))
                    for i in range(WARMUP)}
            _wait_started(path, warm, timeout=30)
            time.sleep(1.0)  # idle worker
            submits = _trigger_paced(conn, n, rate)
            _wait_started(path, set(submits), timeout=30)
    starts = _starts(path)
    from_call = [(starts[k] - s[0]) * 1000 for k, s in submits.items()]
    from_commit = [(starts[k] - s[1]) * 1000 for k, s in submits.items()]
    trigger_ms = [(s[1] - s[0]) * 1000 for s in submits.values()]
    result = summary(from_call)
    return {
        "n": n, "rate_per_s": rate, "received": len(from_call),
        "ms": result, "from_commit_ms": summary(from_commit),
        "trigger_call_ms": summary(trigger_ms),
        "targets": {"p50_ms": TARGET_P50_MS, "p99_ms": TARGET_P99_MS},
        "met": (result["p50"] or 1e9) <= TARGET_P50_MS and (result["p99"] or 1e9)
        <= TARGET_P99_MS,
        "method": "1 idle `pgflow serve --role worker` replica; 5 warm-up runs, 1 s idle, "
                  "then pgflow.runs.trigger() one at a time (own transaction + NOTIFY); "
                  "latency = job body's time.time() - time.time() before the call",
    }
