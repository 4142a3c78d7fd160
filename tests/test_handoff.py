"""Handoff (pgflow/handoff.py): a trigger hands its run to an idle worker's offer.

Real replicas and a real database: the run is created running under the idle worker's
lease and starts from the notification; what cannot start at once, what a transaction
triggers, what goes to a killed, frozen or draining worker, and what a full worker
receives (given back) all end well, each with the attempts it should have.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

import psycopg
from engine import add_job, attempts, run_row, wait_for
from procs import Replica, Replicas, scalar, wait_state
from psycopg.rows import dict_row

from pgflow import breakers, handoff, runs

Conn = psycopg.Connection[dict[str, Any]]
LOCK_CLASS = 1885825135  # "pgho", held by each LISTEN session on its own pid


def offer_of(conn: Conn, replica: Replica, slots: int | None = None) -> dict[str, Any]:
    """The replica's live offer (waits for one, with ``slots`` free if given)."""
    worker = replica.id(conn)

    def live() -> dict[str, Any] | None:
        row = conn.execute("SELECT * FROM pgflow.idle_workers WHERE worker = %s"
                           " AND until > now()", (worker,)).fetchone()
        return row if row and (slots is None or row["slots"] == slots) else None
    return wait_for(live, timeout=20)


def test_a_trigger_hands_its_run_to_an_idle_worker(conn: Conn, replicas: Replicas) -> None:
    add_job(conn, "quick", entrypoint="jobfuncs:noop")
    worker = replicas.start("w", roles=["worker"], concurrency=4)
    offer = offer_of(conn, worker, slots=4)
    run_id = runs.trigger(conn, "quick")
    row = run_row(conn, run_id)
    assert row["handed_off"] and row["attempt"] == 1, row
    if row["state"] != "succeeded":  # it may already have run: it started from the notification
        assert (row["state"], row["lease_owner"]) == ("running", worker.id(conn)), row
    assert wait_state(conn, run_id, "succeeded", "failed")["state"] == "succeeded"
    [attempt] = attempts(conn, run_id)
    assert (attempt["attempt"], attempt["worker_id"], attempt["outcome"]) == (
        1, worker.id(conn), "succeeded")
    # The worker's LISTEN session holds the lock that tells triggers it is alive.
    assert offer["listen_pid"] == scalar(
        conn, "SELECT objid::int FROM pg_locks WHERE locktype = 'advisory'"
              " AND classid = %s AND objid = %s", (LOCK_CLASS, offer["listen_pid"]))


def test_what_cannot_start_at_once_is_queued_not_handed_off(conn: Conn,
                                                            replicas: Replicas) -> None:
    add_job(conn, "quick", entrypoint="jobfuncs:noop")
    add_job(conn, "capped", entrypoint="jobfuncs:noop", max_active_runs=1)
    add_job(conn, "sourced", entrypoint="jobfuncs:noop", sources=["crm"])
    worker = replicas.start("w", roles=["worker"], concurrency=4)
    offer_of(conn, worker, slots=4)
    # Inside a transaction: the offer's row would be held until the commit.
    with conn.transaction():
        in_transaction = runs.trigger(conn, "quick")
        assert run_row(conn, in_transaction)["state"] == "queued"
    capped = runs.trigger(conn, "capped")
    assert not run_row(conn, capped)["handed_off"]
    breakers.open_breaker(conn, "crm", "maintenance", "test")
    held = runs.trigger(conn, "sourced")
    assert run_row(conn, held)["state"] == "queued"
    for run_id in (in_transaction, capped):
        assert wait_state(conn, run_id, "succeeded", "failed")["state"] == "succeeded"
        assert [a["attempt"] for a in attempts(conn, run_id)] == [1]
    time.sleep(1.5)
    assert run_row(conn, held)["state"] == "queued"  # waits for its breaker


def test_a_killed_idle_workers_offer_is_not_taken(conn: Conn, replicas: Replicas) -> None:
    add_job(conn, "quick", entrypoint="jobfuncs:noop")
    gone = replicas.start("gone", roles=["worker"])
    offer = offer_of(conn, gone)
    gone.kill9()
    # Its offer is still in the table, unexpired, but its LISTEN session ended with it.
    wait_for(lambda: scalar(conn, "SELECT count(*) = 0 FROM pg_locks WHERE locktype ="
                                  " 'advisory' AND classid = %s AND objid = %s",
                            (LOCK_CLASS, offer["listen_pid"])), timeout=10)
    conn.execute("UPDATE pgflow.idle_workers SET until = now() + interval '1 minute'")
    run_id = runs.trigger(conn, "quick")
    row = run_row(conn, run_id)
    assert (row["state"], row["lease_owner"], row["handed_off"]) == ("queued", None, False)
    late = replicas.start("late", roles=["worker"])
    assert wait_state(conn, run_id, "succeeded", "failed")["state"] == "succeeded"
    assert [(a["attempt"], a["worker_id"]) for a in attempts(conn, run_id)] == [
        (1, late.id(conn))]


def test_a_frozen_workers_offer_lapses(conn: Conn, replicas: Replicas) -> None:
    add_job(conn, "quick", entrypoint="jobfuncs:noop")
    frozen = replicas.start("frozen", roles=["worker"])
    offer_of(conn, frozen)
    frozen.stop_signal()
    try:
        wait_for(lambda: scalar(conn, "SELECT count(*) = 0 FROM pgflow.idle_workers"
                                      " WHERE until > now()"),
                 timeout=handoff.OFFER_S + 5)
        run_id = runs.trigger(conn, "quick")
        assert run_row(conn, run_id)["state"] == "queued"
        other = replicas.start("other", roles=["worker"])
        assert wait_state(conn, run_id, "succeeded", "failed")["state"] == "succeeded"
        assert [(a["attempt"], a["worker_id"]) for a in attempts(conn, run_id)] == [
            (1, other.id(conn))]
    finally:
        frozen.cont()


def test_a_draining_worker_withdraws_its_offer(conn: Conn, replicas: Replicas) -> None:
    worker = replicas.start("w", roles=["worker"])
    offer_of(conn, worker)
    worker.term()
    assert worker.wait_exit(30) == 0
    assert scalar(conn, "SELECT count(*) FROM pgflow.idle_workers") == 0


def test_a_handoff_to_a_full_worker_is_given_back(conn: Conn, replicas: Replicas) -> None:
    # A worker's offer can overstate its free slots for a moment (its claim raced a
    # trigger); forged here: the worker must give the run back, not exceed its slots.
    add_job(conn, "long", entrypoint="jobfuncs:sleep", params={"seconds": 4})
    add_job(conn, "quick", entrypoint="jobfuncs:noop")
    worker = replicas.start("w", roles=["worker"], concurrency=1)
    offer = offer_of(conn, worker, slots=1)
    with conn.transaction():  # queued, not handed off: claimed, it fills the only slot
        long_run = runs.trigger(conn, "long")
    wait_for(lambda: run_row(conn, long_run)["state"] == "running", timeout=15)
    # Its claim withdrew the offer; the forged one names a claim the worker still knows.
    conn.execute("INSERT INTO pgflow.idle_workers (worker, seq, slots, ttl_s, listen_pid,"
                 " until) VALUES (%(worker)s, %(seq)s, 1, %(ttl_s)s, %(listen_pid)s,"
                 " now() + interval '1 minute') ON CONFLICT (worker) DO UPDATE"
                 " SET seq = EXCLUDED.seq, slots = 1, until = EXCLUDED.until", offer)
    quick = runs.trigger(conn, "quick")
    # Handed off (the row's handed_off flag may already be cleared by the give-back, which
    # can come before this test reads the row): the worker says it gave this run back.
    worker.wait_log("handed-off run given back", where=lambda r: r["run_id"] == quick)
    assert wait_state(conn, quick, "succeeded", "failed", timeout=30)["state"] == "succeeded"
    row = run_row(conn, quick)
    assert (row["attempt"], row["max_attempts"]) == (2, 2)  # the given-back try is refunded
    assert [(a["attempt"], a["outcome"]) for a in attempts(conn, quick)] == [(2, "succeeded")]
    # the long run kept its slot: never two attempts at once on a worker of one slot
    [long_attempt] = attempts(conn, long_run)
    assert long_attempt["outcome"] == "succeeded"  # its lease, renewed, outlived two TTLs
    [quick_attempt] = attempts(conn, quick)
    assert (quick_attempt["started_at"] - long_attempt["started_at"]).total_seconds() >= 4


def test_a_full_claim_withdraws_the_offer_and_a_short_one_offers_the_rest(
        db_url: str, conn: Conn) -> None:
    import asyncio

    from pgflow import queue
    from pgflow.queue import Offer

    add_job(conn, "quick", entrypoint="jobfuncs:noop")
    for second in range(3):
        runs.trigger(conn, "quick", datetime(2001, 1, 1, 0, 0, second, tzinfo=UTC))

    async def claims() -> list[int | None]:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True,
                                                         row_factory=dict_row) as aconn:
            slots = []
            for limit in (2, 5):
                await queue.claim(aconn, "w1", limit, 30.0, Offer(limit, 4242))
                slots.append(scalar(conn, "SELECT slots FROM pgflow.idle_workers"
                                          " WHERE worker = 'w1'"))
            await queue.claim(aconn, "w1", 5, 30.0)  # no offer: withdrawn
            slots.append(scalar(conn, "SELECT count(*) FROM pgflow.idle_workers"))
            return slots
    # 2 of 3 claimed: full, no offer; then 1 of 5: 4 offered; then no offer at all.
    assert asyncio.run(claims()) == [None, 4, 0]


def test_a_handoff_for_another_worker_or_unreadable_is_ignored(conn: Conn,
                                                               replicas: Replicas) -> None:
    # A channel is named by a pid, which a database restart may give to another worker's
    # session; anyone may also NOTIFY it. Neither starts anything.
    add_job(conn, "quick", entrypoint="jobfuncs:noop")
    worker = replicas.start("w", roles=["worker"])
    offer = offer_of(conn, worker)
    channel = f"{handoff.CHANNEL_PREFIX}{offer['listen_pid']}"
    conn.execute("SELECT pg_notify(%s, %s)", (channel, "not json"))
    conn.execute("SELECT pg_notify(%s, %s)", (channel, json.dumps(
        {"worker": "someone-else", "seq": offer["seq"], "id": 1, "job": "quick",
         "logical_time": "2026-01-01T00:00:00+00:00", "attempt": 1, "max_attempts": 3,
         "params": "{}", "attempt_started_at": "2026-01-01T00:00:00+00:00",
         "command": None, "entrypoint": "jobfuncs:noop", "timeout_s": None,
         "backoff_s": 30, "max_backoff_s": 3600, "jitter": True, "no_retry_exit_codes": [],
         "sources": []})))
    worker.wait_log("unreadable handoff notification ignored")
    worker.wait_log("handoff for another worker ignored")
    run_id = runs.trigger(conn, "quick")  # and the worker still takes its own
    assert wait_state(conn, run_id, "succeeded", "failed")["state"] == "succeeded"


def test_a_handoff_arriving_mid_claim_waits_for_the_claim() -> None:
    # An idle worker claims every second; a handoff that arrives while that claim is in
    # flight is decided when it returns: started in a slot the claim left, else given back.
    import asyncio

    from pgflow.log import get_logger
    from pgflow.worker import Worker

    def payload(run_id: int) -> str:
        return json.dumps({"worker": "w", "seq": 1, "id": run_id, "job": "quick",
                           "logical_time": "2026-01-01T00:00:00+00:00", "attempt": 1,
                           "max_attempts": 3, "params": "{}",
                           "attempt_started_at": "2026-01-01T00:00:00+00:00",
                           "command": None, "entrypoint": "jobfuncs:noop", "timeout_s": None,
                           "backoff_s": None, "max_backoff_s": None, "jitter": None,
                           "no_retry_exit_codes": None, "sources": None})

    async def scenario() -> tuple[list[int], list[tuple[int, int]]]:
        worker = Worker("postgresql:///unused", "w", 1, 30, get_logger(test=True))
        worker._offers[1] = time.monotonic()
        worker._claim_in_flight = True  # a claim of its one slot is in flight
        worker._handed_off(payload(7))
        worker._handed_off(payload(8))
        assert not worker.active and not worker._give_backs  # neither decided yet
        worker._claim_in_flight = False  # the claim came back empty: one slot for the first
        worker._take_deferred()
        started = [run_id for run_id, _ in worker.active]
        for held in list(worker.active.values()):
            assert held.task is not None
            await held.task
        return started, list(worker._give_backs)

    assert asyncio.run(scenario()) == ([7], [(8, 1)])
