"""What every ``pgflow`` command shares: the root group, its context, output and errors.

:class:`Ctx` resolves settings and the database connection lazily, so ``--help`` and usage
errors never touch the database; ``emit_json`` and ``emit_table`` are the two output formats;
``fetch_job`` and ``parse_logical_time`` serve more than one command group. :func:`run`
turns every failure into one ``error: ...`` line on stderr and an exit code.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from pgflow.cli._lazy import LazyGroup
from pgflow.errors import NotFound, PgflowError
from pgflow.queries import q

if TYPE_CHECKING:  # imported on first use: `pgflow --help` needs neither (cli/_lazy.py)
    import psycopg

    from pgflow import libpq
    from pgflow.config import Settings
    from pgflow.dbconfig import DatabaseSettings


class Ctx:
    """Lazily resolved settings and database connection shared by subcommands."""

    def __init__(self, database_url: str | None, home: str | None) -> None:
        self._overrides: dict[str, Any] = {"database_url": database_url, "home": home}
        self._settings: Settings | None = None
        self._database: DatabaseSettings | None = None
        self._url: str | None = None
        self._conn: psycopg.Connection[dict[str, Any]] | None = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            from pgflow.config import load_settings

            self._settings = load_settings(**self._overrides)
        return self._settings

    def override(self, **values: Any) -> None:
        """Flags of a subcommand win over the group's flags and the environment."""
        self._overrides.update({k: v for k, v in values.items() if v is not None})
        self._settings = None
        self._database = None
        self._url = None

    @property
    def database(self) -> DatabaseSettings:
        """Only where the database is: cheaper than ``settings`` (no pydantic)."""
        if self._database is None:
            from pgflow.dbconfig import load_database_settings

            self._database = load_database_settings(**self._overrides)
        return self._database

    def url(self) -> str:
        if self._url is None:
            from pgflow.dbconfig import resolve_url

            self._url = resolve_url(self.database)
        return self._url

    def conn(self, *, wait_s: float = 0.0) -> psycopg.Connection[dict[str, Any]]:
        """The command's connection (``wait_s``: for a database that is still starting)."""
        if self._conn is None:
            from pgflow import db

            self._conn = db.connect_migrated(self.url(), self.database.pooler_url,
                                             wait_s=wait_s)
        return self._conn

    def rows(self, query: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        """The rows of a read-only named query: through libpq itself when it loads and
        the schema is current (pgflow/libpq.py: importing psycopg is most of a short
        command's time), else through ``conn()``, which applies pending migrations."""
        if self._conn is None and (session := self._read_session()) is not None:
            try:
                return session.rows(q(query), params)
            finally:
                session.close()
        return self.conn().execute(q(query), params).fetchall()

    def _read_session(self) -> libpq.Session | None:
        from pgflow import libpq, migrate

        pooler = self.database.pooler_url
        url = self.url()
        session = libpq.open_session(pooler or url,
                                     session_setup=None if pooler else q("session_setup"))
        if session is None:
            return None
        try:
            applied = {row["version"] for row in session.rows(q("applied_migrations"))}
        except libpq.QueryFailed:  # no schema yet, or not readable: psycopg's path says
            applied = set()
        except BaseException:
            session.close()
            raise
        if migrate.available_versions() <= applied:
            return session
        session.close()
        return None


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


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--database-url", envvar="PGFLOW_DATABASE_URL", help="libpq URL (default: embedded).")
@click.option("--home", envvar="PGFLOW_HOME", help="Data folder (embedded cluster, secrets).")
@click.version_option(package_name="pgflow")
@click.pass_context
def cli(ctx: click.Context, database_url: str | None, home: str | None) -> None:
    """pgflow: scheduled ETL jobs coordinated by PostgreSQL only."""
    ctx.obj = Ctx(database_url, home)


def fetch_job(ctx: Ctx, name: str) -> dict[str, Any]:
    """The job's row, or NotFound pointing at 'pgflow jobs list'."""
    row = ctx.conn().execute(q("get_job"), {"name": name}).fetchone()
    if row is None:
        raise NotFound(f"no job named {name!r} (see 'pgflow jobs list')")
    return row


def parse_logical_time(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> datetime | None:
    """Click callback: an ISO 8601 option value as an aware datetime (naive means UTC)."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise click.BadParameter(
            f"expected ISO 8601 such as 2026-01-31T12:00:00Z, got {value!r}"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


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
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if debug:
            raise
        if _is_database_error(exc):
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            click.echo(f"error: database error: {first}", err=True)
            return 1
        click.echo(f"error: internal error: {type(exc).__name__}: {exc}"
                   " (PGFLOW_DEBUG=1 shows the traceback)", err=True)
        return 70


def _is_database_error(exc: Exception) -> bool:
    """A psycopg error; without importing psycopg when no command did."""
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(exc, psycopg.Error)
