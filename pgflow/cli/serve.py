"""``pgflow serve``: run a replica with its roles; the heavy modules load only here."""

from __future__ import annotations

import click

from pgflow.cli._base import Ctx, pass_ctx

ALL_ROLES = ("scheduler", "worker", "reaper", "web")
# A replica started beside a database that is starting, recovering or failing over (a
# compose file, a node reboot, Patroni promoting a standby) waits for it this long rather
# than exiting into a restart loop; a wrong password or database fails at once.
STARTUP_WAIT_S = 60.0


@click.command("serve")
@click.option("--role", "roles", multiple=True, type=click.Choice(ALL_ROLES),
              help="Role to play (repeatable); default: all of them.")
@click.option("--concurrency",
              help="Runs this replica executes at once [PGFLOW_CONCURRENCY, 16].")
@click.option("--bind", help="host:port of the web role [PGFLOW_BIND, 127.0.0.1:8080].")
@click.option("--health-bind",
              help="host:port serving only /healthz and /readyz, for replicas without the"
                   " web role [PGFLOW_HEALTH_BIND, off].")
@click.option("--app", "apps", multiple=True, metavar="MODULE:ATTR",
              help="Register the jobs of a pgflow.Flow at start (repeatable).")
@click.option("--grace", default="10s", show_default=True,
              help="How long running attempts may finish after SIGTERM.")
@click.option("--lease-ttl", help="Seconds a lease lasts without heartbeat [PGFLOW_LEASE_TTL, 30].")
@click.option("--retention",
              help="How long finished runs are kept, e.g. 30d [PGFLOW_RETENTION, 30d].")
@click.option("--log-limit",
              help="Output kept per attempt; beyond it the middle is dropped, e.g. 16MiB"
                   " [PGFLOW_LOG_LIMIT, 16MiB].")
@click.option("--public-url",
              help="Base URL of the UI, for links in alerts [PGFLOW_PUBLIC_URL, http://BIND].")
@click.option("--database-url", "serve_url", help="libpq URL [PGFLOW_DATABASE_URL].")
@click.option("--pooler-url",
              help="libpq URL of a transaction-mode PgBouncer for claims, completions, web"
                   " and CLI queries; the leader lock and LISTEN stay direct"
                   " [PGFLOW_POOLER_URL, off].")
@click.option("--home", "serve_home", help="Data folder [PGFLOW_HOME].")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
@click.option("--log-format",
              help="json | console | auto: console on a terminal [PGFLOW_LOG_FORMAT, auto].")
@pass_ctx
def serve_command(ctx: Ctx, roles: tuple[str, ...], concurrency: str | None, bind: str | None,
                  health_bind: str | None,
                  apps: tuple[str, ...], grace: str, lease_ttl: str | None, retention: str | None,
                  log_limit: str | None, public_url: str | None, serve_url: str | None,
                  pooler_url: str | None,
                  serve_home: str | None, log_level: str, log_format: str | None) -> None:
    """Run a replica: scheduler, worker, reaper and web roles."""
    from pgflow import log as logging_setup
    from pgflow.duration import parse_duration
    from pgflow.serve import ServeOptions, serve

    ctx.override(database_url=serve_url, pooler_url=pooler_url, home=serve_home,
                 lease_ttl=lease_ttl, retention=retention, bind=bind, health_bind=health_bind,
                 public_url=public_url,
                 concurrency=concurrency, log_format=log_format, log_limit=log_limit)
    try:
        grace_s = parse_duration(grace)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--grace'") from None
    chosen = tuple(dict.fromkeys(roles)) or ALL_ROLES
    url = ctx.url()
    conn = ctx.conn(wait_s=STARTUP_WAIT_S)
    if ctx.settings.pooler_url:
        from pgflow.pooler import advice

        for line in advice(conn):
            click.echo(f"pgflow: warning: {line}", err=True)
    if apps:
        from pgflow import registry

        loaded = registry.load_sources(list(apps))
        registry.apply(conn, loaded.specs, source=", ".join(apps), invalid=loaded.errors)
    if "web" in chosen:
        from pgflow.config import split_bind
        from pgflow.web import check_bind_allowed

        check_bind_allowed(conn, split_bind(ctx.settings.bind)[0])
    conn.close()
    logging_setup.configure(log_level, ctx.settings.log_format)
    serve(ServeOptions(url=url, roles=chosen, concurrency=ctx.settings.concurrency, grace=grace_s,
                       lease_ttl=ctx.settings.lease_ttl, retention=ctx.settings.retention,
                       bind=ctx.settings.bind, health_bind=ctx.settings.health_bind,
                       settings=ctx.settings, web_required="web" in roles,
                       pooler_url=ctx.settings.pooler_url))
