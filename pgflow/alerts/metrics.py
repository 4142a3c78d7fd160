"""Alert gauges for ``/metrics`` (``pgflow.metrics`` calls these from its scrape)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
from prometheus_client.core import GaugeMetricFamily

from pgflow.alerts import EVENTS
from pgflow.queries import q

_INCIDENT_EVENTS = [e for e in EVENTS if e not in ("run_recovered", "breaker_closed")]


def scrape(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """Open incidents by event and the outbox backlog: two small indexed reads."""
    return {"open": {r["event"]: r["open"] for r in conn.execute(q("incidents_open_by_event"))},
            "backlog": conn.execute(q("notification_backlog")).fetchone()}


def gauges(found: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
    incidents = GaugeMetricFamily("pgflow_alert_incidents_open",
                                  "Alert incidents firing now, by event.", labels=["event"])
    for event in _INCIDENT_EVENTS:
        incidents.add_metric([event], float(found["open"].get(event, 0)))
    yield incidents
    backlog = found["backlog"] or {"pending": 0, "given_up": 0}
    notes = GaugeMetricFamily("pgflow_alert_notifications",
                              "Notifications not delivered: pending (being retried) or given"
                              " up after 24 h.", labels=["delivery"])
    notes.add_metric(["pending"], float(backlog["pending"]))
    notes.add_metric(["given_up"], float(backlog["given_up"]))
    yield notes
