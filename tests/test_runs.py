import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from drive import check_nothing_stuck
from psycopg.rows import dict_row

from pgflow import registry, runs
from pgflow.cli import run
from pgflow.errors import Conflict, NotFound, PgflowError
from pgflow.spec import JobSpec

Conn = psycopg.Connection[dict[str, Any]]
HOSTILE = "'; DROP TABLE pgflow.runs; --"
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def add_job(conn: Conn, name: str, **definition: Any) -> None:
    specs, errors = registry.parse_jobs([(name, {"command": "true", **definition})])
    assert not errors
    registry.apply(conn, specs)


def get(conn: Conn, run_id: int) -> dict[str, Any]:
    row = conn.execute("SELECT * FROM pgflow.runs WHERE id = %s", [run_id]).fetchone()
    assert row is not None
    return row


def set_running(conn: Conn, run_id: int, worker: str = "w1", attempt: int = 1) -> None:
    conn.execute(
        "UPDATE pgflow.runs SET state = 'running', attempt = %s, lease_owner = %s,"
        " lease_expires_at = now() + interval '30 s', attempt_started_at = now(),"
        " started_at = coalesce(started_at, now()) WHERE id = %s", [attempt, worker, run_id])


def set_finished(conn: Conn, run_id: int, state: str, attempt: int = 3) -> None:
    conn.execute(
        "UPDATE pgflow.runs SET state = %s, attempt = %s, finished_at = now() WHERE id = %s",
        [state, attempt, run_id])


def set_state(conn: Conn, run_id: int, state: str) -> None:
    conn.execute("UPDATE pgflow.runs SET state = %s WHERE id = %s", [state, run_id])


def record_attempt(conn: Conn, run_id: int, attempt: int, outcome: str, error: str) -> None:
    conn.execute(
        "INSERT INTO pgflow.attempts (run_id, attempt, worker_id, started_at, outcome, exit_code,"
        " error) VALUES (%s, %s, 'w0', now() - interval '1 min', %s, 1, %s)",
        [run_id, attempt, outcome, error])


def failed_run(conn: Conn, job: str = "etl", at: datetime = T0) -> int:
    run_id = runs.trigger(conn, job, at)
    set_finished(conn, run_id, "failed")
    return run_id


@pytest.fixture(autouse=True)
def _nothing_stuck(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from check_nothing_stuck(request)


@pytest.fixture
def stuck_ok() -> None:
    """This test builds a run state by hand that the engine would never leave behind."""


@pytest.fixture
def etl(conn: Conn) -> Conn:
    add_job(conn, "etl", params={"region": "eu", "limit": 10}, tenant="sales",
            retry={"max_attempts": 3})
    return conn


@pytest.fixture
def other(db_url: str) -> Iterator[Conn]:
    with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as connection:
        yield connection


def listen(db_url: str, channel: str) -> psycopg.Connection[Any]:
    listener = psycopg.connect(db_url, autocommit=True)
    listener.execute(f"LISTEN {channel}")
    return listener


def notifications(listener: psycopg.Connection[Any]) -> list[str]:
    return [n.payload for n in listener.notifies(timeout=0.5)]


def wait_until_blocked(conn: Conn, pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                           [pid]).fetchone()
        if row and row["wait_event_type"] == "Lock":
            return
        time.sleep(0.02)
    raise AssertionError("the concurrent statement never waited for the row lock")


def race(holder: Conn, contender: Conn, first: Callable[[Conn], Any],
         second: Callable[[Conn], Any]) -> tuple[Any, Any]:
    """``first`` changes the row inside an open transaction on ``holder``; ``second`` runs on
    ``contender`` while that transaction holds the row lock, and sees the committed result."""
    outcome: dict[str, Any] = {}

    def contend() -> None:
        try:
            outcome["value"] = second(contender)
        except PgflowError as exc:
            outcome["value"] = exc

    pid = contender.info.backend_pid
    with holder.transaction():
        won = first(holder)
        thread = threading.Thread(target=contend)
        thread.start()
        wait_until_blocked(holder, pid)
    thread.join(10)
    return won, outcome["value"]


# ---------------------------------------------------------------- trigger


def test_trigger_creates_a_queued_manual_run_with_merged_params(etl: Conn, db_url: str) -> None:
    listener = listen(db_url, "pgflow_queue")
    run_id = runs.trigger(etl, "etl", T0, {"limit": 5, "extra": [1, 2]})
    row = get(etl, run_id)
    assert (row["job"], row["state"], row["trigger"], row["tenant"]) == (
        "etl", "queued", "manual", "sales")
    assert row["logical_time"] == T0 and row["max_attempts"] == 3
    assert row["params"] == {"region": "eu", "limit": 5, "extra": [1, 2]}
    assert notifications(listener) == [""]


def test_trigger_defaults_to_the_database_clock_to_the_second(etl: Conn) -> None:
    before = etl.execute("SELECT now() AS now").fetchone()
    run_id = runs.trigger(etl, "etl")
    logical_time = get(etl, run_id)["logical_time"]
    assert before is not None and logical_time.microsecond == 0
    assert abs(logical_time - before["now"]) < timedelta(seconds=2)
    assert get(etl, run_id)["params"] == {"region": "eu", "limit": 10}


def test_naive_logical_time_means_utc(etl: Conn) -> None:
    etl.execute("SET TIME ZONE 'America/New_York'")
    run_id = runs.trigger(etl, "etl", datetime(2026, 3, 1, 12, 0))
    assert get(etl, run_id)["logical_time"] == T0


def test_second_trigger_for_the_same_logical_time_is_refused(etl: Conn) -> None:
    first = runs.trigger(etl, "etl", T0)
    with pytest.raises(Conflict) as refused:
        runs.trigger(etl, "etl", T0 + timedelta(0), {"other": 1})
    assert str(refused.value) == (
        f"job 'etl' already has run {first} for logical time 2026-03-01T12:00:00+00:00;"
        f" pass a different --logical-time or retry run {first}")
    assert etl.execute("SELECT count(*) AS n FROM pgflow.runs").fetchone() == {"n": 1}


def test_unknown_job_suggests_a_name(etl: Conn) -> None:
    with pytest.raises(NotFound, match=r"no job named 'etk', did you mean 'etl'\?"):
        runs.trigger(etl, "etk")
    with pytest.raises(NotFound, match=r"no job named 'zzzzzz' \(see 'pgflow jobs list'\)"):
        runs.trigger(etl, "zzzzzz")


def test_hostile_names_and_params_stay_data(etl: Conn) -> None:
    with pytest.raises(NotFound):
        runs.trigger(etl, HOSTILE)
    run_id = runs.trigger(etl, "etl", T0, {HOSTILE: HOSTILE})
    assert get(etl, run_id)["params"][HOSTILE] == HOSTILE
    assert runs.list_runs(etl, job=HOSTILE, tenant=HOSTILE) == []
    assert len(runs.list_runs(etl)) == 1


# ---------------------------------------------------------------- listing and showing


def test_list_runs_newest_first_with_filters_and_cursor(etl: Conn) -> None:
    add_job(etl, "load")
    ids = [runs.trigger(etl, "etl", T0 + timedelta(hours=i)) for i in range(3)]
    load_id = runs.trigger(etl, "load", T0)
    set_finished(etl, ids[0], "failed")
    assert [r["id"] for r in runs.list_runs(etl)] == [load_id, *reversed(ids)]
    assert [r["id"] for r in runs.list_runs(etl, job="etl")] == list(reversed(ids))
    assert [r["id"] for r in runs.list_runs(etl, state="failed")] == [ids[0]]
    assert [r["id"] for r in runs.list_runs(etl, job="etl", state="queued")] == [ids[2], ids[1]]
    assert [r["id"] for r in runs.list_runs(etl, tenant="default")] == [load_id]
    assert [r["id"] for r in runs.list_runs(etl, limit=2)] == [load_id, ids[2]]
    assert [r["id"] for r in runs.list_runs(etl, before_id=ids[2])] == [ids[1], ids[0]]
    assert [r["id"] for r in runs.list_runs(etl, job="etl", before_id=ids[1])] == [ids[0]]


def test_list_runs_rejects_unknown_state(etl: Conn) -> None:
    with pytest.raises(PgflowError) as refused:
        runs.list_runs(etl, state="runing")
    message = str(refused.value)
    assert "unknown run state 'runing'; did you mean 'running'?" in message
    assert "pending, queued, running, retrying, succeeded, failed, cancelled, upstream_failed" \
        in message
    with pytest.raises(PgflowError, match="limit must be at least 1"):
        runs.list_runs(etl, limit=0)


def test_show_run_has_finished_attempts_and_the_running_one(etl: Conn) -> None:
    run_id = runs.trigger(etl, "etl", T0)
    record_attempt(etl, run_id, 1, "failed", "boom")
    set_running(etl, run_id, worker="w2", attempt=2)
    shown = runs.show_run(etl, run_id)
    assert shown["state"] == "running" and shown["job_exists"] is True
    first, current = shown["attempts"]
    assert (first["attempt"], first["outcome"], first["error"]) == (1, "failed", "boom")
    assert (current["attempt"], current["worker_id"], current["outcome"]) == (2, "w2", None)
    assert current["started_at"] is not None and current["finished_at"] is None


def test_unknown_runs_are_not_found(etl: Conn) -> None:
    for action in (runs.show_run, runs.retry, runs.cancel, runs.ack):
        for run_id in (12345, 0, -1, 2**70):
            with pytest.raises(NotFound, match=rf"no run {run_id} \(see 'pgflow runs list'\)"):
                action(etl, run_id)


# ---------------------------------------------------------------- retry


def test_retry_failed_run_gets_a_fresh_budget(etl: Conn, db_url: str) -> None:
    run_id = failed_run(etl)
    etl.execute("UPDATE pgflow.runs SET acked_at = now(), cancel_requested = true,"
                " available_at = now() - interval '1 day' WHERE id = %s", [run_id])
    listener = listen(db_url, "pgflow_queue")
    result = runs.retry(etl, run_id)
    row = get(etl, run_id)
    assert result["state"] == row["state"] == "queued"
    assert (row["attempt"], row["max_attempts"]) == (3, 6)
    assert row["finished_at"] is None and row["acked_at"] is None
    assert row["cancel_requested"] is False
    assert row["available_at"] > datetime.now(UTC) - timedelta(minutes=1)
    assert notifications(listener) == [""]


def test_retry_cancelled_run(etl: Conn) -> None:
    run_id = runs.trigger(etl, "etl", T0)
    runs.cancel(etl, run_id)
    runs.retry(etl, run_id)
    assert (get(etl, run_id)["state"], get(etl, run_id)["max_attempts"]) == ("queued", 3)


@pytest.mark.parametrize(("state", "message"), [
    ("running", "run {id} is running; cancel it first"),
    ("succeeded", "run {id} succeeded; use 'pgflow trigger' for a new run"),
    ("queued", "run {id} is already queued; nothing to retry"),
    ("retrying", "run {id} is already retrying; nothing to retry"),
    ("pending", "run {id} is already pending; nothing to retry"),
    ("upstream_failed", "run {id} is upstream_failed because of its upstreams: retry those"
                        " runs instead"),
])
def test_retry_refusals_name_the_state(etl: Conn, state: str, message: str,
                                      stuck_ok: None) -> None:
    run_id = runs.trigger(etl, "etl", T0)
    if state == "running":
        set_running(etl, run_id)
    elif state in ("succeeded", "upstream_failed"):
        set_finished(etl, run_id, state)
    else:
        set_state(etl, run_id, state)
    with pytest.raises(Conflict) as refused:
        runs.retry(etl, run_id)
    assert str(refused.value) == message.format(id=run_id)


def test_retry_of_a_deleted_job_is_refused(etl: Conn) -> None:
    run_id = failed_run(etl)
    registry.delete(etl, "etl")
    with pytest.raises(Conflict, match=rf"run {run_id}'s job 'etl' no longer exists"):
        runs.retry(etl, run_id)
    assert get(etl, run_id)["state"] == "failed"


def test_concurrent_retries_exactly_one_wins(etl: Conn, other: Conn) -> None:
    run_id = failed_run(etl)
    won, lost = race(etl, other, lambda c: runs.retry(c, run_id), lambda c: runs.retry(c, run_id))
    assert won["state"] == "queued"
    assert isinstance(lost, Conflict) and str(lost) == f"run {run_id} is already queued;" \
        " nothing to retry"
    assert get(etl, run_id)["max_attempts"] == 6


# ---------------------------------------------------------------- cancel


@pytest.mark.parametrize("state", ["pending", "queued", "retrying"])
def test_cancel_unstarted_run(etl: Conn, state: str) -> None:
    run_id = runs.trigger(etl, "etl", T0)
    set_state(etl, run_id, state)
    result = runs.cancel(etl, run_id)
    row = get(etl, run_id)
    assert result["outcome"] == "cancelled" and row["state"] == "cancelled"
    assert row["finished_at"] is not None


def test_cancel_running_run_asks_its_worker(etl: Conn, db_url: str) -> None:
    run_id = runs.trigger(etl, "etl", T0)
    set_running(etl, run_id, worker="w7")
    listener = listen(db_url, "pgflow_cancel")
    result = runs.cancel(etl, run_id)
    row = get(etl, run_id)
    assert result["outcome"] == "cancel requested" and result["lease_owner"] == "w7"
    assert row["state"] == "running" and row["cancel_requested"] is True
    assert row["finished_at"] is None
    assert notifications(listener) == [str(run_id)]


@pytest.mark.parametrize(("state", "message"), [
    ("succeeded", "run {id} already succeeded; nothing to cancel"),
    ("cancelled", "run {id} is already cancelled"),
    ("failed", "run {id} already failed; nothing to cancel (acknowledge it with"
               " 'pgflow runs ack {id}')"),
    ("upstream_failed", "run {id} is upstream_failed (finished); nothing to cancel"),
])
def test_cancel_refuses_finished_runs(etl: Conn, state: str, message: str) -> None:
    run_id = runs.trigger(etl, "etl", T0)
    set_finished(etl, run_id, state)
    with pytest.raises(Conflict) as refused:
        runs.cancel(etl, run_id)
    assert str(refused.value) == message.format(id=run_id)


def test_cancel_racing_a_claim_asks_the_new_worker(etl: Conn, other: Conn, db_url: str) -> None:
    run_id = runs.trigger(etl, "etl", T0)
    listener = listen(db_url, "pgflow_cancel")
    _, result = race(etl, other, lambda c: set_running(c, run_id, "w9"),
                     lambda c: runs.cancel(c, run_id))
    assert result["outcome"] == "cancel requested" and result["lease_owner"] == "w9"
    assert get(etl, run_id)["cancel_requested"] is True
    assert notifications(listener) == [str(run_id)]


def test_cancel_racing_completion_is_refused(etl: Conn, other: Conn) -> None:
    run_id = runs.trigger(etl, "etl", T0)
    set_running(etl, run_id)

    def succeed(c: Conn) -> None:
        c.execute("UPDATE pgflow.runs SET state = 'succeeded', finished_at = now(),"
                  " lease_owner = NULL, lease_expires_at = NULL WHERE id = %s", [run_id])

    _, result = race(etl, other, succeed, lambda c: runs.cancel(c, run_id))
    assert isinstance(result, Conflict) and "already succeeded" in str(result)


# ---------------------------------------------------------------- ack and dead letters


def test_ack_takes_a_failed_run_out_of_the_dead_letters(etl: Conn) -> None:
    older = failed_run(etl, at=T0)
    newer = failed_run(etl, at=T0 + timedelta(hours=1))
    record_attempt(etl, newer, 3, "failed", "exit 1")
    dead = runs.dead_letters(etl, limit=10)
    assert [d["id"] for d in dead] == [newer, older]
    assert (dead[0]["error"], dead[0]["outcome"], dead[1]["error"]) == ("exit 1", "failed", None)
    result = runs.ack(etl, newer)
    assert result["acked_at"] is not None
    assert [d["id"] for d in runs.dead_letters(etl)] == [older]
    with pytest.raises(Conflict, match=rf"run {newer} was already acknowledged at 20"):
        runs.ack(etl, newer)


@pytest.mark.parametrize("state", ["queued", "succeeded", "cancelled", "running"])
def test_ack_refuses_runs_that_did_not_fail(etl: Conn, state: str) -> None:
    run_id = runs.trigger(etl, "etl", T0)
    if state == "running":
        set_running(etl, run_id)
    elif state != "queued":
        set_finished(etl, run_id, state)
    with pytest.raises(Conflict) as refused:
        runs.ack(etl, run_id)
    assert str(refused.value) == f"run {run_id} is {state}; only failed runs can be acknowledged"


def test_concurrent_acks_exactly_one_wins(etl: Conn, other: Conn) -> None:
    run_id = failed_run(etl)
    won, lost = race(etl, other, lambda c: runs.ack(c, run_id), lambda c: runs.ack(c, run_id))
    assert won["id"] == run_id
    assert isinstance(lost, Conflict) and "already acknowledged" in str(lost)


# ---------------------------------------------------------------- CLI


@pytest.fixture
def cli(db_url: str, etl: Conn, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    monkeypatch.setenv("PGFLOW_DATABASE_URL", db_url)

    def invoke(*args: str) -> tuple[int, str, str]:
        code = run(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


CLI = Callable[..., tuple[int, str, str]]


def assert_one_line_error(result: tuple[int, str, str], fragment: str, code: int = 1) -> None:
    assert result[0] == code and result[1] == ""
    assert result[2].startswith("error: ") and result[2].count("\n") == 1, result[2]
    assert fragment in result[2], result[2]


def test_cli_trigger_prints_the_run_id(cli: CLI, etl: Conn) -> None:
    code, out, err = cli("trigger", "etl", "--logical-time", "2026-03-01T13:00:00+01:00",
                         "--param", "limit=5", "--param", 'filter={"a": 1}', "--param", "on=true",
                         "--param", "name=orders", "--param", "empty=", "--param", "eq=a=b",
                         "--no-downstream")
    assert code == 0 and out.strip().isdigit(), err
    row = get(etl, int(out))
    assert row["logical_time"] == T0
    assert row["params"] == {"region": "eu", "limit": 5, "filter": {"a": 1}, "on": True,
                             "name": "orders", "empty": "", "eq": "a=b"}


def test_cli_trigger_times(cli: CLI, etl: Conn) -> None:
    zulu = int(cli("trigger", "etl", "--logical-time", "2026-03-01T12:00:00Z")[1])
    naive = int(cli("trigger", "etl", "--logical-time", "2026-03-02 12:00")[1])
    assert get(etl, zulu)["logical_time"] == T0
    assert get(etl, naive)["logical_time"] == T0 + timedelta(days=1)
    assert_one_line_error(cli("trigger", "etl", "--logical-time", "2026-03-01T12:00:00Z"),
                          f"already has run {zulu} for logical time 2026-03-01T12:00:00+00:00")
    assert_one_line_error(cli("trigger", "etl", "--logical-time", "yesterday"),
                          "'--logical-time': expected ISO 8601", code=2)


def test_cli_trigger_errors_are_one_line(cli: CLI) -> None:
    assert_one_line_error(cli("trigger", "etl", "--param", "novalue"),
                          "'--param': expected key=value, got 'novalue'", code=2)
    assert_one_line_error(cli("trigger", "etl", "--param", "=x"), "expected key=value", code=2)
    assert_one_line_error(cli("trigger", "elt"), "no job named 'elt', did you mean 'etl'?")
    assert_one_line_error(cli("trigger", HOSTILE), "no job named")


def test_cli_hostile_param_stays_data(cli: CLI, etl: Conn) -> None:
    code, out, _ = cli("trigger", "etl", "--param", f"x={HOSTILE}")
    assert code == 0 and get(etl, int(out))["params"]["x"] == HOSTILE


def test_cli_runs_list(cli: CLI, etl: Conn) -> None:
    first = runs.trigger(etl, "etl", T0)
    second = runs.trigger(etl, "etl", T0 + timedelta(hours=1))
    set_finished(etl, first, "failed")
    code, out, _ = cli("runs", "list")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["ID", "JOB", "LOGICAL_TIME", "STATE", "ATTEMPT",
                                              "TRIGGER", "TENANT", "STARTED_AT", "FINISHED_AT"]
    assert [line.split()[0] for line in lines[1:]] == [str(second), str(first)]
    code, out, _ = cli("runs", "list", "--job", "etl", "--state", "failed", "--json")
    listed = json.loads(out)
    assert [r["id"] for r in listed] == [first] and listed[0]["state"] == "failed"
    assert json.loads(cli("runs", "list", "--limit", "1", "--json")[1])[0]["id"] == second
    assert_one_line_error(cli("runs", "list", "--state", "done"), "unknown run state 'done'")
    assert_one_line_error(cli("runs", "list", "--limit", "0"), "--limit", code=2)


def test_cli_runs_show(cli: CLI, etl: Conn) -> None:
    run_id = runs.trigger(etl, "etl", T0)
    record_attempt(etl, run_id, 1, "failed", "first line\nsecond line")
    set_running(etl, run_id, worker="w3", attempt=2)
    code, out, _ = cli("runs", "show", str(run_id))
    assert code == 0 and f"id:                {run_id}" in out
    assert "state:             running" in out and '"region": "eu"' in out
    attempts = out.split("attempts:\n")[1].splitlines()
    assert attempts[0].split()[:2] == ["ATTEMPT", "WORKER_ID"]
    assert "first line" in attempts[1] and "second line" not in out
    assert attempts[2].split()[:2] == ["2", "w3"]
    shown = json.loads(cli("runs", "show", str(run_id), "--json")[1])
    assert [a["attempt"] for a in shown["attempts"]] == [1, 2]
    assert shown["attempts"][1]["outcome"] is None


def test_cli_run_actions(cli: CLI, etl: Conn) -> None:
    queued = runs.trigger(etl, "etl", T0)
    running = runs.trigger(etl, "etl", T0 + timedelta(hours=1))
    set_running(etl, running, worker="w5")
    failed = failed_run(etl, at=T0 + timedelta(hours=2))
    assert cli("runs", "cancel", str(queued))[:2] == (0, f"run {queued} cancelled\n")
    assert cli("runs", "cancel", str(running))[:2] == (
        0, f"run {running} cancel requested; worker w5 stops it\n")
    assert cli("runs", "ack", str(failed))[:2] == (0, f"run {failed} acknowledged\n")
    assert cli("runs", "retry", str(failed))[:2] == (0, f"run {failed} queued for retry\n")
    assert_one_line_error(cli("runs", "retry", str(running)), f"run {running} is running;"
                          " cancel it first")
    assert_one_line_error(cli("runs", "ack", str(queued)), "only failed runs")
    assert_one_line_error(cli("runs", "cancel", str(queued)), "is already cancelled")


def test_cli_bad_run_ids(cli: CLI) -> None:
    for action in ("show", "retry", "cancel", "ack"):
        assert_one_line_error(cli("runs", action, "abc"), "'abc' is not a valid integer", code=2)
        assert_one_line_error(cli("runs", action, "999999"), "no run 999999")
    assert_one_line_error(cli("runs", "show", "99999999999999999999999"), "no run")


def test_retry_of_upstream_failed_names_the_failed_upstream(etl: Conn) -> None:
    registry.apply(etl, [JobSpec.model_validate({"name": "after", "command": "true",
                                                 "depends_on": ["etl"]})])
    run_id = runs.trigger(etl, "etl", T0)
    etl.execute("UPDATE pgflow.runs SET state = 'failed', finished_at = now() WHERE id = %s",
                (run_id,))
    etl.execute("UPDATE pgflow.runs SET state = 'upstream_failed', finished_at = now()"
                " WHERE job = 'after'")
    after = etl.execute("SELECT id FROM pgflow.runs WHERE job = 'after'").fetchone()
    assert after is not None
    with pytest.raises(Conflict) as refused:
        runs.retry(etl, after["id"])
    assert str(refused.value) == (f"run {after['id']} is upstream_failed because of run {run_id}"
                                  " (etl, failed): retry that run instead")
    runs.retry(etl, run_id)
    assert get(etl, after["id"])["state"] == "pending"


def test_trigger_without_downstream_creates_only_the_job(etl: Conn) -> None:
    registry.apply(etl, [JobSpec.model_validate({"name": "after", "command": "true",
                                                 "depends_on": ["etl"]})])
    runs.trigger(etl, "etl", T0, downstream=False)
    assert etl.execute("SELECT count(*) AS n FROM pgflow.runs").fetchone() == {"n": 1}
    runs.trigger(etl, "etl", T0 + timedelta(hours=1))
    assert etl.execute("SELECT count(*) AS n FROM pgflow.runs").fetchone() == {"n": 3}


def test_retry_message_says_whether_the_run_waits_for_its_upstreams() -> None:
    from pgflow.runs import retry_message

    assert retry_message(7, {"state": "queued"}) == "run 7 queued for retry"
    assert retry_message(7, {"state": "pending"}) == ("run 7 retried: it waits for its"
                                                      " upstream runs (pending)")


def test_a_session_that_triggers_often_plans_the_trigger_once(conn: Conn) -> None:
    """runs.trigger is on the latency path: once psycopg prepared its statement, the
    server runs it with one generic plan instead of planning every call."""
    add_job(conn, "often", command="true")
    start = datetime(2030, 1, 1, tzinfo=UTC)
    for i in range(20):  # psycopg prepares at the 6th; the server tries 5 custom plans
        runs.trigger(conn, "often", start + timedelta(minutes=i))
    row = conn.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                       " WHERE statement LIKE '%%INSERT INTO pgflow.runs%%'").fetchone()
    assert row is not None, "the trigger statement was not prepared"
    assert row["custom_plans"] == 5 and row["generic_plans"] == 10, row


def test_a_jobs_runs_newest_first_include_the_running_ones(etl: Conn, stuck_ok: None) -> None:
    """Running runs live in runs_running_idx, the others in runs_job_idx (migration
    0023): every reader of a job's runs newest first merges the two."""
    ids = [runs.trigger(etl, "etl", T0 + timedelta(minutes=i)) for i in range(4)]
    set_finished(etl, ids[0], "succeeded")
    set_running(etl, ids[1])
    set_running(etl, ids[3])  # ids[2] stays queued

    def latest() -> int:
        row = etl.execute("SELECT id FROM pgflow.latest_run('etl')").fetchone()
        assert row is not None
        return int(row["id"])

    assert latest() == ids[3]
    assert [r["id"] for r in runs.list_runs(etl, job="etl")] == ids[::-1]
    assert [r["id"] for r in runs.list_runs(etl, job="etl", state="running")] == [ids[3], ids[1]]
    assert [r["id"] for r in runs.list_runs(etl, job="etl", before_id=ids[3])] == ids[2::-1]
    first, cursor = runs.page_runs(etl, limit=3, job="etl")
    assert [r["id"] for r in first] == [ids[3], ids[2], ids[1]]
    rest, end = runs.page_runs(etl, limit=3, job="etl", before=cursor)
    assert [r["id"] for r in rest] == [ids[0]] and end is None
    running, _ = runs.page_runs(etl, limit=10, job="etl", state="running")
    assert [r["id"] for r in running] == [ids[3], ids[1]]
    etl.execute("UPDATE pgflow.runs SET state = 'succeeded', finished_at = now(),"
                " lease_owner = NULL, lease_expires_at = NULL, attempt_started_at = NULL"
                " WHERE id = %s", [ids[3]])  # out of runs_running_idx, into runs_job_idx
    assert latest() == ids[3]
    assert [r["id"] for r in runs.list_runs(etl, job="etl")] == ids[::-1]
    assert etl.execute("SELECT id FROM pgflow.latest_run('nope')").fetchone() is None
