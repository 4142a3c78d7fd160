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


DATASET_PREFIX = "dataset:"  # dataset nodes' names; job names cannot contain ':'


def with_datasets(conn: psycopg.Connection[Any], graph: dict[str, Any]) -> dict[str, Any]:
    """``graph`` (from ``lineage``) with the datasets around it: what its jobs produce and
    trigger on, the producers of what the job triggers on and the consumers of what it
    produces. Job depths are doubled so each dataset sits in the column between its
    producer and its consumer; dataset nodes are named ``dataset:<name>`` (kind
    ``dataset``), their edges run producer → dataset → consumer."""
    focus = graph["job"]
    nodes = [{**n, "depth": 2 * n["depth"], "kind": "job"} for n in graph["nodes"]]
    edges = [dict(e) for e in graph["edges"]]
    depth = {n["job"]: n["depth"] for n in nodes}
    links = conn.execute(q("lineage_datasets"),
                         {"job": focus, "jobs": list(depth)}).fetchall()
    # The focal job's links first, so its datasets sit right beside it.
    links.sort(key=lambda link: link["job"] != focus)
    placed: dict[str, int] = {}
    for link in links:
        if link["job"] in depth:
            step = 1 if link["role"] == "produces" else -1
            placed.setdefault(link["dataset"], depth[link["job"]] + step)
    for link in links:
        if link["job"] not in depth and link["dataset"] in placed:
            step = -1 if link["role"] == "produces" else 1
            depth[link["job"]] = placed[link["dataset"]] + step
            nodes.append({"job": link["job"], "depth": depth[link["job"]], "kind": "job",
                          "run_id": link["run_id"], "state": link["state"],
                          "logical_time": None})
    for dataset, where in placed.items():
        nodes.append({"job": DATASET_PREFIX + dataset, "depth": where, "kind": "dataset",
                      "run_id": None, "state": None, "logical_time": None})
    for link in links:
        if link["job"] in depth and link["dataset"] in placed:
            node = DATASET_PREFIX + link["dataset"]
            edges.append({"upstream": link["job"], "job": node} if link["role"] == "produces"
                         else {"upstream": node, "job": link["job"]})
    return {"job": focus, "nodes": nodes, "edges": edges}
