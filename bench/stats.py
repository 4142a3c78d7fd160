"""Percentiles and rate helpers shared by the figures."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def pct(values: Sequence[float], q: float) -> float | None:
    """Percentile with linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: Sequence[float], digits: int = 2) -> dict[str, float | int | None]:
    """n, p50/p95/p99, max and mean of a sample."""
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, digits)

    return {"n": len(values), "p50": r(pct(values, 50)), "p95": r(pct(values, 95)),
            "p99": r(pct(values, 99)), "max": r(max(values)) if values else None,
            "mean": r(statistics.fmean(values)) if values else None}


def decile_rates(first: float, last: float, done_times: Sequence[float]) -> list[float]:
    """Jobs/s in each tenth of the window [first, last] (completions are flushed in
    batches, so equal-count deciles would divide by zero)."""
    if last <= first or not done_times:
        return []
    width = (last - first) / 10
    counts = [0] * 10
    for t in done_times:
        counts[min(9, max(0, int((t - first) / width)))] += 1
    return [round(c / width, 1) for c in counts]


def ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return round(value / reference, 3)
