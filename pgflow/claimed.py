"""The row a claim returns for each run it started (``claim_step`` in
sql/queries/queue.sql): what the worker needs to run the attempt and to decide how it
ends. Claims return up to 500 of them at a time, on the hot path of every run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from functools import partial
from typing import Any, NamedTuple, TypeVar

R = TypeVar("R", bound=tuple[Any, ...])


class Claimed(NamedTuple):
    """A run a claim started, as ``claim_step`` returns it (these columns, in this order).
    Made from the row in C (``claimed_rows``): a dict per run cost the worker about as
    much as loading the row did. Read by name, ``run.job``; ``run["job"]`` works too."""

    id: int
    job: str
    logical_time: datetime
    attempt: int
    max_attempts: int
    params: str  # JSON text
    attempt_started_at: datetime
    checkpoint: str | None
    trigger_events: str | None
    cancel_requested: bool
    # the job's definition: all None when the job was deleted since (a LEFT JOIN)
    command: str | None
    entrypoint: str | None
    timeout_s: float | None
    backoff_s: float | None
    max_backoff_s: float | None
    jitter: bool | None
    no_retry_exit_codes: list[int] | None
    sources: list[str] | None
    # a success needs nothing after its finish (no backfill, no downstream job): recorded
    # without a transaction (queue.finish_plain); False when not known (a handoff)
    plain: bool = False

    def __getitem__(self, key: Any) -> Any:
        return getattr(self, key) if isinstance(key, str) else tuple.__getitem__(self, key)


def named_rows(cls: type[R]) -> Callable[[Any], Callable[[Sequence[Any]], R]]:
    """A psycopg row factory making one ``cls`` (a NamedTuple whose fields are the
    statement's columns, in order) per row, by ``tuple.__new__``: no Python call per row.
    The columns are checked on every result, by their names as the result holds them
    (1 µs; ``cursor.description`` took 15 µs a claim, issue 16)."""
    fields: tuple[str, ...] = cls._fields  # type: ignore[attr-defined]
    expected = tuple(name.encode() for name in fields)
    make = partial(tuple.__new__, cls)

    def factory(cursor: Any) -> Callable[[Sequence[Any]], R]:
        result = cursor.pgresult
        if result is not None and result.nfields:
            names = tuple(result.fname(i) for i in range(result.nfields))
            if names != expected:
                raise RuntimeError(f"columns {tuple(n.decode() for n in names)} are not"
                                   f" {cls.__name__}'s {fields}")
        return make
    return factory


claimed_rows = named_rows(Claimed)
