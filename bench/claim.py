"""Figure 6: the claim query's cost with 0 vs 1,000,000 finished runs in the table.

``EXPLAIN (ANALYZE, BUFFERS)`` of the worker's own ``claim_runs`` (limit 100) over
1,000 queued runs, inside a transaction that is rolled back, several times. As
finished history grows, the fastest planning + execution time must stay within 2x
and the scan of the claimable (partial) index must touch the same blocks; the
UPDATE's own index writes are reported per plan node. Both states are ANALYZEd
(what autovacuum would have done).
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any

import psycopg

from bench.context import Bench, enqueue, one, register
from pgflow import runs
from pgflow.queries import q

FILL_SQL = """
INSERT INTO pgflow.runs (job, logical_time, state, attempt, max_attempts, trigger, tenant,
                         created_at, started_at, finished_at, available_at)
SELECT 'noop', timestamptz '1990-01-01' + make_interval(secs => i), 'succeeded', 1, 3,
       'schedule', 'default', t, t, t, t
FROM generate_series(1, %(n)s) AS i,
     LATERAL (SELECT timestamptz '2020-01-01' + make_interval(secs => i) AS t) AS ts"""


CLAIM_INDEX = "runs_claimable_idx"


def claim_params(sql: str, limit: int) -> dict[str, Any]:
    """Values for the claim query's named parameters (unknown ones get NULL)."""
    known = {"worker": "bench-explain", "limit": limit, "ttl": 30.0}
    return {name: known.get(name) for name in re.findall(r"%\((\w+)\)[sb]", sql)}


def _explain_once(conn: Any, limit: int) -> dict[str, Any]:
    params = claim_params(q("claim_runs"), limit)
    with conn.transaction():
        row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + q("claim_runs"),
                           params).fetchone()
        raise psycopg.Rollback()  # the claim really updated rows: undo it
    plan: dict[str, Any] = row["QUERY PLAN"][0]
    return plan


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = [node]
    for child in node.get("Plans", []):
        found += _nodes(child)
    return found


def _label(node: dict[str, Any]) -> str:
    where = node.get("Index Name") or node.get("Relation Name") or node.get("CTE Name")
    return str(node["Node Type"]) + (f" ({where})" if where else "")


def _self_blocks(node: dict[str, Any]) -> dict[str, int]:
    """Shared blocks hit by each table or index access itself (EXPLAIN counts include
    children); the ModifyTable entry is the UPDATE's own writes (heap and index entries)."""
    found: dict[str, int] = {}
    own = node.get("Shared Hit Blocks", 0) - sum(c.get("Shared Hit Blocks", 0)
                                                 for c in node.get("Plans", []))
    if own > 0 and ("Relation Name" in node or "Index Name" in node):
        found[_label(node)] = own
    for child in node.get("Plans", []):
        for label, blocks in _self_blocks(child).items():
            found[label] = found.get(label, 0) + blocks
    return found


def _claimable_scan_blocks(root: dict[str, Any]) -> int | None:
    scans = [n for n in _nodes(root) if n.get("Index Name") == CLAIM_INDEX]
    return scans[0].get("Shared Hit Blocks") if scans else None


def explain(conn: Any, limit: int, reps: int) -> dict[str, Any]:
    plans = [_explain_once(conn, limit) for _ in range(reps)]
    top = plans[-1]["Plan"]
    total = [p["Planning Time"] + p["Execution Time"] for p in plans]
    return {
        "planning_ms": round(statistics.median(p["Planning Time"] for p in plans), 3),
        "execution_ms": round(statistics.median(p["Execution Time"] for p in plans), 3),
        "total_ms_median": round(statistics.median(total), 3),
        "total_ms_min": round(min(total), 3),
        "shared_hit_blocks": top.get("Shared Hit Blocks"),
        "shared_read_blocks": top.get("Shared Read Blocks"),
        "claimable_scan_blocks": _claimable_scan_blocks(top),
        "blocks_by_node": _self_blocks(top),
        "rows_claimed": top.get("Actual Rows"),
        "plan_nodes": sorted({_label(n) for n in _nodes(top)}),
        "reps": reps,
    }


def measure(b: Bench, finished: int, queued: int = 1000, reps: int = 7) -> dict[str, Any]:
    b.fresh_database()
    with b.connect() as conn:
        register(conn, [{"name": "noop", "entrypoint": "bench.jobs:noop"}])
        enqueue(conn, "noop", queued)
        conn.execute("ANALYZE pgflow.runs")
        empty = explain(conn, 100, reps)
        t0 = time.perf_counter()
        with runs.keys_inserted_after(conn):
            conn.execute(FILL_SQL, {"n": finished})
        fill_s = time.perf_counter() - t0
        conn.execute("VACUUM ANALYZE pgflow.runs")
        full = explain(conn, 100, reps)
        size = one(conn, "SELECT pg_size_pretty(pg_total_relation_size('pgflow.runs')) AS s")
    ratio = full["total_ms_min"] / max(empty["total_ms_min"], 1e-3)
    scan0, scan1 = empty["claimable_scan_blocks"], full["claimable_scan_blocks"]
    return {
        "queued_runs": queued, "limit": 100,
        "with_0_finished": empty, f"with_{finished}_finished": full,
        "finished_rows": finished, "fill_s": round(fill_s, 1), "runs_table_size": size["s"],
        "time_ratio": round(ratio, 2),
        "flat": ratio < 2.0 and scan0 is not None and scan1 is not None
        and scan1 <= 2 * scan0 + 10,
        "flat_rule": "min(planning + execution) grows < 2x and the scan of the claimable "
                     "index touches about the same blocks",
        "method": "EXPLAIN (ANALYZE, BUFFERS) of q('claim_runs') limit 100 in a rolled-back "
                  "transaction, median and min of reps; finished runs inserted with "
                  "generate_series, then VACUUM ANALYZE",
    }
