"""``python -m bench.run [--quick] [--only a,b] [--skip-anchors]``: measure everything,
print one JSON document on stdout (also saved as ``bench/results/run-<ts>.json``) and a
short summary on stderr. See ``bench/__init__.py``."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import (
    anchors,
    backfill,
    claim,
    cli,
    commands,
    datasets,
    deps,
    fanout,
    history,
    latency,
    memory,
    policies,
    registration,
    seeds,
    throughput,
    web,
)
from bench.cluster import open_cluster
from bench.context import Bench
from bench.report import compare, summary_lines, targets

PROJECT = Path(__file__).resolve().parent.parent
RESULTS = PROJECT / "bench" / "results"
FIGURES = ("registration", "throughput", "latency", "fanout", "memory", "claim", "deps",
           "backfill", "web", "commands", "history", "policies", "datasets", "cli", "seeds")


@dataclass(frozen=True)
class Plan:
    """Sizes of every figure; ``QUICK`` is the ~2-minute subset."""

    tp_n: int = 20_000
    tp_replicas: list[int] = field(default_factory=lambda: [1, 2])
    tp_concurrency: list[int] = field(default_factory=lambda: [100, 500])
    lat_n: int = 200
    lat_rate: float = 20.0
    fan_jobs: int = 10_000
    fan_workers: int = 2
    fan_concurrency: int = 500
    mem_runs: int = 1000
    mem_sleep_s: float = 10.0
    mem_kinds: list[str] = field(default_factory=lambda: ["async", "sync"])
    claim_finished: int = 1_000_000
    chain: int = 100
    chain_runs: int = 3
    fan_width: int = 1000
    deps_workers: int = 2
    deps_concurrency: int = 500
    bf_window_s: float = 15.0
    bf_cap: int = 4
    bf_concurrency: int = 8
    cmd_jobs: int = 2000
    seed_jobs: int = 10_000
    seed_replicas: list[int] = field(default_factory=lambda: [1, 2])
    seed_concurrency: list[int] = field(default_factory=lambda: [64, 500])
    ds_lat_n: int = 200


QUICK = Plan(tp_n=5000, tp_concurrency=[500], lat_n=60, fan_jobs=2000, mem_sleep_s=3.0,
             mem_kinds=["async"], claim_finished=100_000, chain=30, chain_runs=1,
             fan_width=200, bf_window_s=5.0, cmd_jobs=500, ds_lat_n=50,
             seed_replicas=[2], seed_concurrency=[64, 500])


def figure_functions(b: Bench, p: Plan) -> dict[str, Callable[[], dict[str, Any]]]:
    return {
        "registration": lambda: registration.measure(b),
        "throughput": lambda: throughput.measure(b, p.tp_n, p.tp_replicas, p.tp_concurrency),
        "latency": lambda: latency.measure(b, p.lat_n, p.lat_rate),
        "fanout": lambda: fanout.measure(b, p.fan_jobs, p.fan_workers, p.fan_concurrency),
        "memory": lambda: memory.measure(b, p.mem_runs, p.mem_sleep_s, p.mem_kinds),
        "claim": lambda: claim.measure(b, p.claim_finished),
        "deps": lambda: deps.measure(b, p.chain, p.chain_runs, p.fan_width, p.deps_workers,
                                     p.deps_concurrency),
        "backfill": lambda: backfill.measure(b, p.bf_window_s, p.bf_cap, p.bf_concurrency),
        "web": lambda: web.measure(b),
        "commands": lambda: commands.measure(b, p.cmd_jobs),
        # Sized by BENCH_DAY_RUNS, BENCH_DAY_RATE, BENCH_HISTORY_MAX (see bench/history.py).
        "history": lambda: history.measure(b),
        "policies": lambda: policies.measure(b, p.tp_n, p.tp_concurrency[-1]),
        "seeds": lambda: seeds.measure(b, p.seed_jobs, p.seed_replicas, p.seed_concurrency),
        "cli": lambda: cli.measure(b, calls=5 if b.quick else 11),
        "datasets": lambda: datasets.measure(b, p.ds_lat_n),
    }


def _timed(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    print(f"bench: {name} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        result = {"ok": True, **fn()}
    except Exception as exc:  # recorded; the other figures still run
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]}
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(f"bench: {name} {'done' if result['ok'] else 'FAILED'} in {result['elapsed_s']} s",
          file=sys.stderr, flush=True)
    return result


def environment(b: Bench) -> dict[str, Any]:
    from pgflow import __version__

    cpu = "?"
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), cpu)
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpu_model": cpu, "cpus": os.cpu_count(), "pgflow": __version__,
            "pg_url": b.cluster.server_url, "pg_settings": b.cluster.settings(),
            "cluster_started_here": b.cluster.control is not None,
            "loadavg_at_start": _loadavg()}


def _loadavg() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="~2-minute subset")
    ap.add_argument("--only", help=f"comma list of: anchors,{','.join(FIGURES)}")
    ap.add_argument("--skip-anchors", action="store_true")
    ap.add_argument("--keep-cluster", action="store_true",
                    help="leave a cluster started by this run running")
    ap.add_argument("--out", type=Path, help="results file (default bench/results/run-<ts>.json)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or RESULTS / f"run-{stamp}.json"
    logdir = RESULTS / "logs" / stamp
    logdir.mkdir(parents=True, exist_ok=True)
    chosen = set(args.only.split(",")) if args.only else {"anchors", *FIGURES}
    if args.skip_anchors:
        chosen.discard("anchors")
    cluster = open_cluster(anchors.anchors_dir())
    b = Bench(cluster, PROJECT, logdir, args.quick)
    doc: dict[str, Any] = {"started": stamp, "mode": "quick" if args.quick else "full",
                           "env": environment(b), "anchors": None, "figures": {}}

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, default=str))

    try:
        if "anchors" in chosen:
            doc["anchors"] = _timed("anchors", lambda: anchors.run(
                cluster, logdir / "anchors", args.quick))
            save()
        for name, fn in figure_functions(b, QUICK if args.quick else Plan()).items():
            if name in chosen:
                doc["figures"][name] = _timed(name, fn)
                save()
    finally:
        if not args.keep_cluster:
            cluster.stop()
    doc["comparison"] = compare(doc)
    doc["targets"] = targets(doc)
    doc["finished"] = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    doc["env"]["loadavg_at_end"] = _loadavg()
    doc["results_file"] = str(out)
    save()
    print(json.dumps(doc, indent=1, default=str))
    print("\n".join(summary_lines(doc)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
