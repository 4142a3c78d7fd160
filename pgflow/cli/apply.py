"""``pgflow apply``: register the jobs of TOML files, folders of them or ``module:attr``."""

from __future__ import annotations

import click

from pgflow import registry
from pgflow.cli._base import Ctx, emit_json, json_option, pass_ctx


@click.command("apply")
@click.argument("sources", nargs=-1, required=True)
@click.option("--prune", is_flag=True, help="Delete jobs these sources no longer define.")
@json_option
@pass_ctx
def apply_command(ctx: Ctx, sources: tuple[str, ...], prune: bool, as_json: bool) -> None:
    """Register jobs (and tenants, sources, alerts) from TOML files, folders or module:attr."""
    loaded = registry.load_sources(sources)
    result = registry.apply(ctx.conn(), loaded.specs, prune=prune, source=", ".join(sources),
                            invalid=loaded.errors, policies=loaded.policies)
    kinds = ("created", "updated", "unchanged", "pruned")
    if as_json:
        emit_json({**result.counts(), "jobs": {k: getattr(result, k) for k in result.counts()},
                   "policies": {k: getattr(result.policies, k) for k in kinds}})
    else:
        counts = result.counts()
        click.echo(", ".join(f"{k} {v}" for k, v in counts.items() if k != "pruned" or prune))
        for kind in kinds:
            if names := getattr(result.policies, kind):
                click.echo(f"{kind}: {', '.join(names)}")
