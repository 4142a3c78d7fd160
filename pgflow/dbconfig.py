"""Where the database is: the three settings a command needs to connect.

``pgflow jobs list`` and the other short commands only connect; loading the full
``Settings`` (pydantic, ``pgflow/config.py``) would cost more than the command itself.
These three are read here the same way (flags over ``PGFLOW_*`` over defaults) with the
same checks and messages; ``config.Settings`` uses the same check and default.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pgflow.errors import ConfigError, DatabaseUnavailable

if TYPE_CHECKING:  # pydantic is not imported by commands that only connect
    from pgflow.config import Settings


def default_home() -> Path:
    return Path.home() / ".local" / "share" / "pgflow"


def check_url(value: str | None) -> str | None:
    """A libpq URL, None for blank; ValueError for anything that is not postgresql://."""
    if value is not None and not value.strip():
        return None
    if value is not None and not value.startswith(("postgresql://", "postgres://")):
        raise ValueError("expected a URL starting with postgresql://")
    return value


@dataclass(frozen=True)
class DatabaseSettings:
    database_url: str | None
    pooler_url: str | None
    home: Path


def load_database_settings(environ: Mapping[str, str] | None = None,
                           **overrides: Any) -> DatabaseSettings:
    """``database_url``, ``pooler_url`` and ``home`` like ``config.load_settings`` reads
    them; raises ConfigError naming the setting and the bad value."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name in ("database_url", "pooler_url", "home"):
        override = overrides.get(name)
        flag = override is not None
        raw = override if flag else env.get(f"PGFLOW_{name.upper()}")
        if name == "home":
            values[name] = Path(raw).expanduser() if raw is not None else default_home()
            continue
        try:
            values[name] = check_url(raw)
        except ValueError as exc:
            source = "flag --" + name.replace("_", "-") if flag else "PGFLOW_" + name.upper()
            raise ConfigError(f"invalid setting {source}={raw!r}: {exc}") from None
    return DatabaseSettings(**values)


def resolve_url(settings: Settings | DatabaseSettings, *, announce: bool = True) -> str:
    """``database_url``, or the URL of the embedded cluster of ``home`` (started on
    demand) when it is unset."""
    if settings.database_url:
        return settings.database_url
    from pgflow.embedded import embedded_cluster

    url = embedded_cluster(settings.home).ensure_running()
    if announce:
        print(f"pgflow: using embedded PostgreSQL {url}", file=sys.stderr)
    return url


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    url = re.sub(r"([?&\s]password=)[^&\s]*", r"\1***", url)  # as libpq variables pinned it
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


# What libpq reports while a server starts, replays its WAL after a crash, shuts down for
# a restart (SQLSTATE 57P03) or does not listen yet: a replica started beside a database
# that is (re)starting waits for it (``db.connect_migrated``).
_STARTING = ("Connection refused", "No such file or directory", "is starting up",
             "not yet accepting connections", "is in recovery mode", "is shutting down")


def unreachable(url: str, message: str) -> DatabaseUnavailable:
    """The one-line error of a refused connection: the URL without its password and the
    last line of libpq's message (the reason; the lines before say which address)."""
    reason = (message.strip().splitlines() or ["connection refused"])[-1]
    error = DatabaseUnavailable(f"cannot connect to {redact(url)}: {reason}")
    error.starting = any(text in message for text in _STARTING)
    return error
