"""Circuit breakers (SPEC §4c): open after the threshold, hold runs without using their
budget, one probe after the cooldown, close and drain; manual open/close."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from engine import WorkerThread, wait_for

from pgflow import breakers, registry
from pgflow.errors import Conflict

Conn = psycopg.Connection[dict[str, Any]]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _apply(conn: Conn, path: Path, text: str) -> None:
    path.write_text(text)
    loaded = registry.load_sources([str(path)])
    registry.apply(conn, loaded.specs, invalid=loaded.errors, policies=loaded.policies)


def _runs(conn: Conn, job: str, n: int, start: datetime = T0) -> list[int]:
    return [row["id"] for row in conn.execute(
        "INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant,"
        " priority, params, capped, held)"
        " SELECT j.name, %s + make_interval(secs => g), 'queued', j.max_attempts, 'manual',"
        " j.tenant, j.priority, j.params, j.capped, j.held"
        " FROM pgflow.jobs j, generate_series(1, %s) g WHERE j.name = %s RETURNING id",
        (start, n, job)).fetchall()]


def _breaker(conn: Conn, source: str = "crm") -> dict[str, Any]:
    row = conn.execute("SELECT * FROM pgflow.breakers WHERE source = %s", (source,)).fetchone()
    return row or {"state": "closed"}


# ---------------------------------------------------------------- pure transitions


def test_transitions_and_cooldown_growth() -> None:
    closed = breakers.State("s", "closed", 1, None, threshold=3, base_s=60)
    assert breakers.after_unavailable(closed, 1).state == "closed"
    opened = breakers.after_unavailable(closed, 2)
    assert (opened.state, opened.cooldown_s) == ("open", 60)
    half = breakers.State("s", "half_open", 3, 60, threshold=3, base_s=60)
    assert breakers.after_unavailable(half, 1).cooldown_s == 120
    assert breakers.after_unavailable(
        breakers.State("s", "open", 3, 60, 3, 60), 5).state == "open"
    cooldown = 60.0
    for _ in range(10):
        cooldown = breakers.next_cooldown(cooldown, 60)
    assert cooldown == 3600  # doubled, capped at 1 h
    assert breakers.next_cooldown(7200, 7200) == 7200  # a base above 1 h does not grow


# ---------------------------------------------------------------- the whole cycle


def test_breaker_opens_holds_probes_once_closes_and_drains(conn: Conn, db_url: str,
                                                           tmp_path: Path) -> None:
    down = tmp_path / "down"
    down.write_text("")
    log = tmp_path / "log"
    _apply(conn, tmp_path / "b.toml", f"""
[sources.crm]
failure_threshold = 3
cooldown = 1

[jobs.sync]
entrypoint = "jobfuncs:source_down_while"
sources = ["crm"]
params = {{ down = "{down}", path = "{log}" }}
retry = {{ max_attempts = 2, backoff = 0, jitter = false }}

[jobs.capped_report]
entrypoint = "jobfuncs:source_down_while"
sources = ["crm"]
max_active_runs = 1
params = {{ down = "{down}", path = "{log}" }}
retry = {{ max_attempts = 2, backoff = 0, jitter = false }}

[jobs.downstream]
entrypoint = "jobfuncs:noop"
depends_on = ["sync"]

[jobs.unrelated]
entrypoint = "jobfuncs:noop"
""")
    failing = _runs(conn, "sync", 3)
    worker = WorkerThread(db_url, concurrency=3)
    try:
        wait_for(lambda: _breaker(conn)["state"] != "closed", timeout=30)
        # Held: not claimed, budget intact (2 attempts left after the refund).
        others = _runs(conn, "capped_report", 3, T0 + timedelta(days=1))
        others += _runs(conn, "sync", 2, T0 + timedelta(days=2))
        free = _runs(conn, "unrelated", 2)
        wait_for(lambda: conn.execute("SELECT bool_and(state = 'succeeded') AS ok FROM"
                                      " pgflow.runs WHERE id = ANY(%s)", (free,)
                                      ).fetchone() == {"ok": True})
        with conn.transaction():  # the runs and the breaker as of one snapshot
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            rows = conn.execute("SELECT id, state, attempt, max_attempts, held,"
                                " attempt_started_at FROM pgflow.runs WHERE id = ANY(%s)",
                                (failing + others,)).fetchall()
            probe = _breaker(conn).get("probe_run")
            opened = conn.execute("SELECT min(at) AS at FROM pgflow.breaker_transitions"
                                  " WHERE to_state = 'open'").fetchone()
        assert opened is not None and opened["at"] is not None
        # Held — except a probe, if the cooldown (1 s) already ran out, and a retry that a
        # worker claimed before the breaker opened and still runs (it fails, then waits).
        loose = [r for r in rows if not (r["state"] in ("queued", "retrying") and r["held"])]
        probing = [r for r in loose if r["id"] == probe]
        early = [r for r in loose if r["id"] != probe and r["state"] == "running"
                 and r["attempt_started_at"] < opened["at"]]
        assert len(probing) <= 1 and len(probing) + len(early) == len(loose), (rows, probe)
        # An attempt before the breaker opened used its budget; none since did.
        assert all(r["max_attempts"] - r["attempt"] >= 1 for r in rows), rows
        assert all(r["attempt"] == 0 for r in rows if r["id"] in others), rows
        # The source comes back: after the cooldown one probe goes through and closes it.
        down.unlink()
        wait_for(lambda: _breaker(conn)["state"] == "closed", timeout=30)
        ids = failing + others
        wait_for(lambda: conn.execute("SELECT count(*) AS n FROM pgflow.runs WHERE id = ANY(%s)"
                                      " AND state = 'succeeded'", (ids,)).fetchone()
                 == {"n": len(ids)}, timeout=30)
    finally:
        worker.stop(grace=1)
    moves = [(r["from_state"], r["to_state"]) for r in conn.execute(
        "SELECT from_state, to_state FROM pgflow.breaker_transitions ORDER BY id")]
    assert moves[0] == ("closed", "open") and moves[-1] == ("half_open", "closed")
    assert ("open", "half_open") in moves
    half = conn.execute("SELECT max(at) AS at FROM pgflow.breaker_transitions"
                        " WHERE to_state = 'half_open'").fetchone()
    closed = conn.execute("SELECT max(at) AS at FROM pgflow.breaker_transitions"
                          " WHERE to_state = 'closed'").fetchone()
    assert half is not None and closed is not None
    probes = conn.execute(
        "SELECT count(*) AS n FROM pgflow.attempts a JOIN pgflow.runs r ON r.id = a.run_id"
        " WHERE r.job IN ('sync', 'capped_report') AND a.started_at >= %s"
        " AND a.started_at < %s", (half["at"], closed["at"])).fetchone()
    assert probes == {"n": 1}  # exactly one probe while half_open
    assert conn.execute("SELECT count(*) AS n FROM pgflow.runs WHERE state = 'failed'"
                        ).fetchone() == {"n": 0}  # no attempt budget was burnt


def test_a_failed_probe_reopens_with_a_longer_cooldown(conn: Conn, db_url: str,
                                                       tmp_path: Path) -> None:
    down = tmp_path / "down"
    down.write_text("")
    _apply(conn, tmp_path / "b.toml", f"""
[sources.crm]
failure_threshold = 1
cooldown = 1
[jobs.sync]
entrypoint = "jobfuncs:source_down_while"
sources = ["crm"]
params = {{ down = "{down}" }}
retry = {{ max_attempts = 1 }}
""")
    _runs(conn, "sync", 2)
    worker = WorkerThread(db_url, concurrency=2)
    try:
        wait_for(lambda: _breaker(conn).get("reopens", 0) >= 1, timeout=30)
    finally:
        worker.stop(grace=1)
    row = _breaker(conn)
    assert row["cooldown_s"] == 2 and row["state"] in ("open", "half_open")
    assert conn.execute("SELECT count(*) AS n FROM pgflow.runs WHERE state = 'failed'"
                        ).fetchone() == {"n": 0}


def test_manual_open_and_close_hold_and_release(conn: Conn, tmp_path: Path) -> None:
    _apply(conn, tmp_path / "m.toml", '[jobs.a]\nentrypoint = "jobfuncs:noop"\n'
           'sources = ["crm"]\n')
    ids = _runs(conn, "a", 3)
    breakers.open_breaker(conn, "crm", "maintenance", "test")
    with pytest.raises(Conflict):
        breakers.open_breaker(conn, "crm", None, "test")
    assert conn.execute("SELECT bool_and(held) AS h FROM pgflow.runs WHERE id = ANY(%s)",
                        (ids,)).fetchone() == {"h": True}
    assert _breaker(conn)["manual"] is True
    breakers.close_breaker(conn, "crm", None, "test")
    assert conn.execute("SELECT bool_or(held) AS h FROM pgflow.runs WHERE id = ANY(%s)",
                        (ids,)).fetchone() == {"h": False}
    with pytest.raises(Conflict):
        breakers.close_breaker(conn, "crm", None, "test")
