"""The OS user that runs the server binaries when pgflow runs as root, and what it can reach.

PostgreSQL refuses to run as root, so as root the binaries run as ``$PGFLOW_PG_OS_USER``
(default ``pgflow``), created with ``useradd`` on first use. That user must be able to search
every parent of a cluster's folder: :func:`can_search` checks it, and roots it cannot reach
are moved under :data:`FALLBACK_CLUSTERS`, a system-wide folder made searchable for it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pgflow.embedded.locks import flock
from pgflow.embedded.text import last_line
from pgflow.errors import DatabaseUnavailable

DEFAULT_OS_USER = "pgflow"
FALLBACK_CLUSTERS = Path("/var/lib/pgflow/clusters")


@dataclass(frozen=True)
class OsUser:
    """The unprivileged account that server binaries run as when pgflow runs as root."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]

    @classmethod
    def lookup(cls, name: str) -> OsUser | None:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            return None
        groups = tuple(os.getgrouplist(name, entry.pw_gid))
        return cls(name, entry.pw_uid, entry.pw_gid, groups)

    @classmethod
    def placeholder(cls, name: str) -> OsUser:
        """Stands in for a not-yet-created user when predicting paths."""
        return cls(name, -1, -1, ())


def _os_user_name() -> str:
    return os.environ.get("PGFLOW_PG_OS_USER") or DEFAULT_OS_USER


def service_user(create: bool) -> OsUser | None:
    """None when not root; otherwise the server's OS user (created if `create`)."""
    if os.geteuid() != 0:
        return None
    name = _os_user_name()
    user = OsUser.lookup(name)
    if user is None and create:
        _create_os_user(name)
        user = OsUser.lookup(name)
    if user is None:
        if create:
            raise DatabaseUnavailable(f"OS user {name!r} for PostgreSQL could not be created")
        return OsUser.placeholder(name)
    if user.uid == 0:
        raise DatabaseUnavailable(
            f"PGFLOW_PG_OS_USER={name} has uid 0, but PostgreSQL refuses to run as root: "
            "name an unprivileged user"
        )
    return user


def _create_os_user(name: str) -> None:
    # Concurrent useradd runs were measured to lose each other's passwd entries: serialise.
    make_public_dirs(FALLBACK_CLUSTERS.parent)
    with flock(FALLBACK_CLUSTERS.parent / "os-user.lock", f"creating OS user {name!r}"):
        if OsUser.lookup(name) is not None:
            return
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        args = [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name]
        try:
            result = subprocess.run(args, capture_output=True, text=True, check=False)
        except OSError as exc:
            result = subprocess.CompletedProcess(args, 1, "", str(exc))
    if result.returncode != 0:
        raise DatabaseUnavailable(
            f"cannot create OS user {name!r} to run PostgreSQL ({last_line(result.stderr)}): "
            "create it or set PGFLOW_PG_OS_USER to an existing unprivileged user"
        )


def can_search(path: Path, user: OsUser) -> bool:
    """Whether `user` may traverse every existing directory from / down to `path`."""
    for directory in [*reversed(path.parents), path]:
        try:
            info = directory.stat()
        except FileNotFoundError:
            break
        if user.uid == info.st_uid:
            bit = stat.S_IXUSR
        elif info.st_gid in user.groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not info.st_mode & bit:
            return False
    return True


def make_public_dirs(path: Path) -> None:
    missing = [p for p in [*reversed(path.parents), path] if not p.exists()]
    for directory in missing:
        with contextlib.suppress(FileExistsError):
            directory.mkdir()
            directory.chmod(0o755)


def server_uid() -> int:
    user = service_user(create=False)
    return user.uid if user is not None else os.geteuid()
