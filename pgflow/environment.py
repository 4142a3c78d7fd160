"""What jobs see of the replica's environment: nothing of pgflow's or libpq's.

Command jobs get the replica's environment minus every variable whose name starts
with ``PG`` — pgflow's own configuration (``PGFLOW_DATABASE_URL`` and
``PGFLOW_POOLER_URL`` with their passwords,
``PGFLOW_SECRET_KEY`` that signs admin sessions, ``PGFLOW_HOME``, … every
``PGFLOW_*``) and libpq's (``PGPASSWORD``, ``PGHOST``, ``PGSERVICE``, ``PGPASSFILE``,
…) — plus the run's own ``PGFLOW_RUN_ID``, ``PGFLOW_JOB``, ``PGFLOW_LOGICAL_TIME``,
``PGFLOW_ATTEMPT`` and ``PGFLOW_PARAMS``. One prefix rather than a list: a libpq
release with a new variable is covered, and the embedded cluster already starts
its server with the same rule. The price: a job that wants libpq defaults for its
own database sets them itself (``env PGHOST=… psql``, a wrapper, its params); it
never gets pgflow's by accident.

Python jobs run inside the replica and read ``os.environ``, so ``pgflow serve``
removes from its own environment, once its settings are loaded, every ``PGFLOW_*``
variable and every libpq variable that names a connection keyword
(``pq.Conninfo.get_defaults``). libpq reads those again at each (re)connect, so
their values are first written into the connection strings (``pin_libpq``). The few
libpq variables without a keyword (``PGSERVICEFILE``, ``PGSYSCONFDIR``,
``PGLOCALEDIR`` with libpq 18) stay: libpq still needs them to find a service file,
and they are paths, not credentials. The removed values are also overwritten in the
process's original environment block, which ``/proc/<pid>/environ`` keeps showing
after ``unsetenv``.

Limits: jobs run as the replica's OS user, so they can read what it can —
``~/.pgpass``, ``$PGFLOW_HOME/secret``, the replica's command line if the URL was
given with ``--database-url``. Keeping a hostile job from pgflow's secrets takes a
different OS user (or container) for jobs; this removes the accidental leaks (an
environment dump in a log, a ``psql`` in a job that silently connects to pgflow's
database with pgflow's password).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, MutableMapping
from urllib.parse import quote

from psycopg import conninfo, pq

PRIVATE_PREFIX = "PG"
PGFLOW_PREFIX = "PGFLOW_"


def job_base(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment every command starts from (the run's variables come on top)."""
    return {k: v for k, v in environ.items() if not k.startswith(PRIVATE_PREFIX)}


def libpq_variables() -> dict[str, str]:
    """libpq's environment variables that have a connection keyword: name -> keyword."""
    return {option.envvar.decode(): option.keyword.decode()
            for option in pq.Conninfo.get_defaults() if option.envvar}


def pin_libpq(url: str, environ: Mapping[str, str]) -> str:
    """``url`` with the libpq variables set in ``environ`` written into it (those the
    URL does not set itself, which win as they do in libpq), so that connections
    made after the variables are gone still mean the same."""
    given = conninfo.conninfo_to_dict(url)
    extra = {keyword: environ[name] for name, keyword in libpq_variables().items()
             if name in environ and keyword not in given}
    if not extra:
        return url
    if not url.startswith(("postgresql://", "postgres://")):
        return conninfo.make_conninfo(url, **extra)
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in sorted(extra.items()))
    return f"{url}{'&' if '?' in url else '?'}{query}"


def replica_private(environ: Mapping[str, str]) -> list[str]:
    """The names ``scrub`` removes from the replica's own environment."""
    libpq = libpq_variables()
    return sorted(k for k in environ if k.startswith(PGFLOW_PREFIX) or k in libpq)


def scrub(environ: MutableMapping[str, str]) -> list[str]:
    """Remove ``replica_private`` names from ``environ`` (``os.environ``: also from the
    process environment and its original block). Returns the names removed."""
    names = replica_private(environ)
    if environ is os.environ:
        _wipe_original(set(names))
    for name in names:
        del environ[name]
    return names


def _wipe_original(names: set[str]) -> None:
    """Overwrite the values of ``names`` in the C environment in place: unsetenv only
    unlinks an entry, and the string set at exec stays in /proc/<pid>/environ."""
    libc = ctypes.CDLL(None)
    entries = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
    i = 0
    while entries[i]:
        address = entries[i]
        entry = ctypes.string_at(address)
        name, sep, value = entry.partition(b"=")
        if sep and name.decode(errors="replace") in names:
            ctypes.memset(address + len(name) + 1, 0, len(value))
        i += 1


def hide(environ: MutableMapping[str, str], names: list[str]) -> list[str]:
    """Remove ``names`` (alert secrets named by ``[alerts]``: ``pgflow.alerts.secrets``) as
    ``scrub`` removes pgflow's own variables. Returns the names that were present."""
    present = sorted(name for name in names if name in environ)
    if environ is os.environ:
        _wipe_original(set(present))
    for name in present:
        del environ[name]
    return present
