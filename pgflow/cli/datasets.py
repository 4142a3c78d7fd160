"""``pgflow emit`` and ``pgflow datasets``: dataset events from outside, and the overview."""

from __future__ import annotations

import json
from typing import Any

import click

from pgflow import datasets
from pgflow.cli._base import Ctx, emit_json, emit_table, json_option, pass_ctx


def _parse_payload(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        payload = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise click.BadParameter("must be a JSON object, e.g. '{\"rows\": 10}'")
    return payload


@click.command("emit")
@click.argument("dataset")
@click.option("--key", help="Idempotency key: the same (dataset, key) records one event.")
@click.option("--payload", callback=_parse_payload, metavar="JSON",
              help="A JSON object passed to the consuming runs (at most 64 KiB).")
@json_option
@pass_ctx
def emit_command(ctx: Ctx, dataset: str, key: str | None, payload: dict[str, Any] | None,
                 as_json: bool) -> None:
    """Record that DATASET was updated; jobs with trigger_on it react. Prints the event id."""
    emitted = datasets.emit(ctx.conn(), dataset, key, payload)
    event = emitted.event
    if as_json:
        emit_json({**datasets.event_json(event), "created": emitted.created})
        return
    click.echo(event["id"])
    if not emitted.created:
        click.echo(f"note: dataset {dataset!r} already has event {event['id']} with key"
                   f" {key!r} (recorded {event['created_at'].isoformat()}): nothing new"
                   " recorded", err=True)
    elif not event["consumers"]:
        click.echo(f"note: no job triggers on dataset {dataset!r} yet: the event is recorded"
                   " but nothing waits for it", err=True)


@click.group("datasets")
def datasets_group() -> None:
    """Datasets: producers, consumers and their events (SPEC §4b)."""


@datasets_group.command("list")
@json_option
@pass_ctx
def datasets_list(ctx: Ctx, as_json: bool) -> None:
    """Every dataset: producers, consumers with events waiting, last event."""
    rows = datasets.overview_json(datasets.overview(ctx.conn()))
    if as_json:
        emit_json(rows)
        return
    emit_table([_table_row(row) for row in rows],
               ["dataset", "producers", "consumers", "last_event", "last_event_at"])


def _table_row(row: dict[str, Any]) -> dict[str, Any]:
    last = row["last_event"] or {}
    consumers = [f"{c['job']}({c['mode']}{', paused' if c['paused'] else ''}:"
                 f" {c['waiting']} waiting)" for c in row["consumers"]]
    return {"dataset": row["dataset"], "producers": row["producers"], "consumers": consumers,
            "last_event": last.get("id"), "last_event_at": last.get("created_at")}
