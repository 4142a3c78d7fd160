"""Server-rendered SVG charts: no JavaScript, no chart library, no network.

Every function takes plain values and returns markup safe to embed in a page (all
text is escaped). Colours name run states, so a graph reads like the run tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from html import escape

from markupsafe import Markup

STATE_COLOURS = {
    "succeeded": "#2e7d32", "failed": "#c62828", "running": "#1565c0", "queued": "#6a1b9a",
    "retrying": "#ef6c00", "pending": "#8d8d8d", "cancelled": "#5d4037",
    "upstream_failed": "#ad1457", "timed_out": "#b71c1c", "lost": "#4e342e",
    "interrupted": "#f9a825", None: "#cfd8dc",
}
TEXT = "#263238"
GRID = "#eceff1"


def colour(state: str | None) -> str:
    return STATE_COLOURS.get(state, STATE_COLOURS[None])


def _svg(width: float, height: float, body: list[str], label: str, css_class: str) -> Markup:
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" class="{css_class}" role="img"'
        f' width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}"'
        f' aria-label="{escape(label)}"><title>{escape(label)}</title>'
        + "".join(body) + "</svg>")


def _text(x: float, y: float, text: str, *, size: int = 11, anchor: str = "start",
          fill: str = TEXT, weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"'
            f' fill="{fill}" font-weight="{weight}">{escape(text)}</text>')


def human_seconds(seconds: float) -> str:
    """``0.25`` → ``250ms``, ``95`` → ``1m35s``, ``7300`` → ``2h1m``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    return f"{int(seconds // 86400)}d{int(seconds % 86400 // 3600):02d}h"


def percentile(sorted_values: Sequence[float], fraction: float) -> float | None:
    """Nearest-rank percentile of already sorted values (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


# ---------------------------------------------------------------- graphs


@dataclass(frozen=True)
class Node:
    name: str
    depth: int
    state: str | None
    href: str
    note: str = ""
    kind: str = "job"  # or "dataset" (pgflow/lineage.py): drawn as a plain, dashed box


NODE_W, NODE_H, COL_GAP, ROW_GAP, PAD = 170, 34, 60, 14, 12


def layered_graph(nodes: Sequence[Node], edges: Sequence[tuple[str, str]], focus: str | None,
                  label: str) -> Markup:
    """A left-to-right DAG: one column per depth, upstream → downstream edges, nodes
    coloured by state and linking to ``href``."""
    if not nodes:
        return _svg(300, 40, [_text(PAD, 24, "no jobs")], label, "graph")
    depths = sorted({n.depth for n in nodes})
    column = {d: i for i, d in enumerate(depths)}
    by_column: dict[int, list[Node]] = {}
    for node in sorted(nodes, key=lambda n: n.name):
        by_column.setdefault(column[node.depth], []).append(node)
    tallest = max(len(c) for c in by_column.values())
    width = PAD * 2 + len(depths) * NODE_W + (len(depths) - 1) * COL_GAP
    height = PAD * 2 + tallest * NODE_H + (tallest - 1) * ROW_GAP + 16
    where: dict[str, tuple[float, float]] = {}
    for col, members in by_column.items():
        offset = (tallest - len(members)) * (NODE_H + ROW_GAP) / 2
        for row, node in enumerate(members):
            where[node.name] = (PAD + col * (NODE_W + COL_GAP),
                                PAD + offset + row * (NODE_H + ROW_GAP))
    body = ['<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7"'
            ' markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z"'
            ' fill="#90a4ae"/></marker></defs>']
    for upstream, job in edges:
        if upstream not in where or job not in where:
            continue
        (x1, y1), (x2, y2) = where[upstream], where[job]
        x1, y1, y2 = x1 + NODE_W, y1 + NODE_H / 2, y2 + NODE_H / 2
        bend = max(COL_GAP / 2, (x2 - x1) / 2)
        body.append(f'<path class="edge" d="M{x1:.1f},{y1:.1f} C{x1 + bend:.1f},{y1:.1f}'
                    f' {x2 - bend:.1f},{y2:.1f} {x2:.1f},{y2:.1f}" fill="none"'
                    ' stroke="#90a4ae" stroke-width="1.5" marker-end="url(#arrow)"/>')
    for node in nodes:
        x, y = where[node.name]
        if node.kind == "dataset":
            body.append(_dataset_node(node, x, y))
            continue
        stroke = ' stroke="#000" stroke-width="3"' if node.name == focus else ""
        name = node.name if len(node.name) <= 22 else node.name[:21] + "…"
        state = node.state or "no runs"
        body.append(
            f'<a href="{escape(node.href)}" class="node" data-job="{escape(node.name)}"'
            f' data-state="{escape(state)}"><title>{escape(node.name)}: {escape(state)}'
            f'{escape(node.note)}</title>'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{NODE_W}" height="{NODE_H}" rx="6"'
            f' fill="{colour(node.state)}"{stroke}/>'
            + _text(x + 8, y + 14, name, fill="#fff", weight="bold")
            + _text(x + 8, y + 28, state, size=10, fill="#fff") + "</a>")
    return _svg(width, height, body, label, "graph")


def _dataset_node(node: Node, x: float, y: float) -> str:
    name = node.name.partition(":")[2]
    shown = name if len(name) <= 22 else name[:21] + "…"
    return (f'<a href="{escape(node.href)}" class="node dataset" data-dataset="{escape(name)}">'
            f'<title>dataset {escape(name)}</title>'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{NODE_W}" height="{NODE_H}" rx="14"'
            ' fill="#eceff1" stroke="#607d8b" stroke-width="1.5" stroke-dasharray="4 3"/>'
            + _text(x + 10, y + 14, shown, fill="#263238", weight="bold")
            + _text(x + 10, y + 28, "dataset", size=10, fill="#546e7a") + "</a>")


# ---------------------------------------------------------------- histogram


def duration_histogram(durations: Sequence[float], label: str, bins: int = 24) -> Markup:
    """Bars of attempt durations with p50 and p95 marked (linear bins up to the p99)."""
    width, height, left, bottom, top = 640, 200, 44, 30, 22
    if not durations:
        return _svg(width, 60, [_text(10, 34, "no finished attempts yet")], label, "histogram")
    values = sorted(durations)
    p50, p95 = percentile(values, 0.5) or 0.0, percentile(values, 0.95) or 0.0
    high = max(percentile(values, 0.99) or 0.0, p95, 1e-3) * 1.05
    step = high / bins
    counts = [0] * bins
    for v in values:
        counts[min(int(v / step), bins - 1)] += 1
    tallest = max(counts)
    plot_w, plot_h = width - left - 10, height - top - bottom
    body = [f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}"'
            f' stroke="{TEXT}"/>']
    for i, count in enumerate(counts):
        if not count:
            continue
        h = plot_h * count / tallest
        x = left + i * plot_w / bins
        body.append(f'<rect class="bar" x="{x + 1:.1f}" y="{top + plot_h - h:.1f}"'
                    f' width="{plot_w / bins - 2:.1f}" height="{h:.1f}" fill="#4e79a7">'
                    f'<title>{human_seconds(i * step)} to {human_seconds((i + 1) * step)}:'
                    f' {count}</title></rect>')
    for i in range(0, bins + 1, max(1, bins // 6)):
        x = left + i * plot_w / bins
        body.append(_text(x, height - 10, human_seconds(i * step), size=10, anchor="middle"))
    body.append(_text(left - 6, top + 4, str(tallest), size=10, anchor="end"))
    body.append(_text(left - 6, top + plot_h, "0", size=10, anchor="end"))
    for name, value, tint in (("p50", p50, "#2e7d32"), ("p95", p95, "#c62828")):
        x = left + min(value / high, 1.0) * plot_w
        body.append(f'<line class="{name}" x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}"'
                    f' y2="{top + plot_h}" stroke="{tint}" stroke-dasharray="4 3"'
                    ' stroke-width="2"/>')
        anchor = "end" if x > left + plot_w * 0.85 else "start"
        body.append(_text(x + (3 if anchor == "start" else -3), top - 8 + (0 if name == "p50"
                          else 10), f"{name} {human_seconds(value)}", size=11, anchor=anchor,
                          fill=tint, weight="bold"))
    return _svg(width, height, body, label, "histogram")


# ---------------------------------------------------------------- dashboard


def runs_per_minute(minutes: dict[int, tuple[int, int, int]], now: datetime,
                    label: str) -> Markup:
    """Runs finished per minute over the 24 h before ``now`` (keys: epoch minutes)."""
    width, height, left, bottom, top = 720, 170, 40, 26, 12
    end = int(now.timestamp()) // 60 * 60
    start = end - 1439 * 60
    series = [minutes.get(start + i * 60, (0, 0, 0))[0] for i in range(1440)]
    tallest = max(max(series), 1)
    plot_w, plot_h = width - left - 10, height - top - bottom
    points = [f"{left + i * plot_w / 1439:.1f},{top + plot_h - plot_h * v / tallest:.1f}"
              for i, v in enumerate(series)]
    base = f"{left + plot_w:.1f},{top + plot_h:.1f} {left:.1f},{top + plot_h:.1f}"
    body = [f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="{GRID}"/>',
            f'<polygon points="{" ".join(points)} {base}" fill="#90caf9"/>',
            f'<polyline class="rpm" points="{" ".join(points)}" fill="none" stroke="#1565c0"'
            ' stroke-width="1"/>',
            _text(left - 4, top + 8, str(tallest), size=10, anchor="end"),
            _text(left - 4, top + plot_h, "0", size=10, anchor="end")]
    for hours_ago in range(24, -1, -6):
        x = left + plot_w * (24 - hours_ago) / 24
        body.append(_text(x, height - 8, "now" if hours_ago == 0 else f"-{hours_ago}h",
                          size=10, anchor="middle"))
    return _svg(width, height, body, label, "chart")


def success_rate_by_hour(minutes: dict[int, tuple[int, int, int]], now: datetime,
                         label: str) -> Markup:
    """Share of finished runs that succeeded (of succeeded + failed), per hour, 24 h."""
    width, height, left, bottom, top = 720, 150, 40, 26, 12
    end = int(now.timestamp()) // 60 * 60 + 60
    plot_w, plot_h = width - left - 10, height - top - bottom
    body = [f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="{GRID}"/>',
            _text(left - 4, top + 8, "100%", size=10, anchor="end"),
            _text(left - 4, top + plot_h, "0%", size=10, anchor="end")]
    for hour in range(24):
        lo = end - (24 - hour) * 3600
        ok = failed = 0
        for minute in range(lo, lo + 3600, 60):
            _, s, f = minutes.get(minute, (0, 0, 0))
            ok, failed = ok + s, failed + f
        x = left + hour * plot_w / 24
        if ok + failed:
            rate = ok / (ok + failed)
            h = plot_h * rate
            tint = "#2e7d32" if rate >= 0.95 else "#ef6c00" if rate >= 0.8 else "#c62828"
            body.append(f'<rect class="rate" x="{x + 1:.1f}" y="{top + plot_h - h:.1f}"'
                        f' width="{plot_w / 24 - 2:.1f}" height="{h:.1f}" fill="{tint}">'
                        f'<title>{rate:.1%} of {ok + failed}</title></rect>')
    for hours_ago in range(24, -1, -6):
        x = left + plot_w * (24 - hours_ago) / 24
        body.append(_text(x, height - 8, "now" if hours_ago == 0 else f"-{hours_ago}h",
                          size=10, anchor="middle"))
    return _svg(width, height, body, label, "chart")


# ---------------------------------------------------------------- attempts


@dataclass(frozen=True)
class Span:
    label: str
    start: datetime
    end: datetime | None
    outcome: str | None


def attempt_timeline(spans: Sequence[Span], now: datetime, label: str) -> Markup:
    """One bar per attempt on a shared time axis (running attempts end at ``now``)."""
    width, row, left = 640, 24, 80
    if not spans:
        return _svg(width, 40, [_text(10, 24, "no attempts yet")], label, "timeline")
    first = min(s.start for s in spans)
    last = max(s.end or now for s in spans)
    total = max((last - first).total_seconds(), 1e-3)
    height = 30 + row * len(spans)
    plot_w = width - left - 10
    body = []
    for i, span in enumerate(spans):
        end = span.end or now
        x = left + plot_w * (span.start - first).total_seconds() / total
        w = max(plot_w * (end - span.start).total_seconds() / total, 2.0)
        y = 6 + i * row
        outcome = span.outcome or "running"
        duration = human_seconds((end - span.start).total_seconds())
        body.append(_text(4, y + 14, span.label, size=11))
        body.append(f'<rect class="attempt" x="{x:.1f}" y="{y}" width="{w:.1f}"'
                    f' height="{row - 6}" rx="3" fill="{colour(outcome)}">'
                    f'<title>{escape(span.label)}: {escape(outcome)}, {duration}</title></rect>')
    body.append(_text(left, height - 6, "+0s", size=10))
    body.append(_text(left + plot_w, height - 6, "+" + human_seconds(total), size=10,
                      anchor="end"))
    return _svg(width, height, body, label, "timeline")

