"""Long runs (SPEC §4e): live output, progress, checkpoints, re-runs, reprocessing.

Real ``pgflow serve`` replicas (tests/procs.py) and the real PostgreSQL of the suite;
every wait is on a condition (no timing thresholds).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from engine import add_job, attempts, enqueue, wait_for
from procs import ROOT, Replicas, child_env, pgflow, run_state, sh, trigger, wait_state

from pgflow import live, queue
from pgflow.db import connect_async
from pgflow.errors import Conflict
from pgflow.rerun import rerun

Conn = psycopg.Connection[dict[str, Any]]

FAST_RETRY = {"max_attempts": 3, "backoff": 0.1, "max_backoff": 0.1, "jitter": False}


def logs(url: str, workdir: Path, run_id: int, *args: str) -> str:
    return pgflow(url, workdir, "runs", "logs", str(run_id), *args).stdout


def chattering(go: Path) -> list[str]:
    """A command printing a numbered line every 0.2 s until ``go`` exists."""
    return sh(f'i=0; while [ ! -e {go} ]; do i=$((i+1)); echo "line $i"; sleep 0.2; done;'
              ' echo "all done"; echo "to stderr" >&2')


# ---------------------------------------------------------------- live output


def test_output_is_visible_while_the_command_runs_and_follow_ends_with_it(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    go = tmp_path / "go"
    add_job(conn, "chatty", command=chattering(go))
    replicas.start("a").id(conn)
    run_id = trigger(db_url, tmp_path, "chatty")

    seen = wait_for(lambda: "line 1\n" in (out := logs(db_url, tmp_path, run_id)) and out,
                    timeout=20)
    assert run_state(conn, run_id)["state"] == "running"  # visible before it ended
    assert seen.startswith("line 1\n")

    follow = subprocess.Popen([sys.executable, "-m", "pgflow", "runs", "logs", str(run_id),
                               "--follow"], cwd=ROOT, env=child_env(db_url, tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        go.touch()
        out, err = follow.communicate(timeout=30)  # ends by itself once the attempt ends
    finally:
        follow.kill()
    assert follow.returncode == 0, err
    assert out.startswith("line 1\nline 2\n")
    assert "all done\n" in out and "to stderr\n" in out
    assert wait_state(conn, run_id, "succeeded")["state"] == "succeeded"
    # The whole output is there after the end too, with the attempt number.
    assert logs(db_url, tmp_path, run_id, "--attempt", "1") == out
    tail = attempts(conn, run_id)[0]["stdout_tail"]
    assert tail.startswith("line 1\n") and tail.endswith("all done\n")


def test_short_commands_keep_their_output_in_the_tails_only(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    add_job(conn, "quick", command=sh("echo out; echo err >&2"))
    replicas.start("a").id(conn)
    run_id = trigger(db_url, tmp_path, "quick")
    wait_state(conn, run_id, "succeeded")
    assert logs(db_url, tmp_path, run_id) == "out\nerr\n"
    bad = pgflow(db_url, tmp_path, "runs", "logs", str(run_id), "--attempt", "2", check=False)
    assert bad.returncode != 0 and "no attempt 2" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_log_limit_keeps_head_and_tail_with_a_marker(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    # 64 KiB limit: 32 KiB of head, 32 KiB of tail; the command prints ~1.3 MB.
    script = ('i=0; while [ $i -lt 20000 ]; do i=$((i+1));'
              ' echo "line $i of a long output, padded to 64 bytes or so ......"; done')
    add_job(conn, "loud", command=sh(script))
    replicas.start("a", env={"PGFLOW_LOG_LIMIT": "64KiB"}).id(conn)
    run_id = trigger(db_url, tmp_path, "loud")
    wait_state(conn, run_id, "succeeded", timeout=60)
    out = logs(db_url, tmp_path, run_id)
    assert out.startswith("line 1 of a long output")
    assert out.endswith("line 20000 of a long output, padded to 64 bytes or so ......\n")
    assert "bytes of output dropped (PGFLOW_LOG_LIMIT)" in out
    assert "line 10000 of" not in out  # the middle is gone
    stored = conn.execute("SELECT sum(length(data)) AS n FROM pgflow.run_output"
                          " WHERE run_id = %s", (run_id,)).fetchone()["n"]
    assert 64 * 1024 <= stored <= 64 * 1024 + live.CHUNK_MAX


def test_live_output_limit_in_memory() -> None:
    out = live.LiveOutput(limit=64 * 1024)
    for i in range(100):
        out.write("stdout", bytes([65 + i % 26]) * 4096)
    assert out.pos == 100 * 4096
    kept = sum(len(p.data) for p in out.pending)
    assert kept == 64 * 1024  # head + tail, never more, however much is printed
    assert out.pending[0].pos == 0
    assert out.pending[-1].pos + len(out.pending[-1].data) == out.pos


# ---------------------------------------------------------------- fencing


def test_a_fenced_attempt_late_chunks_progress_and_checkpoint_are_dropped(
        conn: Conn, db_url: str) -> None:
    add_job(conn, "fenced", command=sh("true"))
    run_id = enqueue(conn, "fenced")

    async def scenario() -> None:
        aconn = await connect_async(db_url, "test")
        try:
            [first] = await queue.claim(aconn, "w1", 1, 30.0)
            # The lease is taken from w1 (as the reaper does) and w2 claims attempt 2.
            await aconn.execute("UPDATE pgflow.runs SET state = 'queued', lease_owner = NULL,"
                                " lease_expires_at = NULL WHERE id = %s", (run_id,))
            [second] = await queue.claim(aconn, "w2", 1, 30.0)
        finally:
            await aconn.close()
        assert (first["attempt"], second["attempt"]) == (1, 2)
        late, current = live.LiveOutput(), live.LiveOutput()
        late.write("stdout", b"late output of attempt 1\n")
        late.progress(0.9, "late")
        late.checkpoint(live.encode_checkpoint({"from": "w1"}))
        current.write("stdout", b"output of attempt 2\n")
        current.checkpoint(live.encode_checkpoint({"from": "w2"}))

        async def connect() -> psycopg.AsyncConnection[Any]:
            return await connect_async(db_url, "test")

        for worker, key, output in (("w1", (run_id, 1), late), ("w2", (run_id, 2), current)):
            flusher = live.Flusher(worker, lambda k=key, o=output: [(k, o)], connect,
                                   log=None, bound_s=10)
            await flusher.flush()
            await flusher._drop_conn()
        assert not late.flushed and current.flushed

    asyncio.run(scenario())
    rows = conn.execute("SELECT attempt, data FROM pgflow.run_output WHERE run_id = %s",
                        (run_id,)).fetchall()
    assert [(r["attempt"], bytes(r["data"])) for r in rows] == [(2, b"output of attempt 2\n")]
    run = conn.execute("SELECT progress, checkpoint, checkpoint_attempt FROM pgflow.runs"
                       " WHERE id = %s", (run_id,)).fetchone()
    assert run == {"progress": None, "checkpoint": {"from": "w2"}, "checkpoint_attempt": 2}


# ---------------------------------------------------------------- progress


def test_progress_from_a_python_job_and_from_a_command(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    go = tmp_path / "go"
    add_job(conn, "py-progress", entrypoint="longfuncs:report_progress",
            params={"go": str(go)})
    control = ('for i in 1 2 3; do echo "{\\"progress\\": 0.$i, \\"message\\": \\"step $i\\"}"'
               ' > "$PGFLOW_CONTROL"; done;'
               ' echo "not json" > "$PGFLOW_CONTROL";'
               ' echo "[1, 2]" > "$PGFLOW_CONTROL";'
               ' echo "{\\"progress\\": 7}" > "$PGFLOW_CONTROL";'
               f' echo "still fine"; while [ ! -e {go} ]; do sleep 0.05; done')
    add_job(conn, "sh-progress", command=sh(control))
    replicas.start("a").id(conn)
    py_run = trigger(db_url, tmp_path, "py-progress")
    sh_run = trigger(db_url, tmp_path, "sh-progress")

    def reported(run_id: int, fraction: float) -> dict[str, Any] | None:
        shown = json.loads(pgflow(db_url, tmp_path, "runs", "show", str(run_id),
                                  "--json").stdout)
        return shown if shown["progress"] == fraction else None

    py = wait_for(lambda: reported(py_run, 0.5), timeout=20)
    assert py["progress_message"] == "half way" and py["state"] == "running"
    cmd = wait_for(lambda: reported(sh_run, 0.3), timeout=20)
    assert cmd["progress_message"] == "step 3"
    text = pgflow(db_url, tmp_path, "runs", "show", str(sh_run)).stdout
    assert "progress:" in text and "0.3" in text
    # Bad control lines are ignored with a warning in the attempt's own log.
    out = wait_for(lambda: "progress must be" in (o := logs(db_url, tmp_path, sh_run)) and o)
    assert "[pgflow] control line ignored: not a JSON object: 'not json'" in out
    assert "[pgflow] control line ignored: expected" in out  # the array
    assert "progress must be from 0 to 1, got 7" in out
    assert "still fine\n" in out
    go.touch()
    assert wait_state(conn, sh_run, "succeeded")["state"] == "succeeded"
    assert wait_state(conn, py_run, "succeeded")["state"] == "succeeded"


def test_control_lines_are_read_newest_first() -> None:
    out = live.LiveOutput()
    lines = b"".join(b'{"progress": %f}\n' % (i / 10_000) for i in range(10_000))
    out.control(b'{"checkpoint": {"n": 1}}\n' + lines + b'{"progress": 1, "message": "end"}\n')
    taken = out.take(1 << 20)
    assert taken.progress == (1.0, "end")
    assert taken.checkpoint == '{"n":1}'
    out.control(b'{"message": "only a message"}')  # no newline yet: not read
    assert out.take(1 << 20).progress is None
    out.end_control()
    assert out.take(1 << 20).progress == (1.0, "only a message")


# ---------------------------------------------------------------- checkpoints


def test_bad_checkpoints_are_refused_and_a_good_one_is_stored(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    result = tmp_path / "errors.json"
    add_job(conn, "bad-cp", entrypoint="longfuncs:bad_checkpoints", params={"out": str(result)})
    nan_and_nul = r'{"checkpoint": {"a": NaN}}\n{"checkpoint": "\\u0000"}\n'
    oversize = r'sed "s/^/{\"checkpoint\": \"/;s/$/\"}/"'
    script = ('echo \'{"checkpoint": {"kept": 1}}\' > "$PGFLOW_CONTROL";'
              f" printf '{nan_and_nul}' > \"$PGFLOW_CONTROL\";"
              f' {{ head -c 1100000 /dev/zero | tr "\\0" x | {oversize}; echo; }}'
              ' > "$PGFLOW_CONTROL"')
    add_job(conn, "bad-cp-sh", command=sh(script))
    replicas.start("a").id(conn)
    py_run = trigger(db_url, tmp_path, "bad-cp")
    sh_run = trigger(db_url, tmp_path, "bad-cp-sh")
    wait_state(conn, py_run, "succeeded")
    wait_state(conn, sh_run, "succeeded")
    errors = json.loads(result.read_text())
    assert "at most 1,048,576" in errors["big"]
    assert "not JSON" in errors["set"] and "not JSON" in errors["nan"]
    assert "NUL" in errors["nul"]
    assert "from 0 to 1" in errors["progress_high"] and "number" in errors["progress_text"]
    stored = {r["id"]: r["checkpoint"] for r in conn.execute(
        "SELECT id, checkpoint FROM pgflow.runs WHERE id = ANY(%s)", ([py_run, sh_run],))}
    assert stored == {py_run: {"ok": True}, sh_run: {"kept": 1}}
    out = logs(db_url, tmp_path, sh_run)
    assert out.count("[pgflow] control line ignored") == 3, out
    assert out.index("not JSON") < out.index("NUL") < out.index("at most 1,048,576")


def test_checkpoints_survive_kill9_and_the_retry_resumes_from_them(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    add_job(conn, "py-resume", entrypoint="longfuncs:resumable", params={"dir": str(tmp_path)},
            retry=FAST_RETRY)
    script = ('if [ -n "$PGFLOW_CHECKPOINT" ]; then echo "resumed from $PGFLOW_CHECKPOINT";'
              ' exit 0; fi; echo \'{"checkpoint": {"batch": 7}, "progress": 0.7}\''
              ' > "$PGFLOW_CONTROL"; exec sleep 60')
    add_job(conn, "sh-resume", command=sh(script), retry=FAST_RETRY)
    # Leases of 5 s, not 2: the attempts counted are the kill's, not a renewal that a
    # loaded machine (the whole suite at once) delayed past a 2 s lease.
    first = replicas.start("a", lease_ttl=5.0)
    first.id(conn)
    py_run = trigger(db_url, tmp_path, "py-resume")
    sh_run = trigger(db_url, tmp_path, "sh-resume")

    def checkpoint(run_id: int) -> Any:
        return conn.execute("SELECT checkpoint FROM pgflow.runs WHERE id = %s",
                            (run_id,)).fetchone()["checkpoint"]

    wait_for(lambda: checkpoint(py_run) == {"batch": 3}, timeout=20)
    wait_for(lambda: checkpoint(sh_run) == {"batch": 7}, timeout=20)
    assert run_state(conn, py_run)["state"] == run_state(conn, sh_run)["state"] == "running"
    first.kill9()
    replicas.start("b", lease_ttl=5.0).id(conn)
    py_done = wait_state(conn, py_run, "succeeded", "failed", timeout=30)
    sh_done = wait_state(conn, sh_run, "succeeded", "failed", timeout=30)
    assert (py_done["state"], py_done["attempt"]) == ("succeeded", 2)
    assert (sh_done["state"], sh_done["attempt"]) == ("succeeded", 2)
    # What the retries themselves report: they started from the checkpoints.
    assert json.loads((tmp_path / "attempt-2.json").read_text()) == {
        "resumed_from": {"batch": 3}}
    assert json.loads((tmp_path / "attempt-1.json").read_text()) == {"resumed_from": None}
    resumed = attempts(conn, sh_run)[1]["stdout_tail"]
    assert resumed.startswith("resumed from ")
    assert json.loads(resumed.removeprefix("resumed from ")) == {"batch": 7}
    assert checkpoint(py_run) == {"batch": 6}


def test_retry_keeps_the_checkpoint_and_rerun_clears_it(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    script = ('echo "attempt $PGFLOW_ATTEMPT saw ${PGFLOW_CHECKPOINT:-nothing}";'
              ' echo "{\\"checkpoint\\": {\\"attempt\\": $PGFLOW_ATTEMPT}}" > "$PGFLOW_CONTROL";'
              ' [ "$PGFLOW_ATTEMPT" != 1 ]')
    add_job(conn, "cp", command=sh(script))
    replicas.start("a").id(conn)
    run_id = trigger(db_url, tmp_path, "cp")
    assert wait_state(conn, run_id, "failed")["attempt"] == 1
    pgflow(db_url, tmp_path, "runs", "retry", str(run_id))
    wait_for(lambda: run_state(conn, run_id)["state"] == "succeeded" or None)
    out = pgflow(db_url, tmp_path, "runs", "rerun", str(run_id)).stdout
    assert f"run {run_id} will run again as attempt 3" in out
    wait_for(lambda: ((r := run_state(conn, run_id))["state"] == "succeeded" and
             r["attempt"] == 3) or None)
    tails = [a["stdout_tail"].splitlines()[0] for a in attempts(conn, run_id)]
    assert tails == ["attempt 1 saw nothing", 'attempt 2 saw {"attempt": 1}',
                     "attempt 3 saw nothing"]


# ---------------------------------------------------------------- re-runs


def test_rerun_is_refused_while_active_and_for_unknown_runs(
        conn: Conn, db_url: str, tmp_path: Path) -> None:
    add_job(conn, "idle", command=sh("true"))
    run_id = enqueue(conn, "idle")
    with pytest.raises(Conflict, match=r"is queued \(active\): only a finished run"):
        rerun(conn, run_id)
    done = pgflow(db_url, tmp_path, "runs", "rerun", str(run_id), check=False)
    assert done.returncode != 0 and "only a finished run can be re-run" in done.stderr
    assert "Traceback" not in done.stderr
    missing = pgflow(db_url, tmp_path, "runs", "rerun", "999999", check=False)
    assert missing.returncode != 0 and "no run 999999" in missing.stderr
    assert run_state(conn, run_id)["state"] == "queued"


def test_rerun_downstream_is_refused_while_a_downstream_run_is_active(
        conn: Conn, db_url: str, tmp_path: Path) -> None:
    add_job(conn, "up", command=sh("true"))
    add_job(conn, "down", command=sh("true"), depends_on=["up"])
    at = datetime(2026, 3, 1, tzinfo=UTC)
    up, down = enqueue(conn, "up", at), enqueue(conn, "down", at)
    conn.execute("UPDATE pgflow.runs SET state = 'succeeded', attempt = 1, finished_at = now()"
                 " WHERE id = %s", (up,))
    refused = pgflow(db_url, tmp_path, "runs", "rerun", str(up), "--downstream", check=False)
    assert refused.returncode != 0
    assert f"downstream run {down} (down, queued) is active" in refused.stderr
    assert run_state(conn, up)["state"] == "succeeded"  # nothing changed
    # Without --downstream the finished run alone runs again.
    assert rerun(conn, up)["state"] == "queued"


def test_rerun_downstream_runs_a_succeeded_branch_again_in_order(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    order = tmp_path / "order"
    for name, ups in (("a", []), ("b", ["a"]), ("c", ["b"]), ("side", [])):
        add_job(conn, name, command=sh(f'echo "{name} $PGFLOW_ATTEMPT" >> {order}'),
                depends_on=ups)
    replicas.start("w").id(conn)
    at = "2026-03-01T00:00:00Z"
    first = trigger(db_url, tmp_path, "a", "--logical-time", at)
    side = trigger(db_url, tmp_path, "side", "--logical-time", at)
    ids = {r["job"]: r["id"] for r in conn.execute(
        "SELECT id, job FROM pgflow.runs WHERE logical_time = %s", (at,))}
    for run_id in ids.values():
        wait_state(conn, run_id, "succeeded")
    assert sorted(order.read_text().splitlines()) == ["a 1", "b 1", "c 1", "side 1"]
    order.write_text("")
    out = pgflow(db_url, tmp_path, "runs", "rerun", str(first), "--downstream").stdout
    assert "2 downstream run(s) will run after it" in out
    for job in ("a", "b", "c"):
        wait_for(lambda j=job: ((r := run_state(conn, ids[j]))["state"] == "succeeded" and
                 r["attempt"] == 2) or None, timeout=30)
    assert order.read_text().splitlines() == ["a 2", "b 2", "c 2"]  # in order, side untouched
    assert run_state(conn, side)["attempt"] == 1


# ---------------------------------------------------------------- backfill --reprocess


def test_backfill_reprocess_failed_reruns_only_the_failed_ticks(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    add_job(conn, "daily", command=sh('echo "$PGFLOW_LOGICAL_TIME"'), schedule="0 0 * * *",
            catchup="none")
    start = datetime(2026, 2, 1, tzinfo=UTC)
    ticks = [start + timedelta(days=i) for i in range(4)]
    made = []
    for i, tick in enumerate(ticks[:3]):
        run_id = enqueue(conn, "daily", tick)
        state = "failed" if i == 1 else "succeeded"
        conn.execute("UPDATE pgflow.runs SET state = %s, attempt = 1, finished_at = now()"
                     " WHERE id = %s", (state, run_id))
        made.append(run_id)
    args = ("backfill", "daily", "--start", ticks[0].isoformat(), "--end",
            (ticks[-1] + timedelta(hours=1)).isoformat())
    bad = pgflow(db_url, tmp_path, *args, "--reprocess", "some", check=False)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    out = pgflow(db_url, tmp_path, *args, "--reprocess", "failed").stdout
    assert "1 run(s) created, 1 re-run, 2 tick(s) skipped" in out
    reprocessed = run_state(conn, made[1])
    assert (reprocessed["state"], reprocessed["trigger"]) == ("pending", "backfill")
    replicas.start("a").id(conn)
    wait_state(conn, made[1], "succeeded", timeout=30)
    assert [run_state(conn, r)["attempt"] for r in made] == [1, 2, 1]
    # --reprocess all re-runs every finished tick.
    backfill_id = reprocessed["backfill_id"]
    wait_for(lambda: conn.execute("SELECT state FROM pgflow.backfills WHERE id = %s",
                                  (backfill_id,)).fetchone()["state"] == "completed" or None)
    out = pgflow(db_url, tmp_path, *args, "--reprocess", "all", "--json").stdout
    assert json.loads(out)["reprocessed"] == 4
    for run_id in made:
        wait_for(lambda r=run_id: (run_state(conn, r)["state"] == "succeeded" and
                 run_state(conn, r)["attempt"] >= 2) or None, timeout=30)


def test_retention_removes_the_output_with_its_run(conn: Conn) -> None:
    from pgflow import retention

    add_job(conn, "old", command=sh("true"))
    run_id = enqueue(conn, "old", datetime(2020, 1, 1, tzinfo=UTC))
    conn.execute("UPDATE pgflow.runs SET state = 'succeeded', attempt = 1,"
                 " finished_at = now() - interval '400 days' WHERE id = %s", (run_id,))
    conn.execute("INSERT INTO pgflow.run_output (run_id, attempt, pos, stream, data)"
                 " VALUES (%s, 1, 0, 'stdout', 'x')", (run_id,))
    retention.run_once(conn, 86400.0)
    assert conn.execute("SELECT count(*) AS n FROM pgflow.run_output").fetchone()["n"] == 0
    assert conn.execute("SELECT count(*) AS n FROM pgflow.runs").fetchone()["n"] == 0


def test_a_flood_of_output_is_drained_not_stored(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    # 50 MB as fast as the pipe takes it: the command is never blocked by pgflow (it
    # ends), and what is stored stays within the limit (1 MiB here).
    add_job(conn, "flood", command=sh("head -c 50000000 /dev/zero | tr '\\0' x; echo; echo end"))
    replicas.start("a", env={"PGFLOW_LOG_LIMIT": "1MiB"}).id(conn)
    run_id = trigger(db_url, tmp_path, "flood")
    assert wait_state(conn, run_id, "succeeded", "failed", timeout=120)["state"] == "succeeded"
    stored = conn.execute("SELECT sum(length(data)) AS n FROM pgflow.run_output"
                          " WHERE run_id = %s", (run_id,)).fetchone()["n"]
    assert 1024 * 1024 <= stored <= 1024 * 1024 + live.CHUNK_MAX
    out = logs(db_url, tmp_path, run_id)
    assert out.startswith("xxxx") and out.endswith("x\nend\n")
    assert "bytes of output dropped" in out
    assert attempts(conn, run_id)[0]["stdout_tail"].endswith("x\nend\n")


def test_a_frozen_then_resumed_worker_late_chunks_are_not_stored(
        conn: Conn, db_url: str, tmp_path: Path, replicas: Replicas) -> None:
    script = ('if [ "$PGFLOW_ATTEMPT" = 1 ]; then i=0; while true; do i=$((i+1));'
              ' echo "attempt 1 line $i"; sleep 0.1; done; fi; echo "attempt 2"')
    add_job(conn, "frozen-chatty", command=sh(script), retry=FAST_RETRY)
    first = replicas.start("a")
    first.id(conn)
    run_id = trigger(db_url, tmp_path, "frozen-chatty")

    def stored(attempt: int) -> int:
        return conn.execute("SELECT count(*) AS n FROM pgflow.run_output WHERE run_id = %s"
                            " AND attempt = %s", (run_id, attempt)).fetchone()["n"]

    wait_for(lambda: stored(1) > 0 or None, timeout=20)  # live output of attempt 1
    first.stop_signal()
    second = replicas.start("b")
    second.id(conn)
    wait_state(conn, run_id, "succeeded", timeout=30)  # attempt 2 ran elsewhere
    before = stored(1)
    offset = first.log_size()
    first.cont()
    # The resumed worker still had attempt 1's last output to write: it was refused.
    dropped = first.wait_log("live output dropped", since=offset,
                             where=lambda r: r.get("run_id") == run_id, timeout=20)
    assert dropped["attempt"] == 1 and dropped["bytes"] > 0
    assert stored(1) == before
    assert logs(db_url, tmp_path, run_id) == "attempt 2\n"


def test_log_limit_setting() -> None:
    from pgflow.config import load_settings
    from pgflow.errors import ConfigError

    assert load_settings({}).log_limit == 16 * 1024 * 1024
    assert load_settings({"PGFLOW_LOG_LIMIT": "512KiB"}).log_limit == 512 * 1024
    assert load_settings({}, log_limit="2m").log_limit == 2 * 1024 * 1024
    with pytest.raises(ConfigError, match="PGFLOW_LOG_LIMIT='lots': expected a size"):
        load_settings({"PGFLOW_LOG_LIMIT": "lots"})
    with pytest.raises(ConfigError, match="--log-limit='1k'"):
        load_settings({}, log_limit="1k")


def test_two_concurrent_reruns_run_the_run_once(conn: Conn, db_url: str) -> None:
    import threading

    from psycopg.rows import dict_row

    add_job(conn, "twice", command=sh("true"))
    run_id = enqueue(conn, "twice")
    conn.execute("UPDATE pgflow.runs SET state = 'succeeded', attempt = 1, finished_at = now()"
                 " WHERE id = %s", (run_id,))
    outcome: dict[str, Any] = {}
    with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as first, \
            psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as second:
        second_pid = second.info.backend_pid

        def other() -> None:
            try:
                outcome["second"] = rerun(second, run_id)
            except Conflict as exc:
                outcome["refused"] = str(exc)

        with first.transaction():
            assert rerun(first, run_id)["state"] == "queued"
            thread = threading.Thread(target=other)
            thread.start()
            # The second re-run waits for the first one's row lock...
            wait_for(lambda: conn.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                (second_pid,)).fetchone()["wait_event_type"] == "Lock" or None, timeout=20)
        thread.join(20)
    # ...and once the first commits, it sees the run queued: refused, nothing doubled.
    assert "second" not in outcome and "is queued (active)" in outcome["refused"]
    row = run_state(conn, run_id)
    assert (row["state"], row["attempt"]) == ("queued", 1)
