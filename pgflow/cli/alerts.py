"""``pgflow alerts``: active incidents and the delivery log; send a test notification."""

from __future__ import annotations

import click

from pgflow.alerts import outbox
from pgflow.cli._base import Ctx, emit_json, emit_table, json_option, pass_ctx
from pgflow.errors import PgflowError


@click.group("alerts")
def alerts_group() -> None:
    """Alert incidents and webhook notifications ([alerts.NAME] tables)."""


@alerts_group.command("list")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 1000),
              help="Recent incidents and deliveries shown.")
@json_option
@pass_ctx
def alerts_list(ctx: Ctx, limit: int, as_json: bool) -> None:
    """Firing incidents, recent ones, alert definitions and the delivery log."""
    report = outbox.overview(ctx.conn(), limit=limit)
    if as_json:
        emit_json(report)
        return
    active = report["active"]
    click.echo(f"firing: {len(active)} incident(s)")
    if active:
        emit_table(active, ["id", "event", "key", "opened_at", "summary"])
    click.echo("recent incidents:")
    emit_table(report["recent"], ["id", "event", "key", "opened_at", "resolved_at", "summary"])
    click.echo(f"alerts: {len(report['alerts'])} defined")
    if report["alerts"]:
        rows = [{**a, "target": a["url"] or f"${a['url_env']}"} for a in report["alerts"]]
        emit_table(rows, ["name", "format", "target", "events", "jobs", "tenants"])
    backlog = report["backlog"] or {"pending": 0, "given_up": 0}
    click.echo(f"deliveries: {backlog['pending']} pending, {backlog['given_up']} given up"
               " (undelivered)")
    if report["deliveries"]:
        emit_table(report["deliveries"], ["created_at", "alert", "event", "status", "delivery",
                                          "attempts", "last_status", "last_error"])


@alerts_group.command("test")
@click.argument("name")
@json_option
@pass_ctx
def alerts_test(ctx: Ctx, name: str, as_json: bool) -> None:
    """Send a test notification to alert NAME now and print what the receiver answered."""
    result = outbox.send_test(ctx.conn(), name, ctx.settings.ui_url)
    answer = result.answer
    if as_json:
        emit_json({"notification": result.notification_id, "ok": answer.ok,
                   "status": answer.status, "error": answer.error, "answer": answer.body[:2000]})
    if not answer.ok:
        raise PgflowError(f"test notification to alert {name!r} failed: {answer.describe()}")
    if not as_json:
        click.echo(f"alert {name}: receiver answered HTTP {answer.status}"
                   f" (notification {result.notification_id})")
