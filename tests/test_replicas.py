"""Several ``pgflow serve`` replicas on one database: exactly one run per tick, and
scheduling leadership that survives a killed or frozen leader.

A job fires every second (6-field cron) with ``catchup = "all"``, so a tick that a
leader change delays must still get its run: over the observed window every second
has exactly one run, and every run ran once (or was retried after a crash).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import psycopg
from engine import add_job, wait_for
from procs import Replica, Replicas, db_now, wait_for_leader

Conn = psycopg.Connection[dict[str, Any]]
EVERY_SECOND = "* * * * * *"
SECOND = timedelta(seconds=1)


def ticking_job(conn: Conn) -> None:
    # Retried on loss: a run whose replica is killed or frozen mid-run must still succeed.
    add_job(conn, "tick", schedule=EVERY_SECOND, entrypoint="jobfuncs:noop", catchup="all",
            retry={"max_attempts": 5, "backoff": 0.1, "max_backoff": 0.1, "jitter": False})


def start_three(conn: Conn, replicas: Replicas) -> list[Replica]:
    started = [replicas.start(name) for name in ("a", "b", "c")]
    for replica in started:
        replica.id(conn)
    return started


def tick_runs(conn: Conn) -> list[dict[str, Any]]:
    return conn.execute(
        "SELECT logical_time, count(*) AS runs, min(id) AS id, min(state) AS state,"
        " min(trigger) AS trigger, min(created_at) AS created_at"
        " FROM pgflow.runs WHERE job = 'tick' GROUP BY logical_time ORDER BY logical_time"
    ).fetchall()


def wait_for_ticks_through(conn: Conn, moment: datetime, timeout: float = 20.0) -> None:
    wait_for(lambda: (rows := tick_runs(conn)) and rows[-1]["logical_time"] >= moment,
             timeout=timeout)


def check_every_tick_once(conn: Conn, until: datetime) -> list[dict[str, Any]]:
    """Every second from the first tick through ``until`` has exactly one run, created by
    the scheduler, and all of them succeed. Returns those ticks."""
    rows = [r for r in tick_runs(conn) if r["logical_time"] <= until]
    assert rows, "no scheduled run at all"
    times = [r["logical_time"] for r in rows]
    assert all(t.microsecond == 0 for t in times)
    assert all(r["runs"] == 1 for r in rows), [r for r in rows if r["runs"] != 1]
    expected = [times[0] + i * SECOND for i in range(int((times[-1] - times[0]) / SECOND) + 1)]
    missing = sorted(set(expected) - set(times))
    assert not missing, f"ticks without a run: {missing}"
    assert {r["trigger"] for r in rows} == {"schedule"}

    ids = [r["id"] for r in rows]

    def all_finished() -> bool:
        row = conn.execute("SELECT count(*) AS n FROM pgflow.runs WHERE id = ANY(%s)"
                           " AND state IN ('succeeded', 'failed')", (ids,)).fetchone()
        return bool(row and row["n"] == len(ids))

    wait_for(all_finished, timeout=20)
    states = conn.execute("SELECT state, count(*) AS n FROM pgflow.runs WHERE id = ANY(%s)"
                          " GROUP BY state", (ids,)).fetchall()
    assert {r["state"]: r["n"] for r in states} == {"succeeded": len(ids)}
    return rows


def attempt_outcomes(conn: Conn, run_ids: list[int]) -> dict[int, list[str]]:
    rows = conn.execute("SELECT run_id, outcome FROM pgflow.attempts WHERE run_id = ANY(%s)"
                        " ORDER BY run_id, attempt", (run_ids,)).fetchall()
    found: dict[int, list[str]] = {}
    for row in rows:
        found.setdefault(row["run_id"], []).append(row["outcome"])
    return found


def schedulers(started: list[Replica], since: dict[str, int] | None = None,
               after: datetime | None = None) -> set[str]:
    """Names of the replicas that logged creating scheduled runs (with ``after``: in a
    pass planned at or after that database time; a replica frozen just after a pass
    logs it when it resumes)."""
    def counts(event: dict[str, Any]) -> bool:
        return after is None or datetime.fromisoformat(event["as_of"]) >= after
    return {r.name for r in started
            if any(counts(e) for e in r.events("scheduled runs",
                                               (since or {}).get(r.name, 0)))}


# ---------------------------------------------------------------- exactly once


def test_three_replicas_create_exactly_one_run_per_tick(
        conn: Conn, replicas: Replicas) -> None:
    ticking_job(conn)
    started = start_three(conn, replicas)
    elected = wait_for_leader(conn, among=started)
    wait_for_ticks_through(conn, db_now(conn) - SECOND)
    first = tick_runs(conn)[0]["logical_time"]
    # Watch five more seconds of ticks.
    wait_for_ticks_through(conn, first + 6 * SECOND)
    rows = check_every_tick_once(conn, first + 6 * SECOND)
    assert len(rows) >= 7

    # No failure here, so every run ran exactly once, and on time.
    outcomes = attempt_outcomes(conn, [r["id"] for r in rows])
    assert all(outcomes.get(r["id"]) == ["succeeded"] for r in rows), outcomes
    # Ticks due once the leader was in place got their run promptly (earlier ones were
    # caught up when it was elected).
    late = [r for r in rows if r["logical_time"] > elected["elected_at"] and
            r["created_at"] - r["logical_time"] > 2 * SECOND]
    assert not late, f"runs created more than 2 s after their tick: {late}"

    # One leader all along, and only it scheduled.
    row = conn.execute("SELECT replica_id, term FROM pgflow.leader").fetchone()
    assert row is not None
    assert (row["replica_id"], row["term"]) == (elected["replica_id"], elected["term"])
    assert schedulers(started) == {elected["replica"].name}
    assert all(r.alive() for r in started)


# ---------------------------------------------------------------- kill -9 of the leader


def test_a_killed_leader_is_replaced_and_no_tick_is_lost_or_doubled(
        conn: Conn, replicas: Replicas) -> None:
    ticking_job(conn)
    started = start_three(conn, replicas)
    old = wait_for_leader(conn, among=started)
    wait_for_ticks_through(conn, db_now(conn) + SECOND)

    killed: Replica = old["replica"]
    killed_id = killed.id(conn)
    killed.kill9()
    killed_at = db_now(conn)
    others = [r for r in started if r is not killed]
    new = wait_for_leader(conn, among=others, after_term=old["term"], timeout=15)
    assert new["replica_id"] != killed_id
    assert new["term"] > old["term"]

    # Scheduling goes on under the new leader, and the ticks of the takeover are there.
    wait_for_ticks_through(conn, killed_at + 4 * SECOND)
    rows = check_every_tick_once(conn, killed_at + 4 * SECOND)
    # A run the killed replica held may have been lost and retried; nothing else repeats.
    outcomes = attempt_outcomes(conn, [r["id"] for r in rows])
    for run_id, seen in outcomes.items():
        assert seen[-1] == "succeeded" and set(seen[:-1]) <= {"lost"}, (run_id, seen)
    assert all(r.alive() for r in others)


# ---------------------------------------------------------------- SIGSTOP of the leader


def test_a_frozen_leader_is_deposed_and_does_not_schedule_when_resumed(
        conn: Conn, replicas: Replicas) -> None:
    ticking_job(conn)
    started = start_three(conn, replicas)
    old = wait_for_leader(conn, among=started)
    wait_for_ticks_through(conn, db_now(conn) + SECOND)

    frozen: Replica = old["replica"]
    frozen.stop_signal()
    others = [r for r in started if r is not frozen]
    # Its session (and the advisory lock) stay open: a standby must see the stale
    # heartbeat, terminate that session and take over.
    new = wait_for_leader(conn, among=others, after_term=old["term"], timeout=15)
    deposer = new["replica"]
    # (The deposer may log after another standby already won the freed lock.)
    wait_for(lambda: any(r.events("deposed a frozen scheduler leader") for r in others),
             timeout=5)
    elected = conn.execute("SELECT elected_at, heartbeat_at FROM pgflow.leader").fetchone()
    assert elected is not None
    # Scheduling continues while the old leader is still frozen.
    wait_for_ticks_through(conn, elected["elected_at"] + 2 * SECOND)
    assert frozen.alive()

    offsets = {r.name: r.log_size() for r in started}
    resumed_at = db_now(conn)
    frozen.cont()
    # The resumed replica finds its session gone and says it no longer leads.
    frozen.wait_log("scheduler leadership ended", since=offsets[frozen.name],
                    where=lambda r: r.get("term") == old["term"])
    wait_for_ticks_through(conn, resumed_at + 3 * SECOND)
    rows = check_every_tick_once(conn, resumed_at + 3 * SECOND)
    outcomes = attempt_outcomes(conn, [r["id"] for r in rows])
    for run_id, seen in outcomes.items():
        assert seen[-1] == "succeeded" and set(seen[:-1]) <= {"lost"}, (run_id, seen)

    # After it resumed, only the new leader scheduled; the leadership did not move back.
    assert schedulers(started, offsets, after=resumed_at) == {deposer.name}
    row = conn.execute("SELECT replica_id, term FROM pgflow.leader").fetchone()
    assert row is not None
    assert (row["replica_id"], row["term"]) == (new["replica_id"], new["term"])
    assert all(r.alive() for r in started)
