"""Schema migrations: numbered ``sql/migrations/NNNN_name.sql`` files.

``migrate`` takes a transaction-scoped advisory lock before it even creates the
schema, so any number of replicas may run it at once: one applies, the others
wait, then find nothing pending. All pending files apply in that one
transaction: a failure leaves the schema as it was.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pgflow.libpq checks for pending migrations without psycopg
    import psycopg

# pg_advisory_xact_lock key: 'pgflow' + 'mig' in ASCII, chosen to avoid clashes with user locks.
MIGRATION_LOCK = 0x7067666C6F776D69

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

_BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS pgflow;
CREATE TABLE IF NOT EXISTS pgflow.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MigrationStatus:
    version: int
    name: str
    applied_at: str | None
    modified: bool  # applied, but the shipped file differs from what was applied


def _folder() -> Any:
    return resources.files("pgflow.sql").joinpath("migrations")


def available_versions() -> set[int]:
    """The shipped migrations' numbers, without reading the files."""
    return {int(m.group(1)) for entry in _folder().iterdir() if (m := _FILE.match(entry.name))}


def available() -> list[Migration]:
    found = []
    for entry in _folder().iterdir():
        match = _FILE.match(entry.name)
        if match:
            sql = entry.read_text(encoding="utf-8")
            found.append(Migration(int(match.group(1)), match.group(2), sql))
    found.sort(key=lambda m: m.version)
    return found


def _applied(conn: psycopg.Connection[Any]) -> dict[int, tuple[str, str]]:
    from psycopg.rows import tuple_row

    cur = conn.cursor(row_factory=tuple_row)
    exists = cur.execute("SELECT to_regclass('pgflow.schema_migrations')").fetchone()
    if not exists or exists[0] is None:
        return {}
    rows = cur.execute(
        "SELECT version, checksum, applied_at::text FROM pgflow.schema_migrations"
    ).fetchall()
    return {version: (checksum, applied_at) for version, checksum, applied_at in rows}


def pending(conn: psycopg.Connection[Any]) -> list[Migration]:
    applied = _applied(conn)
    return [m for m in available() if m.version not in applied]


def status(conn: psycopg.Connection[Any]) -> list[MigrationStatus]:
    applied = _applied(conn)
    result = []
    for m in available():
        checksum, applied_at = applied.get(m.version, (None, None))
        result.append(
            MigrationStatus(m.version, m.name, applied_at, checksum not in (None, m.checksum))
        )
    return result


def migrate(conn: psycopg.Connection[Any]) -> list[Migration]:
    """Apply every pending migration; return those this call applied."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        conn.execute(_BOOTSTRAP)
        todo = pending(conn)
        for m in todo:
            conn.execute(m.sql.encode())
            conn.execute(
                "INSERT INTO pgflow.schema_migrations (version, name, checksum)"
                " VALUES (%s, %s, %s)",
                (m.version, m.name, m.checksum),
            )
    return todo
