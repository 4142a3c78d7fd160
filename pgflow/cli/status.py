"""``pgflow status``: the replicas, their roles, the leader and the queue depth."""

from __future__ import annotations

from typing import Any

import click

from pgflow import breakers, status
from pgflow.alerts import outbox
from pgflow.cli._base import Ctx, emit_json, emit_table, json_option, pass_ctx


@click.command("status")
@json_option
@pass_ctx
def status_command(ctx: Ctx, as_json: bool) -> None:
    """Replicas, their roles, the leader and queue depth by state and tenant."""
    lease_ttl = ctx.settings.lease_ttl  # a bad setting is reported before connecting
    report = status.cluster_status(ctx.conn(), lease_ttl)
    report["breakers"] = [b for b in breakers.list_breakers(ctx.conn())
                          if b["state"] != "closed" or b["failures"]]
    report["breaker_transitions"] = breakers.recent_transitions(ctx.conn(), 10)
    report["incidents"] = outbox.firing(ctx.conn())  # open alert incidents (pgflow.alerts)
    if as_json:
        emit_json(report)
        return
    click.echo(_leader_line(report["leader"]))
    alive = sum(r["alive"] for r in report["replicas"])
    click.echo(f"replicas: {alive} alive, {len(report['replicas']) - alive} not responding")
    if report["replicas"]:
        rows = [{**r, "heartbeat_age_s": f"{r['heartbeat_age_s']:.1f}"} for r in report["replicas"]]
        emit_table(rows, ["id", "host", "pid", "roles", "version", "concurrency",
                          "heartbeat_age_s", "alive", "stopping"])
    queue = report["queue"]
    totals = ", ".join(f"{state} {n}" for state, n in queue["by_state"].items())
    click.echo(f"queue: {totals}; dead letters {queue['dead_letters']}")
    click.echo(f"alerts: {report['incidents']['firing']} incident(s) firing")
    if queue["by_tenant"]:
        emit_table(queue["by_tenant"], ["state", "tenant", "runs"])
    if report["breakers"]:
        click.echo(f"breakers: {len(report['breakers'])} not closed or failing")
        emit_table(report["breakers"], ["source", "state", "failures", "half_open_at",
                                        "held_runs", "reason"])
    if report["breakers"] and report["breaker_transitions"]:
        click.echo("recent breaker transitions:")
        emit_table(report["breaker_transitions"], ["at", "source", "from_state", "to_state",
                                                   "reason"])


def _leader_line(leader: dict[str, Any] | None) -> str:
    if leader is None:
        return "leader: none"
    age = f"heartbeat {leader['heartbeat_age_s']:.1f}s ago"
    stale = "; STALE, a standby will take over" if leader["stale"] else ""
    return f"leader: {leader['replica_id']} (term {leader['term']}, {age}{stale})"
