"""A diamond DAG (extract → {clean, enrich} → load) with runs at exact times, for the
pipeline pages (Gantt, critical path, end-to-end trend, grid)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from engine import add_job
from webhelpers import Conn

T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
JOBS = ("extract", "clean", "enrich", "load")


def diamond(conn: Conn) -> None:
    add_job(conn, "extract", entrypoint="jobfuncs:noop", schedule="0 * * * *")
    add_job(conn, "clean", entrypoint="jobfuncs:noop", depends_on=["extract"])
    add_job(conn, "enrich", entrypoint="jobfuncs:noop", depends_on=["extract"])
    add_job(conn, "load", entrypoint="jobfuncs:noop", depends_on=["clean", "enrich"])


def timed_run(conn: Conn, job: str, at: datetime, state: str, *, created: float,
              started: float | None, finished: float | None,
              trigger: str = "dependency") -> int:
    """A run of ``job`` at logical time ``at``; times are seconds after ``at``."""
    def moment(offset: float | None) -> datetime | None:
        return None if offset is None else at + timedelta(seconds=offset)

    row = conn.execute(
        "INSERT INTO pgflow.runs (job, logical_time, state, attempt, max_attempts, trigger,"
        " tenant, created_at, started_at, finished_at) VALUES (%s, %s, %s, %s, 1, %s,"
        " 'default', %s, %s, %s) RETURNING id",
        (job, at, state, 0 if started is None else 1, trigger, moment(created),
         moment(started), moment(finished))).fetchone()
    assert row is not None
    return int(row["id"])


def diamond_run(conn: Conn, at: datetime, *, load_state: str = "succeeded",
                scale: float = 1.0) -> dict[str, int]:
    """One DAG run: extract 0.5 → 2.0 s, clean 2.2 → 3.0, enrich 2.1 → 6.0 (the slow
    branch), load 6.4 → 7.25 (x ``scale``); end to end 7.25 s x scale after the tick."""
    s = scale
    return {
        "extract": timed_run(conn, "extract", at, "succeeded", created=0.1, started=0.5 * s,
                             finished=2.0 * s, trigger="schedule"),
        "clean": timed_run(conn, "clean", at, "succeeded", created=0.1, started=2.2 * s,
                           finished=3.0 * s),
        "enrich": timed_run(conn, "enrich", at, "succeeded", created=0.1, started=2.1 * s,
                            finished=6.0 * s),
        "load": timed_run(conn, "load", at, load_state, created=0.1, started=6.4 * s,
                          finished=7.25 * s),
    }


def rows_of(run_ids: dict[str, int], conn: Conn) -> list[dict[str, Any]]:
    from pgflow import lineage

    at = conn.execute("SELECT logical_time FROM pgflow.runs WHERE id = %s",
                      (run_ids["extract"],)).fetchone()
    assert at is not None
    return lineage.dag_run(conn, "extract", at["logical_time"])
