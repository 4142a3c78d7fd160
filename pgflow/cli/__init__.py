"""The ``pgflow`` command line.

Every failure the user can act on is one line on stderr (``error: ...``) and a
non-zero exit; no command prints a traceback (``PGFLOW_DEBUG=1`` shows one).

One module per command group; the root group, the shared context and the error
handling are in ``_base``, and the groups are added to the root group here.
"""

from __future__ import annotations

from pgflow.cli import (
    alerts,
    apply,
    backfill,
    breakers,
    datasets,
    db,
    jobs,
    runs,
    serve,
    status,
    tenants,
    tokens,
    trigger,
)
from pgflow.cli._base import cli, main, run

cli.add_command(alerts.alerts_group)
cli.add_command(apply.apply_command)
cli.add_command(backfill.backfill_command)
cli.add_command(breakers.breakers_group)
cli.add_command(datasets.datasets_group)
cli.add_command(datasets.emit_command)
cli.add_command(db.db_group)
cli.add_command(jobs.jobs_group)
cli.add_command(runs.runs_group)
cli.add_command(serve.serve_command)
cli.add_command(status.status_command)
cli.add_command(tenants.tenants_group)
cli.add_command(tokens.token_group)
cli.add_command(trigger.trigger_command)

__all__ = ["cli", "main", "run"]
