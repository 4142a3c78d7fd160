"""Server-rendered charts: pure functions of plain values."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from pgflow.web import svg

NOW = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert svg.percentile(values, 0.5) == 50.0
    assert svg.percentile(values, 0.95) == 95.0
    assert svg.percentile([7.0], 0.95) == 7.0
    assert svg.percentile([], 0.5) is None


def test_human_seconds() -> None:
    assert [svg.human_seconds(s) for s in (0.25, 5, 42, 95, 7300, 90000)] == [
        "250ms", "5.0s", "42s", "1m35s", "2h01m", "1d01h"]


def test_layered_graph_puts_upstreams_left_and_escapes_names() -> None:
    nodes = [svg.Node("<script>", -1, "succeeded", "/jobs/x"),
             svg.Node("mid", 0, "failed", "/jobs/mid"),
             svg.Node("down", 1, None, "/jobs/down")]
    markup = str(svg.layered_graph(nodes, [("<script>", "mid"), ("mid", "down")], "mid", "g"))
    assert "<script>" not in markup and "&lt;script&gt;" in markup
    assert markup.count('class="edge"') == 2
    xs = {name: float(x) for name, x in re.findall(
        r'data-job="([^"]+)".*?<rect x="([\d.]+)"', markup)}
    assert xs["&lt;script&gt;"] < xs["mid"] < xs["down"]
    assert 'stroke="#000"' in markup  # the focus job
    assert 'data-state="no runs"' in markup


def test_histogram_marks_p50_and_p95() -> None:
    markup = str(svg.duration_histogram([float(v) for v in range(1, 101)], "h"))
    assert 'class="p50"' in markup and 'class="p95"' in markup
    assert "p50 50s" in markup and "p95 1m35s" in markup
    assert markup.count('class="bar"') > 10
    assert "no finished attempts" in str(svg.duration_histogram([], "h"))


def test_runs_per_minute_covers_24_hours() -> None:
    minute = int(NOW.timestamp()) // 60 * 60
    minutes = {minute: (10, 9, 1), minute - 3600: (4, 4, 0)}
    markup = str(svg.runs_per_minute(minutes, NOW, "r"))
    points = re.search(r'class="rpm" points="([^"]+)"', markup)
    assert points and len(points.group(1).split()) == 1440
    rates = str(svg.success_rate_by_hour(minutes, NOW, "s"))
    assert rates.count('class="rate"') == 2 and "90.0% of 10" in rates


def test_attempt_timeline() -> None:
    spans = [svg.Span("attempt 1", NOW - timedelta(minutes=10), NOW - timedelta(minutes=9),
                      "failed"),
             svg.Span("attempt 2", NOW - timedelta(minutes=5), None, None)]
    markup = str(svg.attempt_timeline(spans, NOW, "t"))
    assert markup.count('class="attempt"') == 2
    assert "attempt 2: running, 5m00s" in markup
