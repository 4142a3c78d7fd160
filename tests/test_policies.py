"""Tenants and sources (SPEC §3, §4c): validation, apply, fair share and caps in the claim."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from engine import WorkerThread, add_job, wait_for
from procs import Replicas

from pgflow import policies, queue, registry
from pgflow.errors import PgflowError
from pgflow.spec import JobSpec, RegistrationError

Conn = psycopg.Connection[dict[str, Any]]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _apply_file(conn: Conn, path: Path, text: str, prune: bool = False) -> registry.ApplyResult:
    path.write_text(text)
    loaded = registry.load_sources([str(path)])
    return registry.apply(conn, loaded.specs, invalid=loaded.errors, policies=loaded.policies,
                          prune=prune, source=str(path))


def _backlog(conn: Conn, job: str, n: int, start: datetime = T0) -> list[int]:
    rows = conn.execute(
        "INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant,"
        " priority, params, capped, held)"
        " SELECT j.name, %s + make_interval(secs => g), 'queued', 1, 'manual', j.tenant,"
        " j.priority, j.params, j.capped, j.held FROM pgflow.jobs j, generate_series(1, %s) g"
        " WHERE j.name = %s RETURNING id", (start, n, job)).fetchall()
    return [row["id"] for row in rows]


def _claim(db_url: str, limit: int, worker: str = "w") -> list[dict[str, Any]]:
    async def go() -> list[dict[str, Any]]:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            return await queue.claim(c, worker, limit, 300)
    return asyncio.run(go())


def _tenants(conn: Conn, ids: list[int]) -> Counter[str]:
    rows = conn.execute("SELECT tenant FROM pgflow.runs WHERE id = ANY(%s)", (ids,)).fetchall()
    return Counter(row["tenant"] for row in rows)


# ---------------------------------------------------------------- validation and apply


def test_tenants_and_sources_apply_with_jobs_and_prune(conn: Conn, tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    result = _apply_file(conn, path, """
[tenants.dash]
weight = 3
max_concurrency = 20
[sources.crm]
failure_threshold = 2
cooldown = "2m"
max_concurrency = 4
[jobs.a]
entrypoint = "jobfuncs:noop"
tenant = "dash"
sources = ["crm"]
""")
    assert result.created == ["a"]
    assert sorted(result.policies.created) == ["source crm", "tenant dash"]
    row = conn.execute("SELECT * FROM pgflow.tenants").fetchone()
    assert row is not None and (row["weight"], row["max_concurrency"]) == (3, 20)
    src = conn.execute("SELECT * FROM pgflow.sources").fetchone()
    assert src is not None and (src["failure_threshold"], src["cooldown_s"]) == (2, 120)
    assert conn.execute("SELECT capped FROM pgflow.jobs").fetchone() == {"capped": True}
    again = _apply_file(conn, path, path.read_text())
    assert sorted(again.policies.unchanged) == ["source crm", "tenant dash"]
    pruned = _apply_file(conn, path, '[jobs.a]\nentrypoint = "jobfuncs:noop"\n', prune=True)
    assert sorted(pruned.policies.pruned) == ["source crm", "tenant dash"]
    assert conn.execute("SELECT count(*) AS n FROM pgflow.tenants").fetchone() == {"n": 0}
    assert conn.execute("SELECT capped FROM pgflow.jobs").fetchone() == {"capped": False}


@pytest.mark.parametrize(("text", "expected"), [
    ("[tenants.t]\nweight = 0\n", "tenant 't': weight: Input should be greater than 0"),
    ("[tenants.t]\nweight = -1\n", "tenant 't': weight"),
    ("[tenants.t]\nweigth = 2\n", "tenant 't': weigth: unknown key, did you mean 'weight'?"),
    ("[tenants.t]\nmax_concurrency = 0\n", "tenant 't': max_concurrency"),
    ("[sources.s]\nfailure_threshold = 0\n", "source 's': failure_threshold"),
    ("[sources.s]\ncooldown = \"soon\"\n", "source 's': cooldown: expected a duration"),
    ("[sources.s]\ncooldown = 0\n", "source 's': cooldown: cooldown must be longer than 0s"),
    ("[sources.s]\nmax_concurency = 1\n", "did you mean 'max_concurrency'?"),
    ("[sources.\"x;drop table\"]\n", "source 'x;drop table': name: must start with"),
    ("[tenants]\nt = 3\n", "tenant 't': must be a table of keys"),
])
def test_invalid_definitions_apply_nothing(conn: Conn, tmp_path: Path, text: str,
                                           expected: str) -> None:
    body = '[jobs.ok]\nentrypoint = "jobfuncs:noop"\n' + text
    with pytest.raises(RegistrationError) as info:
        _apply_file(conn, tmp_path / "bad.toml", body)
    assert expected in str(info.value)
    for table in ("jobs", "tenants", "sources"):
        assert conn.execute(f"SELECT count(*) AS n FROM pgflow.{table}").fetchone() == {"n": 0}


def test_unknown_top_level_table_is_refused(conn: Conn, tmp_path: Path) -> None:
    with pytest.raises(PgflowError, match="unknown top-level"):
        _apply_file(conn, tmp_path / "x.toml", "[tenant.t]\nweight = 2\n")


def test_a_cap_added_later_reflags_the_waiting_runs(conn: Conn, tmp_path: Path) -> None:
    add_job(conn, "j", entrypoint="jobfuncs:noop", tenant="t")
    ids = _backlog(conn, "j", 5)
    path = tmp_path / "p.toml"
    _apply_file(conn, path, '[tenants.t]\nmax_concurrency = 1\n[jobs.j]\n'
                'entrypoint = "jobfuncs:noop"\ntenant = "t"\nretry = { max_attempts = 1 }\n')
    flags = conn.execute("SELECT bool_and(capped) AS c FROM pgflow.runs WHERE id = ANY(%s)",
                         (ids,)).fetchone()
    assert flags == {"c": True}


# ---------------------------------------------------------------- fair share


def test_a_big_backlog_does_not_delay_another_tenants_runs(conn: Conn, db_url: str) -> None:
    add_job(conn, "big", entrypoint="jobfuncs:noop", tenant="big")
    add_job(conn, "small", entrypoint="jobfuncs:noop", tenant="small")
    _backlog(conn, "big", 300)  # older than the small tenant's runs
    small = _backlog(conn, "small", 5, start=T0 + timedelta(days=1))
    claimed: list[int] = []
    for _ in range(2):  # two claim cycles of 8 slots
        claimed += [row["id"] for row in _claim(db_url, 8)]
    assert set(small) <= set(claimed)


def test_weights_share_the_slots_under_contention(conn: Conn, db_url: str,
                                                  tmp_path: Path) -> None:
    _apply_file(conn, tmp_path / "w.toml", """
[tenants.heavy]
weight = 3
[tenants.light]
weight = 1
[jobs.h]
entrypoint = "jobfuncs:noop"
tenant = "heavy"
[jobs.l]
entrypoint = "jobfuncs:noop"
tenant = "light"
""")
    _backlog(conn, "h", 200)
    _backlog(conn, "l", 200)
    claimed: list[int] = []
    for _ in range(10):  # nothing finishes: running grows by 4 per claim, both have backlogs
        claimed += [row["id"] for row in _claim(db_url, 4)]
    shares = _tenants(conn, claimed)
    assert shares["heavy"] + shares["light"] == 40
    assert 28 <= shares["heavy"] <= 32  # 3:1 of 40, within a claim's worth


def test_work_conserving_when_one_tenant_runs_dry(conn: Conn, db_url: str) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop", tenant="a")
    add_job(conn, "b", entrypoint="jobfuncs:noop", tenant="b")
    _backlog(conn, "a", 2)
    _backlog(conn, "b", 50)
    assert len(_claim(db_url, 10)) == 10  # a's 2 and 8 of b's: no slot left idle


def test_priority_still_orders_runs_across_tenants(conn: Conn, db_url: str) -> None:
    add_job(conn, "low", entrypoint="jobfuncs:noop", tenant="a", priority=-1)
    add_job(conn, "high", entrypoint="jobfuncs:noop", tenant="b", priority=5)
    _backlog(conn, "low", 20)
    high = _backlog(conn, "high", 6)
    assert {row["id"] for row in _claim(db_url, 6)} == set(high)


# ---------------------------------------------------------------- caps


def _peak(conn: Conn, where: str = "true") -> int:
    row = conn.execute(f"""
        SELECT coalesce(max((SELECT count(*) FROM pgflow.attempts b JOIN pgflow.runs rb
                                 ON rb.id = b.run_id
                             WHERE {where.replace('r.', 'rb.')}
                               AND b.started_at <= a.started_at
                               AND b.finished_at > a.started_at)), 0) AS n
        FROM pgflow.attempts a JOIN pgflow.runs r ON r.id = a.run_id WHERE {where}""").fetchone()
    assert row is not None
    return int(row["n"])


def test_a_tenant_cap_holds_across_two_replicas_and_is_reached(
        conn: Conn, db_url: str, tmp_path: Path) -> None:
    _apply_file(conn, tmp_path / "t.toml", """
[tenants.capped]
max_concurrency = 2
[jobs.c1]
entrypoint = "jobfuncs:sleep"
tenant = "capped"
params = { seconds = 0.3 }
[jobs.c2]
entrypoint = "jobfuncs:sleep"
tenant = "capped"
params = { seconds = 0.3 }
[jobs.free]
entrypoint = "jobfuncs:sleep"
params = { seconds = 0.3 }
""")
    replicas = Replicas(db_url, tmp_path)
    samples: list[int] = []
    ids: list[int] = []
    other: list[int] = []
    try:
        started = [replicas.start(name, roles=["worker"], concurrency=4) for name in "ab"]
        for replica in started:  # both up before the work comes: each gets some of it
            replica.id(conn)
        ids = _backlog(conn, "c1", 6) + _backlog(conn, "c2", 6)
        other = _backlog(conn, "free", 6)
        conn.execute("SELECT pg_notify('pgflow_queue', '')")

        def done() -> bool:
            row = conn.execute("SELECT count(*) FILTER (WHERE tenant = 'capped' AND state ="
                               " 'running') AS running, count(*) FILTER (WHERE state ="
                               " 'succeeded') AS ok FROM pgflow.runs").fetchone()
            assert row is not None
            samples.append(row["running"])
            return bool(row["ok"] == len(ids) + len(other))
        wait_for(done, timeout=60, interval=0.02)
    except AssertionError:
        print(conn.execute("SELECT job, state, capped, held, count(*) FROM pgflow.runs"
                           " GROUP BY 1, 2, 3, 4").fetchall())
        raise
    finally:
        replicas.close()
    assert max(samples) == 2
    assert _peak(conn, "r.tenant = 'capped'") == 2
    workers = conn.execute("SELECT count(DISTINCT worker_id) AS n FROM pgflow.attempts"
                           " WHERE run_id = ANY(%s)", (ids,)).fetchone()
    assert workers == {"n": 2}


def test_a_source_cap_is_shared_by_two_jobs(conn: Conn, db_url: str, tmp_path: Path) -> None:
    _apply_file(conn, tmp_path / "s.toml", """
[sources.crm]
max_concurrency = 1
[jobs.x]
entrypoint = "jobfuncs:sleep"
sources = ["crm"]
params = { seconds = 0.2 }
[jobs.y]
entrypoint = "jobfuncs:sleep"
sources = ["crm", "other"]
params = { seconds = 0.2 }
""")
    ids = _backlog(conn, "x", 4) + _backlog(conn, "y", 4)
    workers = [WorkerThread(db_url, concurrency=4, worker_id=f"w{i}") for i in range(2)]
    try:
        wait_for(lambda: conn.execute(
            "SELECT count(*) AS n FROM pgflow.runs WHERE state = 'succeeded'"
        ).fetchone() == {"n": len(ids)}, timeout=60)
    finally:
        for w in workers:
            w.stop(grace=1)
    assert _peak(conn) == 1


def test_concurrent_capped_claims_never_exceed_the_caps(conn: Conn, db_url: str,
                                                        tmp_path: Path) -> None:
    _apply_file(conn, tmp_path / "r.toml", """
[tenants.t]
max_concurrency = 3
[sources.s]
max_concurrency = 2
""" + "".join(f"""
[jobs.t{i}]
entrypoint = "jobfuncs:noop"
tenant = "t"
[jobs.s{i}]
entrypoint = "jobfuncs:noop"
sources = ["s"]
""" for i in range(4)))
    for i in range(4):
        _backlog(conn, f"t{i}", 10)
        _backlog(conn, f"s{i}", 10)
    jobs = [f"{p}{i}" for p in "ts" for i in range(4)]
    barrier = threading.Barrier(6)
    errors: list[BaseException] = []

    def claimer(n: int) -> None:
        async def go() -> None:
            async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
                for _ in range(5):
                    await asyncio.to_thread(barrier.wait)
                    await queue.claim_capped(c, f"w{n}", jobs, 10, 300)
        try:
            asyncio.run(go())
        except BaseException as exc:  # shown below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    row = conn.execute("""
        SELECT count(*) FILTER (WHERE tenant = 't') AS t,
               count(*) FILTER (WHERE job LIKE 's%%') AS s
        FROM pgflow.runs WHERE state = 'running'""").fetchone()
    assert row == {"t": 3, "s": 2}  # reached, never exceeded


def test_a_capped_claim_that_waited_for_its_lock_starts_after_the_finish_it_saw(
        conn: Conn, db_url: str, tmp_path: Path) -> None:
    """A capped claim's transaction begins before it gets its locks; a run of the cap may
    finish while it waits. The attempt it then starts must not be stamped before that
    finish: attempts would seem to overlap beyond the cap."""
    _apply_file(conn, tmp_path / "t.toml", """
[tenants.one]
max_concurrency = 1
[jobs.c]
entrypoint = "jobfuncs:noop"
tenant = "one"
""")
    _backlog(conn, "c", 2)

    async def go() -> None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as a, \
                await psycopg.AsyncConnection.connect(db_url, autocommit=True) as b, \
                await psycopg.AsyncConnection.connect(db_url, autocommit=True) as blocker:
            [first] = await queue.claim_capped(a, "wa", ["c"], 5, 300)
            async with blocker.transaction():
                await blocker.execute("SELECT pg_advisory_xact_lock(1885759855, hashtext("
                                      "'tenant:one'))")
                waiting = asyncio.create_task(queue.claim_capped(b, "wb", ["c"], 5, 300))
                deadline = time.monotonic() + 30
                while conn.execute("SELECT count(*) AS n FROM pg_locks WHERE NOT granted"
                                   " AND locktype = 'advisory'").fetchone() != {"n": 1}:
                    assert time.monotonic() < deadline, "the capped claim never waited"
                    await asyncio.sleep(0.01)
                done = await queue.finish(a, [queue.Finish(
                    first.id, first.attempt, "wa", "succeeded", "succeeded",
                    first.attempt_started_at)])
                assert done == {first.id: "succeeded"}
            [second] = await waiting
            assert second.id != first.id
    asyncio.run(go())
    [finished] = conn.execute("SELECT finished_at FROM pgflow.attempts").fetchall()
    started = conn.execute("SELECT attempt_started_at AS t FROM pgflow.runs"
                           " WHERE state = 'running'").fetchone()
    assert started is not None and started["t"] >= finished["finished_at"]


def test_listing_tenants(conn: Conn, tmp_path: Path) -> None:
    _apply_file(conn, tmp_path / "l.toml", '[tenants.t]\nweight = 2\nmax_concurrency = 5\n'
                '[jobs.a]\nentrypoint = "jobfuncs:noop"\ntenant = "t"\n')
    _backlog(conn, "a", 3)
    rows = {row["name"]: row for row in policies.list_tenants(conn)}
    assert (rows["t"]["weight"], rows["t"]["max_concurrency"], rows["t"]["queued"]) == (2, 5, 3)


def test_spec_models_validate_directly() -> None:
    assert policies.SourceSpec(name="s", cooldown="1m").cooldown == 60  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        policies.TenantSpec(name="t", weight=float("inf"))
    JobSpec.model_validate({"name": "j", "entrypoint": "a:b"})


def test_cli_tenants_and_breakers(conn: Conn, db_url: str, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from pgflow.cli import run

    monkeypatch.setenv("PGFLOW_DATABASE_URL", db_url)
    path = tmp_path / "c.toml"
    path.write_text('[tenants.t]\nweight = 2\n[sources.crm]\nfailure_threshold = 5\n'
                    '[jobs.a]\nentrypoint = "jobfuncs:noop"\ntenant = "t"\nsources = ["crm"]\n')
    assert run(["apply", str(path)]) == 0
    assert "tenant t" in capsys.readouterr().out
    assert run(["tenants", "list", "--json"]) == 0
    listed = {t["name"]: t for t in json.loads(capsys.readouterr().out)}
    assert listed["t"]["weight"] == 2
    assert run(["breakers", "open", "crm", "--reason", "maintenance"]) == 0
    capsys.readouterr()
    assert run(["breakers", "list", "--json"]) == 0
    [crm] = json.loads(capsys.readouterr().out)
    assert (crm["state"], crm["failure_threshold"], crm["manual"]) == ("open", 5, True)
    assert run(["status"]) == 0
    assert "crm" in capsys.readouterr().out
    assert run(["breakers", "close", "crm"]) == 0
    assert run(["breakers", "close", "crm"]) != 0  # already closed: one error line
    assert "already closed" in capsys.readouterr().err
