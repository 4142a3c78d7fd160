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
from psycopg.rows import dict_row

from pgflow.queries import q


def restore_after_retry(conn: psycopg.Connection[Any], run_id: int) -> int:
    """Call in the retry's transaction: downstream runs that failed because of ``run_id``
    wait again; those that still have another failed upstream stay upstream_failed.
    Returns how many runs wait again."""
    cur = conn.cursor(row_factory=dict_row)
    row = cur.execute(q("restore_downstreams"), {"id": run_id}).fetchone()
    if row is None or not row["restored"]:
        return 0
    failed_again = fail_downstreams(conn, row["still_failed"]) if row["still_failed"] else 0
    return int(row["restored"]) - failed_again


def fail_downstreams(conn: psycopg.Connection[Any], run_ids: list[int]) -> int:
    """Call when runs end failed or cancelled outside a worker (operator cancel)."""
    return len(conn.execute(q("fail_downstreams"), {"ids": run_ids}).fetchall())


def failed_upstreams(conn: psycopg.Connection[Any], run_id: int) -> list[dict[str, Any]]:
    """The failed or cancelled upstream runs that hold ``run_id`` back (same logical time)."""
    cur = conn.cursor(row_factory=dict_row)
    return cur.execute(q("failed_upstreams"), {"id": run_id}).fetchall()
