"""``pgflow tenants``: tenants with their weight, cap and runs."""

from __future__ import annotations

import click

from pgflow import policies
from pgflow.cli._base import Ctx, emit_json, emit_table, json_option, pass_ctx


@click.group("tenants")
def tenants_group() -> None:
    """Tenants: shares of worker slots and caps (SPEC §4c)."""


@tenants_group.command("list")
@json_option
@pass_ctx
def tenants_list(ctx: Ctx, as_json: bool) -> None:
    """Every tenant defined or used by a job."""
    rows = policies.list_tenants(ctx.conn())
    if as_json:
        emit_json(rows)
    else:
        emit_table(rows, ["name", "weight", "max_concurrency", "running", "queued", "held",
                          "jobs"])
