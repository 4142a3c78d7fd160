"""The admin pages (GET): server-rendered HTML that works without JavaScript.

Live pages refresh themselves with ``<meta http-equiv="refresh">``. The dashboard's
aggregates come from one statement and are cached for a few seconds per replica; its
24-hour chart reads the per-minute counts of ``pgflow.run_minutes`` (each closed minute
counted once, cluster-wide, ``ROLLUP_MINUTES`` minutes per call at most) and only the
last minutes of runs, so its cost does not grow with the runs of a day. With 10,000,000
runs (536,000 finished in the last 24 h) the first dashboard of each replica used to
read all of those index entries (580 ms); now no call reads more than an hour of them
(the first calls on a busy installation count its last 24 hours an hour at a time).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from pgflow import (
    backfill,
    breakers,
    datasets,
    lineage,
    live,
    policies,
    queue_health,
    runs,
    status,
)
from pgflow.cron import CronError, load_timezone, parse_cron
from pgflow.errors import InvalidInput, NotFound
from pgflow.queries import q
from pgflow.web import dag_history, gantt, panels, svg
from pgflow.web._endpoint import ApiError, Param, parse_param
from pgflow.web._session import TZ_COOKIE, Viewer, local_path, page, render, zone_of
from pgflow.web._state import Conn, WebState, web_state
from pgflow.web.api import MAX_ID, NAME_SCHEMA, STATES, TRIGGERS

PAGE = 50
LINEAGE_MAX_NODES = 120
ACTIVE = ("pending", "queued", "running", "retrying")
# The dashboard's minutes: a minute is counted once it ended SETTLE_S ago (rows stamped
# with a transaction's start time have committed by then), at most ROLLUP_MINUTES per
# dashboard computation; until then (and at most LIVE_S back) it is read from runs.
SETTLE_S = 120
ROLLUP_MINUTES = 60
LIVE_S = 600


def _arg(request: Request, name: str, schema: dict[str, Any]) -> Any:
    """A query parameter checked like the API's (bad input → 400 page)."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return parse_param(Param(name, "query", schema), raw)
    except ApiError as exc:
        raise InvalidInput(exc.message) from None


def _path_name(request: Request) -> str:
    name = request.path_params["name"]
    try:
        parse_param(Param("name", "path", NAME_SCHEMA), name)
    except ApiError:
        raise NotFound(f"no job named {name!r}") from None
    return str(name)


def _path_id(request: Request, what: str = "run") -> int:
    raw = request.path_params["id"]
    if not (raw.isascii() and raw.isdigit()) or not 0 < int(raw) <= MAX_ID:
        raise NotFound(f"no {what} {raw!r}")
    return int(raw)


# ---------------------------------------------------------------- dashboard


def dashboard_data(conn: Conn, state: WebState) -> dict[str, Any]:
    """The dashboard's numbers, cached ``state.cache.ttl_s`` seconds per replica."""
    return state.cache.get("dashboard", lambda: _compute_dashboard(conn, state))


def _compute_dashboard(conn: Conn, state: WebState) -> dict[str, Any]:
    ttl = state.settings.lease_ttl
    conn.execute(q("web_rollup_minutes"), {"settle_s": SETTLE_S, "limit": ROLLUP_MINUTES})
    row = conn.execute(q("web_dashboard"), {"live_s": LIVE_S}).fetchone()
    assert row is not None
    now: datetime = row["now"]
    minutes = {int(m["minute"]): (m["finished"], m["succeeded"], m["failed"])
               for m in row["minutes"]}
    state.minutes = minutes

    depth = row["depth"]
    tenants = sorted({d["tenant"] for d in depth})
    table = {t: dict.fromkeys(ACTIVE, 0) for t in tenants}
    for d in depth:
        table[d["tenant"]][d["state"]] = d["runs"]
    totals = status.by_state(depth)
    replicas = row["replicas"]
    for r in replicas:
        r["alive"] = r["heartbeat_age_s"] < status.ALIVE_TTLS * ttl
    leader = row["leader"]
    last_hour = [v for m, v in minutes.items() if m >= int(now.timestamp()) - 3600]
    ok, failed = sum(v[1] for v in last_hour), sum(v[2] for v in last_hour)
    finished_day = sum(v[0] for v in minutes.values())
    health = queue_health.read(conn)
    return {
        "now": now, "table": table, "totals": totals, "dead_letters": row["dead_letters"],
        "oldest_waiting_s": row["oldest_waiting_s"], "replicas": replicas, "leader": leader,
        "open_breakers": row["open_breakers"], "finished_day": finished_day,
        "rate_hour": ok / (ok + failed) if ok + failed else None,
        "alerts": _alerts(row, replicas, totals, ok, failed, ttl)
        + queue_health.warnings(health),
        "rpm_svg": svg.runs_per_minute(minutes, now, "Runs finished per minute, last 24 hours"),
        "rate_svg": svg.success_rate_by_hour(minutes, now, "Success rate per hour, last 24 h"),
        "panels": panels.dashboard_panels(conn), "health": health,
    }


def _alerts(row: dict[str, Any], replicas: list[dict[str, Any]], totals: dict[str, int],
            ok: int, failed: int, ttl: float) -> list[tuple[str, str, str | None]]:
    """(severity, message, link) for everything an operator should look at now."""
    alerts: list[tuple[str, str, str | None]] = []
    leader = row["leader"]
    if leader is None:
        alerts.append(("error", "No scheduling leader: start a replica with the scheduler"
                       " role (pgflow serve).", "/replicas"))
    elif leader["heartbeat_age_s"] > ttl:
        alerts.append(("error", f"The leader {leader['replica_id']} has not renewed its heartbeat"
                       f" for {svg.human_seconds(leader['heartbeat_age_s'])}; a standby will"
                       " take over.", "/replicas"))
    silent = [r["id"] for r in replicas if not r["alive"]]
    if silent:
        alerts.append(("warning", f"{len(silent)} replica(s) not responding: "
                       + ", ".join(silent[:5]), "/replicas"))
    workers = [r for r in replicas if r["alive"] and "worker" in r["roles"]]
    if totals["queued"] and not workers:
        alerts.append(("error", f"{totals['queued']} run(s) queued but no worker is alive.",
                       "/replicas"))
    if row["dead_letters"]:
        alerts.append(("warning", f"{row['dead_letters']} dead letter(s) need retry or"
                       " acknowledgement.", "/dead-letters"))
    if row["open_breakers"]:
        alerts.append(("warning", "Breaker open for " + ", ".join(row["open_breakers"][:10])
                       + ": their jobs' runs are held back.", "/breakers"))
    waited = row["oldest_waiting_s"]
    if waited is not None and waited > 300:
        alerts.append(("warning", f"The oldest claimable run has waited"
                       f" {svg.human_seconds(waited)}: workers are saturated or absent.",
                       "/runs?state=queued"))
    if ok + failed >= 5 and failed / (ok + failed) > 0.2:
        alerts.append(("warning", f"{failed} of {ok + failed} runs finished in the last hour"
                       " failed.", "/runs?state=failed"))
    return alerts


def dashboard(request: Request) -> Response:
    state = web_state(request)

    def build(conn: Conn, viewer: Viewer) -> dict[str, Any]:
        return {"title": "Dashboard", "d": dashboard_data(conn, state), "ttl":
                state.settings.lease_ttl}

    return page(request, "dashboard.html", build, refresh=lambda _: 10)


# ---------------------------------------------------------------- jobs


def jobs(request: Request) -> Response:
    state = web_state(request)

    def build(conn: Conn, viewer: Viewer) -> dict[str, Any]:
        search = _arg(request, "q", {"type": "string", "maxLength": 200})
        tenant = _arg(request, "tenant", NAME_SCHEMA)
        wanted = _arg(request, "state", {"type": "string",
                                         "enum": ["paused", "active", *STATES]})
        after = _arg(request, "after", {"type": "string", "maxLength": 128})
        paused = {"paused": True, "active": False}.get(wanted or "")
        run_state = wanted if wanted in STATES else None
        args = {"search": search, "tenant": tenant, "paused": paused, "state": run_state}
        rows = conn.execute(q("web_jobs_page"), {**args, "after": after,
                                                 "limit": PAGE + 1}).fetchall()
        count = conn.execute(q("web_jobs_count"), args).fetchone()
        tenants = state.cache.get("tenant_names", lambda: [
            r["tenant"] for r in conn.execute(q("web_tenant_names"))])
        more = len(rows) > PAGE
        rows = rows[:PAGE]
        return {"title": "Jobs", "rows": rows, "total": count["jobs"] if count else 0,
                "next_after": rows[-1]["name"] if more else None, "tenants": tenants,
                "filters": {"q": search or "", "tenant": tenant or "", "state": wanted or ""},
                "states": ["paused", "active", *STATES], "after": after}

    return page(request, "jobs.html", build)


def _next_fires(job: dict[str, Any], count: int = 5) -> list[datetime]:
    if not job["schedule"] or job["next_fire_at"] is None:
        return []
    schedule = parse_cron(job["schedule"], job["timezone"])
    fires = [job["next_fire_at"]]
    while len(fires) < count:
        fires.append(schedule.next_after(fires[-1]))
    return fires


def _lineage_nodes(conn: Conn, name: str) -> tuple[list[svg.Node], list[tuple[str, str]], int]:
    graph = lineage.with_datasets(conn, lineage.lineage(conn, name))
    nodes = sorted(graph["nodes"], key=lambda n: (abs(n["depth"]), n["job"]))
    shown = nodes[:LINEAGE_MAX_NODES]
    names = {n["job"] for n in shown}
    edges = [(e["upstream"], e["job"]) for e in graph["edges"]
             if e["upstream"] in names and e["job"] in names]
    drawn = [_lineage_node(n) for n in shown]
    return drawn, edges, len(nodes) - len(shown)


def _lineage_node(node: dict[str, Any]) -> svg.Node:
    if node["kind"] == "dataset":
        dataset = node["job"].removeprefix(lineage.DATASET_PREFIX)
        return svg.Node(node["job"], node["depth"], None, "/datasets?dataset=" + _seg(dataset),
                        kind="dataset")
    return svg.Node(node["job"], node["depth"], node["state"], "/jobs/" + _seg(node["job"]),
                    f" (run {node['run_id']})" if node["run_id"] else "")


def _seg(text: str) -> str:
    return quote(text, safe="")


def job_page(request: Request) -> Response:
    def build(conn: Conn, viewer: Viewer) -> dict[str, Any]:
        name = _path_name(request)
        job = conn.execute(q("get_job"), {"name": name}).fetchone()
        if job is None:
            raise NotFound(runs.unknown_job_message(conn, name))
        history = conn.execute(q("web_job_history"), {"job": name, "runs": 200}).fetchone()
        assert history is not None
        durations = sorted(history["durations"])
        states = history["states"]
        ok, failed = states.get("succeeded", 0), states.get("failed", 0)
        nodes, edges, hidden = _lineage_nodes(conn, name)
        recent = runs.list_runs(conn, name, limit=20)
        return {
            "title": name, "job": job, "next_fires": _next_fires(job),
            "definition": json.dumps(job["definition"], indent=2, sort_keys=True),
            "lineage_svg": svg.layered_graph(nodes, edges, name, f"Lineage of {name}"),
            "lineage_hidden": hidden,
            "histogram_svg": svg.duration_histogram(durations, f"Durations of {name}"),
            "p50": svg.percentile(durations, 0.5), "p95": svg.percentile(durations, 0.95),
            "attempts_measured": len(durations), "failed_attempts": history["failed_attempts"],
            "success_rate": ok / (ok + failed) if ok + failed else None,
            "states": states, "recent": recent,
            "dag": None if job["depends_on"] else dag_history.history(
                conn, name, conn.execute(q("web_now")).fetchone()["now"]),  # type: ignore[index]
        }

    return page(request, "job.html", build)


def dag_page(request: Request) -> Response:
    def build(conn: Conn, viewer: Viewer) -> dict[str, Any] | Response:
        name = _path_name(request)
        at = _arg(request, "at", {"type": "string", "format": "date-time"})
        if at is None:
            latest = runs.list_runs(conn, name, limit=1)
            if not latest:
                raise NotFound(f"job {name!r} has no runs yet")
            at = latest[0]["logical_time"]
        rows = lineage.dag_run(conn, name, at)
        if not rows:
            raise NotFound(f"no runs of the DAG of {name!r} at {at.isoformat()}")
        depth = _depths({r["job"]: [u for u in r["depends_on"]] for r in rows})
        names = list(depth)
        edges = [(e["upstream"], e["job"]) for e in
                 conn.execute(q("web_dag_edges"), {"jobs": names})]
        nodes = [svg.Node(r["job"], depth[r["job"]], r["state"], f"/runs/{r['id']}",
                          f" (run {r['id']})") for r in rows]
        return {"title": f"DAG run {at.isoformat()}", "job": name, "at": at, "rows": rows,
                "graph_svg": svg.layered_graph(nodes, edges, name, f"DAG run at {at}"),
                "active": any(r["state"] in ACTIVE for r in rows),
                **gantt.dag_run_latency(rows, conn.execute(q("web_now")).fetchone()["now"])}  # type: ignore[index]

    return page(request, "dag.html", build,
                refresh=lambda c: 5 if c.get("active") else None)


def _depths(upstreams: dict[str, list[str]]) -> dict[str, int]:
    """Longest path from a root, counting only the upstreams present."""
    depth: dict[str, int] = {}

    def visit(job: str, seen: frozenset[str]) -> int:
        if job not in depth:
            ups = [u for u in upstreams.get(job, []) if u in upstreams and u not in seen]
            depth[job] = 1 + max((visit(u, seen | {job}) for u in ups), default=-1)
        return depth[job]

    for job in upstreams:
        visit(job, frozenset())
    return depth


# ---------------------------------------------------------------- runs


def runs_page(request: Request) -> Response:
    def build(conn: Conn, viewer: Viewer) -> dict[str, Any]:
        job = _arg(request, "job", NAME_SCHEMA)
        state = _arg(request, "state", {"type": "string", "enum": STATES})
        tenant = _arg(request, "tenant", NAME_SCHEMA)
        trigger = _arg(request, "trigger", {"type": "string", "enum": TRIGGERS})
        cursor = _arg(request, "cursor", {"type": "integer", "minimum": 1, "maximum": MAX_ID})
        rows, next_cursor = runs.page_runs(conn, limit=PAGE, before=cursor, job=job, state=state,
                                      tenant=tenant, trigger=trigger)
        return {"title": "Runs", "rows": rows, "next_cursor": next_cursor,
                "filters": {"job": job or "", "state": state or "", "tenant": tenant or "",
                            "trigger": trigger or ""}, "states": STATES, "triggers": TRIGGERS}

    return page(request, "runs.html", build, refresh=lambda _: 15)


def run_page(request: Request) -> Response:
    def build(conn: Conn, viewer: Viewer) -> dict[str, Any]:
        run_id = _path_id(request)
        run = conn.execute(q("web_run"), {"id": run_id}).fetchone()
        if run is None:
            raise NotFound(f"no run {run_id}")
        attempts = conn.execute(q("run_attempts"), {"id": run_id}).fetchall()
        now = conn.execute(q("web_now")).fetchone()["now"]  # type: ignore[index]
        spans = [svg.Span(f"attempt {a['attempt']}", a["started_at"], a["finished_at"],
                          a["outcome"]) for a in attempts if a["started_at"] is not None]
        events, event_count = (datasets.run_events(conn, run_id) if run["trigger"] == "dataset"
                               else ([], 0))
        return {"title": f"Run {run_id}", "run": run, "attempts": attempts,
                "output": live.page_output(conn, run_id, run["attempt"], run["state"]),
                "trigger_events": events, "trigger_event_count": event_count,
                "timeline_svg": svg.attempt_timeline(spans, now, f"Attempts of run {run_id}"),
                "params": json.dumps(run["params"], indent=2, sort_keys=True),
                "active": run["state"] in ACTIVE}

    return page(request, "run.html", build, refresh=lambda c: 3 if c.get("active") else None)


def dead_letters_page(request: Request) -> Response:
    def build(conn: Conn, viewer: Viewer) -> dict[str, Any]:
        rows = runs.dead_letters(conn, limit=200)
        total = conn.execute(q("status_dead_letters")).fetchone()
        return {"title": "Dead letters", "rows": rows,
                "total": total["dead_letters"] if total else 0}

    return page(request, "dead_letters.html", build)


def backfills_page(request: Request) -> Response:
    def build(conn: Conn, viewer: Viewer) -> dict[str, Any]:
        rows = backfill.list_backfills(conn, limit=100)
        return {"title": "Backfills", "rows": rows,
                "active": any(r["state"] == "running" for r in rows),
                "prefill": request.query_params.get("job", "")[:128]}

    return page(request, "backfills.html", build,
                refresh=lambda c: 10 if c.get("active") else None)


def replicas_page(request: Request) -> Response:
    state = web_state(request)

    def build(conn: Conn, viewer: Viewer) -> dict[str, Any]:
        report = status.cluster_status(conn, state.settings.lease_ttl)
        return {"title": "Replicas", "report": report, "ttl": state.settings.lease_ttl}

    return page(request, "replicas.html", build, refresh=lambda _: 10)


def breakers_page(request: Request) -> Response:
    def build(conn: Conn, viewer: Viewer) -> dict[str, Any]:
        return {"title": "Breakers", "rows": breakers.list_breakers(conn)}

    return page(request, "breakers.html", build)


def tenants_page(request: Request) -> Response:
    def build(conn: Conn, viewer: Viewer) -> dict[str, Any]:
        rows = conn.execute(q("web_tenants")).fetchall()
        defined = {t["name"]: t for t in policies.list_tenants(conn)}
        for row in rows:  # weight and cap (pgflow/policies.py); defaults without an entry
            tenant = defined.get(row["tenant"]) or {}
            row["weight"] = tenant.get("weight", 1)
            row["max_concurrency"] = tenant.get("max_concurrency")
            row["held"] = tenant.get("held", 0)
        return {"title": "Tenants", "rows": rows}

    return page(request, "tenants.html", build, refresh=lambda _: 15)


def tz_page(request: Request) -> Response:
    """Choose how times are shown: ``?zone=UTC``, an IANA name, or ``local`` (the browser's
    zone, filled in by the optional script; without it the page asks for a name)."""
    target = local_path(request.query_params.get("next"))
    zone = request.query_params.get("zone", "UTC").strip()
    if zone == "local" or (zone and zone != "UTC" and not _known_zone(zone)):
        _, current = zone_of(request)
        return render(request, "tz.html", None, {
            "title": "Time zone", "target": target, "current": current,
            "invalid": zone if zone != "local" else None},
            status=200 if zone == "local" else 400)
    response = RedirectResponse(target, 303)
    response.set_cookie(TZ_COOKIE, zone or "UTC", max_age=365 * 86400, samesite="lax",
                        path="/")
    return response


def _known_zone(name: str) -> bool:
    try:
        load_timezone(name)
    except CronError:
        return False
    return True
