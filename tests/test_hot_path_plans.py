"""The hot path ignores history: with 1,000,000 finished runs in the database, every
statement a claim, renewal, finish, dependency hop, reap, tick, backfill release,
safety-net walk, retention batch, dashboard or bounded run listing runs reads runs and
attempts through an index —
never a sequential scan of the history — and the intended index at that.

One database is loaded once for the module (``INSERT … SELECT generate_series``, with
the secondary indexes built after the load, as a restore does), ANALYZEd, and given a
small live workload; then ``EXPLAIN (FORMAT JSON)`` of each named statement with
realistic parameters is walked node by node. No timings here: speed is in
``bench/history.py``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from pgflow import queue, registry, runs
from pgflow.queries import q
from pgflow.queue import NO_OFFER
from pgflow.spec import JobSpec

Conn = psycopg.Connection[dict[str, Any]]
HISTORY = 1_000_000
LIVE = datetime(2031, 1, 1, tzinfo=UTC)
WORKER = "plan-worker"
HOT_TABLES = {"runs", "attempts", "run_keys"}

# Finished runs over 200 jobs (the live jobs among them), finished over the last 30
# days; one in ten has an attempt row (enough for the attempts' indexes to be real).
FILL_RUNS = """
INSERT INTO pgflow.runs (job, logical_time, state, attempt, max_attempts, trigger, tenant,
                         created_at, started_at, finished_at, acked_at, backfill_id)
SELECT (%(jobs)s::text[])[1 + i %% %(njobs)s],
       timestamptz '1990-01-01' + make_interval(secs => (i / %(njobs)s) * 60), st, 1, 3,
       CASE WHEN i %% 50 = 7 THEN 'backfill' ELSE 'schedule' END, 'default',
       fin - interval '1 min', fin - interval '30 s', fin,
       CASE WHEN st = 'failed' AND i %% 200 = 0 THEN fin END,
       CASE WHEN i %% 50 = 7 THEN %(backfill)s::bigint END
FROM generate_series(1, %(n)s) AS i,
     LATERAL (SELECT now() - make_interval(secs => (%(n)s - i) * 2.592) AS fin,
                     CASE i %% 100 WHEN 0 THEN 'failed' WHEN 2 THEN 'cancelled'
                                   WHEN 4 THEN 'upstream_failed' ELSE 'succeeded' END AS st) x
"""
FILL_ATTEMPTS = """
INSERT INTO pgflow.attempts (run_id, attempt, worker_id, started_at, finished_at, outcome)
SELECT id, 1, 'history', started_at, finished_at,
       CASE state WHEN 'succeeded' THEN 'succeeded' ELSE 'failed' END
FROM pgflow.runs WHERE id % 10 = 0
"""


# Running runs are few whatever the history: read by primary key or through
# runs_running_idx (runs_state_idx leaves them out; the planner's pick varies with stats).
RUNNING_RANGE = {"runs_pkey", "runs_running_idx"}
# Every unfinished run: the waiting ones through runs_state_idx, the running ones
# through runs_running_idx.
UNFINISHED = {"runs_state_idx", "runs_running_idx"}
# A job's runs newest first: those not running through runs_job_idx, the running ones
# through runs_running_idx (a claim writes no runs_job_idx entry: migration 0023).
JOB_RUNS = {"runs_job_idx", "runs_running_idx"}
MUST_USE_ALL = (UNFINISHED, JOB_RUNS)

def _with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


def _register(conn: Conn) -> list[str]:
    live = [{"name": "noop", "entrypoint": "jobfuncs:noop"},
            {"name": "capped", "entrypoint": "jobfuncs:noop", "max_active_runs": 2},
            {"name": "up", "entrypoint": "jobfuncs:noop"},
            {"name": "down", "entrypoint": "jobfuncs:noop", "depends_on": ["up"]},
            {"name": "bf", "entrypoint": "jobfuncs:noop", "schedule": "* * * * *"}]
    ticking = [{"name": f"tick-{i:03d}", "entrypoint": "jobfuncs:noop",
                "schedule": "* * * * *"} for i in range(100)]
    other = [{"name": f"hist-{i:03d}", "entrypoint": "jobfuncs:noop"} for i in range(95)]
    registry.apply(conn, [JobSpec.model_validate(d) for d in live + ticking + other])
    return [d["name"] for d in live + other]


def _secondary_indexes(conn: Conn) -> list[tuple[str, str]]:
    rows = conn.execute("""
        SELECT i.indexname, i.indexdef FROM pg_indexes i
        WHERE i.schemaname = 'pgflow' AND i.tablename IN ('runs', 'attempts')
          AND NOT EXISTS (SELECT 1 FROM pg_constraint c
                          WHERE c.conindid = ('pgflow.' || quote_ident(i.indexname))::regclass)
        """).fetchall()
    return [(r["indexname"], r["indexdef"]) for r in rows]


def _create(conn: Conn, jobs: list[str], times: list[datetime], **keys: Any) -> None:
    conn.execute(q("create_runs"), {
        "jobs": jobs, "times": times, "trigger": keys.get("trigger", "manual"),
        "params": None, "downstream": keys.get("downstream", False),
        "state": keys.get("state", "queued"), "priority_offset": 0,
        "backfill_id": keys.get("backfill_id")})


@pytest.fixture(scope="module")
def history(server_url: str, template_db: str) -> Iterator[tuple[Conn, dict[str, Any]]]:
    """A database with HISTORY finished runs and a live workload; (connection, ids)."""
    name = f"pgflow_plans_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template_db)))
    conn = psycopg.connect(_with_database(server_url, name), autocommit=True,
                           row_factory=dict_row)
    try:
        conn.execute("SET jit = off")
        jobs = _register(conn)
        backfill = conn.execute(q("insert_backfill"), {
            "job": "bf", "start": LIVE, "end": LIVE + timedelta(days=1),
            "max_concurrency": 2, "downstream": False}).fetchone()
        assert backfill is not None
        saved = _secondary_indexes(conn)
        with conn.transaction():
            for index, _ in saved:
                conn.execute(sql.SQL("DROP INDEX pgflow.{}").format(sql.Identifier(index)))
            with runs.keys_inserted_after(conn):
                conn.execute(FILL_RUNS, {"jobs": jobs, "njobs": len(jobs), "n": HISTORY,
                                         "backfill": backfill["id"]})
            conn.execute(FILL_ATTEMPTS)
            for _, definition in saved:
                conn.execute(definition)
        live = _live_workload(conn, backfill["id"])
        conn.execute("VACUUM ANALYZE pgflow.runs")
        conn.execute("VACUUM ANALYZE pgflow.attempts")
        conn.execute("ANALYZE pgflow.jobs")
        yield conn, live
    finally:
        conn.close()
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def _live_workload(conn: Conn, backfill_id: int) -> dict[str, Any]:
    times = [LIVE + timedelta(seconds=i) for i in range(600)]
    _create(conn, ["noop"] * 600, times)
    _create(conn, ["capped"] * 50, times[:50])
    _create(conn, ["up"] * 50, times[:50], downstream=True)
    _create(conn, ["bf"] * 200, [LIVE + timedelta(minutes=i) for i in range(200)],
            state="pending", trigger="backfill", backfill_id=backfill_id)
    conn.execute("UPDATE pgflow.runs SET priority = 1 WHERE job = 'up' AND state = 'queued'")
    conn.execute("UPDATE pgflow.jobs SET next_fire_at = now() - interval '1 s'"
                 " WHERE name LIKE 'tick-%%'")
    claimed = conn.execute(q("claim_runs"), {**NO_OFFER, "worker": WORKER, "limit": 150,
                                             "ttl": 3600.0}).fetchall()
    floor = conn.execute(q("runs_floor"), {**LISTING, "scan": 20_000}).fetchone()
    assert floor is not None and floor["floor"] is not None
    return {"running": claimed, "backfill_id": backfill_id, "floor": floor["floor"],
            "pending_down": [r["id"] for r in conn.execute(
                "SELECT id FROM pgflow.runs WHERE job = 'down' AND state = 'pending'")]}


# A listing by tenant: no index covers it, so its page is bounded by runs_floor.
LISTING = {"job": None, "state": None, "tenant": "default", "trigger": None, "since": None,
           "until": None, "before_id": 2**63 - 1}


def _finishes(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return queue.finish_params([
        queue.Finish(run_id=r["id"], attempt=r["attempt"], owner=WORKER, state="succeeded",
                     outcome="succeeded", started_at=r["attempt_started_at"], exit_code=0)
        for r in rows])


def statements(live: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any], set[str]]]:
    """label -> (query name, parameters, indexes on runs/attempts one of which the plan
    must use)."""
    running = live["running"]
    noop = [r for r in running if r["job"] == "noop"]
    ups = [r for r in running if r["job"] == "up"]
    assert noop and ups
    tomorrow = LIVE + timedelta(days=1)
    return {
        "claim": ("claim_runs", {**NO_OFFER, "worker": "w2", "limit": 100, "ttl": 30.0},
                  {"runs_claimable_idx"}),
        "capped waiting": ("capped_jobs_waiting", {}, {"runs_claimable_capped_idx"}),
        "capped claim": ("claim_capped_runs", {"jobs": ["capped"], "worker": "w2", "limit": 2,
                                              "ttl": 30.0, "min_priority": None},
                         {"runs_claimable_capped_idx"}),
        "renewal": ("renew_leases", {
            "worker": WORKER, "ttl": 30.0, "release": True,
            "ids": [r["id"] for r in running], "attempts": [r["attempt"] for r in running]},
            RUNNING_RANGE),
        # One primary-key probe per result (the array of ids in finish_attempts); reading
        # the few running runs through runs_running_idx would do too.
        "finish batch": ("finish_attempts", _finishes(noop[:100]),
                         RUNNING_RANGE),
        "finish upstreams": ("finish_attempts", _finishes(ups),
                             {"run_keys_pkey"}),
        "dependency hop": ("queue_ready_runs", {"ids": live["pending_down"],
                                                "finished": [r["id"] for r in ups]},
                           {"run_keys_pkey"}),
        # Pending runs (the state index's 'pending' range) are not history either.
        "fail downstreams": ("fail_downstreams", {"ids": [ups[0]["id"]]},
                             {"run_keys_pkey", "runs_state_idx"}),
        "reap": ("expired_leases", {"limit": 500}, RUNNING_RANGE),
        "due jobs": ("due_jobs", {"now": datetime.now(UTC),
                                  "horizon": datetime.now(UTC) + timedelta(seconds=2),
                                  "batch": 2500}, set()),
        # A pause or a registration withdraws runs created ahead: the job's few
        # unfinished keys, never its history.
        "withdraw ahead": ("withdraw_ahead_runs", {"names": ["noop", "up"], "rewind": ["noop"]},
                           {"run_keys_pkey"}),
        "dag tick": ("create_runs", {
            "jobs": ["up"] * 5, "times": [tomorrow + timedelta(seconds=i) for i in range(5)],
            "trigger": "schedule", "params": None, "downstream": True, "state": "queued",
            "priority_offset": 0, "backfill_id": None}, set()),
        "plain tick": ("create_plain_runs", {
            "jobs": [f"tick-{i:03d}" for i in range(100)], "times": [tomorrow] * 100,
            "trigger": "schedule", "params": None, "only_lone": False}, set()),
        "trigger": ("create_plain_run", {
            "job": "tick-000", "logical_time": tomorrow, "handoff": True, "params": None,
            "only_lone": True}, set()),
        "backfill release": ("release_backfill_runs", {"ids": [live["backfill_id"]]},
                             {"runs_backfill_held_idx", "runs_backfill_idx"}),
        "backfill complete": ("complete_backfills", {"ids": [live["backfill_id"]]},
                              {"runs_backfill_idx", "runs_backfill_held_idx"}),
        "safety net: pending": ("repair_pending", {"after": 0, "limit": 1000},
                                {"runs_state_idx"}),
        "safety net: leases": ("repair_leases", {"ttl": 30.0, "alive_s": 90.0, "limit": 500},
                               RUNNING_RANGE),
        "retention batch": ("prune_runs", {
            "retention_s": 7 * 86400.0, "now": None, "limit": 2000, "after_finished": None,
            "after_id": None}, {"runs_finished_idx"}),
        "web: runs page floor": ("runs_floor", {**LISTING, "scan": 20_000},
                                 {"runs_pkey"}),
        "web: runs page floor of a job": ("runs_floor", {**LISTING, "job": "noop",
                                                         "scan": 20_000}, JOB_RUNS),
        "web: runs page of a job": ("runs_page_of_job", {**LISTING, "job": "noop", "tenant": None,
                                                  "floor": None, "limit": 51}, JOB_RUNS),
        "runs of a job": ("runs_list_by_job", {**LISTING, "job": "noop", "limit": 51},
                          JOB_RUNS),
        "web: job history": ("web_job_history", {"job": "noop", "runs": 50}, JOB_RUNS),
        # each job's latest run: pgflow.latest_run, inlined (checked below)
        "web: jobs page": ("web_jobs_page", {"after": None, "search": None, "tenant": None,
                                             "paused": None, "state": None, "limit": 50},
                           JOB_RUNS),
        "web: runs page by tenant": ("runs_page", {**LISTING, "floor": live["floor"],
                                                       "limit": 51}, {"runs_pkey"}),
        # the newest runs, whatever their state or job: the primary key, backwards
        "web: runs page": ("runs_page", {**LISTING, "tenant": None, "floor": None,
                                         "limit": 51}, {"runs_pkey"}),
        "web: dashboard minutes": ("web_rollup_minutes", {"settle_s": 120, "limit": 60},
                                   {"runs_finished_idx"}),
        "web: dashboard": ("web_dashboard", {"live_s": 600}, {"runs_finished_idx"}),
        # The dashboard's panels: the day's failures index-only (runs_failed_idx), one
        # hour of finished runs for the slowest jobs, never the day as a whole.
        "web: dashboard panels": ("web_dashboard_panels", {
            "settle_s": 120, "limit": 10, "per_hour": 10, "failures_scan": 20_000},
            {"runs_failed_idx"}),
        "web: slowest jobs of an hour": ("web_rollup_slow_hours", {
            "settle_s": 120, "limit": 1, "per_hour": 10}, {"runs_finished_idx"}),
        "web: pipeline grid": ("dag_history_runs", {
            "jobs": ["up", "down"], "times": [LIVE + timedelta(seconds=i) for i in range(25)]},
            {"run_keys_pkey"}),
        "web: pipeline times": ("dag_history_times", {"job": "up", "times": 25},
                                {"run_keys_pkey"}),
        # A Prometheus scrape: the last interval's starts and finishes, not the history.
        "metrics scrape": ("metrics_scrape", {
            "since": datetime.now(UTC) - timedelta(seconds=15), "settle": 2.0, "alive_s": 90.0,
            "neg_bounds": [-60.0, -1.0], "neg_lag_bounds": [-60.0, -1.0]},
            {"runs_schedule_started_idx"}),
        # Queue depth by state (pgflow status, the dashboard, a scrape, the tenants'
        # pages): the unfinished runs, both of their indexes.
        "status: queue depth": ("status_queue_depth", {}, UNFINISHED),
        "web: tenants": ("web_tenants", {}, UNFINISHED),
        "tenants list": ("policy_tenant_list", {}, UNFINISHED),
        "retention status": ("retention_status", {"retention_s": 7 * 86400.0, "now": None,
                                                  "cap": 100_000}, {"runs_finished_idx"}),
    }


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def _params(query: str, given: dict[str, Any]) -> dict[str, Any]:
    names = set(re.findall(r"%\((\w+)\)[sb]", query))
    missing = names - set(given)
    assert not missing, f"statement takes parameters this test does not know: {missing}"
    return {name: given[name] for name in names}


def plan_of(conn: Conn, name: str, params: dict[str, Any]) -> dict[str, Any]:
    query = q(name)
    row = conn.execute("EXPLAIN (FORMAT JSON) " + query, _params(query, params)).fetchone()
    assert row is not None
    plan: dict[str, Any] = row["QUERY PLAN"][0]["Plan"]
    return plan


LABELS = list(statements({"running": [{"id": 1, "attempt": 1, "job": j,
                                       "attempt_started_at": LIVE} for j in ("noop", "up")],
                          "backfill_id": 1, "pending_down": [1], "floor": 1}))


@pytest.mark.parametrize("label", LABELS)
def test_hot_statement_reads_no_history(history: tuple[Conn, dict[str, Any]],
                                        label: str) -> None:
    conn, live = history
    name, params, intended = statements(live)[label]
    try:
        q(name)
    except KeyError:
        pytest.fail(f"statement {name!r} is gone: update this test to its new name")
    plan = plan_of(conn, name, params)
    nodes = list(_nodes(plan))
    seq = [n["Relation Name"] for n in nodes
           if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in HOT_TABLES]
    assert not seq, f"{label}: sequential scan of {seq}"
    used = {n["Index Name"] for n in nodes if "Index Name" in n}
    if intended in MUST_USE_ALL:  # e.g. every unfinished run: waiting and running ones
        assert intended <= used, f"{label}: expected both of {intended}, plan uses {used}"
    elif intended:
        assert used & intended, f"{label}: expected one of {intended}, plan uses {used}"


def test_a_jobs_latest_run_is_inlined_as_two_index_probes(
        history: tuple[Conn, dict[str, Any]]) -> None:
    """pgflow.latest_run is a set-returning SQL function of one SELECT: the planner
    inlines it (no Function Scan, which would run it as a call per job)."""
    conn, _ = history
    explained = conn.execute("EXPLAIN (FORMAT JSON) SELECT * FROM pgflow.latest_run('noop')"
                             ).fetchone()
    assert explained is not None
    nodes = list(_nodes(explained["QUERY PLAN"][0]["Plan"]))
    assert not [n for n in nodes if n["Node Type"] in ("Seq Scan", "Function Scan")], nodes
    assert {n["Index Name"] for n in nodes if "Index Name" in n} >= JOB_RUNS


def test_the_history_is_there(history: tuple[Conn, dict[str, Any]]) -> None:
    conn, _ = history
    row = conn.execute("SELECT reltuples FROM pg_class WHERE oid = 'pgflow.runs'::regclass"
                       ).fetchone()
    assert row is not None and row["reltuples"] >= HISTORY


@pytest.mark.parametrize("name", ["prune_runs", "prune_preview"])
def test_retention_never_walks_the_queue(history: tuple[Conn, dict[str, Any]],
                                         name: str) -> None:
    """The dependency rules probe one run by its key (run_keys) per dependency. Written as a
    join, the planner could (and under load, with stale statistics, did) start from the
    queued and running runs through runs_state_idx once per candidate: 17 s a batch
    with a backlog of a few thousand runs in bench/history.py. The scalar subqueries
    leave it no such plan; this checks the plan it does get."""
    conn, _ = history
    plan = plan_of(conn, name, {"retention_s": 7 * 86400.0, "now": None, "limit": 2000,
                                "after_finished": None, "after_id": None})
    used = {n["Index Name"] for n in _nodes(plan) if "Index Name" in n}
    assert "runs_state_idx" not in used
    assert {"runs_finished_idx", "run_keys_pkey"} <= used


def generic_plan_of(conn: Conn, name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The plan a session with ``plan_cache_mode = force_generic_plan`` (a worker's claim
    session: the named query generic_plans) runs for ``name``, as the worker sends it
    (the claim with its limit written in): planned for any values."""
    query = queue._claim_sql(params["limit"]) if name == "claim_runs" else q(name)
    order: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        if match.group(1) not in order:
            order.append(match.group(1))
        return f"${order.index(match.group(1)) + 1}"

    text = re.sub(r"%\((\w+)\)s", placeholder, query)
    values = _params(query, params)
    with conn.transaction(force_rollback=True):
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        conn.execute(sql.SQL("PREPARE generic_plan AS {}").format(sql.SQL(text)))  # type: ignore[arg-type]
        args = sql.SQL(", ").join(sql.Literal(values[key]) for key in order)
        execute = sql.SQL("EXECUTE generic_plan({})").format(args) if order else \
            sql.SQL("EXECUTE generic_plan")
        row = conn.execute(sql.SQL("EXPLAIN (FORMAT JSON) {}").format(execute)).fetchone()
        conn.execute("DEALLOCATE generic_plan")
    assert row is not None
    plan: dict[str, Any] = row["QUERY PLAN"][0]["Plan"]
    return plan


# label -> whether the statement claims (then it must reach the claimed rows by key)
CLAIM_SESSION = {"claim": True, "capped waiting": False, "capped claim": True}


@pytest.mark.parametrize("label", list(CLAIM_SESSION))
def test_the_claim_sessions_generic_plans_read_no_history(
        history: tuple[Conn, dict[str, Any]], label: str) -> None:
    """The claim session plans once for all values (sql/queries/sessions.sql): those plans
    too go through the intended index, and reach the claimed rows by primary key."""
    conn, live = history
    name, params, intended = statements(live)[label]
    nodes = list(_nodes(generic_plan_of(conn, name, params)))
    seq = [n["Relation Name"] for n in nodes
           if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in HOT_TABLES]
    assert not seq, f"{label}: sequential scan of {seq}"
    used = {n["Index Name"] for n in nodes if "Index Name" in n}
    assert used & intended, f"{label}: expected one of {intended}, plan uses {used}"
    assert "runs_pkey" in used or not CLAIM_SESSION[label], used


def test_the_claims_generic_plan_expects_no_more_runs_than_it_claims(
        history: tuple[Conn, dict[str, Any]]) -> None:
    """With the limit as a parameter, the generic plan guessed a tenth of the queue
    (7,500 candidates of 10,000 distinct jobs' runs) and ran 20 times slower than the
    custom one (41 ms a claim of 64). Written in, the limit bounds every estimate."""
    conn, live = history
    _, params, _ = statements(live)["claim"]
    nodes = list(_nodes(generic_plan_of(conn, "claim_runs", params)))
    updates = [n for n in nodes if n["Node Type"] == "ModifyTable"]
    assert updates and all(n["Plan Rows"] <= params["limit"] for n in updates), updates
    limits = [n for n in nodes if n["Node Type"] == "Limit"]
    assert limits and all(n["Plan Rows"] <= params["limit"] for n in limits), limits


@pytest.mark.parametrize("results", [100, 5000])
def test_a_plain_finish_probes_each_result_once(history: tuple[Conn, dict[str, Any]],
                                                results: int) -> None:
    """finish_attempts in plain mode (queue.finish_plain, the hot path of most results):
    the runs it updates are never the outer side of a nested loop over the batch's
    results (a plan that did so, made when the plain test was a parameter the planner
    folded, scanned all 5,000 results once per run: 12 s a batch)."""
    conn, _ = history
    batch = [queue.Finish(10**9 + i, 1, WORKER, "succeeded", "succeeded", LIVE, plain=True)
             for i in range(results)]
    plan = plan_of(conn, "finish_attempts", {**queue.finish_params(batch), "plain": True})
    [update] = [n for n in _nodes(plan) if n.get("Operation") == "Update"]
    for node in _nodes(update):
        if node["Node Type"] == "Nested Loop":
            inner = node["Plans"][1]
            assert inner.get("CTE Name") != "result", f"the results rescanned per run: {node}"
