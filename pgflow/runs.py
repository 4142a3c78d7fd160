"""Operator actions on runs: trigger, list, show, retry, cancel, ack, dead letters.

Each state change is one UPDATE guarded by the states it may start from. When it
changes nothing (the run is in another state, or another operator or a worker got
there first) the run is read again so the refusal names its current state and
what to do instead. Functions take a sync dict-row connection; they open their
own transaction where they write more than one statement.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from pgflow import backfill, deps, handoff
from pgflow.errors import Conflict, InvalidInput, NotFound, PgflowError
from pgflow.queries import q

Conn = psycopg.Connection[dict[str, Any]]
Row = dict[str, Any]

RUN_STATES = ("pending", "queued", "running", "retrying", "succeeded", "failed", "cancelled",
              "upstream_failed")
ACTIVE_STATES = ("pending", "queued", "running", "retrying")
_MAX_ID = 2**63 - 1


# ---------------------------------------------------------------- trigger


def trigger(
    conn: Conn,
    job: str,
    logical_time: datetime | None = None,
    params: dict[str, Any] | None = None,
    *,
    downstream: bool = True,
) -> int:
    """Create a manual run of ``job`` and return its id.

    ``logical_time`` defaults to the database's now() truncated to the second;
    ``params`` are merged over the job's own. One run per (job, logical time):
    a second trigger for the same pair is refused. With ``downstream`` (the
    default) the run starts a DAG run: a root brings the other roots of its DAG,
    and every job downstream gets a pending run (queued at once when its upstreams
    already succeeded at that time, upstream_failed when one of them failed); a
    non-root job runs without waiting for its upstreams. ``downstream=False`` runs
    only this job. A refused trigger creates nothing.
    """
    if logical_time is not None and logical_time.tzinfo is None:
        logical_time = logical_time.replace(tzinfo=UTC)
    # A job without downstream jobs takes one plain INSERT: the trigger is on the
    # latency path. Others (and refusals) go through the DAG-run statement.
    params_json = None if params is None else Jsonb(params)
    plain = conn.execute(q("create_plain_run"), {
        "job": job, "logical_time": logical_time, "params": params_json,
        "only_lone": downstream, "handoff": handoff.may_hand_off(conn)}).fetchone()
    if plain is not None:
        return int(plain["id"])
    with conn.transaction():  # a refused trigger creates no downstream runs either
        rows = conn.execute(q("create_runs"), {
            "jobs": [job], "times": [logical_time], "trigger": "manual", "params": params_json,
            "downstream": downstream, "state": "queued", "priority_offset": 0,
            "backfill_id": None,
        }).fetchall()
        created = next((row for row in rows if row["job"] == job), None)
        if created is None:
            raise _trigger_refusal(conn, job, logical_time or _db_second(conn))
        # Downstream runs whose upstreams already ran at this time go ahead now.
        deps.settle(conn, [row["id"] for row in rows if row["state"] == "pending"],
                    fresh=[row["id"] for row in rows])
    return int(created["id"])


def _db_second(conn: Conn) -> datetime:
    row = conn.execute(q("run_db_second"), {"now": None}).fetchone()
    assert row is not None
    now: datetime = row["now"]
    return now


def _trigger_refusal(conn: Conn, job: str, when: datetime) -> PgflowError:
    existing = conn.execute(q("run_by_logical_time"), {"job": job, "logical_time": when}).fetchone()
    if existing is None:
        return NotFound(unknown_job_message(conn, job))
    run_id = existing["id"]
    return Conflict(
        f"job {job!r} already has run {run_id} for logical time {iso_utc(when)};"
        f" pass a different --logical-time or retry run {run_id}"
    )


def unknown_job_message(conn: Conn, job: str) -> str:
    names = [row["name"] for row in conn.execute(q("run_job_names"))]
    close = difflib.get_close_matches(job, names, n=1)
    hint = f", did you mean {close[0]!r}?" if close else " (see 'pgflow jobs list')"
    return f"no job named {job!r}{hint}"


def iso_utc(value: datetime) -> str:
    return value.astimezone(UTC).isoformat()


# ---------------------------------------------------------------- reading


def list_runs(
    conn: Conn,
    job: str | None = None,
    state: str | None = None,
    tenant: str | None = None,
    limit: int = 100,
    before_id: int | None = None,
    *,
    trigger: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> list[Row]:
    """Runs newest first, optionally filtered (logical time in [since, until));
    ``before_id`` pages (ids below it)."""
    if state is not None:
        check_state(state)
    if limit < 1:
        raise InvalidInput(f"limit must be at least 1, got {limit}")
    query = "runs_list_by_job" if job is not None else (
        "runs_list_by_state" if state is not None else "runs_list_all")
    args = {"job": job, "state": state, "tenant": tenant, "trigger": trigger, "since": since,
            "until": until, "limit": limit,
            "before_id": None if before_id is None else min(max(before_id, 0), _MAX_ID)}
    return conn.execute(q(query), args).fetchall()


# A page of runs with a filter its index does not cover reads at most this many index
# entries (runs_floor); with 10,000,000 runs, a tenant's runs newest first read the
# whole history (5 s) before this bound.
RUNS_SCAN = 20_000


def page_runs(conn: Conn, *, limit: int, before: int | None = None, job: str | None = None,
              state: str | None = None, tenant: str | None = None,
              trigger: str | None = None, since: Any = None,
              until: Any = None) -> tuple[list[dict[str, Any]], int | None]:
    """Runs newest first below ``before`` and the cursor of the next page (None: no more).
    A page may hold fewer than ``limit`` runs and still have a next page: when its
    filters are not all served by one index, it looks at RUNS_SCAN runs at most."""
    args = {"job": job, "state": state, "tenant": tenant, "trigger": trigger,
            "since": since, "until": until, "scan": RUNS_SCAN,
            "before_id": _MAX_ID if before is None else min(max(before, 0), _MAX_ID)}
    residual = any(v is not None for v in (tenant, trigger, since, until)) or (
        job is not None and state is not None)
    floor = None
    if residual:
        row = conn.execute(q("runs_floor"), args).fetchone()
        floor = None if row is None else row["floor"]
    page = "runs_page" if job is None else "runs_page_of_job"
    rows = conn.execute(q(page), {**args, "floor": floor, "limit": limit + 1}).fetchall()
    if len(rows) > limit:
        return rows[:limit], int(rows[limit - 1]["id"])
    return rows, None if floor is None else int(floor) + 1


def check_state(state: str) -> None:
    if state in RUN_STATES:
        return
    close = difflib.get_close_matches(state, RUN_STATES, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise InvalidInput(f"unknown run state {state!r}; {hint}valid states: {', '.join(RUN_STATES)}")


def show_run(conn: Conn, run_id: int) -> Row:
    """One run with its attempts; the attempt in progress has no outcome yet."""
    run = _get(conn, run_id)
    run["attempts"] = conn.execute(q("run_attempts"), {"id": run_id}).fetchall()
    return run


def dead_letters(conn: Conn, limit: int = 100) -> list[Row]:
    """Failed runs nobody has acknowledged yet, newest first, with their last error."""
    if limit < 1:
        raise InvalidInput(f"limit must be at least 1, got {limit}")
    return conn.execute(q("runs_dead_letters"), {"limit": limit}).fetchall()


def _get(conn: Conn, run_id: int) -> Row:
    _check_id(run_id)
    row = conn.execute(q("run_get"), {"id": run_id}).fetchone()
    if row is None:
        raise _no_run(run_id)
    return row


def _check_id(run_id: int) -> None:
    if not 0 < run_id <= _MAX_ID:
        raise _no_run(run_id)


def _no_run(run_id: int) -> NotFound:
    return NotFound(f"no run {run_id} (see 'pgflow runs list')")


# ---------------------------------------------------------------- actions


def retry_message(run_id: int, retried: Row) -> str:
    """What an operator is told about a retry: queued now, or waiting for upstreams."""
    if retried.get("state") == "pending":
        return f"run {run_id} retried: it waits for its upstream runs (pending)"
    return f"run {run_id} queued for retry"


def retry(conn: Conn, run_id: int) -> Row:
    """Run a failed or cancelled run again with a fresh attempt budget.

    A run without upstream runs at its logical time is queued. Another goes back to
    ``pending`` and is queued once they have all succeeded (at once if they have); a
    retry is refused while one of them is failed or cancelled (retry that one). The
    runs that were upstream_failed because of this one wait for it again.
    """
    _check_id(run_id)
    with conn.transaction():
        changed = conn.execute(q("run_retry"), {"id": run_id, "now": None}).fetchone()
        if changed is not None:
            if changed["state"] == "pending":
                changed["state"] = settle_going_again(conn, run_id)
            deps.restore_after_retry(conn, run_id)
            if changed["state"] == "queued":
                conn.execute(q("notify_queue"))
    if changed is None:
        raise _retry_refusal(conn, _get(conn, run_id))
    return changed


def settle_going_again(conn: Conn, run_id: int) -> str:
    """Queue a retried or re-run run, or leave it pending behind its upstream runs; one
    with a failed upstream is refused (raised inside the caller's transaction)."""
    settled = deps.settle(conn, [run_id])
    if run_id in settled.doomed:  # raised inside the transaction: nothing changes
        blockers = deps.failed_upstreams(conn, run_id)
        named = ", ".join(f"run {b['id']} ({b['job']}, {b['state']})" for b in blockers)
        raise Conflict(f"run {run_id} cannot run while its upstream {named or 'runs'}"
                       f" {'has' if len(blockers) == 1 else 'have'} not succeeded:"
                       f" retry {'that run' if len(blockers) == 1 else 'those runs'} first")
    return "queued" if run_id in settled.queued else "pending"


def _retry_refusal(conn: Conn, run: Row) -> PgflowError:
    rid, state = run["id"], run["state"]
    if state == "upstream_failed":
        blockers = deps.failed_upstreams(conn, rid)
        named = ", ".join(f"run {b['id']} ({b['job']}, {b['state']})" for b in blockers)
        return Conflict(f"run {rid} is upstream_failed because of {named or 'its upstreams'}:"
                        f" retry {'that run' if len(blockers) == 1 else 'those runs'} instead")
    if state in ("failed", "cancelled"):
        return Conflict(f"run {rid}'s job {run['job']!r} no longer exists; register it again"
                        f" (pgflow apply) before retrying run {rid}")
    reasons = {
        "running": f"run {rid} is running; cancel it first",
        "succeeded": f"run {rid} succeeded; use 'pgflow trigger' for a new run",
    }
    return Conflict(reasons.get(state, f"run {rid} is already {state}; nothing to retry"))


def cancel(conn: Conn, run_id: int) -> Row:
    """Cancel a run that has not finished.

    An unstarted run becomes ``cancelled`` at once. A running one is flagged
    ``cancel_requested`` and its worker is told on ``pgflow_cancel``; the worker
    (or the reaper) records the final state. The result's ``outcome`` is
    ``cancelled`` or ``cancel requested``.
    """
    _check_id(run_id)
    with conn.transaction():
        changed = conn.execute(q("run_cancel"), {"id": run_id, "now": None}).fetchone()
        if changed is not None and changed["state"] == "cancelled":
            settled = deps.fail_downstreams(conn, [run_id])
            backfill.complete(conn, settled.backfills | {changed["backfill_id"]} - {None})
    if changed is None:
        raise _cancel_refusal(_get(conn, run_id))
    requested = changed["state"] == "running"
    return {**changed, "outcome": "cancel requested" if requested else "cancelled"}


def _cancel_refusal(run: Row) -> PgflowError:
    rid, state = run["id"], run["state"]
    reasons = {
        "succeeded": f"run {rid} already succeeded; nothing to cancel",
        "cancelled": f"run {rid} is already cancelled",
        "failed": (f"run {rid} already failed; nothing to cancel"
                   f" (acknowledge it with 'pgflow runs ack {rid}')"),
    }
    return Conflict(reasons.get(state, f"run {rid} is {state} (finished); nothing to cancel"))


def ack(conn: Conn, run_id: int) -> Row:
    """Acknowledge a failed run: it leaves the dead-letter view."""
    _check_id(run_id)
    changed = conn.execute(q("run_ack"), {"id": run_id, "now": None}).fetchone()
    if changed is None:
        raise _ack_refusal(_get(conn, run_id))
    return changed


def _ack_refusal(run: Row) -> PgflowError:
    rid, state = run["id"], run["state"]
    if state == "failed":
        return Conflict(f"run {rid} was already acknowledged at {iso_utc(run['acked_at'])}")
    return Conflict(f"run {rid} is {state}; only failed runs can be acknowledged")


# ---------------------------------------------------------------- bulk history loads


@contextmanager
def keys_inserted_after(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Runs inserted inside get their keys (pgflow.run_keys) from one INSERT … SELECT at
    the end instead of one trigger call each: for tools that load synthetic history
    (benchmarks, plan tests), 2 to 3 times faster. Their pairs must be new (a repeated
    pair fails the load instead of being skipped). The load is a transaction of its own
    (a savepoint inside the caller's): the trigger is off only inside it, and back if
    the load fails; runs stays locked (ALTER TABLE) until the outer commit. The table's
    owner only."""
    with conn.transaction():
        conn.execute(q("bulk_runs_begin"))
        last = conn.cursor(row_factory=tuple_row).execute(q("bulk_runs_last_id")).fetchone()
        yield
        conn.execute(q("bulk_runs_keys"), {"after": last[0] if last else 0})
        conn.execute(q("bulk_runs_end"))
