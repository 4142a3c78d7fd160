import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import structlog
from drive import check_nothing_stuck
from psycopg import AsyncConnection
from structlog.testing import capture_logs

from pgflow import registry
from pgflow.leader import LeaderInfo, Leadership, current_leader
from pgflow.scheduler import SchedulePass
from pgflow.spec import JobSpec

Conn = psycopg.Connection[dict[str, Any]]
TTL = 3.0
ROOT = Path(__file__).resolve().parent.parent

# A scheduler replica in a process of its own, so that the test can freeze it (SIGSTOP).
REPLICA_SCRIPT = """
import asyncio, signal, sys
import structlog
from pgflow.leader import run_scheduler

async def main() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await run_scheduler(sys.argv[1], sys.argv[2], float(sys.argv[3]), stop,
                        structlog.get_logger())

asyncio.run(main())
"""


@pytest.fixture(autouse=True)
def _nothing_stuck(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from check_nothing_stuck(request)


class Replica:
    """A Leadership running as a task, with its own stop event."""

    def __init__(self, url: str, name: str) -> None:
        self.leadership = Leadership(url, name, TTL, structlog.get_logger())
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(self.leadership.run(self.stop))

    @property
    def leads(self) -> bool:
        return self.leadership.is_leader

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 5)


@asynccontextmanager
async def replicas(url: str, *names: str) -> AsyncIterator[list[Replica]]:
    started = [Replica(url, name) for name in names]
    try:
        yield started
    finally:
        for replica in started:
            await replica.close()


async def eventually(check: Callable[[], Awaitable[bool] | bool], timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        outcome = check()
        if outcome if isinstance(outcome, bool) else await outcome:
            return
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def leader_row(url: str) -> LeaderInfo | None:
    async with await AsyncConnection.connect(url, autocommit=True) as conn:
        return await current_leader(conn, TTL)


async def backend_alive(url: str, pid: int) -> bool:
    async with await AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,))
        return await cur.fetchone() is not None


async def terminate(url: str, pid: int) -> None:
    async with await AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("SELECT pg_terminate_backend(%s, 2000)", (pid,))


def only_leader(group: list[Replica]) -> Replica:
    leading = [r for r in group if r.leads]
    assert len(leading) == 1, [r.leadership.replica_id for r in leading]
    return leading[0]


def test_exactly_one_replica_leads_and_a_standby_takes_over(db_url: str) -> None:
    async def scenario() -> None:
        async with replicas(db_url, "r1", "r2", "r3") as group:
            await eventually(lambda: any(r.leads for r in group))
            await asyncio.sleep(1.5)  # every standby has tried the lock again meanwhile
            first = only_leader(group)
            first_term = first.leadership.term
            assert first_term is not None
            row = await leader_row(db_url)
            assert row is not None and row.replica_id == first.leadership.replica_id
            assert row.term == first.leadership.term and not row.stale

            await first.close()
            assert not first.leads
            rest = [r for r in group if r is not first]
            await eventually(lambda: any(r.leads for r in rest), timeout=4)
            second = only_leader(rest)
            row = await leader_row(db_url)
            assert row is not None and row.replica_id == second.leadership.replica_id
            assert second.leadership.term == row.term == first_term + 1

    asyncio.run(scenario())


def test_a_leader_whose_session_is_killed_stops_leading(db_url: str) -> None:
    async def scenario() -> int:
        async with replicas(db_url, "only") as [replica]:
            await eventually(lambda: replica.leads)
            row = await leader_row(db_url)
            assert row is not None
            await terminate(db_url, row.backend_pid)
            # It competes again on a new session and wins the next term.
            await eventually(lambda: replica.leads and replica.leadership.term == row.term + 1)
            again = await leader_row(db_url)
            assert again is not None and again.term == row.term + 1
            assert again.backend_pid != row.backend_pid
            return row.term

    with capture_logs() as logs:
        term = asyncio.run(scenario())
    events = [(entry["event"], entry.get("term")) for entry in logs]
    ended = events.index(("scheduler leadership ended", term))
    assert events[ended + 1][0] == "scheduler connection failed"
    assert events.index(("scheduler leadership won", term + 1)) > ended


def test_a_frozen_leader_is_deposed_after_the_lease_ttl(db_url: str, tmp_path: Path) -> None:
    log = (tmp_path / "frozen.log").open("w")
    frozen = subprocess.Popen(
        [sys.executable, "-c", REPLICA_SCRIPT, db_url, "frozen", str(TTL)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )

    async def scenario() -> None:
        async def frozen_leads() -> bool:
            row = await leader_row(db_url)
            return row is not None and row.replica_id == "frozen"

        await eventually(frozen_leads, timeout=15)
        old = await leader_row(db_url)
        assert old is not None
        async with replicas(db_url, "standby") as [standby]:
            await asyncio.sleep(1.2)  # a standby leaves a live leader alone
            assert not standby.leads
            os.kill(frozen.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            await eventually(lambda: standby.leads, timeout=TTL + 4)
            assert time.monotonic() - stopped >= TTL - 1.0  # only a stale heartbeat deposes
            assert not await backend_alive(db_url, old.backend_pid)
            row = await leader_row(db_url)
            assert row is not None and (row.replica_id, row.term) == ("standby", old.term + 1)

            os.kill(frozen.pid, signal.SIGCONT)  # it wakes up, finds its session gone
            await asyncio.sleep(1.5)
            assert standby.leads
            row = await leader_row(db_url)
            assert row is not None and row.replica_id == "standby"

    try:
        asyncio.run(scenario())
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
        frozen.terminate()
        frozen.wait(10)
        log.close()
    output = (tmp_path / "frozen.log").read_text()
    assert "scheduler leadership won" in output and "Traceback" not in output


def test_a_definition_change_wakes_a_sleeping_leader(conn: Conn, db_url: str) -> None:
    async def scenario() -> None:
        # Nothing is scheduled and the leader may sleep 30 s: only the NOTIFY sent by
        # registration can wake it in time.
        leadership = Leadership(db_url, "sleepy", 60, structlog.get_logger(), max_sleep=30)
        stop = asyncio.Event()
        task = asyncio.create_task(leadership.run(stop))
        try:
            await eventually(lambda: leadership.is_leader)
            await asyncio.sleep(0.3)  # it is asleep now
            await asyncio.to_thread(registry.apply, conn, [JobSpec.model_validate(
                {"name": "new", "schedule": "* * * * * *", "command": "true"})])

            async def has_run() -> bool:
                async with await AsyncConnection.connect(db_url) as aconn:
                    cur = await aconn.execute("SELECT 1 FROM pgflow.runs WHERE job = 'new'")
                    return await cur.fetchone() is not None

            await eventually(has_run, timeout=10)
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)

    asyncio.run(scenario())


def test_no_tick_is_lost_or_doubled_across_a_takeover(conn: Conn, db_url: str) -> None:
    jobs = [JobSpec.model_validate({"name": f"every_second_{i}", "schedule": "* * * * * *",
                                    "catchup": "all", "command": "true"}) for i in range(20)]
    registry.apply(conn, jobs)

    async def scenario() -> None:
        async with replicas(db_url, "a", "b") as group:
            await eventually(lambda: any(r.leads for r in group))
            await asyncio.sleep(1.5)
            await only_leader(group).close()
            await eventually(lambda: any(r.leads for r in group), timeout=4)
            await asyncio.sleep(1.5)

    asyncio.run(scenario())
    rows = conn.execute(
        "SELECT job, count(*) AS runs, count(DISTINCT logical_time) AS ticks,"
        " extract(epoch FROM max(logical_time) - min(logical_time))::int + 1 AS span"
        " FROM pgflow.runs GROUP BY job").fetchall()
    assert len(rows) == len(jobs)
    for row in rows:
        # One run per second from the first tick to the last: none doubled, none skipped.
        assert row["runs"] == row["ticks"] == row["span"] >= 3, row



def test_a_leader_busy_with_a_large_backlog_keeps_its_term(conn: Conn, db_url: str) -> None:
    """Defect 14: 50 jobs x 2,000 missed ticks under catchup = "all" (100,000 runs) with a
    1.5 s TTL and a standby ready to depose. One transaction holding all of a pass's
    ticks outlasts the TTL; passes are bounded and heartbeat in between, so the leader
    keeps its term, and every tick is created exactly once."""
    jobs, backlog = 50, 2000
    registry.apply(conn, [JobSpec.model_validate(
        {"name": f"busy_{i:02}", "schedule": "* * * * * *", "catchup": "all",
         "command": "true"}) for i in range(jobs)])
    conn.execute("UPDATE pgflow.jobs SET paused = true")

    async def scenario() -> tuple[int, int]:
        group = [Leadership(db_url, name, 1.5, structlog.get_logger(), max_sleep=0.5,
                            retry_interval=0.2) for name in ("first", "second")]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(g.run(stop)) for g in group]
        try:
            await eventually(lambda: any(g.is_leader for g in group))
            row = await leader_row(db_url)
            assert row is not None
            conn.execute("UPDATE pgflow.jobs SET paused = false,"
                         " next_fire_at = date_trunc('second', now()) - %s * interval '1 s'",
                         (backlog,))
            conn.execute("SELECT pg_notify('pgflow_jobs', '')")

            def caught_up() -> bool:  # every job's next tick is (nearly) in the future
                behind = conn.execute("SELECT count(*) AS n FROM pgflow.jobs"
                                      " WHERE next_fire_at < now() - interval '3 s'").fetchone()
                return behind == {"n": 0}

            await eventually(caught_up, timeout=90)
            after = await leader_row(db_url)
            assert after is not None
            return row.term, after.term
        finally:
            stop.set()
            await asyncio.gather(*tasks)

    with capture_logs() as logs:
        before, after = asyncio.run(scenario())
    assert after == before, "the busy leader was deposed"
    assert not [e for e in logs if e["event"] == "deposed a frozen scheduler leader"]
    rows = conn.execute(
        "SELECT job, count(*) AS runs, count(DISTINCT logical_time) AS ticks,"
        " extract(epoch FROM max(logical_time) - min(logical_time))::int + 1 AS span"
        " FROM pgflow.runs GROUP BY job").fetchall()
    assert len(rows) == jobs
    for row in rows:
        assert row["runs"] == row["ticks"] == row["span"] >= backlog, row


def test_a_leader_creates_lone_ticks_ahead_and_never_lets_one_start_early(
        conn: Conn, db_url: str) -> None:
    registry.apply(conn, [JobSpec.model_validate(
        {"name": "every_second", "schedule": "* * * * * *", "command": "true",
         "catchup": "none"})])

    async def created_ahead() -> bool:
        async with await AsyncConnection.connect(db_url) as aconn:
            cur = await aconn.execute("SELECT count(*) FROM pgflow.runs"
                                      " WHERE created_at < logical_time")
            row = await cur.fetchone()
            return row is not None and row[0] >= 3

    async def scenario() -> None:
        async with replicas(db_url, "ahead"):
            await eventually(created_ahead, timeout=15)

    asyncio.run(scenario())
    early = conn.execute("SELECT count(*) AS n FROM pgflow.runs"
                         " WHERE available_at < logical_time").fetchone()
    assert early == {"n": 0}  # claimable from its tick on, never before


def test_a_release_the_leader_was_too_busy_to_meet_is_sent_late(db_url: str) -> None:
    """The workers are woken for a tick whose runs were created ahead even when the
    leader looks only after it passed (a long pass, a chore)."""
    async def scenario() -> list[str]:
        leadership = Leadership(db_url, "busy", TTL, structlog.get_logger())
        async with await AsyncConnection.connect(db_url, autocommit=True) as aconn, \
                await AsyncConnection.connect(db_url, autocommit=True) as listener:
            await listener.execute("LISTEN pgflow_queue")
            cur = await aconn.execute("SELECT now() - interval '1 second'")
            row = await cur.fetchone()
            assert row is not None
            leadership._releases = {row[0]}  # a tick already past, never released
            await leadership._wait_for_work(aconn, asyncio.Event(), SchedulePass())
            assert leadership._releases == set()
            return [n.channel async for n in listener.notifies(timeout=2, stop_after=1)]

    assert asyncio.run(scenario()) == ["pgflow_queue"]
