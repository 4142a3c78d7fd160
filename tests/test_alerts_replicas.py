"""Alerts with real ``pgflow serve`` replicas: the leader evaluates, any replica sends;
no_leader seen by replicas that do not lead; replica_lost after a SIGKILL; the CLI;
alert secrets kept from jobs."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from alerting import Receiver, apply_toml, incidents, notifications
from engine import enqueue
from procs import Conn, Replicas, pgflow, until, wait_for_leader, wait_state

from pgflow import breakers

FAST = {"PGFLOW_ALERTS_INTERVAL": "0.3", "PGFLOW_ALERTS_POLL": "0.2",
        "PGFLOW_ALERTS_BACKOFF": "0.2", "PGFLOW_ALERTS_NO_LEADER_EVERY": "0.5"}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.close()


def test_a_replica_pages_a_dead_letter_streak_once_and_its_recovery(
        conn: Conn, replicas: Replicas, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", f"""
[alerts.oncall]
url = "{receiver.url()}"
events = ["run_failed", "run_recovered"]

[jobs.load]
entrypoint = "jobfuncs:fail_if"
retry = {{ max_attempts = 1 }}
""")
    replicas.start("a", env={**FAST, "PGFLOW_PUBLIC_URL": "https://pgflow.example.com"})
    wait_for_leader(conn)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    for i in range(3):
        wait_state(conn, enqueue(conn, "load", t0 + timedelta(minutes=i), {"fail": True}),
                   "failed")
    until(lambda: receiver.bodies() or None)
    ok = enqueue(conn, "load", t0 + timedelta(minutes=5))
    wait_state(conn, ok, "succeeded")
    until(lambda: len(receiver.bodies()) >= 2 or None)
    assert [(b["event"], b["status"]) for b in receiver.bodies()] == [
        ("run_failed", "firing"), ("run_recovered", "resolved")]
    assert receiver.bodies()[0]["url"].startswith("https://pgflow.example.com/runs/")
    [incident] = incidents(conn, "run_failed")
    assert len(incident["runs"]) == 3 and incident["resolved_at"] is not None


def test_no_leader_is_raised_once_by_replicas_that_do_not_lead(
        conn: Conn, replicas: Replicas, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", f'[alerts.oncall]\nurl = "{receiver.url()}"\n')
    leader = replicas.start("leader", roles=["scheduler"], env=FAST)
    wait_for_leader(conn, leader)
    for name in ("w1", "w2"):
        replicas.start(name, roles=["worker"], env=FAST)
    leader.kill9()
    until(lambda: incidents(conn, "no_leader") or None, timeout=30)
    until(lambda: receiver.bodies() or None)
    [incident] = incidents(conn, "no_leader")
    assert incident["resolved_at"] is None
    assert [(r["event"], r["status"]) for r in notifications(conn)] == [("no_leader", "firing")]
    replicas.start("back", roles=["scheduler"], env=FAST)
    until(lambda: incidents(conn, "no_leader")[0]["resolved_at"] or None, timeout=30)
    until(lambda: len(receiver.bodies()) >= 2 or None)
    assert [(b["event"], b["status"]) for b in receiver.bodies()] == [
        ("no_leader", "firing"), ("no_leader", "resolved")]


def test_replica_lost_after_a_sigkilled_replica_that_held_runs(
        conn: Conn, replicas: Replicas, tmp_path: Path, receiver: Receiver) -> None:
    apply_toml(conn, tmp_path / "a.toml", f"""
[alerts.oncall]
url = "{receiver.url()}"
events = ["replica_lost"]

[jobs.long]
entrypoint = "jobfuncs:sleep"
params = {{ seconds = 600 }}
""")
    replicas.start("boss", roles=["scheduler", "reaper"], env=FAST)
    wait_for_leader(conn)
    worker = replicas.start("doomed", roles=["worker"], env=FAST)
    doomed = worker.id(conn)
    run_id = enqueue(conn, "long", datetime.now(UTC))
    wait_state(conn, run_id, "running")
    worker.kill9()
    until(lambda: receiver.bodies() or None, timeout=40)
    [body] = receiver.bodies()
    assert body["event"] == "replica_lost" and doomed in body["summary"]
    assert body["run_id"] == run_id
    [incident] = incidents(conn, "replica_lost")
    assert incident["key"] == doomed and incident["runs"] == [run_id]


def test_cli_lists_and_tests_alerts(conn: Conn, db_url: str, tmp_path: Path,
                                    receiver: Receiver) -> None:
    (tmp_path / "a.toml").write_text(
        f'[alerts.oncall]\nurl = "{receiver.url()}"\n\n'
        '[alerts.dead]\nurl = "http://127.0.0.1:9/nothing"\n')
    applied = pgflow(db_url, tmp_path, "apply", str(tmp_path / "a.toml"))
    assert "alert oncall" in applied.stdout
    sent = pgflow(db_url, tmp_path, "alerts", "test", "oncall")
    assert "HTTP 200" in sent.stdout and receiver.bodies()[0]["event"] == "test"
    failed = pgflow(db_url, tmp_path, "alerts", "test", "dead", check=False)
    assert failed.returncode != 0 and "Traceback" not in failed.stderr
    assert failed.stderr.startswith("error: test notification to alert 'dead' failed")
    unknown = pgflow(db_url, tmp_path, "alerts", "test", "nobody", check=False)
    assert unknown.returncode != 0 and "unknown alert 'nobody'" in unknown.stderr
    listed = json.loads(pgflow(db_url, tmp_path, "alerts", "list", "--json").stdout)
    assert [a["name"] for a in listed["alerts"]] == ["dead", "oncall"]
    assert {d["delivery"] for d in listed["deliveries"]} == {"delivered", "given_up"}
    text = pgflow(db_url, tmp_path, "alerts", "list").stdout
    assert "firing: 0 incident(s)" in text and "1 given up" in text
    assert "alerts: 0 incident(s) firing" in pgflow(db_url, tmp_path, "status").stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('[alerts.x]\nurl = "ftp://example.com"\n')
    refused = pgflow(db_url, tmp_path, "apply", str(bad), check=False)
    assert refused.returncode != 0 and "alert 'x': url" in refused.stderr


def test_alert_secrets_are_kept_from_jobs(conn: Conn, replicas: Replicas, tmp_path: Path,
                                          receiver: Receiver) -> None:
    dump = tmp_path / "env.json"
    apply_toml(conn, tmp_path / "a.toml", f"""
[alerts.signed]
url_env = "PGFLOW_ALERT_ONCALL_URL"
secret_env = "ONCALL_SECRET"

[jobs.envdump]
command = ["python", "-c", "import json, os; json.dump(dict(os.environ), open('{dump}', 'w'))"]
""")
    replicas.start("a", env={**FAST, "PGFLOW_ALERT_ONCALL_URL": receiver.url("/signed"),
                             "ONCALL_SECRET": "k3y"})
    wait_for_leader(conn)
    run_id = enqueue(conn, "envdump", datetime.now(UTC))
    wait_state(conn, run_id, "succeeded")
    seen = json.loads(dump.read_text())
    assert "PGFLOW_ALERT_ONCALL_URL" not in seen and "ONCALL_SECRET" not in seen
    breakers.open_breaker(conn, "crm", "test", "test")
    until(lambda: receiver.bodies("/signed") or None)
    request = next(r for r in receiver.requests if r["path"] == "/signed")
    expected = hmac.new(b"k3y", request["raw"], hashlib.sha256).hexdigest()
    assert request["headers"]["X-Pgflow-Signature"] == f"sha256={expected}"
    # The URL is a secret: no replica log line names it.
    assert receiver.url("/signed") not in (tmp_path / "replica-a.log").read_text()
