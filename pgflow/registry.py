"""Registering job definitions: load, validate the whole graph, write in bulk.

A registration is atomic. Every definition is validated, then the graph made of
the jobs already registered plus the new ones (minus pruned ones) is checked;
if anything is wrong nothing is written and every problem is reported. Writes
are a handful of statements whatever the number of jobs.
"""

from __future__ import annotations

import difflib
import importlib
import json
import sys
import time
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from pgflow import backfill, dag, datasets, deps, scheduler
from pgflow import policies as _policies
from pgflow.cron import parse_cron
from pgflow.errors import Conflict, NotFound, PgflowError
from pgflow.flow import Flow
from pgflow.queries import q
from pgflow.spec import JobSpec, SpecError, parse_job
from pgflow.spec import RegistrationError as RegistrationError  # callers import it from here too


@dataclass
class ApplyResult:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    policies: Any = None  # pgflow.policies.PolicyResult: tenants and sources

    def counts(self) -> dict[str, int]:
        return {name: len(getattr(self, name)) for name in ("created", "updated", "unchanged",
                                                            "pruned")}


# ---------------------------------------------------------------- loading


def load_toml(path: Path) -> tuple[list[JobSpec], list[SpecError]]:
    """Job definitions of one TOML file (``[jobs.<name>]`` tables)."""
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PgflowError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PgflowError(f"{path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise PgflowError(f"{path}: invalid TOML: {exc}") from None
    unknown = sorted(set(document) - {"jobs", *_policies.TABLES})
    if unknown:
        raise PgflowError(
            f"{path}: unknown top-level key(s) {', '.join(map(repr, unknown))}:"
            " job definitions go in [jobs.<name>] tables (and [tenants.<name>],"
            " [sources.<name>], [alerts.<name>])"
        )
    jobs = document.get("jobs", {})
    if not isinstance(jobs, dict):
        raise PgflowError(f"{path}: 'jobs' must be a table of [jobs.<name>] tables")
    return parse_jobs(jobs.items())


def parse_jobs(items: Iterable[tuple[str, Any]]) -> tuple[list[JobSpec], list[SpecError]]:
    specs: list[JobSpec] = []
    errors: list[SpecError] = []
    for name, raw in items:
        spec, problems = parse_job(name, raw)
        errors += problems
        if spec is not None:
            specs.append(spec)
    return specs, errors


def load_object(target: str) -> tuple[list[JobSpec], list[SpecError]]:
    """Job definitions from ``module:attr`` (a Flow, a JobSpec, or a list/dict of them)."""
    module_name, _, attr = target.partition(":")
    try:
        if "" not in sys.path:
            sys.path.insert(0, "")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise PgflowError(f"cannot load {target}: {exc}") from None
    return specs_from_object(obj, target)


def specs_from_object(obj: Any, target: str) -> tuple[list[JobSpec], list[SpecError]]:
    if isinstance(obj, Flow):
        return obj.specs(), []
    if isinstance(obj, JobSpec):
        return [obj], []
    if isinstance(obj, dict):
        return parse_jobs(obj.items())
    if isinstance(obj, list | tuple) and all(isinstance(o, JobSpec) for o in obj):
        return list(obj), []
    raise PgflowError(
        f"{target} is a {type(obj).__name__}; expected a pgflow.Flow, a JobSpec,"
        " a list of JobSpec or a dict of job definitions"
    )


@dataclass
class Loaded:
    """What the sources define: valid specs, and the problems of the invalid ones."""

    specs: list[JobSpec] = field(default_factory=list)
    errors: list[SpecError] = field(default_factory=list)
    policies: _policies.Policies = field(default_factory=lambda: _policies.Policies())


def load_sources(sources: Sequence[str]) -> Loaded:
    """Every job of every TOML file, folder of TOML files, or ``module:attr``.

    Invalid definitions are collected, not raised, so that ``apply`` can report
    them together with the graph's problems.
    """
    loaded = Loaded()
    defined_in: dict[str, str] = {}
    for source in sources:
        for origin, (found, problems) in _load_one(source):
            loaded.errors += problems
            for spec in found:
                if spec.name in defined_in:
                    loaded.errors.append(SpecError(job=spec.name, key=None, reason=(
                        f"defined twice ({defined_in[spec.name]} and {origin})")))
                    continue
                defined_in[spec.name] = origin
                loaded.specs.append(spec)
    loaded.policies, problems = _policies.load_files(sources)  # [tenants.*], [sources.*]
    loaded.errors += problems
    return loaded


def _load_one(source: str) -> list[tuple[str, tuple[list[JobSpec], list[SpecError]]]]:
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.toml"))
        if not files:
            raise PgflowError(f"{source}: folder has no .toml files")
        return [(str(f), load_toml(f)) for f in files]
    if path.exists() or source.endswith(".toml") or ":" not in source:
        return [(source, load_toml(path))]
    return [(source, load_object(source))]


# ---------------------------------------------------------------- validation


def check_graph(
    existing: dict[str, dict[str, Any]],
    new: Sequence[JobSpec],
    removed: set[str],
    invalid: set[str] = frozenset(),  # type: ignore[assignment]
) -> list[SpecError]:
    """Problems of the graph ``existing - removed + new`` (new definitions win).

    ``invalid`` names jobs being registered whose definitions failed validation:
    they count as existing (no false "unknown upstream") but are not checked.
    """
    graph: dict[str, list[str]] = {name: [] for name in invalid}
    schedule_of: dict[str, str | None] = {}
    for name, row in existing.items():
        if name not in removed:
            graph[name] = list(row["depends_on"])
            schedule_of[name] = _schedule_key(row["schedule"], row["timezone"])
    new_names = set()
    for spec in new:
        new_names.add(spec.name)
        graph[spec.name] = list(spec.depends_on)
        schedule_of[spec.name] = _schedule_key(spec.schedule, spec.timezone)

    errors: list[SpecError] = []
    for job, upstreams in graph.items():
        for upstream in upstreams:
            if upstream not in graph:
                errors.append(SpecError(job=job, key="depends_on",
                                        reason=_unknown_upstream(upstream, graph, removed)))
    order, stuck = dag.topological_order(graph)
    for cycle in dag.find_cycles(graph, stuck):
        errors.append(SpecError(job=cycle[0], key="depends_on",
                                reason="dependency cycle: " + " -> ".join(cycle)))
    for job, examples in dag.root_schedule_conflicts(graph, order, schedule_of).items():
        if any(root in invalid for root, _ in examples):
            continue
        shown = ", ".join(f"{root} ({_show_key(key)})" for root, key in examples)
        errors.append(SpecError(job=job, key="depends_on", reason=(
            f"upstream roots have different schedules: {shown}; jobs of one DAG must share"
            " their roots' schedule")))
    return errors


def _schedule_key(schedule: str | None, timezone: str) -> str | None:
    return None if schedule is None else f"{schedule} {timezone}"


def _show_key(key: str | None) -> str:
    return "no schedule" if key is None else key


def _unknown_upstream(upstream: str, graph: dict[str, list[str]], removed: set[str]) -> str:
    if upstream in removed:
        return f"depends on {upstream!r}, which this change removes"
    close = difflib.get_close_matches(upstream, list(graph), n=1)
    hint = f", did you mean {close[0]!r}?" if close else ""
    return f"unknown upstream job {upstream!r}{hint}"


# ---------------------------------------------------------------- writing


def apply(
    conn: psycopg.Connection[Any],
    specs: Sequence[JobSpec],
    *,
    prune: bool = False,
    source: str = "",
    invalid: Sequence[SpecError] = (),
    policies: _policies.Policies | None = None,
) -> ApplyResult:
    """Register ``specs`` in one transaction; with ``prune``, remove jobs not among them.

    ``invalid`` carries the problems of definitions that did not validate (see
    ``Loaded``): nothing is applied then, and they are reported with the graph's.
    """
    with conn.transaction():
        conn.execute(q("lock_registry"))
        existing = {row["name"]: row for row in conn.execute(q("registry_snapshot"))}
        bad_names = {error.job for error in invalid if error.kind == "job"}
        names = {spec.name for spec in specs} | bad_names
        removed = set(existing) - names if prune else set()
        errors = [*invalid, *check_graph(existing, specs, removed, bad_names),
                  *_policies.duplicates(policies),
                  *datasets.check_registry(existing, specs, removed)]
        if errors:
            raise RegistrationError(errors, source)
        now: datetime = conn.execute("SELECT now() AS now").fetchone()["now"]  # type: ignore[index]
        result = ApplyResult(pruned=sorted(removed))
        changed: list[JobSpec] = []
        rewired: list[str] = []
        waiting: list[int] = []
        for spec in specs:
            row = existing.get(spec.name)
            if row is None:
                result.created.append(spec.name)
            elif row["definition"] == spec.definition():
                result.unchanged.append(spec.name)
                continue
            else:
                result.updated.append(spec.name)
            changed.append(spec)
        if changed or removed:
            # Old edges go first: a changed job may have depended on a removed one.
            conn.execute(q("delete_deps"), {"jobs": sorted(removed | {c.name for c in changed})})
            scheduler.withdraw_ahead(conn, sorted(removed))
            gone = conn.execute(q("delete_jobs"), {"names": sorted(removed)}).fetchall()
            _write(conn, changed, existing, now)
            _withdraw_changed(conn, changed, existing)
            datasets.drop_stale(conn, [spec.name for spec in changed])
            rewired = _rewired(changed, existing)
            settled, waiting = _resettle(conn, rewired)
            backfill.complete(conn, settled.backfills.union(*(g["backfills"] for g in gone)))
            conn.execute(q("notify_jobs_changed"))
        result.policies = _policies.write(conn, policies, prune=prune)  # tenants, sources, flags
    if waiting and conn.info.transaction_status == IDLE:
        _resettle_after_older_finishes(conn, rewired)
    return result


def _withdraw_changed(conn: psycopg.Connection[Any], specs: Sequence[JobSpec],
                      existing: dict[str, dict[str, Any]]) -> None:
    """Runs created ahead for a job this registration changes, or makes a DAG root (an
    upstream of a changed job), are withdrawn (scheduler.py): the tick is created again
    as the job now stands. A job whose schedule changed has its new fire time already."""
    names = {spec.name for spec in specs} | {u for spec in specs for u in spec.depends_on}
    moved = {spec.name for spec in specs if spec.name in existing
             and (existing[spec.name]["schedule"], existing[spec.name]["timezone"])
             != (spec.schedule, spec.timezone)}
    scheduler.withdraw_ahead(conn, sorted(names), rewind=sorted(names - moved))


IDLE = TransactionStatus.IDLE  # not inside a caller's transaction: ours has committed
OLDER_FINISHES_WAIT_S = 5.0


def _rewired(specs: Sequence[JobSpec], existing: dict[str, dict[str, Any]]) -> list[str]:
    """Jobs whose upstream edges this registration changes."""
    return sorted(spec.name for spec in specs if spec.name not in existing
                  or sorted(existing[spec.name]["depends_on"]) != sorted(spec.depends_on))


def _resettle(conn: psycopg.Connection[Any],
              jobs: list[str]) -> tuple[deps.Settled, list[int]]:
    """The pending runs of re-wired jobs are judged by their new upstreams, in the
    transaction that wrote the edges: ready ones are queued, those behind a failed
    upstream fail, the rest wait on the new set (returned with what was settled)."""
    if not jobs:
        return deps.Settled(), []
    pending = [row["id"] for row in conn.execute(q("pending_runs_of_jobs"), {"jobs": jobs})]
    settled = deps.settle(conn, pending)
    return settled, sorted(set(pending) - set(settled.queued) - set(settled.doomed))


def _resettle_after_older_finishes(conn: psycopg.Connection[Any], jobs: list[str]) -> None:
    """Once the edges are committed, settle the re-wired jobs' waiting runs again, after
    every transaction older than that commit has ended (for ``OLDER_FINISHES_WAIT_S`` at
    most: past it, the safety net's pending repair is what queues them). A finish whose
    statement began before the commit reads job_deps in its older snapshot: if it waited
    for our lock on its run and ended it after our commit, it never looked for the new
    downstream run, and our first settle saw the run still running (pgflow/deps.py)."""
    deadline = time.monotonic() + OLDER_FINISHES_WAIT_S
    since = None  # the first look takes the server's clock
    while True:
        older = conn.execute(q("older_transactions"), {"since": since}).fetchone()
        assert older is not None
        if not older["any"]:
            break
        if time.monotonic() >= deadline:
            return
        since = older["since"]
        time.sleep(0.01)
    with conn.transaction():
        settled, _ = _resettle(conn, jobs)
        backfill.complete(conn, settled.backfills)


def _write(
    conn: psycopg.Connection[Any],
    specs: Sequence[JobSpec],
    existing: dict[str, dict[str, Any]],
    now: datetime,
) -> None:
    rows = [_row(spec, existing.get(spec.name), now) for spec in specs]
    # Every upstream must exist before an edge points at it: all jobs first, then edges.
    conn.execute(q("upsert_jobs"), {"rows": json.dumps(rows)})
    pairs = [(spec.name, upstream) for spec in specs for upstream in spec.depends_on]
    if pairs:
        conn.execute(q("insert_deps"), {"dep_jobs": [p[0] for p in pairs],
                                        "dep_upstreams": [p[1] for p in pairs]})


def _row(spec: JobSpec, old: dict[str, Any] | None, now: datetime) -> dict[str, Any]:
    return {
        "name": spec.name,
        "tenant": spec.tenant,
        "schedule": spec.schedule,
        "timezone": spec.timezone,
        "command": spec.command,
        "entrypoint": spec.entrypoint,
        "priority": spec.priority,
        "timeout_s": spec.timeout,
        "deadline_s": spec.deadline,
        "max_active_runs": spec.max_active_runs,
        "catchup": spec.catchup,
        "sources": spec.sources,
        "params": spec.params,
        "max_attempts": spec.retry.max_attempts,
        "backoff_s": spec.retry.backoff,
        "max_backoff_s": spec.retry.max_backoff,
        "jitter": spec.retry.jitter,
        "no_retry_exit_codes": spec.retry.no_retry_exit_codes,
        "next_fire_at": _next_fire_at(spec, old, now),
        "definition": spec.definition(),
    }


def _next_fire_at(spec: JobSpec, old: dict[str, Any] | None, now: datetime) -> str | None:
    """Keep the persisted fire time when the schedule is unchanged (no tick is lost
    or repeated by re-registering); otherwise the first tick after now."""
    if spec.schedule is None:
        return None
    if old and (old["schedule"], old["timezone"]) == (spec.schedule, spec.timezone):
        kept = old["next_fire_at"]
        if kept is not None:
            return str(kept.isoformat())
    return parse_cron(spec.schedule, spec.timezone).next_after(now).isoformat()


def delete(conn: psycopg.Connection[Any], name: str) -> None:
    """Delete one job. Refused while other jobs depend on it; its runs stay."""
    with conn.transaction():
        conn.execute(q("lock_registry"))
        downstream = [r["job"] for r in conn.execute(q("downstreams_of"), {"names": [name]})]
        if downstream:
            raise Conflict(
                f"job {name!r} has downstream job(s) {', '.join(downstream)}:"
                " delete them or remove it from their depends_on first"
            )
        conn.execute(q("delete_deps"), {"jobs": [name]})
        scheduler.withdraw_ahead(conn, [name])
        gone = conn.execute(q("delete_jobs"), {"names": [name]}).fetchall()
        if not gone:
            raise NotFound(f"no job named {name!r} (see 'pgflow jobs list')")
        backfill.complete(conn, gone[0]["backfills"])
        conn.execute(q("notify_jobs_changed"))


def set_paused(conn: psycopg.Connection[Any], name: str, paused: bool) -> None:
    """Pause or resume a job (scheduled runs only; triggers still work). The leader hears
    of it at once; on resume, missed ticks follow the job's catchup setting."""
    from pgflow.runs import unknown_job_message

    with conn.transaction():
        # A tick created ahead that has not come yet waits for the resume: the pause's
        # trigger withdraws it (sql/migrations/0019_withdraw_on_pause.sql).
        if conn.execute(q("set_paused"), {"name": name, "paused": paused}).fetchone() is None:
            raise NotFound(unknown_job_message(conn, name))
        conn.execute(q("notify_jobs_changed"))
