"""The environment variables alerts read (``url_env``, ``secret_env``), kept from jobs.

``pgflow serve`` hands the replica's environment to ``capture`` before it scrubs it
(``pgflow.serve.hide_secrets``): the copy stays in this module, where only the
senders read it, and the variables named by the alert definitions in the database
are removed from the process environment (and its original block), so neither
Python jobs (``os.environ``) nor commands (the supervisor's scrubbed environment)
see them. ``PGFLOW_*`` variables are scrubbed anyway. A variable first named by an
alert applied later is removed when a sender first reads it; a command supervisor
already running keeps its copy of the environment, so name such variables
``PGFLOW_ALERT_...`` (kept for the senders when ``serve`` scrubs ``PGFLOW_*``) or
restart the replicas after adding them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import psycopg

from pgflow import db, environment
from pgflow.errors import DatabaseUnavailable
from pgflow.queries import q

ALERT_PREFIX = "PGFLOW_ALERT_"
# Only the alerts' own variables: never a copy of the whole environment (the database
# URL), which Python jobs, running in this process, could read here.
_PRIVATE: dict[str, str] = {}


def capture(environ: Mapping[str, str], url: str | None = None, *,
            pooled: bool = False) -> list[str]:
    """Keep a private copy of the ``PGFLOW_ALERT_*`` variables of ``environ`` (``serve``
    scrubs every ``PGFLOW_*`` next) and, with ``url``, move the variables the alert
    definitions name out of ``os.environ`` into it. Returns the names removed."""
    _PRIVATE.update({k: v for k, v in environ.items() if k.startswith(ALERT_PREFIX)})
    if url is None:
        return []
    try:
        with db.connect(url, pooled=pooled, application_name="pgflow-serve") as conn:
            names = [row["name"] for row in conn.execute(q("alert_env_names"))]
    except (psycopg.Error, DatabaseUnavailable):
        return []  # database not there yet (or not migrated): names are hidden when read
    return hide(names)


def hide(names: Iterable[str]) -> list[str]:
    """Move ``names`` from ``os.environ`` to the private copy."""
    names = [name for name in names if name]
    for name in names:
        if name in os.environ:
            _PRIVATE[name] = os.environ[name]
    return environment.hide(os.environ, names)


def lookup(name: str) -> str | None:
    """The value of an alert's variable: the replica's copy, else this process's
    environment (the CLI's ``pgflow alerts test``); it is then hidden from jobs."""
    if name in os.environ:
        hide([name])
    return _PRIVATE.get(name)
