"""A chaos soak: real replicas, jobs ticking every second, and everything going wrong.

Three or more ``pgflow serve`` replicas run root jobs that tick every second with
``catchup = "all"`` (about one attempt in five fails; one root fails permanently,
so its downstream becomes ``upstream_failed``) and a downstream job for some of
them. Meanwhile a seeded random loop SIGKILLs and restarts replicas, freezes them
with SIGSTOP (the replica alone or its whole process group) for up to three lease
TTLs, terminates random pgflow backends, and restarts the database once with
``pg_ctl -m immediate``; operator commands (``jobs pause``/``resume`` of a spare
job, ``runs list``) are timed throughout.

Each command attempt appends ``run attempt pid`` to ``exec.log`` under an
exclusive ``flock -n`` on a per-run lock file: if an earlier attempt of the same run
still held it (an attempt overlapping its retry), the attempt writes to
``overlap.log`` instead. The kernel drops the lock when the holder dies, so this
detects overlaps between processes of different replicas without trusting clocks.

``check()`` then quiesces the cluster and verifies: one run per (job, tick) and no
tick missing, nothing left pending/queued/running/retrying, downstream states that
match their upstream, no (run, attempt) executed twice, no overlap, attempts within
policy, every attempt with an exit code really executed, and no safety-net repair.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from procs import TTL, Conn, Replica, Replicas, pgflow, scalar, until
from psycopg.rows import dict_row

from pgflow.embedded import Cluster

ROOTS = 6
DOWNSTREAM_OF = (0, 1, 3)  # roots with a downstream job
PERMANENT_ROOT = 1  # its failures are permanent (exit 2 is in no_retry_exit_codes)
ACTIVE = ("pending", "queued", "running", "retrying")


def _command(workdir: Path, fail_code: int) -> str:
    lock = f"{workdir}/lock-$PGFLOW_RUN_ID"
    body = (f'echo "$PGFLOW_RUN_ID $PGFLOW_ATTEMPT $$" >> {workdir}/exec.log;'
            ' sleep 0.$((PGFLOW_RUN_ID % 4));'
            f' [ $(( (PGFLOW_RUN_ID * 7 + PGFLOW_ATTEMPT * 3) % 5 )) -ne 0 ] || exit {fail_code}')
    return (f"flock -n -E 99 {lock} sh -c '{body}'; rc=$?;"
            f' [ $rc -ne 99 ] || echo "$PGFLOW_RUN_ID $PGFLOW_ATTEMPT" >> {workdir}/overlap.log;'
            " exit $rc")


def pipeline(workdir: Path) -> str:
    """The soak's jobs as TOML."""
    jobs = []
    for i in range(ROOTS):
        fail_code = 2 if i == PERMANENT_ROOT else 1
        jobs.append(f"""
[jobs.r{i}]
schedule = "* * * * * *"
catchup = "all"
command = {json.dumps(_command(workdir, fail_code))}
retry = {{ max_attempts = 4, backoff = 0.2, max_backoff = 1, no_retry_exit_codes = [2] }}
""")
    for i in DOWNSTREAM_OF:
        jobs.append(f"""
[jobs.d{i}]
depends_on = ["r{i}"]
command = {json.dumps(_command(workdir, 1))}
retry = {{ max_attempts = 4, backoff = 0.2, max_backoff = 1 }}
""")
    jobs.append("""
[jobs.spare]
schedule = "@yearly"
command = "true"
""")
    return "".join(jobs)


@dataclass
class Soak:
    cluster: Cluster
    url: str
    workdir: Path
    seed: int
    replicas_count: int = 3
    events: list[str] = field(default_factory=list)
    operator_s: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.pool = Replicas(self.url, self.workdir)
        self.live: list[Replica] = []
        self.frozen: dict[int, tuple[Replica, float, bool]] = {}
        self.restarted_db = False
        self.restarting_db = False
        self._names = 0

    # ------------------------------------------------------------ setup

    def start(self) -> None:
        toml = self.workdir / "soak.toml"
        toml.write_text(pipeline(self.workdir))
        (self.workdir / "exec.log").touch()
        (self.workdir / "overlap.log").touch()
        pgflow(self.url, self.workdir, "apply", str(toml))
        for _ in range(self.replicas_count):
            self._spawn()

    def _spawn(self) -> Replica:
        self._names += 1
        replica = self.pool.start(f"s{self._names}", concurrency=8, lease_ttl=TTL)
        self.live.append(replica)
        return replica

    # ------------------------------------------------------------ chaos

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        db_restart_at = time.monotonic() + seconds * self.rng.uniform(0.3, 0.6)
        done = threading.Event()
        operator = threading.Thread(target=self._time_operator_commands, args=(done,))
        operator.start()
        try:
            while time.monotonic() < deadline:
                self._thaw_due()
                if not self.restarted_db and time.monotonic() >= db_restart_at:
                    self._restart_database()
                else:
                    self._one_action()
                time.sleep(self.rng.uniform(0.3, 1.2))
        finally:
            done.set()
            operator.join()
            self._thaw_all()

    def _one_action(self) -> None:
        actions: list[Callable[[], None]] = [self._kill9, self._freeze, self._terminate_backend]
        self.rng.choice(actions)()

    def _victim(self) -> Replica | None:
        for replica in self.live:  # none may stop by itself, even across the restart
            assert replica.alive(), (f"{replica} exited on its own with "
                                     f"{replica.proc.returncode}:\n{replica.tail()}")
        candidates = [r for r in self.live if r.pid not in self.frozen]
        return self.rng.choice(candidates) if len(candidates) > 1 else None

    def _kill9(self) -> None:
        victim = self._victim()
        if victim is None:
            return
        self.events.append(f"kill -9 {victim}")
        victim.kill9()
        self.live.remove(victim)
        self._spawn()

    def _freeze(self) -> None:
        victim = self._victim()
        if victim is None:
            return
        whole_group = self.rng.random() < 0.5
        until_s = time.monotonic() + self.rng.uniform(0.5, 3.0) * TTL
        self.events.append(f"SIGSTOP {'group of ' if whole_group else ''}{victim}")
        if whole_group:
            _signal_group(victim.pid, signal.SIGSTOP)
        else:
            victim.stop_signal()
        self.frozen[victim.pid] = (victim, until_s, whole_group)

    def _thaw_due(self, everything: bool = False) -> None:
        for pid, (replica, until_s, whole_group) in list(self.frozen.items()):
            if everything or time.monotonic() >= until_s:
                if whole_group:
                    _signal_group(pid, signal.SIGCONT)
                else:
                    replica.cont()
                del self.frozen[pid]

    def _thaw_all(self) -> None:
        self._thaw_due(everything=True)

    def _terminate_backend(self) -> None:
        with self._connect() as conn:
            pid = scalar(conn, "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                               " AND application_name LIKE 'pgflow%%' AND pid <> pg_backend_pid()"
                               " ORDER BY random() LIMIT 1")
            if pid is not None:
                self.events.append(f"pg_terminate_backend({pid})")
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))

    def _restart_database(self) -> None:
        self.events.append("database restart (immediate)")
        self.restarted_db = self.restarting_db = True
        self.cluster.stop("immediate")
        self.cluster.start()
        # Operator commands that were connecting while it was down may fail for a while yet.
        threading.Timer(5.0, self._restarted).start()

    def _restarted(self) -> None:
        self.restarting_db = False

    def _time_operator_commands(self, done: threading.Event) -> None:
        """Operator commands go on beside the chaos; each must succeed (the database is
        down for a moment once, so a failure is retried until it is back)."""
        commands = itertools.cycle([("jobs", "pause", "spare"), ("runs", "list", "--limit", "5"),
                                    ("jobs", "resume", "spare")])
        while not done.is_set():
            args = next(commands)
            started = time.monotonic()
            if pgflow(self.url, self.workdir, *args, check=False, timeout=60).returncode:
                assert self._database_restarting(), f"pgflow {' '.join(args)} failed"
                continue
            self.operator_s.append(time.monotonic() - started)
            done.wait(0.5)

    def _database_restarting(self) -> bool:
        return self.restarting_db

    # ------------------------------------------------------------ verdict

    def _connect(self) -> Conn:
        return psycopg.connect(self.url, autocommit=True, row_factory=dict_row)

    def quiesce(self, timeout: float = 120.0) -> None:
        """Stop the ticks and wait until every run has ended."""
        for i in range(ROOTS):
            pgflow(self.url, self.workdir, "jobs", "pause", f"r{i}")
        with self._connect() as conn:
            until(lambda: scalar(conn, "SELECT count(*) = 0 FROM pgflow.runs"
                                       " WHERE state = ANY(%s)", (list(ACTIVE),)) or None,
                  timeout=timeout)

    def check(self) -> dict[str, Any]:
        self.quiesce()
        with self._connect() as conn:
            report = self._check_ticks(conn)
            self._check_downstreams(conn)
            report.update(self._check_executions(conn))
            self._check_repairs(conn)
        report["events"] = len(self.events)
        report["operator_max_s"] = round(max(self.operator_s, default=0.0), 3)
        return report

    def _check_ticks(self, conn: Conn) -> dict[str, Any]:
        runs = 0
        for i in range(ROOTS):
            times = [r["logical_time"] for r in conn.execute(
                "SELECT logical_time FROM pgflow.runs WHERE job = %s ORDER BY 1", (f"r{i}",))]
            assert times, f"r{i} never ran"
            expected = int((times[-1] - times[0]).total_seconds()) + 1
            missing = sorted({times[0] + timedelta(seconds=s) for s in range(expected)}
                             - set(times))
            assert not missing, f"r{i}: ticks missing: {missing[:5]}"
            assert len(times) == len(set(times)) == expected
            runs += len(times)
        return {"root_runs": runs}

    def _check_downstreams(self, conn: Conn) -> None:
        for i in DOWNSTREAM_OF:
            pairs = conn.execute(
                "SELECT u.logical_time, u.state AS up, d.state AS down FROM pgflow.runs u"
                " LEFT JOIN pgflow.runs d ON d.job = %s AND d.logical_time = u.logical_time"
                " WHERE u.job = %s", (f"d{i}", f"r{i}")).fetchall()
            for pair in pairs:
                allowed = {"succeeded": {"succeeded", "failed"}, "failed": {"upstream_failed"},
                           "cancelled": {"upstream_failed"}}[pair["up"]]
                assert pair["down"] in allowed, f"d{i} at {pair['logical_time']}: {pair}"

    def _check_executions(self, conn: Conn) -> dict[str, Any]:
        overlaps = (self.workdir / "overlap.log").read_text().split("\n")
        assert overlaps == [""], f"attempts overlapped their retry: {overlaps[:10]}"
        executed = [tuple(map(int, line.split()[:2]))
                    for line in (self.workdir / "exec.log").read_text().splitlines() if line]
        assert len(executed) == len(set(executed)), "a (run, attempt) was executed twice"
        recorded = conn.execute("SELECT run_id, attempt, outcome, exit_code FROM pgflow.attempts"
                                ).fetchall()
        executed_set = set(executed)
        unexecuted = [a for a in recorded if a["exit_code"] is not None
                      and (a["run_id"], a["attempt"]) not in executed_set]
        assert not unexecuted, f"attempts with an exit code that never ran: {unexecuted[:5]}"
        over = conn.execute("SELECT id, attempt, max_attempts FROM pgflow.runs"
                            " WHERE attempt > max_attempts").fetchall()
        assert not over, f"runs beyond their attempt budget: {over[:5]}"
        return {"attempts": len(recorded), "executed": len(executed),
                "outcomes": dict(Counter(str(a["outcome"]) for a in recorded))}

    def _check_repairs(self, conn: Conn) -> None:
        exists = scalar(conn, "SELECT to_regclass('pgflow.repairs') IS NOT NULL")
        if exists:
            repairs = conn.execute("SELECT * FROM pgflow.repairs").fetchall()
            assert not repairs, f"the safety net had to repair: {repairs}"

    def close(self) -> None:
        self._thaw_all()
        self.pool.close()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
