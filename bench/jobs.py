"""Job bodies the benchmark registers. Worker replicas import them (``bench.jobs:...``),
so they run with the project root as working directory."""

from __future__ import annotations

import asyncio
import os
import time
from typing import IO, Any

_starts: IO[str] | None = None


async def noop(ctx: Any) -> None:
    return None


async def record_start(ctx: Any) -> None:
    """Write ``<run id> <time.time()>`` to $BENCH_LAT_FILE: the instant the job began."""
    now = time.time()
    global _starts
    if _starts is None:
        _starts = open(os.environ["BENCH_LAT_FILE"], "a", buffering=1)  # noqa: SIM115
    _starts.write(f"{ctx.run_id} {now:.6f}\n")


async def sleep_async(ctx: Any) -> None:
    await asyncio.sleep(float(ctx.params.get("seconds", 10)))


def sleep_sync(ctx: Any) -> None:
    time.sleep(float(ctx.params.get("seconds", 10)))
