"""Checks over the whole dependency graph, in O(V + E).

The graph is ``{job: [upstream, ...]}``. Cycles are found with Kahn's
algorithm: whatever cannot be ordered sits on or behind a cycle, and walking
upstream from such a job always reaches a cycle, which is reported by name.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

Graph = Mapping[str, Sequence[str]]


def topological_order(graph: Graph) -> tuple[list[str], set[str]]:
    """(jobs in dependency order, jobs that cannot be ordered because of a cycle).

    Upstreams missing from ``graph`` are ignored here (reported elsewhere).
    """
    indegree = {job: 0 for job in graph}
    downstreams: dict[str, list[str]] = {job: [] for job in graph}
    for job, upstreams in graph.items():
        for upstream in upstreams:
            if upstream in graph:
                indegree[job] += 1
                downstreams[upstream].append(job)
    ready = deque(job for job, degree in indegree.items() if degree == 0)
    order: list[str] = []
    while ready:
        job = ready.popleft()
        order.append(job)
        for downstream in downstreams[job]:
            indegree[downstream] -= 1
            if indegree[downstream] == 0:
                ready.append(downstream)
    stuck = {job for job, degree in indegree.items() if degree > 0}
    return order, stuck


def find_cycles(graph: Graph, stuck: set[str]) -> list[list[str]]:
    """Distinct cycles among ``stuck`` jobs, each as [a, b, ..., a] in upstream→downstream order."""
    cycles: list[list[str]] = []
    seen: set[str] = set()
    for start in sorted(stuck):
        if start in seen:
            continue
        path: list[str] = []
        position: dict[str, int] = {}
        job = start
        # Every stuck job has a stuck upstream, so this walk ends on a repeat.
        while job not in position and job not in seen:
            position[job] = len(path)
            path.append(job)
            job = min(u for u in graph[job] if u in stuck)
        seen.update(path)
        if job in position:
            cycle = path[position[job] :]
            cycle.reverse()  # walked downstream→upstream; report in run order
            cycles.append([*cycle, cycle[0]])
    return cycles


def root_schedule_conflicts(
    graph: Graph, order: Sequence[str], schedule_of: Mapping[str, str | None]
) -> dict[str, list[tuple[str, str | None]]]:
    """Dependent jobs whose root ancestors do not share one schedule.

    ``schedule_of`` maps each root to a comparable schedule key (cron + timezone, or
    None for a job that only runs when triggered). Returns {job: [(root, key), ...]}
    with two differing examples for every job where the roots disagree first.
    """
    roots_of: dict[str, dict[str | None, str]] = {}
    conflicts: dict[str, list[tuple[str, str | None]]] = {}
    for job in order:
        upstreams = [u for u in graph[job] if u in graph]
        if not upstreams:
            roots_of[job] = {schedule_of.get(job): job}
            continue
        merged: dict[str | None, str] = {}
        for upstream in upstreams:
            for key, root in roots_of[upstream].items():
                merged.setdefault(key, root)
            if len(merged) > 1:
                break  # two examples are enough; keeps the walk O(V + E)
        roots_of[job] = merged
        inherited = any(len(roots_of[u]) > 1 for u in upstreams)
        if len(merged) > 1 and not inherited:
            conflicts[job] = [(root, key) for key, root in list(merged.items())[:2]]
    return conflicts
