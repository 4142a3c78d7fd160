"""A root job's pipeline history: end-to-end durations of its latest DAG runs (with
p50/p95) and the grid of those logical times x the DAG's jobs, like Airflow's grid view.

Bounded whatever the history: the latest ``TIMES`` logical times of the root (its
run keys, backwards) and at most ``MAX_JOBS`` jobs of its DAG, read by run-key
probes. End-to-end time is :func:`pgflow.web.gantt.end_to_end` per logical time; the
percentiles count the DAG runs whose every run succeeded (a failed pipeline delivered
nothing, so its time is not a latency).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from html import escape
from typing import Any
from urllib.parse import quote

import psycopg
from markupsafe import Markup

from pgflow.queries import q
from pgflow.web import gantt
from pgflow.web.svg import _svg, _text, colour, percentile

Conn = psycopg.Connection[dict[str, Any]]

TIMES = 25
MAX_JOBS = 60


@dataclass(frozen=True)
class DagRun:
    logical_time: datetime
    state: str  # succeeded | failed | running (some run not finished)
    seconds: float
    done: bool


def history(conn: Conn, root: str, now: datetime) -> dict[str, Any] | None:
    """The trend and grid of ``root``'s DAG, or None when it has no downstream jobs."""
    jobs = conn.execute(q("dag_history_jobs"), {"job": root, "max_jobs": MAX_JOBS + 1}
                        ).fetchall()
    if len(jobs) < 2:
        return None
    shown = _topological([(j["job"], [u for u in j["depends_on"]]) for j in jobs[:MAX_JOBS]])
    times = [r["logical_time"] for r in conn.execute(
        q("dag_history_times"), {"job": root, "times": TIMES})][::-1]
    rows = conn.execute(q("dag_history_runs"), {"jobs": shown, "times": times}).fetchall()
    cells: dict[tuple[str, datetime], dict[str, Any]] = {
        (r["job"], r["logical_time"]): r for r in rows}
    by_time: dict[datetime, list[dict[str, Any]]] = {}
    for r in rows:
        by_time.setdefault(r["logical_time"], []).append(r)
    dag_runs = [_dag_run(at, by_time[at], now) for at in times if at in by_time]
    delivered = sorted(d.seconds for d in dag_runs if d.done and d.state == "succeeded")
    p50, p95 = percentile(delivered, 0.5), percentile(delivered, 0.95)
    return {"jobs": shown, "times": times, "cells": cells, "dag_runs": dag_runs,
            "jobs_hidden": len(jobs) > MAX_JOBS, "p50": p50, "p95": p95,
            "measured": len(delivered),
            "trend_svg": trend_svg(root, dag_runs, p50, p95,
                                   f"End-to-end duration of the DAG runs of {root}")}


def _dag_run(at: datetime, rows: list[dict[str, Any]], now: datetime) -> DagRun:
    seconds, done = gantt.end_to_end(rows, now)
    states = {r["state"] for r in rows}
    state = ("running" if not done else "succeeded" if states == {"succeeded"}
             else "failed")
    return DagRun(at, state, seconds, done)


def _topological(jobs: list[tuple[str, list[str]]]) -> list[str]:
    """Jobs by depth (longest path from a root among the shown jobs), then name."""
    ups = dict(jobs)
    depth: dict[str, int] = {}

    def visit(job: str, seen: frozenset[str]) -> int:
        if job not in depth:
            known = [u for u in ups.get(job, []) if u in ups and u not in seen]
            depth[job] = 1 + max((visit(u, seen | {job}) for u in known), default=-1)
        return depth[job]

    for job in ups:
        visit(job, frozenset())
    return sorted(ups, key=lambda j: (depth[j], j))


def trend_svg(root: str, dag_runs: Sequence[DagRun], p50: float | None, p95: float | None,
              label: str) -> Markup:
    """One bar per DAG run (oldest left, linking to it), coloured by its outcome, with
    the p50 and p95 of the successful ones as dashed lines."""
    width, height, left, bottom, top, right = 720, 190, 60, 34, 14, 96
    if not dag_runs:
        return _svg(width, 40, [_text(10, 24, "no DAG runs yet")], label, "trend")
    tallest = max(max(d.seconds for d in dag_runs), p95 or 0.0, 1e-3) * 1.1
    plot_w, plot_h = width - left - right, height - top - bottom
    step = min(plot_w / max(len(dag_runs), 1), 40.0)
    body = [f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#f5f7f8"/>',
            _text(left - 4, top + 8, gantt.precise_seconds(tallest), size=10, anchor="end"),
            _text(left - 4, top + plot_h, "0", size=10, anchor="end")]
    for i, d in enumerate(dag_runs):
        h = max(plot_h * d.seconds / tallest, 1.0)
        x = left + i * step
        href = f"/jobs/{quote(root, safe='')}/dag?at={quote(d.logical_time.isoformat(), safe='')}"
        note = "" if d.done else " so far"
        body.append(
            f'<a href="{escape(href)}"><rect class="trend-bar" data-state="{d.state}"'
            f' x="{x + 1:.1f}" y="{top + plot_h - h:.1f}" width="{max(step - 2, 1):.1f}"'
            f' height="{h:.1f}" fill="{colour(d.state)}"><title>'
            f'{escape(d.logical_time.isoformat())}: {d.state},'
            f' {gantt.precise_seconds(d.seconds)}{note}</title></rect></a>')
    for name, value, tint in (("p50", p50, "#2e7d32"), ("p95", p95, "#c62828")):
        if value is None:
            continue
        y = top + plot_h - plot_h * value / tallest
        body.append(f'<line class="{name}" x1="{left}" y1="{y:.1f}" x2="{left + plot_w}"'
                    f' y2="{y:.1f}" stroke="{tint}" stroke-dasharray="5 3" stroke-width="2"/>')
        body.append(_text(left + plot_w + 4, y + 4, f"{name} {gantt.precise_seconds(value)}",
                          size=11, fill=tint, weight="bold"))
    first, last = dag_runs[0].logical_time, dag_runs[-1].logical_time
    body.append(_text(left, height - 12, first.strftime("%Y-%m-%d %H:%M UTC"), size=10))
    if len(dag_runs) > 1:
        body.append(_text(max(left + step * len(dag_runs), left + 240), height - 12,
                          last.strftime("%Y-%m-%d %H:%M UTC"), size=10, anchor="end"))
    return _svg(width, height, body, label, "trend")
