"""Datasets and triggers: events recorded by producers, consumed exactly once by runs.

Design note
===========

Ledger. ``pgflow.dataset_events`` holds one row per event: a succeeded run of a
job with ``produces`` (one per dataset, recorded by ``finish_attempts`` in the
statement that marks the run succeeded), or an outside ``emit`` (CLI, API). An
emit with a ``key`` is idempotent through ``UNIQUE (dataset, key)``.

Deliveries, not a time window. The statement that records an event also writes
one row of ``pgflow.dataset_deliveries`` per job whose ``trigger_on`` names the
dataset at that moment: the event *waits* for that job (``run_id IS NULL``). A
consumer therefore sees the events recorded from its registration on, and a
paused job keeps its rows. Consuming is setting ``run_id`` on the job's waiting
rows, in the transaction that creates the run; the primary key ``(job,
event_id)`` makes "an event is consumed by at most one run of each job" a
constraint, and the row that stays until then makes it "at least one".

Why not a cursor over event ids: ids are handed out when an INSERT runs, not when
it commits, so a cursor moved past id 7 may skip an id 6 that commits later (two
producers finishing together). A per-event row has no such gap; it costs one row
per (event, consumer), removed with the event by retention.

Consuming. The scheduler leader runs ``consume`` before each cron pass, on
its lock connection (``pgflow/leader.py``: a deposed leader cannot commit), and is
woken by ``NOTIFY pgflow_datasets`` when an event is delivered. One pass is one
transaction: find the jobs whose condition holds over their waiting events
(``all``: every dataset of ``trigger_on`` has one; ``any``: one has) and whose
previous dataset run has finished; lock those jobs' rows (``SKIP LOCKED``: a
second scheduler skips them); read their waiting events again under the lock;
create one run each (trigger ``dataset``, logical time = newest consumed event's
``created_at``); point the events at it, checking that every row changed (else
the whole pass rolls back). A crash anywhere before the commit leaves the events
waiting and creates no run; after it, both are there. The unique ``(job,
logical_time)`` of ``run_keys`` stays the backstop: a collision (another run of the
job at that very microsecond) moves the new run's time one microsecond later.

A run consumes every waiting event of its job at once, up to ``MAX_EVENTS_PER_RUN``
(a backlog beyond that is consumed by the next runs, the oldest first, and each
dataset's oldest event is always in, so an ``all`` run has every dataset). While a
consumer's dataset run is active, new events wait: runs never pile up.

The hot path. ``finish_attempts`` gains one primary-key lookup of the job per
succeeded run (``produces <> '{}'`` is false for most jobs, and nothing else
happens for them); the claim returns the consumed events only for runs whose
trigger is ``dataset``. Measured on the shared 2-core machine, 100 runs per
statement, fastest of 16 alternating runs: finish 4.65 -> 4.83 ms, claim 2.46 ->
2.61 ms, i.e. about 2 microseconds per run. ``make bench`` (figure ``datasets``)
measures event -> run start with an idle replica and 10,000-event bursts.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pgflow import deps
from pgflow.errors import InvalidInput
from pgflow.queries import q
from pgflow.spec import NAME_RE, SpecError

MAX_PAYLOAD_BYTES = 64 * 1024
MAX_KEY_LENGTH = 512
MAX_EVENTS_PER_RUN = 10_000
# Consuming jobs handled per transaction; more follow in the next pass right away.
BATCH = 500
MAX_PASSES = 20
_ONE_MICROSECOND = timedelta(microseconds=1)
_COLLISION_RETRIES = 5

Conn = psycopg.Connection[dict[str, Any]]


# ---------------------------------------------------------------- emitting


def check_name(dataset: str) -> str:
    """``dataset`` if it follows the job-name rules, else InvalidInput naming the rule."""
    if not isinstance(dataset, str) or not NAME_RE.match(dataset) or len(dataset) > 128:
        raise InvalidInput(
            f"invalid dataset name {dataset!r}: it must start with a letter or digit, use only"
            " letters, digits, '_', '.', '-', and be at most 128 characters")
    return dataset


def check_key(key: Any) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_LENGTH or "\x00" in key:
        raise InvalidInput(f"key: must be a string of 1 to {MAX_KEY_LENGTH} characters"
                           " without NUL")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput("key: must be valid UTF-8 text") from None
    return key


def check_payload(payload: Any) -> dict[str, Any]:
    """A JSON object of at most ``MAX_PAYLOAD_BYTES`` (as compact JSON text)."""
    if payload is None:
        return {}
    if not isinstance(payload, dict):
        raise InvalidInput("payload: must be a JSON object")
    try:
        text = json.dumps(payload, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
        size = len(text.encode("utf-8"))
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError: a lone surrogate
        raise InvalidInput(f"payload: not storable JSON: {exc}") from None
    if _has_nul(payload):  # PostgreSQL's jsonb cannot hold \u0000
        raise InvalidInput("payload: must not contain NUL characters")
    if size > MAX_PAYLOAD_BYTES:
        raise InvalidInput(f"payload: larger than {MAX_PAYLOAD_BYTES // 1024} KiB")
    return payload


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


@dataclass(frozen=True)
class Emitted:
    """One emit: the event (new or the existing one of its key), and whether it is new."""

    event: dict[str, Any]
    created: bool


def emit(conn: Conn, dataset: str, key: str | None = None,
         payload: dict[str, Any] | None = None) -> Emitted:
    """Record an event of ``dataset`` from outside; a repeated ``key`` records nothing
    and returns the event recorded first. ``conn`` is an autocommit connection (or the
    caller commits)."""
    dataset, key, payload = check_name(dataset), check_key(key), check_payload(payload)
    # One statement (the event, its deliveries, the leader's wake-up): atomic on its own.
    row = conn.execute(q("emit_event"), {"dataset": dataset, "key": key,
                                         "payload": Jsonb(payload)}).fetchone()
    if row is not None:
        return Emitted(row, True)
    existing = conn.execute(q("event_by_key"), {"dataset": dataset, "key": key}).fetchone()
    assert existing is not None  # a conflict means the keyed event is committed
    return Emitted(existing, False)


def event_json(event: dict[str, Any]) -> dict[str, Any]:
    return {"id": event["id"], "dataset": event["dataset"], "key": event["key"],
            "run_id": event["run_id"], "payload": event["payload"],
            "created_at": event["created_at"].isoformat(), "consumers": event["consumers"]}


# ---------------------------------------------------------------- reading


def overview(conn: Conn, dataset: str | None = None) -> list[dict[str, Any]]:
    """Every known dataset: producers, consumers (with events waiting), last event."""
    return conn.execute(q("list_datasets"), {"dataset": dataset}).fetchall()


def overview_json(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"dataset": r["dataset"], "producers": list(r["producers"]),
             "consumers": r["consumers"], "last_event": r["last_event"]} for r in rows]


def recent_events(conn: Conn, dataset: str, limit: int = 20) -> list[dict[str, Any]]:
    return conn.execute(q("recent_events"), {"dataset": dataset, "limit": limit}).fetchall()


def run_events(conn: Conn, run_id: int, limit: int = 200) -> tuple[list[dict[str, Any]], int]:
    """The events run ``run_id`` consumed (at most ``limit``), and how many there are."""
    rows = conn.execute(q("run_trigger_events"), {"run_id": run_id, "limit": limit}).fetchall()
    if len(rows) < limit:
        return rows, len(rows)
    count = conn.execute(q("run_trigger_event_count"), {"run_id": run_id}).fetchone()
    return rows, int(count["n"]) if count else len(rows)


# ---------------------------------------------------------------- registration


def check_registry(existing: dict[str, dict[str, Any]], new: Sequence[Any],
                   removed: set[str]) -> list[SpecError]:
    """A job may not trigger on a dataset that only it produces (it would re-trigger
    itself forever); loops through other jobs are data flow and allowed."""
    produces: dict[str, set[str]] = {}
    trigger_on: dict[str, list[str]] = {}
    for name, row in existing.items():
        if name not in removed:
            definition = row["definition"]
            produces[name] = set(definition.get("produces") or ())
            trigger_on[name] = list(definition.get("trigger_on") or ())
    for spec in new:
        produces[spec.name] = set(spec.produces)
        trigger_on[spec.name] = list(spec.trigger_on or ())
    producers: dict[str, set[str]] = {}
    for name, datasets in produces.items():
        for dataset in datasets:
            producers.setdefault(dataset, set()).add(name)
    errors = []
    for spec in new:
        own = [d for d in trigger_on[spec.name] if producers.get(d) == {spec.name}]
        if own:
            errors.append(SpecError(job=spec.name, key="trigger_on", reason=(
                f"triggers on {', '.join(map(repr, own))}, which only this job produces:"
                " it would trigger itself forever")))
    return errors


def drop_stale(conn: Conn, jobs: Sequence[str]) -> None:
    """After a registration: events waiting for a dataset a job no longer triggers on."""
    if jobs:
        conn.execute(q("drop_stale_deliveries"), {"jobs": list(jobs)})


# ---------------------------------------------------------------- consuming


@dataclass
class ConsumePass:
    """What one ``consume`` call did."""

    runs: dict[str, int] = field(default_factory=dict)  # job -> run id
    events: int = 0
    passes: int = 0
    more: bool = False  # the last pass was full: call again


async def consume(conn: AsyncConnection[Any], *, batch: int = BATCH,
                  cap: int = MAX_EVENTS_PER_RUN,
                  before_pass: Callable[[], Awaitable[None]] | None = None) -> ConsumePass:
    """Create the runs of every consuming job whose condition holds; one transaction per
    ``batch`` jobs, ``before_pass`` (the leader's heartbeat) before each."""
    result = ConsumePass()
    while result.passes < MAX_PASSES:
        if before_pass is not None:
            await before_pass()
        try:
            result.more = await _one_pass(conn, batch, cap, result)
        except _Raced:
            result.more = True  # rolled back; the next pass starts from what is there
        result.passes += 1
        if not result.more:
            break
    return result


async def _one_pass(conn: AsyncConnection[Any], batch: int, cap: int,
                    result: ConsumePass) -> bool:
    async with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(q("ready_consumers"), {"batch": batch})
        ready = await cur.fetchall()
        if not ready:
            return False
        # Read again as locked: paused meanwhile, or redefined (checked once more below).
        jobs = {row["name"]: row for row in ready if not row["paused"]}
        await cur.execute(q("waiting_events"), {"jobs": list(jobs), "cap": cap})
        waiting: dict[str, list[dict[str, Any]]] = {}
        for row in await cur.fetchall():
            waiting.setdefault(row["job"], []).append(row)
        chosen = {job: events for job, events in waiting.items()
                  if _holds(jobs[job], {e["dataset"] for e in events})}
        if chosen:
            runs = await _create_runs(cur, conn, chosen, {j for j in chosen if jobs[j]["in_dag"]})
            await _consume(cur, chosen, runs)
            result.runs.update(runs)
            result.events += sum(len(chosen[job]) for job in runs)
    return len(ready) >= batch


def _holds(job: dict[str, Any], datasets: set[str]) -> bool:
    wanted = set(job["trigger_on"])
    if job["trigger_mode"] == "any":
        return bool(wanted & datasets)
    return bool(wanted) and wanted <= datasets


async def _create_runs(cur: psycopg.AsyncCursor[dict[str, Any]], conn: AsyncConnection[Any],
                       chosen: dict[str, list[dict[str, Any]]], in_dag: set[str]
                       ) -> dict[str, int]:
    """One run per job at its newest event's time (a job with downstream jobs starts a DAG
    run, the others take the plain INSERT); a time taken by another run of the job (a
    manual trigger at that microsecond) moves one microsecond later."""
    times: dict[str, datetime] = {job: max(e["created_at"] for e in events)
                                  for job, events in chosen.items()}
    runs: dict[str, int] = {}
    fresh: list[int] = []
    pending: list[int] = []
    for _ in range(_COLLISION_RETRIES):
        todo = [job for job in times if job not in runs]
        if not todo:
            break
        rows = []
        for dag in (False, True):
            part = [job for job in todo if (job in in_dag) == dag]
            if not part:
                continue
            base = {"jobs": part, "times": [times[job] for job in part], "trigger": "dataset",
                    "params": None}
            if dag:
                await cur.execute(q("create_runs"), {
                    **base, "downstream": True, "state": "queued", "priority_offset": 0,
                    "backfill_id": None})
            else:
                await cur.execute(q("create_plain_runs"), {**base, "only_lone": False})
            rows += await cur.fetchall()
        for row in rows:
            fresh.append(row["id"])
            if row["state"] == "pending":
                pending.append(row["id"])
            if row["job"] in todo and row["trigger"] == "dataset" and row["job"] not in runs:
                runs[row["job"]] = row["id"]
        for job in todo:
            times[job] += _ONE_MICROSECOND
    # Downstream runs whose upstreams already ran at that time go ahead now.
    await deps.settle_async(conn, pending, fresh=fresh)
    return runs


async def _consume(cur: psycopg.AsyncCursor[dict[str, Any]], chosen: dict[str, list[Any]],
                   runs: dict[str, int]) -> None:
    pairs = [(job, e["event_id"], run_id) for job, run_id in runs.items() for e in chosen[job]]
    await cur.execute(q("consume_deliveries"), {
        "jobs": [p[0] for p in pairs], "events": [p[1] for p in pairs],
        "runs": [p[2] for p in pairs]})
    if cur.rowcount != len(pairs):
        # Someone else changed these rows under our lock (a registration dropping them):
        # roll the whole pass back; the next one starts from what is there.
        raise _Raced(f"consumed {cur.rowcount} of {len(pairs)} deliveries")


class _Raced(Exception):
    """The pass lost a race: its transaction rolls back."""
