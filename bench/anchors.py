"""The anchors (procrastinate, pgqueuer, a bare SQL queue) measured in the same run on
the same cluster, with the shared harness (``PGFLOW_ANCHORS_DIR``, default
``/work/shared/bench``). The harness writes logs next to itself, so it runs from a
temporary copy (its results and logs are kept under ``bench/results/logs/``).
``PGFLOW_ANCHORS_PYTHON`` picks its interpreter (default: ours, with the ``bench``
extra installed)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.cluster import Cluster

DEFAULT_DIR = "/work/shared/bench"
FILES = ("bench_anchors.py", "anchor_jobs.py")
MODULES = ("procrastinate", "pgqueuer", "asyncpg", "uvloop", "psycopg")
FULL_ARGS = ["--only", "pgqueuer,procrastinate,sqlref", "--ref-unbatched-conns", "1"]
QUICK_ARGS = ["--only", "pgqueuer,sqlref", "--n", "5000", "--n-lat", "60",
              "--n-single", "200", "--ref-unbatched-conns", "1"]
KEEP = ("system", "test", "config", "ok", "error", "jobs_per_s", "enqueue_batch_per_s",
        "enqueue_single_per_s", "worker_cpu_ms_per_job", "pg_cpu_ms_per_job", "p50_ms",
        "p95_ms", "p99_ms", "max_ms", "n", "received")


def anchors_dir() -> Path:
    return Path(os.environ.get("PGFLOW_ANCHORS_DIR", DEFAULT_DIR))


def _missing(python: str) -> list[str]:
    if python == sys.executable:
        return [m for m in MODULES if importlib.util.find_spec(m) is None]
    probe = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:]" \
            " if u.find_spec(m) is None))"
    done = subprocess.run([python, "-c", probe, *MODULES], capture_output=True, text=True)
    return done.stdout.split() if done.returncode == 0 else [f"python {python} unusable"]


def run(cluster: Cluster, logdir: Path, quick: bool, timeout_s: float = 900) -> dict[str, Any]:
    """Run the harness once (1 repetition); a summary, or why it could not run. Its
    results and logs end up in ``logdir``."""
    source = anchors_dir()
    if not all((source / f).exists() for f in FILES):
        return {"available": False, "reason": f"anchor harness not found in {source}"}
    python = os.environ.get("PGFLOW_ANCHORS_PYTHON", sys.executable)
    missing = _missing(python)
    if missing:
        return {"available": False, "reason": f"missing modules for the anchors: {missing}"
                " (pip install -e '.[bench]')"}
    logdir.mkdir(parents=True, exist_ok=True)
    out = logdir / "anchors.json"
    with tempfile.TemporaryDirectory(prefix="pgflow-anchors-") as work:
        for name in FILES:
            shutil.copy2(source / name, Path(work) / name)
        code = _run_harness(python, Path(work), out, quick, cluster, logdir, timeout_s)
        if (Path(work) / "results").exists():
            shutil.copytree(Path(work) / "results", logdir / "results", dirs_exist_ok=True)
    if not out.exists():
        return {"available": False, "reason": f"harness exited {code} without results"
                f" (see {logdir / 'harness.log'})"}
    return {"available": True, "exit_code": code, "source": str(source),
            "raw_file": str(out), **summarize(json.loads(out.read_text()))}


def _run_harness(python: str, work: Path, out: Path, quick: bool, cluster: Cluster,
                 logdir: Path, timeout_s: float) -> int:
    argv = [python, "bench_anchors.py", "run", "--reps", "1", "--out", str(out),
            *(QUICK_ARGS if quick else FULL_ARGS)]
    env = {**os.environ, "BENCH_PG_URL": cluster.server_url}
    with (logdir / "harness.log").open("w") as log:
        log.write(" ".join(argv) + "\n")
        log.flush()
        done = subprocess.run(argv, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
    return done.returncode


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    records = [{k: r[k] for k in KEEP if k in r} for r in doc.get("results", [])]
    throughput = [r for r in records if r["test"] == "throughput" and r["ok"]]
    pgq = [r for r in throughput if r["system"].startswith("pgqueuer")]
    batched = [r for r in throughput if r["system"] == "sqlref"
               and r["config"].startswith("batched")]
    return {
        "versions": doc.get("env", {}).get("packages", {}),
        "records": records,
        "pgqueuer_best": _best(pgq),
        "pgqueuer_best_by_procs": {p: _best([r for r in pgq if r["config"] == f"{p} proc"])
                                   for p in ("1", "2")},
        "procrastinate_best": _best([r for r in throughput
                                     if r["system"].startswith("procrastinate")]),
        "sqlref_batched_best": _best(batched),
        "latency": {r["system"]: {k: round(r[k], 2) for k in ("p50_ms", "p95_ms", "p99_ms")}
                    for r in records if r["test"] == "latency" and r["ok"]},
        "failures": [r for r in records if not r["ok"]],
    }


def _best(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not records:
        return None
    top = max(records, key=lambda r: r["jobs_per_s"])
    return {"system": top["system"], "config": top["config"],
            "jobs_per_s": round(top["jobs_per_s"], 1)}
