"""Queue health: dead tuples, vacuum and the xmin horizon of pgflow's hot tables.

Design note. A Postgres queue slows down for two reasons its own counters do not
show: dead row versions (every claim, renewal and finish leaves one) that indexes
still point to until vacuum removes them, and an old snapshot — a long-open
transaction anywhere in the database, a replication slot, a prepared transaction, a
standby's hot_standby_feedback — that holds the xmin horizon back so vacuum cannot
remove them at all. So pgflow reports both, from the statistics views only (two
statements, no table scan): per hot table its live and dead tuples and the last
(auto)vacuum and (auto)analyze, and the oldest open transaction and the xmin horizon
with what holds it. The dashboard shows them, ``/metrics`` exports them as gauges and
``deploy/prometheus/alerts.yml`` alerts on them. Sessions of other roles are visible
only to a member of ``pg_read_all_stats``: grant it to pgflow's role for the full
picture.
"""

from __future__ import annotations

from typing import Any

import psycopg

from pgflow.queries import q

Conn = psycopg.Connection[dict[str, Any]]

# Tables every claim, finish, heartbeat or tick updates.
HOT_TABLES = ("runs", "attempts", "jobs", "replicas", "leader", "breakers")
# Shown as warnings on the dashboard; the Prometheus rules use the same thresholds.
DEAD_TUPLES_WARN = 20_000
OLDEST_XACT_WARN_S = 600.0
XMIN_AGE_WARN = 10_000_000


def read(conn: Conn) -> dict[str, Any]:
    """``tables`` (one row per hot table), ``oldest_xact`` and ``horizon`` (or None)."""
    tables = conn.execute(q("queue_health_tables"), {"tables": list(HOT_TABLES)}).fetchall()
    horizon = conn.execute(q("queue_health_horizon")).fetchone()
    assert horizon is not None
    for table in tables:
        total = table["live_tuples"] + table["dead_tuples"]
        table["dead_share"] = table["dead_tuples"] / total if total else 0.0
        table["warn"] = table["dead_tuples"] >= DEAD_TUPLES_WARN
    oldest, held = horizon["oldest_xact"], horizon["horizon"]
    return {
        "tables": tables, "oldest_xact": oldest, "horizon": held,
        "oldest_xact_warn": oldest is not None and oldest["age_s"] >= OLDEST_XACT_WARN_S,
        "horizon_warn": held is not None and held["xmin_age"] >= XMIN_AGE_WARN,
    }


def warnings(health: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    """(severity, message, link) for the dashboard's alert list."""
    found: list[tuple[str, str, str | None]] = []
    for table in health["tables"]:
        if table["warn"]:
            found.append(("warning", f"pgflow.{table['table']} has {table['dead_tuples']:,}"
                          " dead rows: vacuum is behind or held back (see Queue health).",
                          None))
    oldest = health["oldest_xact"]
    if health["oldest_xact_warn"]:
        app = f" ({oldest['application_name']})" if oldest["application_name"] else ""
        found.append(("warning", f"A transaction has been open for {oldest['age_s'] / 60:.0f}"
                      f" min (pid {oldest['pid']}{app}): vacuum cannot remove the queue's"
                      " dead rows while it lasts.", None))
    held = health["horizon"]
    if health["horizon_warn"]:
        found.append(("warning", f"The xmin horizon is {held['xmin_age']:,} transactions old,"
                      f" held by {held['kind']} {held['holder']}.", None))
    return found
