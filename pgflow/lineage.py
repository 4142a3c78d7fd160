"""Lineage: a job's place in the dependency graph, and the runs of one DAG run."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from pgflow.queries import q


def lineage(conn: psycopg.Connection[Any], job: str) -> dict[str, Any]:
    """Upstream and downstream closure of ``job`` with each job's latest run state."""
    nodes = conn.execute(q("lineage_nodes"), {"job": job}).fetchall()
    names = [n["job"] for n in nodes]
    edges = conn.execute(q("lineage_edges"), {"jobs": names}).fetchall()
    return {"job": job, "nodes": nodes, "edges": edges}


def dag_run(
    conn: psycopg.Connection[Any], job: str, logical_time: datetime
) -> list[dict[str, Any]]:
    """Every run of ``logical_time`` in the DAG that ``job`` belongs to."""
    return conn.execute(q("dag_run"), {"job": job, "logical_time": logical_time}).fetchall()
