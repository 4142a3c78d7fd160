"""The cluster at a glance: replicas, the scheduling leader, queue depth.

One cheap query per section (the queue sections read only the non-terminal runs
through the state indexes), and every age is measured by the database clock.
"""

from __future__ import annotations

from typing import Any

import psycopg

from pgflow.queries import q
from pgflow.runs import ACTIVE_STATES

Conn = psycopg.Connection[dict[str, Any]]

ALIVE_TTLS = 3
"""A replica counts as alive while its heartbeat is younger than this many lease TTLs."""


def cluster_status(conn: Conn, ttl: float) -> dict[str, Any]:
    """Replicas, leader and queue depth; ``ttl`` is the lease TTL in seconds.

    ``leader`` is None when no replica has ever led; it is ``stale`` when its
    heartbeat is older than ``ttl`` (a standby will depose it).
    """
    args = {"ttl": ttl, "alive_ttls": ALIVE_TTLS}
    replicas = conn.execute(q("status_replicas"), args).fetchall()
    leader = conn.execute(q("status_leader"), args).fetchone()
    depth = conn.execute(q("status_queue_depth")).fetchall()
    dead = conn.execute(q("status_dead_letters")).fetchone()
    return {
        "replicas": replicas,
        "leader": leader,
        "queue": {
            "by_state": by_state(depth),
            "by_tenant": depth,
            "dead_letters": int(dead["dead_letters"]) if dead else 0,
        },
    }


def by_state(depth: list[dict[str, Any]]) -> dict[str, int]:
    """Total runs per non-terminal state (zero included) from (state, tenant, runs) rows."""
    totals = dict.fromkeys(ACTIVE_STATES, 0)
    for row in depth:
        totals[row["state"]] += int(row["runs"])
    return totals
