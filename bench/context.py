"""What every figure needs: the cluster, a fresh pgflow database, replicas, and the
few pgflow calls that set up a workload (register jobs, enqueue runs, read results)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from psycopg.rows import tuple_row

from bench import procs
from bench.cluster import Cluster, Conn
from pgflow import db, migrate, registry
from pgflow.queries import q
from pgflow.spec import JobSpec

DATABASE = "pgflow_bench"
# Logical times of enqueued runs: distinct instants far from any schedule's ticks.
EPOCH = datetime(2001, 1, 1, tzinfo=UTC)
TERMINAL = ("succeeded", "failed", "cancelled", "upstream_failed")


@dataclass
class Bench:
    cluster: Cluster
    project: Path
    logdir: Path
    quick: bool

    @property
    def url(self) -> str:
        return self.cluster.db_url(DATABASE)

    def fresh_database(self) -> str:
        """An empty, migrated pgflow database (dropped and re-created), checkpointed."""
        self.cluster.reset_database(DATABASE)
        with db.connect(self.url) as conn:
            migrate.migrate(conn)
        self.cluster.checkpoint()
        return self.url

    def connect(self) -> Conn:
        return db.connect(self.url)

    @contextmanager
    def replicas(self, tag: str, *, roles: Sequence[str] = ("worker",), concurrency: int = 16,
                 count: int = 1, env: dict[str, str] | None = None,
                 ) -> Iterator[list[procs.Replica]]:
        """Replicas running for the ``with`` block, stopped (gracefully) after it."""
        started = procs.start_replicas(self.url, self.project, self.logdir, tag, roles=roles,
                                       concurrency=concurrency, count=count, env=env)
        try:
            yield started
        finally:
            procs.stop_replicas(started)


def register(conn: Conn, definitions: Sequence[dict[str, Any]]) -> None:
    """Register jobs (one transaction), as ``pgflow apply`` does."""
    registry.apply(conn, [JobSpec.model_validate(d) for d in definitions])


def enqueue(conn: Conn, job: str, n: int, *, chunk: int = 1000, first: int = 0,
            params: dict[str, Any] | None = None) -> None:
    """``n`` queued runs of ``job`` (logical times EPOCH + i s), ``chunk`` per transaction,
    each transaction with its queue notification (what ``pgflow trigger`` sends)."""
    for start in range(first, first + n, chunk):
        times = [EPOCH + timedelta(seconds=i) for i in range(start, min(start + chunk,
                                                                          first + n))]
        with conn.transaction():
            conn.execute(create_runs_sql(), {
                "jobs": [job] * len(times), "times": times, "trigger": "manual",
                "params": None if params is None else json.dumps(params),
                "downstream": False, "state": "queued", "priority_offset": 0,
                "backfill_id": None})
            conn.execute(q("notify_queue"))


def create_runs_sql() -> str:
    """The named query that creates (DAG) runs; it was renamed during development."""
    try:
        return q("create_runs")
    except KeyError:
        return q("create_dag_runs")


def count_runs(conn: Conn, states: Sequence[str], job: str | None = None) -> int:
    row = conn.execute("SELECT count(*) AS n FROM pgflow.runs WHERE state = ANY(%s)"
                       " AND (%s::text IS NULL OR job = %s)", (list(states), job, job)
                       ).fetchone()
    assert row is not None
    return int(row["n"])


UNFINISHED = ("pending", "queued", "running", "retrying")
WAITING = tuple(s for s in UNFINISHED if s != "running")


def any_unfinished(conn: Conn) -> bool:
    """Whether a run is still to finish: what the figures poll for, probes of
    runs_state_idx (waiting runs) and runs_running_idx (running ones) that stop at the
    first such run. (A count of the unfinished runs every quarter second read every entry
    each time, the dead ones of runs already claimed included: a tenth of PostgreSQL's
    CPU during a 40,000-run throughput figure, charged to pgflow.)"""
    row = conn.execute("SELECT EXISTS (SELECT 1 FROM pgflow.runs WHERE state = ANY(%s))"
                       " OR EXISTS (SELECT 1 FROM pgflow.runs WHERE state = 'running')"
                       " AS left", (list(WAITING),)).fetchone()
    assert row is not None
    return bool(row["left"])


def wait_all_finished(conn: Conn, n: int, *, timeout: float, interval: float,
                      alive: Sequence[procs.Replica], what: str) -> float:
    """Poll until none of the ``n`` runs known to exist is unfinished; returns the
    time.time() it was first seen. Raises unless all ``n`` succeeded."""
    seen = procs.wait_until(lambda: not any_unfinished(conn), timeout=timeout,
                            interval=interval, alive=alive, what=what)
    succeeded = count_runs(conn, ("succeeded",))
    if succeeded < n:
        raise RuntimeError(f"{what}: only {succeeded} of {n} runs succeeded")
    return seen


def replicas_registered(conn: Conn, replicas: Sequence[procs.Replica]) -> bool:
    row = conn.execute("SELECT count(*) AS n FROM pgflow.replicas WHERE pid = ANY(%s)",
                       ([r.pid for r in replicas],)).fetchone()
    return row is not None and row["n"] == len(replicas)


def wait_registered(conn: Conn, replicas: Sequence[procs.Replica], timeout: float = 30) -> None:
    procs.wait_until(lambda: replicas_registered(conn, replicas), timeout=timeout,
                     alive=replicas, what="replicas registered")


def one(conn: Conn, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> dict[str, Any]:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row


def floats(conn: Conn, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[float]:
    cur = conn.cursor(row_factory=tuple_row)
    return [float(r[0]) for r in cur.execute(sql, params).fetchall() if r[0] is not None]


def each_configuration(measure_one: Callable[[Bench, int, int, int], dict[str, Any]], b: Bench,
                       n: int, replica_counts: Sequence[int],
                       concurrencies: Sequence[int]) -> list[dict[str, Any]]:
    """``measure_one`` for every (replicas, concurrency); a configuration that fails is
    recorded with its error and the others still run."""
    runs: list[dict[str, Any]] = []
    for replicas in replica_counts:
        for concurrency in concurrencies:
            try:
                runs.append({"ok": True, **measure_one(b, n, replicas, concurrency)})
            except Exception as exc:
                runs.append({"ok": False, "replicas": replicas, "concurrency": concurrency,
                             "error": f"{type(exc).__name__}: {exc}"})
    return runs
