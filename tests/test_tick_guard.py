"""The leader keeps the next tick clear of its periodic chores (pgflow/leader.py,
TICK_GUARD_S): they wait while a tick is imminent, and still run with jobs that fire
every second."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest
import structlog

from pgflow import registry, safety_net
from pgflow.leader import TICK_GUARD_S, Leadership
from pgflow.spec import JobSpec

Conn = psycopg.Connection[dict[str, Any]]


def test_chores_wait_only_while_a_tick_is_imminent() -> None:
    leadership = Leadership("postgresql://unused", "r1", 3.0, structlog.get_logger())
    assert leadership._clear_of_tick()  # nothing scheduled yet
    leadership._tick_at = time.monotonic() + TICK_GUARD_S / 2
    assert not leadership._clear_of_tick()  # the tick's pass comes first
    leadership._tick_at = time.monotonic() - 0.01
    assert leadership._clear_of_tick()  # that tick was just handled
    leadership._tick_at = time.monotonic() + 10 * TICK_GUARD_S
    assert leadership._clear_of_tick()


def test_chores_still_run_when_jobs_fire_every_second(
    conn: Conn, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry.apply(conn, [JobSpec.model_validate(
        {"name": "every_second", "schedule": "* * * * * *", "command": "true",
         "catchup": "none"})])
    nets: list[float] = []
    real = safety_net.run_once_async

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nets.append(time.monotonic())
        return await real(*args, **kwargs)

    monkeypatch.setattr(safety_net, "run_once_async", counted)

    async def scenario() -> None:
        stop = asyncio.Event()
        leadership = Leadership(db_url, "r1", 3.0, structlog.get_logger(), net_interval=0.2)
        task = asyncio.create_task(leadership.run(stop))
        deadline = time.monotonic() + 30
        while (len(nets) < 3 or ticks(conn) < 3) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    assert len(nets) >= 3 and ticks(conn) >= 3
    times = [r["logical_time"] for r in conn.execute(
        "SELECT logical_time FROM pgflow.runs ORDER BY logical_time").fetchall()]
    assert len(set(times)) == len(times)  # one run per tick, none doubled


def ticks(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) AS n FROM pgflow.runs").fetchone()
    assert row is not None
    return int(row["n"])
