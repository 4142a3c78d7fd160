"""Dependencies between runs of one logical time (a DAG run).

- Creation: ``create_runs`` creates the runs of a whole DAG run at once (the
  requested jobs, the other roots of their DAG, and every job downstream as
  ``pending``), so the UI and SQL show the full DAG run from the start.
- Completion: ``finish_attempts`` locks the pending direct downstreams of runs
  that succeeded and ``queue_ready_runs`` (the next statement, fresh snapshot)
  queues those whose upstreams all succeeded. Two upstreams finishing at once
  serialise on the downstream's row lock; the second sees the first's commit.
- Failure: ``fail_downstreams`` marks the pending closure ``upstream_failed``; an
  operator retry of the failed run restores it (``restore_after_retry``).
"""

from __future__ import annotations

from typing import Any

import psycopg

from pgflow.queries import q


def restore_after_retry(conn: psycopg.Connection[Any], run_id: int) -> int:
    """Call in the retry's transaction: downstream runs that failed because of ``run_id``
    wait again; those that still have another failed upstream stay upstream_failed.
    Returns how many runs wait again."""
    row = conn.execute(q("restore_downstreams"), {"id": run_id}).fetchone()
    if row is None:
        return 0
    still_failed, restored = _values(row)
    if still_failed:
        conn.execute(q("fail_downstreams"), {"ids": still_failed})
    return int(restored)


def fail_downstreams(conn: psycopg.Connection[Any], run_ids: list[int]) -> int:
    """Call when runs end failed or cancelled outside a worker (operator cancel)."""
    return len(conn.execute(q("fail_downstreams"), {"ids": run_ids}).fetchall())


def failed_upstreams(conn: psycopg.Connection[Any], run_id: int) -> list[dict[str, Any]]:
    """The failed or cancelled upstream runs that hold ``run_id`` back (same logical time)."""
    cur = conn.execute(q("failed_upstreams"), {"id": run_id})
    return [dict(zip(("id", "job", "state"), _values(r), strict=True)) for r in cur.fetchall()]


def _values(row: Any) -> tuple[Any, ...]:
    return tuple(row.values()) if isinstance(row, dict) else tuple(row)
