"""``pgflow trigger``: a manual run of one job, with its logical time and parameters."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import click

from pgflow import runs
from pgflow.cli._base import Ctx, parse_logical_time, pass_ctx


def _parse_params(
    _ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]
) -> dict[str, Any] | None:
    if not values:
        return None
    params: dict[str, Any] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected key=value, got {item!r}")
        try:
            params[key] = json.loads(raw)
        except ValueError:
            params[key] = raw
    return params


@click.command("trigger")
@click.argument("name")
@click.option("--logical-time", callback=parse_logical_time,
              help="ISO 8601 time the run is for (naive = UTC; default: now, to the second).")
@click.option("--param", "params", multiple=True, callback=_parse_params, metavar="KEY=VALUE",
              help="Run parameter over the job's own; VALUE is JSON if it parses, else text.")
@click.option("--no-downstream", is_flag=True,
              help="Do not start downstream jobs after this run.")
@pass_ctx
def trigger_command(ctx: Ctx, name: str, logical_time: datetime | None,
                    params: dict[str, Any] | None, no_downstream: bool) -> None:
    """Create a manual run of job NAME and print its id."""
    run_id = runs.trigger(ctx.conn(), name, logical_time, params, downstream=not no_downstream)
    click.echo(run_id)
