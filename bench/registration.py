"""Figure 1: registering 10,000 jobs with dependencies from one TOML file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.context import Bench, count_runs, one

TARGET_S = 5.0


def write_toml(path: Path, roots: int, children: int) -> int:
    """``roots`` scheduled roots, each with ``children`` dependent jobs; returns the count."""
    lines = []
    for r in range(roots):
        root = f"root_{r:05d}"
        lines += [f"[jobs.{root}]", 'schedule = "0 3 * * *"',
                  'entrypoint = "bench.jobs:noop"', ""]
        for c in range(children):
            lines += [f"[jobs.{root}_child_{c}]", f'depends_on = ["{root}"]',
                      'entrypoint = "bench.jobs:noop"', ""]
    path.write_text("\n".join(lines))
    return roots * (1 + children)


def _cli_seconds(b: Bench, *args: str) -> tuple[float, dict[str, Any]]:
    argv = [sys.executable, "-m", "pgflow", *args]
    env = {**os.environ, "PGFLOW_DATABASE_URL": b.url}
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=b.project, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"pgflow {' '.join(args)}: {done.stderr.strip()}")
    output = json.loads(done.stdout) if "--json" in args else {}
    return seconds, output


def measure(b: Bench) -> dict[str, Any]:
    roots, children = 2000, 4
    b.fresh_database()
    path = b.logdir / "registration.toml"
    total = write_toml(path, roots, children)
    startup_s, _ = _cli_seconds(b, "--version")
    first_s, first = _cli_seconds(b, "apply", str(path), "--json")
    again_s, again = _cli_seconds(b, "apply", str(path), "--json")
    with b.connect() as conn:
        jobs = one(conn, "SELECT count(*) AS n FROM pgflow.jobs")["n"]
        deps = one(conn, "SELECT count(*) AS n FROM pgflow.job_deps")["n"]
        runs = count_runs(conn, ("pending", "queued"))
    return {
        "jobs": total, "roots": roots, "children_per_root": children,
        "registered_jobs": jobs, "registered_deps": deps, "runs_created": runs,
        "apply_wall_s": round(first_s, 3), "apply_counts": _counts(first),
        "reapply_unchanged_wall_s": round(again_s, 3), "reapply_counts": _counts(again),
        "cli_startup_wall_s": round(startup_s, 3),
        "target_s": TARGET_S, "met": first_s < TARGET_S and jobs == total,
        "method": "wall time of `python -m pgflow apply FILE --json` (a new process: "
                  "interpreter start, TOML parse, validation, writes) on a migrated, empty "
                  "database; then the same file again (all unchanged)",
    }


def _counts(output: dict[str, Any]) -> dict[str, int]:
    return {k: output[k] for k in ("created", "updated", "unchanged") if k in output}
