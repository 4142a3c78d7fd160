"""Policies: tenants' fair share and caps, sources' caps, and what the claim does with them.

Definitions (SPEC §3): ``[tenants.NAME] weight, max_concurrency`` and
``[sources.NAME] failure_threshold, cooldown, max_concurrency``, validated here in
the same pydantic style as jobs and written by ``registry.apply`` in the transaction
that writes the jobs (``--prune`` removes those no longer defined). Circuit breakers
are in ``pgflow.breakers``.

Two claim paths, as before, but a run's path is decided once, when it is created:
- A job is ``capped`` (constrained) when its runs count against a cap: its own
  ``max_active_runs``, its tenant's ``max_concurrency``, or a ``max_concurrency`` of
  one of its sources. Runs copy the flag; ``apply`` recomputes it for every job and
  re-flags the runs that wait or run, in the same transaction (``reflag``), so a cap
  added or removed takes effect for the backlog at once.
- A job is ``held`` while a breaker of one of its sources is not closed; runs copy
  that too and breaker transitions re-flag them (``pgflow.breakers``). Held runs are
  in no claim index: 50,000 of them cost a claim nothing (bench/policies.py measures
  it). The claim still checks breakers itself, so a breaker opened with plain SQL
  holds runs as well, only not for free.

Fair share (the hot claim, ``claim_runs``, still one statement). The claimable index
leads with the tenant. The statement finds the tenants with claimable runs by a skip
scan (one index probe per tenant, not per run), takes each one's best ``limit``
runs with a ``LATERAL ... LIMIT`` (locked, ``SKIP LOCKED``), and gives every candidate
a virtual time: ``(running + k) / weight`` for the tenant's k-th candidate, where
``running`` is the tenant's cluster-wide count of running runs. It keeps the
``limit`` candidates with the best (priority, virtual time). So priority orders runs
first; at equal priority, slots go to whichever tenant is furthest below its weighted
share of everything running, across replicas, because ``running`` is read from the
database and not from this replica. It is work-conserving: a tenant without
candidates takes nothing, and the others' candidates fill every slot (each tenant
offers up to ``limit``). The window over candidates is bounded by tenants x limit,
never by the queue length (Hatchet's window over all queued tasks is what broke at
25k). With one waiting tenant the running counts are not even read.

Caps hold cluster-wide under concurrent claims. The hot claim never sees a run that
counts against a cap (the flag). Constrained runs are claimed by
``claim_capped_runs`` after ``lock_capped_jobs`` took transaction-scoped advisory
locks on every job, tenant and source key the claim may touch, in hash order (the
same total order everywhere: no deadlock); the claim then runs as a new statement, so
its snapshot sees every claim that committed before the locks were granted, and
counts running runs exactly. It takes per job up to the room left under the job's,
the tenant's and the sources' caps, then keeps a candidate only if its rank within
its tenant and within every capped source it touches is inside that cap's room: a run
touching two sources needs a slot in both. Constrained runs whose priority is not
lower than the best unconstrained one are claimed before the hot claim, as before.

Backfill runs sit ``BACKFILL_PRIORITY_OFFSET`` (-2,000,001) below their job's
priority, below every scheduled run of every tenant (priorities are within ±1,000,000).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import psycopg
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pgflow.alerts.definitions import AlertSpec
from pgflow.queries import q
from pgflow.spec import NAME_PATTERN, Seconds, SpecError, did_you_mean

Name = Annotated[str, Field(min_length=1, max_length=128, pattern=NAME_PATTERN)]


class TenantSpec(BaseModel):
    """``[tenants.NAME]``: share of worker slots when tenants compete, and a cap."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name
    weight: float = Field(default=1.0, gt=0, le=1_000_000, allow_inf_nan=False)
    max_concurrency: int | None = Field(default=None, ge=1, le=1_000_000)

    def definition(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class SourceSpec(BaseModel):
    """``[sources.NAME]``: its circuit breaker and a cap shared by every job naming it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name
    failure_threshold: int = Field(default=3, ge=1, le=1_000_000)
    cooldown: Seconds = 60.0
    max_concurrency: int | None = Field(default=None, ge=1, le=1_000_000)

    @field_validator("cooldown")
    @classmethod
    def _positive(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("cooldown must be longer than 0s")
        return value

    def definition(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


_MODELS: dict[str, type[BaseModel]] = {"tenant": TenantSpec, "source": SourceSpec,
                                       "alert": AlertSpec}


def parse(kind: str, name: str, raw: Any) -> tuple[BaseModel | None, list[SpecError]]:
    """Validate one ``[tenants.x]`` (kind ``tenant``) or ``[sources.x]`` table."""
    model = _MODELS[kind]
    if not isinstance(raw, dict):
        return None, [SpecError(kind=kind, job=name, key=None, reason="must be a table of keys")]
    if "name" in raw and raw["name"] != name:
        return None, [SpecError(kind=kind, job=name, key="name",
                                reason=f"does not match the {kind}'s name")]
    try:
        return model.model_validate({**raw, "name": name}), []
    except ValidationError as exc:
        options = sorted(set(model.model_fields) - {"name"})
        errors = []
        for error in exc.errors():
            loc = [str(part) for part in error["loc"]]
            reason = str(error["msg"]).removeprefix("Value error, ")
            if error["type"] == "extra_forbidden":
                reason = did_you_mean(loc[-1], options)
            elif error["type"] == "string_pattern_mismatch":
                reason = ("must start with a letter or digit and use only letters, digits,"
                          " '_', '.', '-'")
            errors.append(SpecError(kind=kind, job=name, key=".".join(loc) or None,
                                    reason=reason))
        return None, errors


@dataclass
class Policies:
    """The tenants, sources and alerts a registration defines."""

    tenants: list[TenantSpec] = field(default_factory=list)
    sources: list[SourceSpec] = field(default_factory=list)
    alerts: list[AlertSpec] = field(default_factory=list)

    def extend(self, other: Policies) -> None:
        self.tenants += other.tenants
        self.sources += other.sources
        self.alerts += other.alerts


def parse_tables(document: dict[str, Any], origin: str) -> tuple[Policies, list[SpecError]]:
    """The ``tenants`` and ``sources`` tables of one TOML document."""
    found = Policies()
    errors: list[SpecError] = []
    for key, kind, target in (("tenants", "tenant", found.tenants),
                              ("sources", "source", found.sources),
                              ("alerts", "alert", found.alerts)):
        table = document.get(key, {})
        if not isinstance(table, dict):
            errors.append(SpecError(kind=kind, job=key, key=None,
                                    reason=f"{origin}: '{key}' must be a table of [{key}.<name>]"
                                           " tables"))
            continue
        for name, raw in table.items():
            spec, problems = parse(kind, name, raw)
            errors += problems
            if spec is not None:
                target.append(spec)  # type: ignore[arg-type]
    return found, errors


TABLES = ("tenants", "sources", "alerts")


def load_files(sources: Sequence[str]) -> tuple[Policies, list[SpecError]]:
    """The tenants and sources of every TOML file (or folder of them) among ``sources``;
    ``module:attr`` sources define jobs only."""
    found = Policies()
    errors: list[SpecError] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            files = sorted(path.glob("*.toml"))
        elif path.exists():
            files = [path]
        else:
            continue  # a module:attr, or a missing file the job loader reported
        for file in files:
            try:
                document = tomllib.loads(file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
                continue  # reported by the job loader
            more, problems = parse_tables(document, str(file))
            found.extend(more)
            errors += problems
    return found, errors


def duplicates(policies: Policies | None) -> list[SpecError]:
    if policies is None:
        return []
    errors = []
    for kind, specs in (("tenant", policies.tenants), ("source", policies.sources),
                        ("alert", policies.alerts)):
        seen: set[str] = set()
        for spec in specs:
            if spec.name in seen:
                errors.append(SpecError(kind=kind, job=spec.name, key=None,
                                        reason="defined twice"))
            seen.add(spec.name)
    return errors


@dataclass
class PolicyResult:
    created: list[str] = field(default_factory=list)  # "tenant x", "source y"
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    reflagged: int = 0  # runs whose capped/held flags changed


def write(conn: psycopg.Connection[Any], policies: Policies | None, *,
          prune: bool) -> PolicyResult:
    """Write tenants and sources (None: a registration of jobs alone, e.g. the API's, which
    leaves them be) and re-flag jobs and runs. Called inside ``registry.apply``'s
    transaction, after the jobs were written, so ``reflag`` sees both."""
    result = PolicyResult()
    if policies is not None:
        _write_tables(conn, policies, prune, result)
    result.reflagged = reflag(conn)
    return result


def _write_tables(conn: psycopg.Connection[Any], policies: Policies, prune: bool,
                  result: PolicyResult) -> None:
    for kind, table, specs in (("tenant", "tenants", policies.tenants),
                               ("source", "sources", policies.sources),
                               ("alert", "alerts", policies.alerts)):
        existing = {row["name"]: row["definition"]
                    for row in conn.execute(q(f"policy_{table}_snapshot"))}
        changed = []
        for spec in specs:
            definition = spec.definition()
            if spec.name not in existing:
                result.created.append(f"{kind} {spec.name}")
            elif existing[spec.name] == definition:
                result.unchanged.append(f"{kind} {spec.name}")
                continue
            else:
                result.updated.append(f"{kind} {spec.name}")
            changed.append(_row(spec))
        if changed:
            conn.execute(q(f"policy_upsert_{table}"), {"rows": json.dumps(changed)})
        if prune:
            keep = sorted(spec.name for spec in specs)
            gone = conn.execute(q(f"policy_prune_{table}"), {"keep": keep}).fetchall()
            result.pruned += [f"{kind} {row['name']}" for row in gone]


def _row(spec: BaseModel) -> dict[str, Any]:
    row = spec.row() if isinstance(spec, AlertSpec) else spec.model_dump(mode="json")
    if isinstance(spec, SourceSpec):
        row["cooldown_s"] = row.pop("cooldown")
    row["definition"] = spec.definition()  # type: ignore[attr-defined]
    return row


def reflag(conn: psycopg.Connection[Any]) -> int:
    """Recompute every job's ``capped``/``held`` flags and copy them to its waiting (and,
    for ``capped``, running) runs; returns how many runs changed."""
    jobs = [row["name"] for row in conn.execute(q("policy_reflag_jobs"))]
    if not jobs:
        return 0
    rows = conn.execute(q("policy_reflag_runs"), {"jobs": jobs}).fetchall()
    if rows:
        conn.execute(q("notify_queue"))
    return len(rows)


def list_tenants(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """Every tenant defined or used by a job: weight, cap, running and queued runs."""
    return conn.execute(q("policy_tenant_list")).fetchall()


def list_sources(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    return conn.execute(q("policy_source_list")).fetchall()


def tenant_names(specs: Iterable[TenantSpec]) -> Sequence[str]:
    return sorted(spec.name for spec in specs)
