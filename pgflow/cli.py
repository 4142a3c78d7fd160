"""The ``pgflow`` command line.

Every failure the user can act on is one line on stderr (``error: ...``) and a
non-zero exit; no command prints a traceback (``PGFLOW_DEBUG=1`` shows one).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import click
import psycopg

from pgflow import db, migrate, registry, runs, status
from pgflow.config import Settings, load_settings
from pgflow.errors import NotFound, PgflowError
from pgflow.queries import q


class Ctx:
    """Lazily resolved settings and database connection shared by subcommands."""

    def __init__(self, database_url: str | None, home: str | None) -> None:
        self._overrides: dict[str, Any] = {"database_url": database_url, "home": home}
        self._settings: Settings | None = None
        self._url: str | None = None
        self._conn: psycopg.Connection[dict[str, Any]] | None = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = load_settings(**self._overrides)
        return self._settings

    def override(self, **values: Any) -> None:
        """Flags of a subcommand win over the group's flags and the environment."""
        self._overrides.update({k: v for k, v in values.items() if v is not None})
        self._settings = None
        self._url = None

    def url(self) -> str:
        if self._url is None:
            self._url = db.resolve_url(self.settings)
        return self._url

    def conn(self) -> psycopg.Connection[dict[str, Any]]:
        if self._conn is None:
            self._conn = db.connect_migrated(self.url())
        return self._conn


pass_ctx = click.make_pass_decorator(Ctx)


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def emit_json(document: Any) -> None:
    click.echo(json.dumps(document, default=_json_default, indent=2))


def emit_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, datetime):
            return value.strftime("%Y-%m-%d %H:%M:%S%z")
        if isinstance(value, list):
            return ",".join(map(str, value)) or "-"
        return str(value)

    cells = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    click.echo("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for r in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--database-url", envvar="PGFLOW_DATABASE_URL", help="libpq URL (default: embedded).")
@click.option("--home", envvar="PGFLOW_HOME", help="Data folder (embedded cluster, secrets).")
@click.version_option(package_name="pgflow")
@click.pass_context
def cli(ctx: click.Context, database_url: str | None, home: str | None) -> None:
    """pgflow: scheduled ETL jobs coordinated by PostgreSQL only."""
    ctx.obj = Ctx(database_url, home)


# ---------------------------------------------------------------- db


@cli.group("db")
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


# ---------------------------------------------------------------- apply


@cli.command("apply")
@click.argument("sources", nargs=-1, required=True)
@click.option("--prune", is_flag=True, help="Delete jobs these sources no longer define.")
@json_option
@pass_ctx
def apply_command(ctx: Ctx, sources: tuple[str, ...], prune: bool, as_json: bool) -> None:
    """Register jobs from TOML files, folders of them, or module:attr."""
    loaded = registry.load_sources(sources)
    result = registry.apply(ctx.conn(), loaded.specs, prune=prune, source=", ".join(sources),
                            invalid=loaded.errors)
    if as_json:
        emit_json({**result.counts(), "jobs": {k: getattr(result, k) for k in result.counts()}})
    else:
        counts = result.counts()
        click.echo(", ".join(f"{k} {v}" for k, v in counts.items() if k != "pruned" or prune))


# ---------------------------------------------------------------- jobs


@cli.group("jobs")
def jobs_group() -> None:
    """Inspect and control registered jobs."""


@jobs_group.command("list")
@click.option("--tenant", help="Only this tenant's jobs.")
@click.option("--limit", type=click.IntRange(1, 1_000_000), default=100_000, show_default=True)
@json_option
@pass_ctx
def jobs_list(ctx: Ctx, tenant: str | None, limit: int, as_json: bool) -> None:
    """List jobs."""
    rows = ctx.conn().execute(q("list_jobs"), {"tenant": tenant, "limit": limit}).fetchall()
    if as_json:
        emit_json(rows)
    else:
        emit_table(rows, ["name", "tenant", "schedule", "timezone", "paused", "next_fire_at",
                          "depends_on"])


def _job(ctx: Ctx, name: str) -> dict[str, Any]:
    row = ctx.conn().execute(q("get_job"), {"name": name}).fetchone()
    if row is None:
        raise NotFound(f"no job named {name!r} (see 'pgflow jobs list')")
    return row


@jobs_group.command("show")
@click.argument("name")
@json_option
@pass_ctx
def jobs_show(ctx: Ctx, name: str, as_json: bool) -> None:
    """Show one job's definition and state."""
    row = _job(ctx, name)
    if as_json:
        emit_json(row)
        return
    definition = row.pop("definition")
    for key, value in row.items():
        click.echo(f"{key + ':':<14} {value if value not in (None, []) else '-'}")
    click.echo("definition:")
    click.echo(json.dumps(definition, indent=2))


def _set_paused(ctx: Ctx, name: str, paused: bool) -> None:
    registry.set_paused(ctx.conn(), name, paused)
    click.echo(f"{name} {'paused' if paused else 'resumed'}")


@jobs_group.command("pause")
@click.argument("name")
@pass_ctx
def jobs_pause(ctx: Ctx, name: str) -> None:
    """Stop creating scheduled runs of a job."""
    _set_paused(ctx, name, True)


@jobs_group.command("resume")
@click.argument("name")
@pass_ctx
def jobs_resume(ctx: Ctx, name: str) -> None:
    """Resume a paused job (missed ticks follow its catchup setting)."""
    _set_paused(ctx, name, False)


@jobs_group.command("delete")
@click.argument("name")
@pass_ctx
def jobs_delete(ctx: Ctx, name: str) -> None:
    """Delete a job; its run history stays, its unstarted runs are cancelled."""
    registry.delete(ctx.conn(), name)
    click.echo(f"{name} deleted")


# ---------------------------------------------------------------- trigger and runs


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


def _parse_logical_time(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise click.BadParameter(
            f"expected ISO 8601 such as 2026-01-31T12:00:00Z, got {value!r}"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@cli.command("trigger")
@click.argument("name")
@click.option("--logical-time", callback=_parse_logical_time,
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


@cli.group("runs")
def runs_group() -> None:
    """Inspect runs and act on them (retry, cancel, acknowledge)."""


RUN_ID = click.argument("run_id", metavar="ID", type=int)
RUN_COLUMNS = ["id", "job", "logical_time", "state", "attempt", "trigger", "tenant",
               "started_at", "finished_at"]


@runs_group.command("list")
@click.option("--job", help="Only this job's runs.")
@click.option("--state", help="Only runs in this state.")
@click.option("--tenant", help="Only this tenant's runs.")
@click.option("--limit", type=click.IntRange(1, 100_000), default=100, show_default=True)
@json_option
@pass_ctx
def runs_list(ctx: Ctx, job: str | None, state: str | None, tenant: str | None, limit: int,
              as_json: bool) -> None:
    """List runs, newest first."""
    rows = runs.list_runs(ctx.conn(), job=job, state=state, tenant=tenant, limit=limit)
    if as_json:
        emit_json(rows)
    else:
        emit_table(rows, RUN_COLUMNS)


@runs_group.command("show")
@RUN_ID
@json_option
@pass_ctx
def runs_show(ctx: Ctx, run_id: int, as_json: bool) -> None:
    """Show one run and its attempts."""
    run = runs.show_run(ctx.conn(), run_id)
    if as_json:
        emit_json(run)
        return
    attempts = run.pop("attempts")
    params = run.pop("params")
    for key, value in run.items():
        click.echo(f"{key + ':':<18} {_human(value)}")
    click.echo(f"{'params:':<18} {json.dumps(params)}")
    click.echo("attempts:")
    for attempt in attempts:
        attempt["error"] = (attempt["error"] or "").strip().split("\n")[0] or None
    emit_table(attempts, ["attempt", "worker_id", "started_at", "finished_at", "outcome",
                          "exit_code", "error"])


def _human(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S%z")
    return str(value)


@runs_group.command("retry")
@RUN_ID
@pass_ctx
def runs_retry(ctx: Ctx, run_id: int) -> None:
    """Queue a failed or cancelled run again, with a fresh attempt budget."""
    runs.retry(ctx.conn(), run_id)
    click.echo(f"run {run_id} queued for retry")


@runs_group.command("cancel")
@RUN_ID
@pass_ctx
def runs_cancel(ctx: Ctx, run_id: int) -> None:
    """Cancel a run; a running one is stopped by its worker within seconds."""
    result = runs.cancel(ctx.conn(), run_id)
    if result["outcome"] == "cancelled":
        click.echo(f"run {run_id} cancelled")
    else:
        click.echo(f"run {run_id} cancel requested; worker {result['lease_owner']} stops it")


@runs_group.command("ack")
@RUN_ID
@pass_ctx
def runs_ack(ctx: Ctx, run_id: int) -> None:
    """Acknowledge a failed run (it leaves the dead-letter list)."""
    runs.ack(ctx.conn(), run_id)
    click.echo(f"run {run_id} acknowledged")


# ---------------------------------------------------------------- status


@cli.command("status")
@json_option
@pass_ctx
def status_command(ctx: Ctx, as_json: bool) -> None:
    """Replicas, their roles, the leader and queue depth by state and tenant."""
    report = status.cluster_status(ctx.conn(), ctx.settings.lease_ttl)
    if as_json:
        emit_json(report)
        return
    click.echo(_leader_line(report["leader"]))
    alive = sum(r["alive"] for r in report["replicas"])
    click.echo(f"replicas: {alive} alive, {len(report['replicas']) - alive} not responding")
    if report["replicas"]:
        rows = [{**r, "heartbeat_age_s": f"{r['heartbeat_age_s']:.1f}"} for r in report["replicas"]]
        emit_table(rows, ["id", "host", "pid", "roles", "version", "concurrency",
                          "heartbeat_age_s", "alive", "stopping"])
    queue = report["queue"]
    totals = ", ".join(f"{state} {n}" for state, n in queue["by_state"].items())
    click.echo(f"queue: {totals}; dead letters {queue['dead_letters']}")
    if queue["by_tenant"]:
        emit_table(queue["by_tenant"], ["state", "tenant", "runs"])


def _leader_line(leader: dict[str, Any] | None) -> str:
    if leader is None:
        return "leader: none"
    age = f"heartbeat {leader['heartbeat_age_s']:.1f}s ago"
    stale = "; STALE, a standby will take over" if leader["stale"] else ""
    return f"leader: {leader['replica_id']} (term {leader['term']}, {age}{stale})"


# ---------------------------------------------------------------- serve

ALL_ROLES = ("scheduler", "worker", "reaper", "web")


@cli.command("serve")
@click.option("--role", "roles", multiple=True, type=click.Choice(ALL_ROLES),
              help="Role to play (repeatable); default: all of them.")
@click.option("--concurrency", type=click.IntRange(1, 100_000), default=16, show_default=True,
              help="Runs this replica executes at once.")
@click.option("--bind", help="host:port of the web role [PGFLOW_BIND, 127.0.0.1:8080].")
@click.option("--app", "apps", multiple=True, metavar="MODULE:ATTR",
              help="Register the jobs of a pgflow.Flow at start (repeatable).")
@click.option("--grace", default="10s", show_default=True,
              help="How long running attempts may finish after SIGTERM.")
@click.option("--lease-ttl", help="Seconds a lease lasts without heartbeat [PGFLOW_LEASE_TTL, 30].")
@click.option("--database-url", "serve_url", help="libpq URL [PGFLOW_DATABASE_URL].")
@click.option("--home", "serve_home", help="Data folder [PGFLOW_HOME].")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
@pass_ctx
def serve_command(ctx: Ctx, roles: tuple[str, ...], concurrency: int, bind: str | None,
                  apps: tuple[str, ...], grace: str, lease_ttl: str | None,
                  serve_url: str | None, serve_home: str | None, log_level: str) -> None:
    """Run a replica: scheduler, worker, reaper and web roles."""
    from pgflow import log as logging_setup
    from pgflow.duration import parse_duration
    from pgflow.serve import ServeOptions, serve

    ctx.override(database_url=serve_url, home=serve_home, lease_ttl=lease_ttl, bind=bind)
    try:
        grace_s = parse_duration(grace)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--grace'") from None
    chosen = tuple(dict.fromkeys(roles)) or ALL_ROLES
    url = ctx.url()
    conn = ctx.conn()
    if apps:
        loaded = registry.load_sources(list(apps))
        registry.apply(conn, loaded.specs, source=", ".join(apps), invalid=loaded.errors)
    if "web" in chosen:
        from pgflow.config import split_bind
        from pgflow.web import check_bind_allowed

        check_bind_allowed(conn, split_bind(ctx.settings.bind)[0])
    conn.close()
    logging_setup.configure(log_level)
    serve(ServeOptions(url=url, roles=chosen, concurrency=concurrency, grace=grace_s,
                       lease_ttl=ctx.settings.lease_ttl, bind=ctx.settings.bind,
                       settings=ctx.settings, web_required="web" in roles))


# ---------------------------------------------------------------- backfill


BACKFILL_COLUMNS = ["id", "job", "range_start", "range_end", "max_concurrency", "state",
                    "ticks", "skipped", "progress"]


@cli.command("backfill")
@click.argument("target", metavar="NAME|list|show|cancel")
@click.argument("backfill_id", metavar="[ID]", required=False, type=int)
@click.option("--start", callback=_parse_logical_time, help="First logical time (inclusive).")
@click.option("--end", callback=_parse_logical_time, help="Last logical time (exclusive).")
@click.option("--max-concurrency", type=click.IntRange(1, 10_000), default=2, show_default=True,
              help="Runs of this backfill running at once.")
@click.option("--downstream", is_flag=True, help="Also run the job's downstream jobs.")
@json_option
@pass_ctx
def backfill_command(ctx: Ctx, target: str, backfill_id: int | None, start: datetime | None,
                     end: datetime | None, max_concurrency: int, downstream: bool,
                     as_json: bool) -> None:
    """Re-run job NAME for every tick in [--start, --end); or list, show ID, cancel ID.

    With --start/--end the first argument is always a job name (even a job named 'list').
    """
    creating = start is not None or end is not None
    if not creating and target in ("list", "show", "cancel"):
        _backfill_action(ctx, target, backfill_id, as_json)
        return
    if start is None or end is None:
        raise click.UsageError("backfill needs NAME --start ISO --end ISO"
                               " (or: backfill list | show ID | cancel ID)")
    if backfill_id is not None:
        raise click.UsageError(f"unexpected argument {backfill_id} after the job name")
    _backfill_create(ctx, target, start, end, max_concurrency, downstream, as_json)


def _backfill_create(ctx: Ctx, name: str, start: datetime, end: datetime,
                     max_concurrency: int, downstream: bool, as_json: bool) -> None:
    from pgflow import backfill

    conn = ctx.conn()
    job = _job(ctx, name)
    ticks = (backfill.plan_ticks(job["schedule"], job["timezone"], start, end)
             if job["schedule"] else [])
    with click.progressbar(length=max(len(ticks), 1), label=f"backfilling {name}",
                           file=sys.stderr, show_pos=True) as bar:
        made = backfill.create(conn, name, start, end, max_concurrency=max_concurrency,
                               downstream=downstream, progress=bar.update)
    if as_json:
        emit_json(made)
    else:
        click.echo(f"backfill {made['id']}: {made['created']} run(s) created,"
                   f" {made['skipped']} tick(s) skipped (already had a run)")


def _backfill_action(ctx: Ctx, action: str, backfill_id: int | None, as_json: bool) -> None:
    from pgflow import backfill

    if action == "list":
        rows = [_with_progress(r) for r in backfill.list_backfills(ctx.conn())]
        if as_json:
            emit_json(rows)
        else:
            emit_table(rows, BACKFILL_COLUMNS)
        return
    if backfill_id is None:
        raise click.UsageError(f"backfill {action} needs an ID (see 'pgflow backfill list')")
    if action == "cancel":
        result = backfill.cancel(ctx.conn(), backfill_id)
        click.echo(f"backfill {backfill_id} cancelled: {result['cancelled']} run(s) cancelled,"
                   f" {result['stopping']} running run(s) asked to stop")
        return
    row = _with_progress(backfill.show(ctx.conn(), backfill_id))
    if as_json:
        emit_json(row)
        return
    for key in [*BACKFILL_COLUMNS, "downstream", "created_at", "finished_at"]:
        click.echo(f"{key + ':':<16} {row[key] if row[key] is not None else '-'}")
    click.echo("runs:           " + (", ".join(
        f"{k} {v}" for k, v in sorted(row["counts"].items())) or "-"))


def _with_progress(row: dict[str, Any]) -> dict[str, Any]:
    counts = row["counts"]
    done = sum(counts.get(s, 0) for s in ("succeeded", "failed", "cancelled", "upstream_failed"))
    return {**row, "progress": f"{done}/{sum(counts.values())}"}


# ---------------------------------------------------------------- tokens


@cli.group("token")
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


# ---------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(argv))


def run(argv: Sequence[str] | None = None, *, invoke: Callable[..., Any] | None = None) -> int:
    """Run the CLI and return the exit code; every error becomes one line on stderr."""
    debug = os.environ.get("PGFLOW_DEBUG") == "1"
    try:
        (invoke or cli.main)(args=list(argv) if argv is not None else None,
                             standalone_mode=False, prog_name="pgflow")
        return 0
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.Abort:
        click.echo("error: aborted", err=True)
        return 130
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        return exc.exit_code
    except PgflowError as exc:
        click.echo(f"error: {exc}", err=True)
        return 1
    except psycopg.Error as exc:
        if debug:
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        click.echo(f"error: database error: {first}", err=True)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if debug:
            raise
        click.echo(f"error: internal error: {type(exc).__name__}: {exc}"
                   " (PGFLOW_DEBUG=1 shows the traceback)", err=True)
        return 70
