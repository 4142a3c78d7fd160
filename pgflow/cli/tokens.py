"""``pgflow token``: create, list and revoke API and UI tokens."""

from __future__ import annotations

import click

from pgflow.cli._base import Ctx, emit_json, emit_table, json_option, pass_ctx


@click.group("token")
def token_group() -> None:
    """API and UI tokens (viewer < operator < admin)."""


@token_group.command("create")
@click.option("--role", required=True, type=click.Choice(["viewer", "operator", "admin"]))
@click.option("--note", help="What the token is for (shown in 'token list').")
@pass_ctx
def token_create(ctx: Ctx, role: str, note: str | None) -> None:
    """Create a token and print it (it is shown only this once)."""
    from pgflow import tokens

    click.echo(tokens.create(ctx.conn(), role, note))


@token_group.command("list")
@json_option
@pass_ctx
def token_list(ctx: Ctx, as_json: bool) -> None:
    """List tokens (their secrets are never shown again)."""
    from pgflow import tokens

    rows = tokens.list_tokens(ctx.conn())
    if as_json:
        emit_json(rows)
    else:
        emit_table(rows, ["id", "role", "prefix", "note", "created_at", "last_used_at",
                          "revoked_at"])


@token_group.command("revoke")
@click.argument("token_id", type=int)
@pass_ctx
def token_revoke(ctx: Ctx, token_id: int) -> None:
    """Revoke a token; its API calls and UI sessions stop working at once."""
    from pgflow import tokens

    tokens.revoke(ctx.conn(), token_id)
    click.echo(f"token {token_id} revoked")
