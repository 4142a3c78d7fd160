"""Pipeline latency: the Gantt chart of one DAG run, its critical path and end-to-end time.

Design note. A run of a DAG run waits, then runs. It becomes *ready* when it is
created and every upstream run present has finished (a root is ready when created);
from then until its first attempt starts it waits for a worker (``wait-bar``), then it
runs until it finishes (``run-bar``, coloured by state; retries and their backoff are
inside it). The *critical path* is the chain that decided when the DAG run ended:
start from the run that finished last and step to the upstream that finished last,
until a run without upstreams — shortening any other run would not have ended the
DAG run sooner. The end-to-end time runs from the DAG run's start (its logical time
when the root was scheduled, i.e. the cron tick; otherwise when its first run was
created, so a backfill of last year does not read as a year) to the last finish.
Pure functions of the rows; the SVG is server-rendered and needs no script.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from html import escape
from typing import Any

from markupsafe import Markup

from pgflow.web.svg import TEXT, _svg, _text, colour, human_seconds

FINISHED = ("succeeded", "failed", "cancelled", "upstream_failed")
MAX_BARS = 150  # a DAG run of thousands of runs draws these (the critical path among them)
WAIT_COLOUR = "#b0bec5"


def precise_seconds(seconds: float) -> str:
    """Durations under 10 s to the millisecond (``1.234 s``), longer ones as usual."""
    if seconds < 10:
        return f"{seconds:.3f} s"
    return human_seconds(seconds)


@dataclass(frozen=True)
class Bar:
    run_id: int
    job: str
    state: str
    ready_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    upstreams: tuple[str, ...]


def bars(rows: Sequence[Mapping[str, Any]]) -> list[Bar]:
    """One bar per run, in start order (unstarted runs last), with its ready time."""
    by_job = {r["job"]: r for r in rows}
    out = []
    for r in rows:
        ups = tuple(u for u in r["depends_on"] if u in by_job)
        finishes = [by_job[u]["finished_at"] for u in ups if by_job[u]["finished_at"]]
        ready = max([r["created_at"], *finishes])
        out.append(Bar(r["id"], r["job"], r["state"], ready, r["started_at"], r["finished_at"],
                       ups))
    return sorted(out, key=lambda b: (b.started_at is None, b.started_at or b.ready_at,
                                      b.run_id))


def critical_path(runs: Sequence[Bar], now: datetime) -> list[int]:
    """Run ids of the critical path, from a root to the run that finished last (a run
    still running counts as finishing now)."""
    by_job = {b.job: b for b in runs}

    def end(bar: Bar) -> datetime | None:
        return bar.finished_at or (now if bar.started_at else None)

    ended = [b for b in runs if end(b) is not None]
    if not ended:
        return []
    last = max(ended, key=lambda b: (end(b), b.run_id))
    path = [last.run_id]
    seen = {last.job}
    while True:
        ups = [by_job[u] for u in last.upstreams if u not in seen and end(by_job[u])]
        if not ups:
            return path[::-1]
        last = max(ups, key=lambda b: (end(b), b.run_id))
        seen.add(last.job)
        path.append(last.run_id)


def dag_start(rows: Sequence[Mapping[str, Any]]) -> datetime:
    """The tick for a scheduled DAG run, else when its first run was created."""
    created: datetime = min(r["created_at"] for r in rows)
    scheduled: list[datetime] = [r["logical_time"] for r in rows if r["trigger"] == "schedule"]
    return min(scheduled) if scheduled else created


def end_to_end(rows: Sequence[Mapping[str, Any]], now: datetime) -> tuple[float, bool]:
    """(seconds from the DAG run's start to its last finish — or to now while a run is
    not finished —, whether every run has finished)."""
    done = all(r["state"] in FINISHED for r in rows)
    finishes = [r["finished_at"] for r in rows if r["finished_at"] is not None]
    last = max(finishes) if done and finishes else now
    return max((last - dag_start(rows)).total_seconds(), 0.0), done


def gantt_svg(runs: Sequence[Bar], origin: datetime, now: datetime, critical: Sequence[int],
              label: str) -> Markup:
    """One row per run on a shared time axis from ``origin``: its wait (ready → started)
    and its run (started → finished, or now), the critical path outlined."""
    width, row, left, right = 900, 26, 190, 70
    if not runs:
        return _svg(width, 40, [_text(10, 24, "no runs")], label, "gantt")
    ends = [b.finished_at or now for b in runs]
    total = max(max((e - origin).total_seconds() for e in ends), 1e-3)
    plot_w = width - left - right
    height = 44 + row * len(runs)

    def x(moment: datetime) -> float:
        return left + plot_w * max((moment - origin).total_seconds(), 0.0) / total

    on_path = set(critical)
    body = [f'<rect x="{left}" y="4" width="{plot_w}" height="{row * len(runs)}"'
            ' fill="#f5f7f8"/>']
    axis_y = 8 + row * len(runs) + 14
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        tick = left + plot_w * fraction
        body.append(f'<line x1="{tick:.1f}" y1="4" x2="{tick:.1f}" y2="{axis_y - 12}"'
                    ' stroke="#dfe4e6"/>')
        body.append(_text(tick, axis_y, "+" + precise_seconds(total * fraction), size=10,
                          anchor="middle"))
    for i, bar in enumerate(runs):
        y = 8 + i * row
        name = bar.job if len(bar.job) <= 26 else bar.job[:25] + "…"
        critical_attr = ' data-critical="1"' if bar.run_id in on_path else ""
        body.append(f'<g class="gantt-run{" critical" if critical_attr else ""}"'
                    f' data-run="{bar.run_id}" data-state="{escape(bar.state)}"{critical_attr}>')
        body.append(f'<a href="/runs/{bar.run_id}">'
                    + _text(6, y + 13, name, weight="bold" if critical_attr else "normal")
                    + "</a>")
        body.extend(_bar_shapes(bar, x, y, row - 8, now, bool(critical_attr)))
        body.append("</g>")
    body.append(_text(left, axis_y + 14, "from the DAG run's start", size=10, fill="#78909c"))
    return _svg(width, height + 14, body, label, "gantt")


def _bar_shapes(bar: Bar, x: Any, y: float, h: float, now: datetime,
                critical: bool) -> list[str]:
    outline = ' stroke="#000" stroke-width="2.5"' if critical else ""
    shapes = []
    wait_end = bar.started_at or (bar.finished_at if bar.state in FINISHED else now)
    if wait_end is not None and wait_end > bar.ready_at:
        waited = (wait_end - bar.ready_at).total_seconds()
        shapes.append(
            f'<rect class="wait-bar" x="{x(bar.ready_at):.1f}" y="{y + h / 4:.1f}"'
            f' width="{max(x(wait_end) - x(bar.ready_at), 1.0):.1f}" height="{h / 2:.1f}"'
            f' fill="{WAIT_COLOUR}"><title>{escape(bar.job)}: waited'
            f' {precise_seconds(waited)} for a worker</title></rect>')
    if bar.started_at is None:
        at = x(bar.ready_at)
        shapes.append(
            f'<rect class="run-bar" x="{at:.1f}" y="{y:.1f}" width="3" height="{h:.1f}"'
            f' fill="{colour(bar.state)}"{outline}><title>{escape(bar.job)}:'
            f' {escape(bar.state)}, never started</title></rect>')
        return shapes
    end = bar.finished_at or now
    ran = (end - bar.started_at).total_seconds()
    label = f"{escape(bar.job)}: {escape(bar.state)}, ran {precise_seconds(ran)}"
    start_x = x(bar.started_at)
    shapes.append(
        f'<rect class="run-bar" x="{start_x:.1f}" y="{y:.1f}"'
        f' width="{max(x(end) - start_x, 2.0):.1f}" height="{h:.1f}" rx="2"'
        f' fill="{colour(bar.state)}"{outline}><title>{label}</title></rect>')
    shapes.append(_text(x(end) + 4, y + h - 4, precise_seconds(ran), size=10,
                        fill=TEXT))
    return shapes


def dag_run_latency(rows: Sequence[Mapping[str, Any]], now: datetime) -> dict[str, Any]:
    """What the DAG-run page shows: the Gantt chart, the critical path's runs, the
    start and the end-to-end time."""
    runs = bars(rows)
    path = critical_path(runs, now)
    start = dag_start(rows)
    seconds, done = end_to_end(rows, now)
    origin = min(start, *(b.ready_at for b in runs))
    drawn = shown_bars(runs, path, MAX_BARS)
    return {"gantt_svg": gantt_svg(drawn, origin, now, path, "Gantt chart of the DAG run"),
            "gantt_hidden": len(runs) - len(drawn), "critical_path": path,
            "dag_start": start, "end_to_end_s": seconds, "dag_done": done}


def shown_bars(runs: Sequence[Bar], path: Sequence[int], limit: int) -> list[Bar]:
    """At most ``limit`` bars in start order: the critical path's, then the earliest."""
    keep = set(path)
    for bar in runs:
        if len(keep) >= limit:
            break
        keep.add(bar.run_id)
    return [b for b in runs if b.run_id in keep]
