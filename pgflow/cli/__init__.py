"""The ``pgflow`` command line.

Every failure the user can act on is one line on stderr (``error: ...``) and a
non-zero exit; no command prints a traceback (``PGFLOW_DEBUG=1`` shows one).

One module per command group; the root group, the shared context and the error
handling are in ``_base``. The groups are listed in ``COMMANDS`` and imported only
when used, so ``pgflow --help`` and ``pgflow jobs list`` start fast (``_lazy``).
"""

from __future__ import annotations

from pgflow.cli._base import cli, main, run
from pgflow.cli._lazy import LazyCommand as C

# name -> ("module:attr", first sentence of its docstring: the short help of --help).
COMMANDS: dict[str, C] = {
    "alerts": C("pgflow.cli.alerts:alerts_group",
                "Alert incidents and webhook notifications ([alerts.NAME] tables)."),
    "apply": C("pgflow.cli.apply:apply_command",
               "Register jobs (and tenants, sources, alerts) from TOML files, folders or"
               " module:attr."),
    "backfill": C("pgflow.cli.backfill:backfill_command",
                  "Re-run job NAME for every tick in [--start, --end); or list, show ID,"
                  " cancel ID."),
    "breakers": C("pgflow.cli.breakers:breakers_group", "Circuit breakers, one per source."),
    "datasets": C("pgflow.cli.datasets:datasets_group",
                  "Datasets: producers, consumers and their events (SPEC §4b)."),
    "db": C("pgflow.cli.db:db_group", "Schema migrations and the embedded database."),
    "emit": C("pgflow.cli.datasets:emit_command",
              "Record that DATASET was updated; jobs with trigger_on it react."),
    "jobs": C("pgflow.cli.jobs:jobs_group", "Inspect and control registered jobs."),
    "runs": C("pgflow.cli.runs:runs_group",
              "Inspect runs and act on them (retry, cancel, acknowledge)."),
    "serve": C("pgflow.cli.serve:serve_command",
               "Run a replica: scheduler, worker, reaper and web roles."),
    "status": C("pgflow.cli.status:status_command",
                "Replicas, their roles, the leader and queue depth by state and tenant."),
    "tenants": C("pgflow.cli.tenants:tenants_group",
                 "Tenants: shares of worker slots and caps (SPEC §4c)."),
    "token": C("pgflow.cli.tokens:token_group", "API and UI tokens (viewer < operator < admin)."),
    "trigger": C("pgflow.cli.trigger:trigger_command",
                 "Create a manual run of job NAME and print its id."),
}
cli.add_lazy(COMMANDS)

__all__ = ["COMMANDS", "cli", "main", "run"]
