"""Entrypoint jobs of the fencing and partition tests: each writes a journal line
``<event> <run id> <attempt> <time.time()>`` to the file named by params['journal'], so a
test can order what a job did against what the database recorded."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any


def note(ctx: Any, event: str) -> None:
    with open(ctx.params["journal"], "a") as out:
        out.write(f"{event} {ctx.run_id} {ctx.attempt} {time.time()!r}\n")


def journal(path: Path) -> list[tuple[str, int, int, float]]:
    """The lines written so far, as (event, run id, attempt, time)."""
    if not path.exists():
        return []
    lines = [line.split() for line in path.read_text().splitlines()]
    return [(e, int(r), int(a), float(t)) for e, r, a, t in lines]


async def first_attempt_sleeps(ctx: Any) -> None:
    """Attempt 1 sleeps (params['seconds'], default 60) and notes its cancellation;
    later attempts succeed at once."""
    note(ctx, "start")
    if ctx.attempt > 1:
        return
    try:
        await asyncio.sleep(float(ctx.params.get("seconds", 60)))
    except asyncio.CancelledError:
        note(ctx, "cancelled")
        raise
    note(ctx, "done")


def stubborn(ctx: Any) -> None:
    """A sync job that ignores ctx.cancelled for params['seconds']."""
    note(ctx, "start")
    time.sleep(float(ctx.params["seconds"]))
    note(ctx, "returned")


def stamp(ctx: Any) -> None:
    """A sync job that notes when its body ran."""
    note(ctx, "ran")


async def async_stamp(ctx: Any) -> None:
    note(ctx, "ran")


async def sleeps_every_attempt(ctx: Any) -> None:
    """Every attempt sleeps (params['seconds'], default 60) and notes its cancellation."""
    note(ctx, "start")
    try:
        await asyncio.sleep(float(ctx.params.get("seconds", 60)))
    except asyncio.CancelledError:
        note(ctx, "cancelled")
        raise
    note(ctx, "done")


async def surrogate_error(ctx: Any) -> None:
    """Fails with a message holding a lone surrogate, as a surrogate-escaped file name
    gives (PostgreSQL cannot store it)."""
    name = b"report-\xff.csv".decode("utf-8", "surrogateescape")
    raise FileNotFoundError(f"no such file: {name}")
