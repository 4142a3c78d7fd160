"""Re-runs: a finished run runs again as its next attempt (SPEC §4e).

``runs retry`` is for failures and keeps the checkpoint (the retry resumes). A
re-run is for a run whose work must be done again (the data changed, the code was
fixed): any finished run, succeeded included, starts clean — no checkpoint, no
progress, a fresh attempt budget. With ``downstream`` its downstream runs at the
same logical time (transitively) go back to ``pending`` and run after it, through
the ordinary dependency rule (pgflow/deps.py).

Concurrency. Everything happens in one transaction: the run's UPDATE is guarded by
the finished states (a second re-run, a retry or a claim cannot slip in: a
finished run is never claimed, and whichever UPDATE commits first wins), the
downstream runs are locked in id order before their states are looked at, and
their UPDATE is guarded the same way; its row count must match, or nothing
changes. A downstream that is queued, retrying or running refuses the whole
re-run (re-running its upstream under it would race it); a pending one stays
pending (it will wait for the re-run). Runs made pending are settled in the same
transaction (``deps.settle``), so none waits for an upstream that already ended.
"""

from __future__ import annotations

from typing import Any

import psycopg

from pgflow import deps, runs
from pgflow.errors import Conflict, NotFound
from pgflow.queries import q

FINISHED = ("succeeded", "failed", "cancelled", "upstream_failed")
ACTIVE = ("queued", "retrying", "running")
REPROCESS = {"none": (), "failed": ("failed", "cancelled", "upstream_failed"), "all": FINISHED}

Row = dict[str, Any]


def rerun(conn: psycopg.Connection[Any], run_id: int, *, downstream: bool = False) -> Row:
    """Run the finished run ``run_id`` again; returns it (``state`` queued or pending)
    with ``downstream``: the ids of the downstream runs made pending."""
    if not 0 < run_id < 2**63:
        raise NotFound(f"no run {run_id} (see 'pgflow runs list')")
    with conn.transaction():
        changed = conn.execute(q("run_rerun"), {"id": run_id}).fetchone()
        if changed is None:
            raise _refusal(conn, run_id)
        changed = dict(changed)
        pended: list[int] = []
        if downstream:
            pended = pend_downstream(conn, [run_id], None)
        if changed["state"] == "pending":
            changed["state"] = runs.settle_going_again(conn, run_id)
        if pended:
            deps.settle(conn, pended)
        elif not downstream:
            deps.restore_after_retry(conn, run_id)  # its upstream_failed runs wait again
        if changed["state"] == "queued":
            conn.execute(q("notify_queue"))
    changed["downstream"] = pended
    return changed


def pend_downstream(conn: psycopg.Connection[Any], ids: list[int],
                    backfill_id: int | None) -> list[int]:
    """Make the finished downstream runs of ``ids`` pending again (inside the caller's
    transaction); Conflict if one of them is active."""
    closure = conn.execute(q("rerun_downstream_closure"), {"ids": ids}).fetchall()
    busy = [r for r in closure if r["state"] in ACTIVE]
    if busy:
        named = ", ".join(f"run {r['id']} ({r['job']}, {r['state']})" for r in busy[:5])
        raise Conflict(f"downstream {named} {'is' if len(busy) == 1 else 'are'} active:"
                       " wait for it to finish or cancel it, then re-run")
    finished = [r["id"] for r in closure if r["state"] in FINISHED]
    if not finished:
        return []
    done = conn.execute(q("rerun_pend_runs"), {"ids": finished, "backfill_id": backfill_id}
                        ).fetchall()
    if len(done) != len(finished):
        missing = sorted(set(finished) - {r["id"] for r in done})
        raise Conflict(f"downstream run(s) {', '.join(map(str, missing))} changed meanwhile or"
                       " their job no longer exists; nothing was re-run")
    return finished


def _refusal(conn: psycopg.Connection[Any], run_id: int) -> Exception:
    row = conn.execute("SELECT r.id, r.job, r.state, j.name IS NOT NULL AS job_exists"
                       " FROM pgflow.runs r LEFT JOIN pgflow.jobs j ON j.name = r.job"
                       " WHERE r.id = %s", (run_id,)).fetchone()
    if row is None:
        return NotFound(f"no run {run_id} (see 'pgflow runs list')")
    if row["state"] in FINISHED:
        return Conflict(f"run {run_id}'s job {row['job']!r} no longer exists; register it"
                        " again (pgflow apply) before re-running it")
    hint = "cancel it first" if row["state"] == "running" else "it will run anyway"
    return Conflict(f"run {run_id} is {row['state']} (active): only a finished run can be"
                    f" re-run; {hint}")


def rerun_message(run_id: int, row: Row) -> str:
    waits = " (it waits for its upstream runs)" if row["state"] == "pending" else ""
    down = row.get("downstream") or []
    tail = f"; {len(down)} downstream run(s) will run after it" if down else ""
    return f"run {run_id} will run again as attempt {row['attempt'] + 1}{waits}{tail}"
