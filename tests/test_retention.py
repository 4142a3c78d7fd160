"""Retention: finished runs older than PGFLOW_RETENTION go with their attempts; dead
letters, unfinished runs and the runs a DAG run still needs stay."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from engine import WorkerThread, add_job, enqueue, wait_for
from procs import ROOT, Replicas, child_env, scalar
from psycopg.rows import dict_row

from pgflow import retention, runs
from pgflow.cli import run as cli_run
from pgflow.queries import q

Conn = psycopg.Connection[dict[str, Any]]
NOW = datetime(2030, 6, 1, 12, 0, tzinfo=UTC)
HOUR = 3600.0
OLD = NOW - timedelta(days=2)
RECENT = NOW - timedelta(minutes=10)
_SEQ = itertools.count()


def insert_run(conn: Conn, job: str, state: str, *, finished: datetime | None = None,
               at: datetime | None = None, acked: bool = False, attempts: int = 1,
               backfill_id: int | None = None) -> int:
    """A run as the engine leaves it in ``state`` (finished ones at ``finished``), with
    ``attempts`` attempt rows."""
    at = at or (finished or OLD) - timedelta(hours=1, seconds=next(_SEQ))
    terminal = state in ("succeeded", "failed", "cancelled", "upstream_failed")
    running = state == "running"
    row = conn.execute(
        "INSERT INTO pgflow.runs (job, logical_time, state, attempt, max_attempts, trigger,"
        " tenant, created_at, started_at, finished_at, acked_at, lease_owner,"
        " lease_expires_at, attempt_started_at, backfill_id)"
        " VALUES (%(job)s, %(at)s, %(state)s, %(attempt)s, 3, 'manual', 'default', %(at)s,"
        " %(started)s, %(finished)s, %(acked)s, %(owner)s, %(lease)s, %(started)s,"
        " %(backfill_id)s) RETURNING id",
        {"job": job, "at": at, "state": state, "attempt": max(attempts, 1 if running else 0),
         "started": at if attempts or running else None,
         "finished": (finished or OLD) if terminal else None,
         "acked": (finished or OLD) if acked else None,
         "owner": "w" if running else None,
         "lease": NOW + timedelta(days=1) if running else None,
         "backfill_id": backfill_id}).fetchone()
    assert row is not None
    for n in range(1, attempts + (0 if running else 1)):
        conn.execute("INSERT INTO pgflow.attempts (run_id, attempt, worker_id, started_at,"
                     " finished_at, outcome) VALUES (%s, %s, 'w', %s, %s, 'failed')",
                     (row["id"], n, at, at))
    return int(row["id"])


def surviving(conn: Conn, ids: dict[str, int]) -> set[str]:
    left = {r["id"] for r in conn.execute("SELECT id FROM pgflow.runs WHERE id = ANY(%s)",
                                          (list(ids.values()),))}
    return {name for name, rid in ids.items() if rid in left}


def prune(conn: Conn, retention_s: float = HOUR, **options: Any) -> retention.PrunePass:
    return retention.run_once(conn, retention_s, now=NOW, **options)


def test_old_finished_runs_go_with_their_attempts_and_everything_else_stays(conn: Conn) -> None:
    add_job(conn, "j", entrypoint="jobfuncs:noop")
    ids = {
        "old succeeded": insert_run(conn, "j", "succeeded", attempts=2),
        "old cancelled": insert_run(conn, "j", "cancelled", attempts=0),
        "old upstream_failed": insert_run(conn, "j", "upstream_failed", attempts=0),
        "old acked failed": insert_run(conn, "j", "failed", acked=True, attempts=3),
        "old dead letter": insert_run(conn, "j", "failed", attempts=3),
        "recent succeeded": insert_run(conn, "j", "succeeded", finished=RECENT),
        "recent acked failed": insert_run(conn, "j", "failed", finished=RECENT, acked=True),
        "old pending": insert_run(conn, "j", "pending", attempts=0),
        "old queued": insert_run(conn, "j", "queued", attempts=0),
        "old running": insert_run(conn, "j", "running", attempts=1),
        "old retrying": insert_run(conn, "j", "retrying", attempts=1),
    }
    goes = {"old succeeded", "old cancelled", "old upstream_failed", "old acked failed"}
    preview = retention.preview(conn, HOUR, now=NOW)
    assert {r["state"]: r["runs"] for r in preview} == {
        "succeeded": 1, "cancelled": 1, "upstream_failed": 1, "failed": 1}
    assert all(r["oldest"] == r["newest"] == OLD for r in preview)

    found = prune(conn)

    assert surviving(conn, ids) == set(ids) - goes
    assert found.runs == {"succeeded": 1, "cancelled": 1, "upstream_failed": 1, "failed": 1}
    assert found.done and found.deleted == 4
    gone = [ids[name] for name in goes]
    assert scalar(conn, "SELECT count(*) FROM pgflow.attempts WHERE run_id = ANY(%s)",
                  (gone,)) == 0
    assert scalar(conn, "SELECT count(*) FROM pgflow.attempts WHERE run_id = %s",
                  (ids["old dead letter"],)) == 3
    assert prune(conn).deleted == 0  # nothing else is due: a second pass is a no-op
    assert retention.preview(conn, HOUR, now=NOW) == []


def test_retention_is_measured_from_finished_at(conn: Conn) -> None:
    add_job(conn, "j", entrypoint="jobfuncs:noop")
    # Created (and its logical time) long ago but finished recently: it stays.
    kept = insert_run(conn, "j", "succeeded", finished=NOW - timedelta(minutes=59),
                      at=NOW - timedelta(days=300))
    gone = insert_run(conn, "j", "succeeded", finished=NOW - timedelta(minutes=61))
    prune(conn)
    assert surviving(conn, {"kept": kept, "gone": gone}) == {"kept"}


def test_an_upstream_stays_while_a_downstream_run_of_its_logical_time_waits(
        conn: Conn) -> None:
    add_job(conn, "up", entrypoint="jobfuncs:noop")
    add_job(conn, "side", entrypoint="jobfuncs:noop")
    add_job(conn, "down", entrypoint="jobfuncs:noop", depends_on=["up", "side"])
    at = OLD - timedelta(hours=5)
    up = insert_run(conn, "up", "succeeded", at=at)
    side = insert_run(conn, "side", "running", at=at)
    down = insert_run(conn, "down", "pending", at=at, attempts=0)
    other_up = insert_run(conn, "up", "succeeded", at=at - timedelta(hours=1))  # no downstream

    prune(conn)
    # Deleting `up` would make `down` ignore it ("not part of this DAG run").
    assert surviving(conn, {"up": up, "down": down, "side": side, "other": other_up}) == {
        "up", "down", "side"}
    assert retention.preview(conn, HOUR, now=NOW) == []

    # Its downstream finishes (recently): now `up` may go; `down` is kept by its own age.
    conn.execute("UPDATE pgflow.runs SET state = 'succeeded', finished_at = %s,"
                 " lease_owner = NULL, lease_expires_at = NULL WHERE id = %s",
                 (RECENT, side))
    conn.execute("UPDATE pgflow.runs SET state = 'succeeded', finished_at = %s"
                 " WHERE id = %s", (RECENT, down))
    prune(conn)
    assert surviving(conn, {"up": up, "down": down, "side": side}) == {"down", "side"}


def test_upstream_failed_runs_stay_with_their_dead_letter_and_follow_it(conn: Conn) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop")
    add_job(conn, "b", entrypoint="jobfuncs:noop", depends_on=["a"])
    add_job(conn, "c", entrypoint="jobfuncs:noop", depends_on=["b"])
    at = OLD - timedelta(hours=3)
    ids = {"a": insert_run(conn, "a", "failed", at=at, attempts=3),
           "b": insert_run(conn, "b", "upstream_failed", at=at, attempts=0),
           "c": insert_run(conn, "c", "upstream_failed", at=at, attempts=0)}
    prune(conn)
    assert surviving(conn, ids) == {"a", "b", "c"}

    # While kept, retrying the dead letter still resumes its downstream runs.
    runs.retry(conn, ids["a"])
    assert scalar(conn, "SELECT state FROM pgflow.runs WHERE id = %s", (ids["b"],)) == "pending"
    conn.execute("UPDATE pgflow.runs SET state = 'failed', finished_at = %s, attempt = 3"
                 " WHERE id = %s", (OLD, ids["a"]))
    conn.execute("UPDATE pgflow.runs SET state = 'upstream_failed', finished_at = %s"
                 " WHERE id = ANY(%s)", (OLD, [ids["b"], ids["c"]]))

    # Acknowledged, the chain goes one level per pass: nothing strands, nothing dangles.
    runs.ack(conn, ids["a"])
    conn.execute("UPDATE pgflow.runs SET acked_at = %s WHERE id = %s", (OLD, ids["a"]))
    assert prune(conn).deleted == 2  # a, and b (its only upstream run is no dead letter)
    assert surviving(conn, ids) == {"c"}  # b was still upstream_failed in that snapshot
    assert prune(conn).deleted == 1
    assert surviving(conn, ids) == set()


def test_batches_walk_past_the_runs_that_stay(conn: Conn) -> None:
    add_job(conn, "j", entrypoint="jobfuncs:noop")
    base = OLD - timedelta(days=1)
    # 30 dead letters oldest of all, then 50 succeeded runs.
    for i in range(30):
        insert_run(conn, "j", "failed", finished=base + timedelta(seconds=i),
                   at=base - timedelta(days=1, seconds=i))
    for i in range(50):
        insert_run(conn, "j", "succeeded", finished=base + timedelta(minutes=1, seconds=i),
                   at=base - timedelta(days=2, seconds=i))

    first = prune(conn, batch=20, max_batches=2)
    assert first.batches == 2 and first.scanned == 40 and first.deleted == 10
    assert not first.done and first.after is not None
    # A cut-short pass goes on from its cursor: the dead letters are not read again.
    rest = prune(conn, batch=20, after=first.after)
    assert rest.deleted == 40 and rest.done and rest.scanned == 40
    assert scalar(conn, "SELECT count(*) FROM pgflow.runs") == 30


def test_a_run_an_operator_holds_is_skipped_without_waiting(conn: Conn, db_url: str) -> None:
    add_job(conn, "j", entrypoint="jobfuncs:noop")
    held = insert_run(conn, "j", "failed", acked=True, attempts=3)
    other = insert_run(conn, "j", "succeeded")
    with psycopg.connect(db_url, row_factory=dict_row) as operator:
        # An operator's retry, not yet committed, holds the row.
        operator.execute("UPDATE pgflow.runs SET state = 'queued', finished_at = NULL,"
                         " acked_at = NULL, max_attempts = 6 WHERE id = %s", (held,))
        found = prune(conn)  # returns at once: SKIP LOCKED, nobody waits
        assert found.deleted == 1
        assert surviving(conn, {"held": held, "other": other}) == {"held"}
        operator.commit()
    # The retry committed: the run is queued again and never a candidate.
    assert prune(conn).deleted == 0
    assert scalar(conn, "SELECT state FROM pgflow.runs WHERE id = %s", (held,)) == "queued"


def test_a_prune_waits_for_nobody_and_a_retry_after_it_finds_no_run(
        conn: Conn, db_url: str) -> None:
    """The other order: the prune holds the row; an operator's retry of it (an old
    acknowledged dead letter) waits for that batch only and then finds it gone."""
    add_job(conn, "j", entrypoint="jobfuncs:noop")
    old = insert_run(conn, "j", "failed", acked=True, attempts=3)
    with psycopg.connect(db_url, row_factory=dict_row) as pruner:
        with pruner.transaction():
            pruner.execute(q("prune_runs"), {
                "retention_s": HOUR, "now": NOW, "limit": 100, "after_finished": None,
                "after_id": None})
            outcome: list[Any] = []
            retry = threading.Thread(target=lambda: outcome.append(_retry(db_url, old)))
            retry.start()
            wait_for(lambda: scalar(conn, "SELECT count(*) FROM pg_locks WHERE NOT granted"
                                          " AND locktype = 'transactionid'") >= 1)
        retry.join(10)
    assert outcome == ["no run"]


def _retry(url: str, run_id: int) -> str:
    from pgflow.errors import NotFound

    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as c:
        try:
            runs.retry(c, run_id)
            return "retried"
        except NotFound:
            return "no run"


def _old_history(conn: Conn, n: int, *, finished: datetime, dead_every: int = 100) -> None:
    """``n`` succeeded runs of job 'j' (every ``dead_every``-th a dead letter) finished
    at ``finished``, with one attempt each."""
    conn.execute(
        "INSERT INTO pgflow.runs (job, logical_time, state, attempt, max_attempts, trigger,"
        " tenant, created_at, started_at, finished_at)"
        " SELECT 'j', timestamptz '2001-01-01' + make_interval(secs => i),"
        " CASE WHEN i %% %(dead)s = 0 THEN 'failed' ELSE 'succeeded' END, 1, 1, 'manual',"
        " 'default', %(at)s, %(at)s, %(at)s FROM generate_series(1, %(n)s) AS i",
        {"n": n, "at": finished, "dead": dead_every})
    conn.execute("INSERT INTO pgflow.attempts (run_id, attempt, worker_id, started_at,"
                 " finished_at, outcome) SELECT id, 1, 'w', started_at, finished_at,"
                 " 'succeeded' FROM pgflow.runs")


def test_two_pruners_at_once_share_the_work(conn: Conn, db_url: str) -> None:
    """Two leaders for a moment (a leader change mid-pass): SKIP LOCKED splits the rows,
    nobody waits, nothing is deleted twice or kept by mistake."""
    add_job(conn, "j", entrypoint="jobfuncs:noop")
    _old_history(conn, 3000, finished=OLD)
    results: list[retention.PrunePass] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as own:
                results.append(retention.run_once(own, HOUR, now=NOW, batch=100))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert sum(r.deleted for r in results) == 2970
    assert scalar(conn, "SELECT count(*) FROM pgflow.runs") == 30  # the dead letters
    assert scalar(conn, "SELECT count(*) FROM pgflow.attempts") == 30


def test_ended_backfills_go_once_their_runs_are_gone(conn: Conn) -> None:
    add_job(conn, "bf", entrypoint="jobfuncs:noop", schedule="@daily")
    backfills = []
    for state in ("completed", "cancelled", "running"):
        row = conn.execute(
            "INSERT INTO pgflow.backfills (job, range_start, range_end, max_concurrency,"
            " state, finished_at) VALUES ('bf', %s, %s, 1, %s, %s) RETURNING id",
            (OLD - timedelta(days=9), OLD - timedelta(days=8), state,
             None if state == "running" else OLD)).fetchone()
        assert row is not None
        backfills.append(row["id"])
    done, cancelled, running = backfills
    insert_run(conn, "bf", "succeeded", backfill_id=done)
    recent = insert_run(conn, "bf", "succeeded", finished=RECENT, backfill_id=cancelled)
    found = prune(conn)
    assert found.backfills == 1
    left = {r["id"] for r in conn.execute("SELECT id FROM pgflow.backfills")}
    assert left == {cancelled, running}  # one still has a run; one is running
    conn.execute("UPDATE pgflow.runs SET finished_at = %s WHERE id = %s", (OLD, recent))
    assert prune(conn).backfills == 1


def test_pruning_while_a_worker_claims_and_finishes_loses_nothing(
        conn: Conn, db_url: str) -> None:
    add_job(conn, "quick", entrypoint="jobfuncs:noop")
    worker = WorkerThread(db_url, concurrency=16)
    pruned: dict[str, int] = {}
    errors: list[BaseException] = []
    stop = threading.Event()

    def pruning() -> None:
        with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as own:
            while not stop.is_set():
                try:
                    found = retention.run_once(own, 0.2, batch=25)
                except BaseException as exc:  # reported by the assertion below
                    errors.append(exc)
                    return
                for state, n in found.runs.items():
                    pruned[state] = pruned.get(state, 0) + n
                time.sleep(0.02)

    pruner = threading.Thread(target=pruning)
    pruner.start()
    total = 0
    try:
        base = datetime(2031, 1, 1, tzinfo=UTC)
        for wave in range(8):
            for i in range(50):
                enqueue(conn, "quick", base + timedelta(minutes=wave, seconds=i))
                total += 1
            time.sleep(0.1)
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM pgflow.runs WHERE state <> "
                                      "'succeeded'") == 0, timeout=60)
        wait_for(lambda: pruned.get("succeeded", 0) > 0, timeout=20)
    finally:
        stop.set()
        pruner.join(30)
        worker.stop()
    assert not errors
    left = scalar(conn, "SELECT count(*) FROM pgflow.runs")
    assert set(pruned) <= {"succeeded"}
    assert pruned.get("succeeded", 0) + left == total  # every run ran and succeeded once
    assert scalar(conn, "SELECT count(*) FROM pgflow.attempts a LEFT JOIN pgflow.runs r"
                        " ON r.id = a.run_id WHERE r.id IS NULL") == 0
    assert scalar(conn, "SELECT count(*) FROM pgflow.attempts") == left


# ---------------------------------------------------------------- the command line


@pytest.fixture
def cli(db_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Iterator[Any]:
    monkeypatch.setenv("PGFLOW_DATABASE_URL", db_url)
    monkeypatch.setenv("PGFLOW_RETENTION", "1h")

    def invoke(*args: str) -> tuple[int, str, str]:
        code = cli_run(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    yield invoke


def test_db_prune_dry_run_shows_what_would_go_and_prune_deletes_it(cli: Any,
                                                                   conn: Conn) -> None:
    add_job(conn, "j", entrypoint="jobfuncs:noop")
    now = datetime.now(UTC)
    for state in ("succeeded", "succeeded", "cancelled"):
        insert_run(conn, "j", state, finished=now - timedelta(hours=3))
    insert_run(conn, "j", "failed", finished=now - timedelta(hours=5))  # a dead letter
    insert_run(conn, "j", "succeeded", finished=now - timedelta(minutes=5))

    code, out, _ = cli("db", "prune", "--dry-run", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["dry_run"] and doc["total"] == 3
    assert doc["runs"] == {"cancelled": 1, "succeeded": 2} and doc["retention_s"] == HOUR
    assert scalar(conn, "SELECT count(*) FROM pgflow.runs") == 5  # nothing deleted

    code, out, _ = cli("db", "prune", "--dry-run")
    assert code == 0 and out.startswith("would delete 3 finished runs")
    assert "retention 1h" in out and "STATE" in out and "succeeded" in out

    code, out, _ = cli("db", "status", "--json")
    kept = json.loads(out)["retention"]
    assert kept["retention_s"] == HOUR and kept["past_retention"] == 4
    assert kept["dead_letters_kept"] == 1 and not kept["capped"] and kept["leader"] is None
    code, out, _ = cli("db", "status")
    assert "retention: 1h (PGFLOW_RETENTION here)" in out
    assert "past retention: 4 finished runs, 1 of them dead letters" in out

    code, out, _ = cli("db", "prune")
    assert code == 0 and out.startswith("deleted 3 finished runs (cancelled 1, succeeded 2)")
    assert scalar(conn, "SELECT count(*) FROM pgflow.runs") == 2
    code, out, _ = cli("db", "prune", "--retention", "1m", "--json")
    assert json.loads(out)["runs"] == {"succeeded": 1}


def test_bad_retention_values_are_one_line_errors(cli: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = cli("db", "prune", "--retention", "0", "--dry-run")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("error: invalid setting flag --retention='0'")
    monkeypatch.setenv("PGFLOW_RETENTION", "soon")
    code, _, err = cli("db", "status")
    assert code == 1 and err.count("\n") == 1
    assert "PGFLOW_RETENTION='soon'" in err and "30s, 10m, 2h, 1d" in err


def test_serve_refuses_a_bad_retention_flag_in_one_line(db_url: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pgflow", "serve", "--retention", "soon"],
                          cwd=ROOT, env=child_env(db_url, tmp_path), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: invalid setting flag --retention='soon'")


# ---------------------------------------------------------------- the leader


def test_the_leader_prunes_by_itself(conn: Conn, replicas: Replicas) -> None:
    add_job(conn, "j", entrypoint="jobfuncs:noop")
    now = datetime.now(UTC)
    gone = [insert_run(conn, "j", "succeeded", finished=now - timedelta(minutes=m))
            for m in range(1, 4)]
    dead = insert_run(conn, "j", "failed", finished=now - timedelta(minutes=5))
    replica = replicas.start("leader", roles=("scheduler", "worker"),
                             env={"PGFLOW_RETENTION": "2s"})
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM pgflow.runs WHERE id = ANY(%s)",
                            (gone,)) == 0, timeout=30)
    # Runs that finish while it leads go too, about 2 s after they finished.
    fresh = enqueue(conn, "j", datetime(2031, 1, 1, tzinfo=UTC))
    wait_for(lambda: scalar(conn, "SELECT state FROM pgflow.runs WHERE id = %s",
                            (fresh,)) in (None, "succeeded"), timeout=30)
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM pgflow.runs WHERE id = %s",
                            (fresh,)) == 0, timeout=30)
    assert scalar(conn, "SELECT state FROM pgflow.runs WHERE id = %s", (dead,)) == "failed"
    record = replica.wait_log("retention: deleted finished runs")
    assert record["runs"] >= 1
    # The totals row is written just after a pass's deletes commit.
    wait_for(lambda: (scalar(conn, "SELECT pruned_runs FROM pgflow.retention") or 0) >= 4,
             timeout=10)
    leader = conn.execute("SELECT * FROM pgflow.retention").fetchone()
    assert leader is not None and leader["retention_s"] == 2.0
    assert leader["replica_id"] == replica.id(conn)


def test_a_new_leader_finishes_a_pass_its_killed_predecessor_began(
        conn: Conn, replicas: Replicas) -> None:
    add_job(conn, "j", entrypoint="jobfuncs:noop")
    _old_history(conn, 60_000, finished=datetime.now(UTC) - timedelta(hours=2))
    first = replicas.start("first", roles=("scheduler",), env={"PGFLOW_RETENTION": "1h"})
    first.wait_log("retention: deleted finished runs", timeout=30)
    first.kill9()  # mid-pass: its session ends, its open batch rolls back
    left = scalar(conn, "SELECT count(*) FROM pgflow.runs")
    second = replicas.start("second", roles=("scheduler",), env={"PGFLOW_RETENTION": "1h"})
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM pgflow.runs") == 600, timeout=60)
    assert left > 600  # the kill did land mid-pass
    assert scalar(conn, "SELECT count(*) FROM pgflow.runs WHERE state <> 'failed'") == 0
    assert scalar(conn, "SELECT count(*) FROM pgflow.attempts") == 600
    leader = conn.execute("SELECT * FROM pgflow.retention").fetchone()
    assert leader is not None and leader["replica_id"] == second.id(conn)
