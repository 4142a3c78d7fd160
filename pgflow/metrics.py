"""Prometheus metrics, computed from the database at scrape time (``GET /metrics``).

Design. pgflow's truth is in PostgreSQL, and a replica serving ``/metrics`` may not
run any worker, so every number comes from one SQL statement per scrape
(``metrics_scrape``), never one per job:

- **Gauges** are read as they are: queue depth by state and tenant, running runs,
  dead letters, the oldest claimable run's wait, replicas alive / not responding,
  the leader (present, heartbeat age, term, which replica), open breakers.
- ``pgflow_repairs_total{kind}`` is the exception: the safety net counts its repairs
  in ``pgflow.repairs`` (one more small statement), so it is a cluster-wide total.
- ``pgflow_worker_demand_*`` read the view ``pgflow.worker_demand`` (one more
  statement), the numbers an autoscaler scales workers on.
- **Counters and histograms** must only go up, so they are *not* "how many in the
  last N minutes". Each scrape reads the events of the interval since the previous
  scrape (runs that finished, attempts that ended, scheduled runs that started:
  indexed by time), and adds them to counters kept in this process. The interval
  ends ``SETTLE_S`` seconds before now, so rows stamped with a transaction's start
  time have committed before their interval is read; each event is counted once.
  The values are "events seen since this process started": they reset when it
  restarts, which ``rate()``/``increase()`` handle. Every web replica reports the
  same cluster-wide events, so aggregate across replicas with ``max without
  (instance)`` (or scrape one), never ``sum``. A run that fails and is retried
  within one scrape interval shows only its final finish.

The pgflow job is the ``pgflow_job`` label (``job`` is Prometheus' own target label).
Histograms per job cost one series per bucket per job: 10,000 jobs is ~150,000
series, fine for one Prometheus, but drop ``pgflow_attempt_duration_seconds`` in a
relabel rule if that is too many.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from psycopg_pool import PoolTimeout

from pgflow import queue_health
from pgflow.alerts import metrics as alert_metrics
from pgflow.queries import q
from pgflow.safety_net import KINDS as REPAIR_KINDS
from pgflow.status import ALIVE_TTLS

Conn = psycopg.Connection[dict[str, Any]]

SETTLE_S = 30.0
DURATION_BOUNDS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0,
                   21600.0)
LAG_BOUNDS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
ACTIVE_STATES = ("pending", "queued", "running", "retrying")


@dataclass
class Histogram:
    """Cumulative-ready bucket counts for fixed ``bounds`` (plus +Inf) and a sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def add_bucket(self, bounds_at_or_above: int, n: int, seconds: float) -> None:
        """Add ``n`` observations that are <= exactly ``bounds_at_or_above`` of the bounds
        (what width_bucket over the negated bounds returns)."""
        self.counts[len(self.bounds) - bounds_at_or_above] += n
        self.total += seconds

    def buckets(self) -> list[tuple[str, float]]:
        running, out = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


class Metrics:
    """The collector behind ``/metrics``; ``connection()`` lends a dict-row connection."""

    def __init__(self, connection: Callable[[], AbstractContextManager[Conn]],
                 lease_ttl: float, settle_s: float = SETTLE_S) -> None:
        self._connection = connection
        self._lease_ttl = lease_ttl
        self._settle_s = settle_s
        self._lock = threading.Lock()
        self._since: datetime | None = None
        self._finished: dict[tuple[str, str, str], int] = defaultdict(int)
        self._attempts: dict[tuple[str, str], int] = defaultdict(int)
        self._durations: dict[str, Histogram] = {}
        self._lag = Histogram(LAG_BOUNDS)
        self._scrape_errors = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            started = time.perf_counter()
            try:
                row = self._scrape()
            except (psycopg.Error, PoolTimeout, OSError):
                row = None
                self._scrape_errors += 1
            yield _gauge("pgflow_database_up", "1 if the last scrape could read the database.",
                         1.0 if row is not None else 0.0)
            if row is not None:
                yield from _gauges(row, self._lease_ttl)
                yield from alert_metrics.gauges(row["alerts"])
                yield from _dataset_gauges(row["datasets"])
            yield from self._counters()
            errors = CounterMetricFamily("pgflow_metrics_scrape_errors",
                                         "Scrapes that could not read the database.")
            errors.add_metric([], float(self._scrape_errors))
            yield errors
            yield _gauge("pgflow_metrics_scrape_duration_seconds",
                         "Time this scrape spent reading the database.",
                         time.perf_counter() - started)

    def _scrape(self) -> dict[str, Any]:
        with self._connection() as conn:
            # The safety net's repairs are cluster-wide totals kept in pgflow.repairs.
            repairs = conn.execute(q("repair_totals")).fetchall()
            # What an autoscaler reads (pgflow.worker_demand), as gauges.
            demand = conn.execute(q("worker_demand")).fetchone()
            # Breakers: state per source, transitions (cluster-wide, from their log).
            states = conn.execute(q("breaker_states")).fetchall()
            moves = conn.execute(q("breaker_transition_counts")).fetchall()
            # Queue health: dead tuples, vacuum, xmin horizon (statistics views only).
            health = queue_health.read(conn)
            alerting = alert_metrics.scrape(conn)  # open incidents, notification backlog
            datasets = conn.execute(q("dataset_metrics")).fetchall()  # pgflow/datasets.py
            row = conn.execute(q("metrics_scrape"), {
                "since": self._since, "settle": self._settle_s,
                "alive_s": ALIVE_TTLS * self._lease_ttl,
                "neg_bounds": [-b for b in reversed(DURATION_BOUNDS)],
                "neg_lag_bounds": [-b for b in reversed(LAG_BOUNDS)],
            }).fetchone()
        assert row is not None
        row["repairs"] = {r["kind"]: r["total"] for r in repairs}
        row["demand"] = demand
        row["breaker_states"] = states
        row["breaker_moves"] = moves
        row["health"] = health
        row["alerts"] = alerting
        row["datasets"] = datasets
        for f in row["finished"]:
            self._finished[(f["job"], f["tenant"], f["outcome"])] += f["n"]
        for a in row["attempts"]:
            self._attempts[(a["job"], a["outcome"])] += a["n"]
            histogram = self._durations.setdefault(a["job"], Histogram(DURATION_BOUNDS))
            histogram.add_bucket(a["bucket"], a["n"], a["seconds"] or 0.0)
        for s in row["lags"]:
            self._lag.add_bucket(s["bucket"], s["n"], s["seconds"] or 0.0)
        self._since = row["upper"]
        return row

    def _counters(self) -> Iterator[Metric]:
        finished = CounterMetricFamily(
            "pgflow_runs_finished",
            "Runs that reached a final state, by job, tenant and outcome (the run state).",
            labels=["pgflow_job", "tenant", "outcome"])
        for (job, tenant, outcome), n in sorted(self._finished.items()):
            finished.add_metric([job, tenant, outcome], float(n))
        yield finished
        attempts = CounterMetricFamily(
            "pgflow_attempts", "Attempts that ended, by job and outcome.",
            labels=["pgflow_job", "outcome"])
        for (job, outcome), n in sorted(self._attempts.items()):
            attempts.add_metric([job, outcome], float(n))
        yield attempts
        durations = HistogramMetricFamily(
            "pgflow_attempt_duration_seconds", "Duration of ended attempts, by job.",
            labels=["pgflow_job"])
        for job, histogram in sorted(self._durations.items()):
            durations.add_metric([job], histogram.buckets(), histogram.total)
        yield durations
        lag = HistogramMetricFamily(
            "pgflow_schedule_lag_seconds",
            "Delay from a scheduled run's cron tick to the start of its first attempt.")
        lag.add_metric([], self._lag.buckets(), self._lag.total)
        yield lag


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _gauges(row: dict[str, Any], lease_ttl: float) -> Iterator[Metric]:
    depth = GaugeMetricFamily("pgflow_queue_depth", "Runs not yet finished, by state and tenant.",
                              labels=["state", "tenant"])
    totals = dict.fromkeys(ACTIVE_STATES, 0)
    for d in row["depth"]:
        depth.add_metric([d["state"], d["tenant"]], float(d["runs"]))
        totals[d["state"]] += d["runs"]
    yield depth
    by_state = GaugeMetricFamily("pgflow_queue_runs",
                                 "Runs not yet finished, by state (every state, zeros too).",
                                 labels=["state"])
    for state, n in totals.items():
        by_state.add_metric([state], float(n))
    yield by_state
    yield _gauge("pgflow_running_runs", "Runs running now.", float(totals["running"]))
    yield _gauge("pgflow_dead_letters", "Failed runs nobody has acknowledged.",
                 float(row["dead_letters"]))
    yield _gauge("pgflow_oldest_waiting_seconds",
                 "How long the oldest claimable (queued or retrying) run has waited.",
                 float(row["oldest_waiting_s"] or 0.0))
    replicas = GaugeMetricFamily("pgflow_replicas", "Replicas by heartbeat freshness.",
                                 labels=["state"])
    replicas.add_metric(["alive"], float(row["replicas_alive"]))
    replicas.add_metric(["not_responding"],
                        float(row["replicas_total"] - row["replicas_alive"]))
    yield replicas
    leader = row["leader"]
    fresh = leader is not None and leader["heartbeat_age_s"] <= lease_ttl
    yield _gauge("pgflow_leader_present",
                 "1 if a scheduling leader's heartbeat is fresher than the lease TTL.",
                 1.0 if fresh else 0.0)
    if leader is not None:
        yield _gauge("pgflow_leader_heartbeat_age_seconds", "Age of the leader's heartbeat.",
                     float(leader["heartbeat_age_s"]))
        yield _gauge("pgflow_leader_term", "Leadership term (increases on every election).",
                     float(leader["term"]))
        info = GaugeMetricFamily("pgflow_leader_info", "The replica leading scheduling.",
                                 labels=["replica_id"])
        info.add_metric([leader["replica_id"]], 1.0)
        yield info
    repairs = CounterMetricFamily(
        "pgflow_repairs",
        "Stuck runs and backfills the safety net repaired, cluster-wide, by kind (a bug).",
        labels=["kind"])
    for kind in REPAIR_KINDS:
        repairs.add_metric([kind], float(row["repairs"].get(kind, 0)))
    yield repairs
    yield from _demand_gauges(row["demand"])
    yield from _queue_health_gauges(row["health"])
    yield _gauge("pgflow_breakers_open", "Sources whose circuit breaker is open.",
                 float(len(row["open_breakers"])))
    breakers = GaugeMetricFamily("pgflow_breaker_open", "1 for each source whose breaker is open.",
                                 labels=["source"])
    for source in row["open_breakers"]:
        breakers.add_metric([source], 1.0)
    yield breakers
    states = GaugeMetricFamily("pgflow_breaker_state",
                              "1 for the state each source's breaker is in.",
                              labels=["source", "state"])
    for b in row.get("breaker_states", []):
        for name in ("closed", "open", "half_open"):
            states.add_metric([b["source"], name], float(b["state"] == name))
    yield states
    moves = CounterMetricFamily("pgflow_breaker_transitions",
                                "Breaker transitions, by source and the state entered.",
                                labels=["source", "to_state"])
    for m in row.get("breaker_moves", []):
        moves.add_metric([m["source"], m["to_state"]], float(m["n"]))
    yield moves



def _demand_gauges(demand: dict[str, Any]) -> Iterator[Metric]:
    """The row of pgflow.worker_demand: workers needed = (claimable + running) / concurrency."""
    yield _gauge("pgflow_worker_demand_claimable", "Runs a worker could start now.",
                 float(demand["claimable"]))
    yield _gauge("pgflow_worker_demand_running", "Runs running now.", float(demand["running"]))
    yield _gauge("pgflow_worker_demand_held",
                 "Runs due but held back by an open breaker or a max_active_runs cap.",
                 float(demand["held"]))
    yield _gauge("pgflow_worker_demand_oldest_claimable_age_seconds",
                 "How long the oldest claimable run has waited (0 when none waits).",
                 float(demand["oldest_claimable_age_s"]))


def _queue_health_gauges(health: dict[str, Any]) -> Iterator[Metric]:
    """Dead tuples and vacuum of the hot tables, the oldest transaction and the xmin
    horizon (see pgflow/queue_health.py)."""
    tables = [("pgflow_table_live_tuples", "Live rows of a hot pgflow table (statistics).",
               "live_tuples"),
              ("pgflow_table_dead_tuples", "Dead rows of a hot pgflow table not yet vacuumed.",
               "dead_tuples")]
    for name, doc, key in tables:
        family = GaugeMetricFamily(name, doc, labels=["table"])
        for t in health["tables"]:
            family.add_metric([t["table"]], float(t[key]))
        yield family
    stamps = [("pgflow_table_last_autovacuum_timestamp_seconds",
               "When autovacuum last vacuumed a hot pgflow table (0: never).", "last_autovacuum"),
              ("pgflow_table_last_autoanalyze_timestamp_seconds",
               "When autovacuum last analyzed a hot pgflow table (0: never).",
               "last_autoanalyze")]
    for name, doc, key in stamps:
        family = GaugeMetricFamily(name, doc, labels=["table"])
        for t in health["tables"]:
            family.add_metric([t["table"]], t[key].timestamp() if t[key] else 0.0)
        yield family
    oldest, horizon = health["oldest_xact"], health["horizon"]
    yield _gauge("pgflow_oldest_transaction_age_seconds",
                 "Age of the oldest open transaction of another client session of the database.",
                 float(oldest["age_s"]) if oldest else 0.0)
    yield _gauge("pgflow_xmin_horizon_age_transactions",
                 "Transactions since the oldest snapshot, replication slot or prepared"
                 " transaction that holds back vacuum (0: none held).",
                 float(horizon["xmin_age"]) if horizon else 0.0)


def _dataset_gauges(rows: list[dict[str, Any]]) -> Iterator[Metric]:
    stored = GaugeMetricFamily("pgflow_dataset_events",
                               "Dataset events recorded and not yet removed by retention.",
                               labels=["dataset"])
    waiting = GaugeMetricFamily("pgflow_dataset_events_waiting",
                                "Dataset events a consuming job has not consumed yet.",
                                labels=["dataset", "job"])
    for row in rows:
        if row["job"] is None:
            stored.add_metric([row["dataset"]], float(row["n"]))
        else:
            waiting.add_metric([row["dataset"], row["job"]], float(row["n"]))
    yield stored
    yield waiting
