"""Alerts (SPEC §4d): incidents from table facts, once per transition; the outbox and
webhook delivery against a real HTTP receiver; [alerts.NAME] validation."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from alerting import (
    PUBLIC,
    Receiver,
    apply_toml,
    deliver,
    evaluate_once,
    incidents,
    notifications,
)
from engine import WorkerThread, enqueue, wait_for

from pgflow import breakers
from pgflow.alerts import evaluate, outbox
from pgflow.db import connect_async
from pgflow.spec import RegistrationError

Conn = psycopg.Connection[dict[str, Any]]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.close()


def _alert(receiver: Receiver, name: str = "oncall", path: str = "/hook", **keys: str) -> str:
    extra = "".join(f"{k} = {v}\n" for k, v in keys.items())
    return f'[alerts.{name}]\nurl = "{receiver.url(path)}"\n{extra}\n'


def _state(conn: Conn, run_id: int) -> str:
    row = conn.execute("SELECT state FROM pgflow.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return str(row["state"])


def _finish(conn: Conn, job: str, params: dict[str, Any], offset_s: int) -> int:
    at = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=offset_s)
    run_id = enqueue(conn, job, at, params)
    wait_for(lambda: _state(conn, run_id) in ("succeeded", "failed"))
    return run_id


def test_dead_letters_found_in_the_pass_that_resolves_their_streak_join_its_incident(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    """Two more dead letters and the success after them, all in one pass: the incident
    lists all three dead letters before it is resolved (it used to list only the first:
    the resolve came before the append, which skips resolved incidents)."""
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver) + """
[jobs.load]
entrypoint = "jobfuncs:fail_if"
retry = { max_attempts = 1 }
""")
    worker = WorkerThread(db_url, concurrency=2)
    try:
        first = _finish(conn, "load", {"fail": True}, 1)
        assert evaluate_once(db_url).opened == {"run_failed": 1}
        more = [_finish(conn, "load", {"fail": True}, i) for i in (2, 3)]
        _finish(conn, "load", {}, 4)
        assert evaluate_once(db_url).resolved == {"run_failed": 1}
    finally:
        worker.stop()
    [incident] = incidents(conn, "run_failed")
    assert incident["runs"] == [first, *more] and incident["resolved_at"] is not None
    assert incident["summary"].endswith("3 dead letters in a row")


def test_a_streak_of_dead_letters_pages_once_and_the_next_success_recovers_once(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver) + """
[jobs.load]
entrypoint = "jobfuncs:fail_if"
retry = { max_attempts = 1 }

[jobs.flaky]
entrypoint = "jobfuncs:fail_once"
retry = { max_attempts = 2, backoff = 0 }
""")
    worker = WorkerThread(db_url, concurrency=2)
    try:
        first = _finish(conn, "load", {"fail": True}, 1)
        assert evaluate_once(db_url).opened == {"run_failed": 1}
        more = [_finish(conn, "load", {"fail": True}, i) for i in (2, 3)]
        flaky = _finish(conn, "flaky", {}, 4)  # fails once, retried, succeeds: nothing
        assert _state(conn, flaky) == "succeeded"
        assert evaluate_once(db_url).changed == 0
        ok = _finish(conn, "load", {}, 5)
        assert evaluate_once(db_url).resolved == {"run_failed": 1}
        assert evaluate_once(db_url).changed == 0
    finally:
        worker.stop()
    [incident] = incidents(conn, "run_failed")
    assert incident["runs"] == [first, *more] and incident["resolved_at"] is not None
    deliver(db_url, lambda: len(receiver.requests) >= 2)
    fired, recovered = receiver.bodies()
    assert (fired["event"], fired["status"], fired["job"], fired["run_id"]) == (
        "run_failed", "firing", "load", first)
    assert fired["url"] == f"{PUBLIC}/runs/{first}" and "told to fail" in fired["error"]
    assert fired["attempt"] == 1 and fired["logical_time"].startswith("2026-01-01T00:00:01")
    assert (recovered["event"], recovered["status"], recovered["run_id"]) == (
        "run_recovered", "resolved", ok)
    assert {"id", "at", "summary", "tenant"} <= set(fired) and fired["id"] != recovered["id"]
    rows = notifications(conn)
    assert [(r["event"], r["status"], r["delivery"]) for r in rows] == [
        ("run_failed", "firing", "delivered"), ("run_recovered", "resolved", "delivered")]
    assert all(r["delivered_at"] is not None and r["attempts"] == 1 for r in rows)


def test_a_deadline_fires_while_the_run_is_late_and_resolves_when_it_succeeds(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver) + """
[jobs.slow]
entrypoint = "jobfuncs:sleep"
deadline = "2s"
params = { seconds = 7 }
""")
    assert conn.execute("SELECT deadline_s FROM pgflow.jobs").fetchone() == {"deadline_s": 2.0}
    worker = WorkerThread(db_url)
    try:
        run_id = enqueue(conn, "slow", datetime.now(UTC))
        wait_for(lambda: _state(conn, run_id) == "running")
        wait_for(lambda: evaluate_once(db_url).opened.get("deadline_missed"), timeout=10)
        assert _state(conn, run_id) == "running"  # fired before the run ended
        wait_for(lambda: _state(conn, run_id) == "succeeded")
    finally:
        worker.stop()
    assert evaluate_once(db_url).resolved == {"deadline_missed": 1}
    deliver(db_url, lambda: len(receiver.requests) >= 2)
    assert [(b["event"], b["status"], b["run_id"]) for b in receiver.bodies()] == [
        ("deadline_missed", "firing", run_id), ("deadline_missed", "resolved", run_id)]


def test_a_run_that_never_starts_still_misses_its_deadline(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver) + """
[jobs.nightly]
entrypoint = "jobfuncs:noop"
deadline = "1m"
""")
    late = enqueue(conn, "nightly", datetime.now(UTC) - timedelta(minutes=5))  # no worker
    enqueue(conn, "nightly", datetime.now(UTC))  # not late yet
    assert evaluate_once(db_url).opened == {"deadline_missed": 1}
    assert evaluate_once(db_url).changed == 0
    [incident] = incidents(conn, "deadline_missed")
    assert incident["run_id"] == late and "queued" in incident["summary"]


def test_breaker_opening_and_closing_are_announced(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver) + """
[sources.warehouse]
failure_threshold = 1
cooldown = "1h"

[jobs.extract]
entrypoint = "jobfuncs:unavailable"
sources = ["warehouse"]
""")
    worker = WorkerThread(db_url)
    try:
        enqueue(conn, "extract", datetime.now(UTC))
        wait_for(lambda: breakers.list_breakers(conn)[0]["state"] == "open")
    finally:
        worker.stop()
    assert evaluate_once(db_url).opened == {"breaker_opened": 1}
    breakers.close_breaker(conn, "warehouse", "fixed", "test")
    assert evaluate_once(db_url).resolved == {"breaker_opened": 1}
    deliver(db_url, lambda: len(receiver.requests) >= 2)
    assert [(b["event"], b["status"], b["source"]) for b in receiver.bodies()] == [
        ("breaker_opened", "firing", "warehouse"), ("breaker_closed", "resolved", "warehouse")]


def _open_breaker(conn: Conn, db_url: str) -> None:
    breakers.open_breaker(conn, "crm", "maintenance", "test")
    assert evaluate_once(db_url).opened == {"breaker_opened": 1}


def test_a_receiver_answering_500_twice_gets_the_same_id_three_times(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver))
    receiver.answers["/hook"] = [500, 500]
    _open_breaker(conn, db_url)
    [row] = notifications(conn)
    deliver(db_url, lambda: notifications(conn)[0]["delivery"] == "delivered")
    ids = [b["id"] for b in receiver.bodies()]
    assert ids == [str(row["id"])] * 3
    [done] = notifications(conn)
    assert done["attempts"] == 3 and done["delivered_at"] is not None
    assert done["last_status"] == 200


def test_an_incident_is_resolved_at_a_receiver_only_after_it_fired_there(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver))
    receiver.answers["/hook"] = [500, 500]  # the firing notification needs three tries
    _open_breaker(conn, db_url)
    breakers.close_breaker(conn, "crm", "fixed", "test")
    assert evaluate_once(db_url).resolved == {"breaker_opened": 1}
    deliver(db_url, lambda: all(n["delivery"] == "delivered" for n in notifications(conn)))
    assert [(b["event"], b["status"]) for b in receiver.bodies()] == [
        ("breaker_opened", "firing")] * 3 + [("breaker_closed", "resolved")]


def test_slack_format_and_signature(conn: Conn, db_url: str, tmp_path: Path,
                                    receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_ALERT_SECRET", "s3cret")
    apply_toml(conn, tmp_path / "a.toml",
               _alert(receiver, "chat", "/slack", format='"slack"')
               + _alert(receiver, "signed", "/signed", secret_env='"TEST_ALERT_SECRET"'))
    _open_breaker(conn, db_url)
    deliver(db_url, lambda: len(receiver.requests) >= 2)
    [slack] = receiver.bodies("/slack")
    assert set(slack) == {"text"} and "breaker_opened" in slack["text"]
    assert f"<{PUBLIC}/breakers|Open in pgflow>" in slack["text"]
    [signed] = [r for r in receiver.requests if r["path"] == "/signed"]
    expected = hmac.new(b"s3cret", signed["raw"], hashlib.sha256).hexdigest()
    assert signed["headers"]["X-Pgflow-Signature"] == f"sha256={expected}"
    assert "X-Pgflow-Signature" not in next(r for r in receiver.requests
                                            if r["path"] == "/slack")["headers"]
    assert "TEST_ALERT_SECRET" not in os.environ  # read once, then kept from jobs


def test_a_hanging_receiver_does_not_delay_other_alerts(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml",
               _alert(receiver, "stuck", "/hang") + _alert(receiver, "fine", "/ok"))
    receiver.hang.add("/hang")
    _open_breaker(conn, db_url)
    deliver(db_url, lambda: receiver.hanging.is_set() and bool(receiver.bodies("/ok")))
    states = {r["alert"]: r["delivery"] for r in notifications(conn)}
    assert states == {"stuck": "pending", "fine": "delivered"}
    assert not receiver.release.is_set()  # the hanging request was still open


def test_a_timed_out_request_is_retried_with_the_same_id(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver, "stuck", "/hang"))
    receiver.hang.add("/hang")
    _open_breaker(conn, db_url)
    deliver(db_url, lambda: notifications(conn)[0]["last_error"] is not None, timeout=1.0)
    [row] = notifications(conn)
    assert row["delivery"] == "pending" and "timed out" in row["last_error"]
    receiver.hang.clear()
    receiver.release.set()
    deliver(db_url, lambda: notifications(conn)[0]["delivery"] == "delivered")
    assert len({b["id"] for b in receiver.bodies("/hang")}) == 1


def test_an_undeliverable_notification_is_given_up_after_its_window(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver))
    receiver.answers["/hook"] = [500] * 100
    _open_breaker(conn, db_url)
    conn.execute("UPDATE pgflow.notifications SET give_up_at = now() + interval '1 second'")
    deliver(db_url, lambda: notifications(conn)[0]["delivery"] == "given_up")
    [row] = notifications(conn)
    assert row["delivered_at"] is None and row["last_status"] == 500 and row["attempts"] >= 1


def test_filters_by_event_job_glob_and_tenant(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml",
               _alert(receiver, "etl", "/etl", jobs='["extract_*"]', events='["run_failed"]')
               + _alert(receiver, "sales", "/sales", tenants='["sales"]')
               + _alert(receiver, "breakers", "/breakers", events='["breaker_opened"]') + """
[jobs.extract_orders]
entrypoint = "jobfuncs:fail"
tenant = "sales"
retry = { max_attempts = 1 }

[jobs.report]
entrypoint = "jobfuncs:fail"
retry = { max_attempts = 1 }
""")
    worker = WorkerThread(db_url, concurrency=2)
    try:
        for job in ("extract_orders", "report"):
            _finish(conn, job, {}, 1)
    finally:
        worker.stop()
    assert evaluate_once(db_url).opened == {"run_failed": 2}
    got = {(r["alert"], r["payload"]["job"]) for r in notifications(conn)}
    assert got == {("etl", "extract_orders"), ("sales", "extract_orders")}


def test_invalid_alert_definitions_are_rejected_atomically(conn: Conn, tmp_path: Path) -> None:
    bad = """
[jobs.fine]
entrypoint = "jobfuncs:noop"

[alerts.ftp]
url = "ftp://example.com/hook"

[alerts.typo]
url = "https://example.com/hook"
events = ["run_faild"]

[alerts.extra]
url = "https://example.com/hook"
channel = "#ops"

[alerts.glob]
url = "https://example.com/hook"
jobs = ["extract_[abc"]

[alerts.none]
format = "json"
"""
    with pytest.raises(RegistrationError) as caught:
        apply_toml(conn, tmp_path / "bad.toml", bad)
    message = str(caught.value)
    for where in ("alert 'ftp': url", "alert 'typo': events.0", "alert 'extra': channel",
                  "alert 'glob': jobs", "alert 'none'"):
        assert where in message
    assert "scheme must be http or https" in message and "nothing applied" in message
    assert conn.execute("SELECT count(*) AS n FROM pgflow.jobs").fetchone() == {"n": 0}
    assert conn.execute("SELECT count(*) AS n FROM pgflow.alerts").fetchone() == {"n": 0}


def test_apply_reports_and_prunes_alerts(conn: Conn, tmp_path: Path,
                                         receiver: Receiver) -> None:
    first = apply_toml(conn, tmp_path / "a.toml", _alert(receiver, "a") + _alert(receiver, "b"))
    assert first.policies.created == ["alert a", "alert b"]
    again = apply_toml(conn, tmp_path / "a.toml", _alert(receiver, "a"))
    assert again.policies.unchanged == ["alert a"] and again.policies.pruned == []
    path = tmp_path / "a.toml"
    from pgflow import registry

    loaded = registry.load_sources([str(path)])
    pruned = registry.apply(conn, loaded.specs, policies=loaded.policies, prune=True)
    assert pruned.policies.pruned == ["alert b"]


def test_no_leader_is_raised_once_by_many_replicas_and_resolved_once(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver))
    conn.execute("INSERT INTO pgflow.leader (replica_id, backend_pid, term, heartbeat_at)"
                 " VALUES ('gone', 1, 1, now() - interval '1 minute')")

    async def checks() -> list[evaluate.AlertPass]:
        conns = [await connect_async(db_url, f"replica-{i}") for i in range(4)]
        try:
            return await asyncio.gather(*(evaluate.check_no_leader(
                c, public_url=PUBLIC, lease_ttl=10.0) for c in conns))
        finally:
            for c in conns:
                await c.close()

    assert sum(p.opened.get("no_leader", 0) for p in asyncio.run(checks())) == 1
    assert sum(p.changed for p in asyncio.run(checks())) == 0
    conn.execute("UPDATE pgflow.leader SET replica_id = 'back', heartbeat_at = now()")
    assert sum(p.resolved.get("no_leader", 0) for p in asyncio.run(checks())) == 1
    assert [(r["event"], r["status"]) for r in notifications(conn)] == [
        ("no_leader", "firing"), ("no_leader", "resolved")]


def test_backlog_and_failure_rate(conn: Conn, db_url: str, tmp_path: Path,
                                  receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver) + """
[jobs.waiting]
entrypoint = "jobfuncs:noop"
""")
    run_id = enqueue(conn, "waiting", datetime.now(UTC))
    conn.execute("UPDATE pgflow.runs SET available_at = now() - interval '10 minutes'")
    conn.execute(
        "INSERT INTO pgflow.attempts (run_id, attempt, worker_id, outcome)"
        " SELECT %s, g, 'w', CASE WHEN g <= 5 THEN 'failed' ELSE 'succeeded' END"
        " FROM generate_series(1, 20) g", (run_id,))
    assert evaluate_once(db_url).opened == {"backlog": 1, "failure_rate": 1}
    conn.execute("UPDATE pgflow.runs SET available_at = now()")
    conn.execute("UPDATE pgflow.attempts SET outcome = 'succeeded' WHERE attempt > 1")
    assert evaluate_once(db_url).resolved == {"backlog": 1, "failure_rate": 1}


def test_send_test_reports_what_the_receiver_answered(
        conn: Conn, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver))
    ok = outbox.send_test(conn, "oncall", PUBLIC)
    assert ok.answer.ok and receiver.bodies()[0]["event"] == "test"
    receiver.answers["/hook"] = [503]
    failed = outbox.send_test(conn, "oncall", PUBLIC)
    assert failed.answer.status == 503 and not failed.answer.ok
    rows = {str(r["id"]): r for r in notifications(conn)}
    assert rows[ok.notification_id]["delivery"] == "delivered"
    assert rows[failed.notification_id]["delivery"] == "given_up"


def test_many_notifications_to_a_hanging_receiver_leave_slots_for_the_others(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml",
               _alert(receiver, "stuck", "/hang") + _alert(receiver, "fine", "/ok"))
    receiver.hang.add("/hang")
    for i in range(10):
        breakers.open_breaker(conn, f"source{i}", "maintenance", "test")
    assert evaluate_once(db_url).opened == {"breaker_opened": 10}
    deliver(db_url, lambda: len(receiver.bodies("/ok")) == 10, in_flight=4, per_alert=2)
    assert not receiver.release.is_set()
    assert len(receiver.bodies("/hang")) == 2  # no more than its share was taken


def test_retention_prunes_old_deliveries_and_resolved_incidents(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    from pgflow import retention

    apply_toml(conn, tmp_path / "a.toml", _alert(receiver))
    _open_breaker(conn, db_url)
    breakers.close_breaker(conn, "crm", "done", "test")
    evaluate_once(db_url)
    _open_breaker(conn, db_url)  # a second incident, still firing
    deliver(db_url, lambda: len(receiver.requests) >= 3)
    breakers.open_breaker(conn, "erp", "down", "test")
    assert evaluate_once(db_url).opened == {"breaker_opened": 1}  # its notification waits
    conn.execute("UPDATE pgflow.notifications SET created_at = now() - interval '40 days'")
    conn.execute("UPDATE pgflow.incidents SET opened_at = now() - interval '41 days',"
                 " resolved_at = CASE WHEN resolved_at IS NOT NULL"
                 " THEN now() - interval '40 days' END")
    retention.run_once(conn, 30 * 86400.0)
    assert [r["delivery"] for r in notifications(conn)] == ["pending"]
    assert [(i["key"], i["resolved_at"]) for i in incidents(conn)] == [("crm", None),
                                                                      ("erp", None)]


def test_evaluators_racing_each_other_fire_each_transition_once(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver) + """
[jobs.load]
entrypoint = "jobfuncs:fail"
retry = { max_attempts = 1 }
""")
    worker = WorkerThread(db_url)
    try:
        for i in range(3):
            _finish(conn, "load", {}, i)
    finally:
        worker.stop()
    breakers.open_breaker(conn, "crm", "maintenance", "test")

    async def race() -> list[evaluate.AlertPass]:
        conns = [await connect_async(db_url, f"evaluator-{i}") for i in range(3)]
        try:
            return await asyncio.gather(*(evaluate.run_once(
                c, public_url=PUBLIC, lease_ttl=30.0) for c in conns))
        finally:
            for c in conns:
                await c.close()

    passes = asyncio.run(race())
    assert sum(p.changed for p in passes) == 2
    assert sorted(e for p in passes for e in p.opened) == ["breaker_opened", "run_failed"]
    assert [(r["event"], r["status"]) for r in notifications(conn)] == [
        ("breaker_opened", "firing"), ("run_failed", "firing")]
    [incident] = incidents(conn, "run_failed")
    assert len(incident["runs"]) == 3


def test_two_senders_deliver_every_notification_once(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", _alert(receiver, "a", "/a") + _alert(receiver, "b", "/b"))
    for i in range(10):
        breakers.open_breaker(conn, f"source{i}", "maintenance", "test")
    assert evaluate_once(db_url).notifications == 20

    def pending() -> bool:
        return not conn.execute("SELECT 1 FROM pgflow.notifications"
                                " WHERE delivery = 'pending'").fetchone()

    import threading

    other = threading.Thread(target=deliver, args=(db_url, pending))
    other.start()
    deliver(db_url, pending)
    other.join(30)
    ids = [b["id"] for b in receiver.bodies("/a") + receiver.bodies("/b")]
    assert len(ids) == 20 and len(set(ids)) == 20


def test_a_late_result_from_a_sender_whose_lease_passed_changes_nothing(
        conn: Conn, db_url: str, tmp_path: Path, receiver: Receiver) -> None:
    from pgflow.queries import q

    apply_toml(conn, tmp_path / "a.toml", _alert(receiver))
    _open_breaker(conn, db_url)
    claim = {"lease_s": 30, "limit": 10, "per_alert": 2, "busy": []}
    [first] = conn.execute(q("notification_claim"), claim).fetchall()
    conn.execute("UPDATE pgflow.notifications SET next_attempt_at = now()")  # lease passed
    [second] = conn.execute(q("notification_claim"), claim).fetchall()
    assert (first["id"], first["attempts"], second["attempts"]) == (second["id"], 1, 2)
    done = conn.execute(q("notification_delivered"), {
        "id": second["id"], "attempts": 2, "status": 200}).fetchall()
    late = conn.execute(q("notification_failed"), {
        "id": first["id"], "attempts": 1, "status": 500, "error": "late", "delay_s": 1,
        "give_up": False}).fetchall()
    assert len(done) == 1 and late == []
    [row] = notifications(conn)
    assert row["delivery"] == "delivered" and row["last_error"] is None
