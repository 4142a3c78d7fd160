"""Durations as users write them: ``30s``, ``10m``, ``2h``, ``1d`` or a number of seconds."""

from __future__ import annotations

import math
import re

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_duration(value: object) -> float:
    """Return the duration in seconds; raise ValueError with a readable reason."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 30s, 10m, 2h, 1d, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if not match:
            shown = value if len(value) <= 40 else value[:40] + "..."
            raise ValueError(f"expected a duration like 30s, 10m, 2h, 1d, got {shown!r}")
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    else:
        raise ValueError(f"expected a duration like 30s, 10m, 2h, 1d, got {type(value).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"duration must be a non-negative number of seconds, got {value!r}")
    if seconds > 366 * 86400:
        raise ValueError(f"duration {value!r} is longer than a year")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest exact spelling of a duration (``90`` → ``90s``, ``7200`` → ``2h``)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
