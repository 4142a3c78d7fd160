"""``pgflow db``: apply schema migrations, show their status, stop the embedded server."""

from __future__ import annotations

import click

from pgflow import db, migrate
from pgflow.cli._base import Ctx, emit_json, emit_table, json_option, pass_ctx
from pgflow.errors import PgflowError


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
    """Show applied and pending migrations."""
    conn = db.connect(ctx.url())
    rows = [
        {"version": s.version, "name": s.name, "state": "applied" if s.applied_at else "pending",
         "applied_at": s.applied_at, "modified": s.modified}
        for s in migrate.status(conn)
    ]
    if as_json:
        emit_json({"migrations": rows, "pending": sum(r["state"] == "pending" for r in rows)})
    else:
        emit_table(rows, ["version", "name", "state", "applied_at"])


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
