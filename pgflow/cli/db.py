"""``pgflow db``: apply schema migrations, show their status and the retention, prune
finished runs now, stop the embedded server."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import click

from pgflow import db, migrate, retention
from pgflow.cli._base import Ctx, emit_json, emit_table, json_option, pass_ctx
from pgflow.duration import format_duration
from pgflow.errors import PgflowError

# Between two batches of `db prune`: other sessions' statements get the server first.
PRUNE_PAUSE_S = 0.02


@click.group("db")
def db_group() -> None:
    """Schema migrations and the embedded database."""


@db_group.command("migrate")
@pass_ctx
def db_migrate(ctx: Ctx) -> None:
    """Apply pending schema migrations (safe from several replicas at once)."""
    conn = db.connect(ctx.url())
    applied = migrate.migrate(conn)
    if applied:
        for m in applied:
            click.echo(f"applied {m.version:04d}_{m.name}")
    else:
        click.echo("schema is up to date")


@db_group.command("status")
@json_option
@pass_ctx
def db_status(ctx: Ctx, as_json: bool) -> None:
    """Show applied and pending migrations, and the retention of finished runs."""
    conn = db.connect_pooled(ctx.url(), ctx.settings.pooler_url)
    rows = [
        {"version": s.version, "name": s.name, "state": "applied" if s.applied_at else "pending",
         "applied_at": s.applied_at, "modified": s.modified}
        for s in migrate.status(conn)
    ]
    pending = sum(r["state"] == "pending" for r in rows)
    kept = None if pending else retention.status(conn, ctx.settings.retention)
    if as_json:
        emit_json({"migrations": rows, "pending": pending, "retention": kept})
        return
    emit_table(rows, ["version", "name", "state", "applied_at"])
    if kept is not None:
        click.echo("")
        for line in _retention_lines(kept):
            click.echo(line)


def _retention_lines(kept: dict[str, Any]) -> list[str]:
    past = f"{kept['past_retention']:,}{'+' if kept['capped'] else ''}"
    lines = [f"retention: {format_duration(kept['retention_s'])} (PGFLOW_RETENTION here): runs"
             f" finished before {_when(kept['cutoff'])} are deleted",
             f"past retention: {past} finished runs, {kept['dead_letters_kept']:,} of them dead"
             " letters kept until acknowledged (pgflow runs ack)",
             f"oldest finished run: {_when(kept['oldest_finished'])}"]
    leader = kept["leader"]
    if leader is None:
        lines.append("leader's retention: no pass yet (the scheduler leader prunes)")
    else:
        lines.append(f"leader's retention: {format_duration(leader['retention_s'])} on replica"
                     f" {leader['replica_id']}, last pass {leader['last_pass_age_s']:.0f}s ago"
                     f" ({leader['last_pass_runs']:,} runs), {leader['pruned_runs']:,} runs"
                     f" and {leader['pruned_backfills']:,} backfills pruned in all")
    return lines


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).isoformat(timespec="seconds")


@db_group.command("prune")
@click.option("--dry-run", is_flag=True, help="Only show what would be deleted.")
@click.option("--retention", "keep_for",
              help="Keep finished runs this long [PGFLOW_RETENTION, 30d].")
@json_option
@pass_ctx
def db_prune(ctx: Ctx, dry_run: bool, keep_for: str | None, as_json: bool) -> None:
    """Delete finished runs older than the retention now (what the leader does by itself),
    in short batches; --dry-run shows what would go."""
    ctx.override(retention=keep_for)
    keep = ctx.settings.retention
    conn = ctx.conn()
    cutoff = retention.status(conn, keep, cap=1)["cutoff"]
    if dry_run:
        found = retention.preview(conn, keep)
        doc = {"dry_run": True, "retention_s": keep, "cutoff": cutoff,
               "runs": {r["state"]: r["runs"] for r in found},
               "total": sum(r["runs"] for r in found),
               "oldest": min((r["oldest"] for r in found), default=None),
               "newest": max((r["newest"] for r in found), default=None)}
        if as_json:
            emit_json(doc)
            return
        click.echo(f"would delete {doc['total']:,} finished runs (and their attempts) that"
                   f" finished before {_when(cutoff)} (retention {format_duration(keep)}):")
        if found:
            emit_table(found, ["state", "runs", "oldest", "newest"])
        return
    done = retention.run_once(conn, keep, pause_s=PRUNE_PAUSE_S)
    doc = {"dry_run": False, "retention_s": keep, "cutoff": cutoff, "runs": done.runs,
           "total": done.deleted, "backfills": done.backfills, "batches": done.batches,
           "seconds": round(done.seconds, 3)}
    if as_json:
        emit_json(doc)
        return
    states = ", ".join(f"{state} {n:,}" for state, n in sorted(done.runs.items()))
    click.echo(f"deleted {done.deleted:,} finished runs{f' ({states})' if states else ''} and"
               f" {done.backfills:,} backfills in {done.batches} batches, {done.seconds:.1f}s")


@db_group.command("stop")
@pass_ctx
def db_stop(ctx: Ctx) -> None:
    """Stop the embedded PostgreSQL of this home."""
    if ctx.settings.database_url:
        raise PgflowError(
            "PGFLOW_DATABASE_URL is set: 'pgflow db stop' only stops the embedded database"
        )
    from pgflow.embedded import embedded_cluster

    stopped = embedded_cluster(ctx.settings.home).stop()
    click.echo("embedded PostgreSQL stopped" if stopped else "embedded PostgreSQL was not running")
