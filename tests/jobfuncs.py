"""Entrypoint jobs used by the engine tests (imported by workers by name)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pgflow


async def noop(ctx: Any) -> None:
    return None


def sync_noop(ctx: Any) -> None:
    return None


async def record(ctx: Any) -> None:
    """Append 'run_id attempt' to the file named by params['path']."""
    with open(ctx.params["path"], "a") as out:
        out.write(f"{ctx.run_id} {ctx.attempt} {ctx.logical_time.isoformat()}\n")


async def sleep(ctx: Any) -> None:
    await asyncio.sleep(float(ctx.params.get("seconds", 60)))


def sync_sleep(ctx: Any) -> None:
    deadline = time.monotonic() + float(ctx.params.get("seconds", 60))
    while time.monotonic() < deadline and not ctx.cancelled.is_set():
        time.sleep(0.05)


async def fail(ctx: Any) -> None:
    raise ValueError(f"attempt {ctx.attempt} failed")


async def permanent(ctx: Any) -> None:
    raise pgflow.PermanentError("bad input, do not retry")


async def unavailable(ctx: Any) -> None:
    raise pgflow.SourceUnavailable("warehouse")


async def fail_once(ctx: Any) -> None:
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")


async def marker_then_sleep(ctx: Any) -> None:
    """Write a marker file (so a test knows the attempt started), then sleep."""
    Path(ctx.params["marker"]).write_text(f"{os.getpid()} {ctx.attempt}")
    await asyncio.sleep(float(ctx.params.get("seconds", 60)))


def stubborn_sleep(ctx: Any) -> None:
    """A sync job that ignores ctx.cancelled (writes a marker first)."""
    Path(ctx.params["marker"]).write_text("started")
    time.sleep(float(ctx.params.get("seconds", 120)))


async def source_down_while(ctx: Any) -> None:
    """SourceUnavailable(params['source']) while the file params['down'] exists; records
    'run_id attempt' in params['path'] (if given) either way."""
    if "path" in ctx.params:
        with open(ctx.params["path"], "a") as out:
            out.write(f"{ctx.run_id} {ctx.attempt}\n")
    await asyncio.sleep(float(ctx.params.get("seconds", 0)))
    if Path(ctx.params["down"]).exists():
        raise pgflow.SourceUnavailable(ctx.params.get("source", "crm"))


async def fail_if(ctx: Any) -> None:
    """Fails when the run's params say ``fail`` (one job, failing and succeeding runs)."""
    if ctx.params.get("fail"):
        raise RuntimeError(f"run {ctx.run_id} told to fail")
    await asyncio.sleep(float(ctx.params.get("seconds", 0)))


TRIGGER_EVENTS: dict[int, list[dict[str, Any]]] = {}


async def record_trigger_events(ctx: Any) -> None:
    """Keep the dataset events the run consumed (the worker runs in the test's process)."""
    TRIGGER_EVENTS[ctx.run_id] = ctx.trigger_events
