"""The :class:`Cluster`: one private PostgreSQL server and the layout of its folder.

A cluster's root holds ``data/``, ``server.log``, the lock file and usually the socket dir;
:class:`_Site` is where those really are once the symlink (for roots the service user cannot
reach) and the short socket dir (for paths too long for a socket) are decided.
:class:`Cluster` initialises, starts, stops, kills and destroys the server with ``initdb``
and ``pg_ctl``, clearing the lock files a crash leaves; :func:`embedded_cluster` is the one
kept for a ``PGFLOW_HOME``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import psycopg
from psycopg import sql

from pgflow.embedded.binaries import find_bindir, locale_args, major_version
from pgflow.embedded.locks import flock
from pgflow.embedded.osuser import (
    FALLBACK_CLUSTERS,
    OsUser,
    can_search,
    make_public_dirs,
    server_uid,
    service_user,
)
from pgflow.embedded.procs import (
    child_pids,
    has_proc,
    pid_alive,
    pid_exists,
    proc_uid,
    processes_in,
    wait_for_exit,
)
from pgflow.embedded.text import last_line, log_tail, one_line
from pgflow.errors import DatabaseUnavailable, PgflowError

PORT = 5432
SOCKET_FILE = f".s.PGSQL.{PORT}"
MAX_SOCKET_PATH = 107  # sizeof(sockaddr_un.sun_path) minus the terminating NUL
SHORT_SOCKET_BASE = Path("/tmp")
STOP_MODES = frozenset({"smart", "fast", "immediate"})

PG_CTL_WAIT_SECONDS = 60
START_RETRY_SECONDS = 10.0
LOG_ROTATE_BYTES = 10 * 1024 * 1024

# Set by pgflow itself; settings may not move the socket or open TCP.
RESERVED_SETTINGS = frozenset(
    {"listen_addresses", "port", "unix_socket_directories", "unix_socket_permissions"}
)
_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_OFF = frozenset({"off", "false", "no", "0"})
# Start failures caused by leftovers of a crashed server, worth another attempt.
_TRANSIENT_START = re.compile(
    r"lock file|shared memory|already in use|another postmaster|could not bind", re.IGNORECASE
)
# A server that is there but cannot take connections yet (crash recovery, startup).
_NOT_READY = re.compile(r"starting up|in recovery|recovery mode|not yet accepting")


# --------------------------------------------------------------------------- helpers


def _socket_accepts(path: Path) -> bool:
    """Whether a server listens on the unix socket (no protocol: logs nothing)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _child_env() -> dict[str, str]:
    # PGPORT, PGDATA, PGHOST... in the caller's environment must not leak into the server.
    return {key: value for key, value in os.environ.items() if not key.startswith("PG")}


def _digest(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _guc_path(path: Path) -> str:
    """A path as one element of a comma-separated GUC list (quoted when needed)."""
    text = str(path)
    if re.fullmatch(r"[\w/.+-]+", text):
        return text
    return '"' + text.replace('"', '""') + '"'


def _check_settings(settings: Mapping[str, str]) -> None:
    for name, value in settings.items():
        if not _SETTING_NAME.match(name):
            raise PgflowError(f"invalid PostgreSQL setting name {name!r}")
        if name.lower() in RESERVED_SETTINGS:
            raise PgflowError(f"PostgreSQL setting {name!r} is managed by pgflow")
        # Tests kill clusters and rely on committed rows surviving.
        if name.lower() == "synchronous_commit" and str(value).lower() in _OFF:
            raise PgflowError("synchronous_commit=off would lose committed runs on a crash")


# --------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class _Site:
    """Where a cluster's files really are, after the symlink and socket-length decisions."""

    root: Path
    socket_dir: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    @property
    def lock(self) -> Path:
        return self.root / "pgflow.lock"

    @property
    def socket_record(self) -> Path:
        return self.root / "socket_dir"

    @property
    def pidfile(self) -> Path:
        return self.data / "postmaster.pid"


class Cluster:
    """One private PostgreSQL server whose files all live under `root`."""

    def __init__(
        self,
        root: Path,
        *,
        database: str = "pgflow",
        settings: Mapping[str, str] | None = None,
        user: str = "pgflow",
    ) -> None:
        self.root = Path(root).expanduser().absolute()
        self.database = database
        self.user = user
        self.settings = {name: str(value) for name, value in (settings or {}).items()}
        _check_settings(self.settings)
        self._bindir: Path | None = None

    def __repr__(self) -> str:
        return f"Cluster({str(self.root)!r})"

    # ----------------------------------------------------------------- public API

    @property
    def bindir(self) -> Path:
        if self._bindir is None:
            self._bindir = find_bindir()
        return self._bindir

    @property
    def url(self) -> str:
        """libpq URL over the unix socket."""
        return self._url(self._site(), self.database)

    @property
    def data_dir(self) -> Path:
        return self._site().data

    @property
    def log_file(self) -> Path:
        return self._site().log

    @property
    def socket_dir(self) -> Path:
        return self._site().socket_dir

    def ensure_running(self) -> str:
        """Initialise, start and create the database as needed; return the URL."""
        site, user = self._prepare()
        with flock(site.lock, "starting or stopping this database"):
            if not self._initialised(site):
                self._initdb(site, user)
            self._start_unless_serving(site, user)
            self._create_database(site)
        return self._url(site, self.database)

    def start(self) -> None:
        """Start the initialised server unless it is running (stale lock files tolerated)."""
        site, user = self._prepare()
        with flock(site.lock, "starting or stopping this database"):
            if not self._initialised(site):
                raise DatabaseUnavailable(
                    f"no PostgreSQL cluster in {site.data}: use ensure_running() to create it"
                )
            self._start_unless_serving(site, user)

    def stop(self, mode: str = "fast") -> bool:
        """Shut the server down (pg_ctl stop -m `mode`); False if it was not running."""
        if mode not in STOP_MODES:
            raise ValueError(f"stop mode must be one of {sorted(STOP_MODES)}, not {mode!r}")
        site = self._site()
        if not site.data.is_dir():
            return False
        with flock(site.lock, "starting or stopping this database"):
            pid = self._running_pid(site)
            if pid is None:
                return False
            args = ["stop", "-D", site.data.name, "-m", mode, "-w", "-t", str(PG_CTL_WAIT_SECONDS)]
            result = self._pg_ctl(args, site, service_user(create=True))
            if self._running_pid(site) is not None:
                raise DatabaseUnavailable(
                    f"PostgreSQL in {site.data} did not stop: {last_line(result.stderr)}"
                )
            wait_for_exit([pid])
            return True

    def kill(self) -> None:
        """SIGKILL the postmaster and every process of this cluster, like a crash would."""
        site = self._site()
        victims = processes_in(site.data) or set()
        pid = self._running_pid(site)
        if pid is not None:
            victims |= child_pids(pid) | {pid}
            # The postmaster first, so that it cannot react to its children dying.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for victim in victims - {pid}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGKILL)
        wait_for_exit(victims)

    def is_running(self) -> bool:
        return self._running_pid(self._site()) is not None

    def postmaster_pid(self) -> int | None:
        """The pid of the running server, or None."""
        return self._running_pid(self._site())

    def destroy(self) -> None:
        """Stop the server (killing it if it will not stop) and delete every file."""
        site = self._site()
        if site.data.is_dir():
            with contextlib.suppress(DatabaseUnavailable):
                self.stop("fast")
            self.kill()
        if site.socket_dir.parent != site.root:
            shutil.rmtree(site.socket_dir, ignore_errors=True)
        shutil.rmtree(site.root, ignore_errors=True)
        if self.root.is_symlink():
            self.root.unlink()

    # ----------------------------------------------------------------- layout

    def _real_root(self, user: OsUser | None) -> Path:
        if os.path.lexists(self.root):
            return self.root.resolve()
        target = self.root.parent.resolve() / self.root.name
        if user is None or can_search(target.parent, user):
            return target
        return FALLBACK_CLUSTERS / _digest(str(target), 16)

    def _site(self) -> _Site:
        """The layout, computed without creating anything."""
        real = self._real_root(service_user(create=False))
        return _Site(real, _socket_dir_for(real))

    def _prepare(self) -> tuple[_Site, OsUser | None]:
        """Create the folders with the right owners; decide symlink and socket dir."""
        _ = self.bindir  # raise PostgresNotFound before creating anything
        user = service_user(create=True)
        self.root.parent.mkdir(parents=True, exist_ok=True)
        real = self._real_root(user)
        if real.parent == FALLBACK_CLUSTERS:
            make_public_dirs(FALLBACK_CLUSTERS)
        real.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not os.path.lexists(self.root):
            _symlink(real, self.root)
        if user is not None:
            self._check_reachable(real, user)
            _adopt(real, user)
        else:
            real.chmod(0o700)
        site = _Site(real, _socket_dir_for(real))
        _prepare_socket_dir(site, user)
        return site, user

    def _check_reachable(self, real: Path, user: OsUser) -> None:
        if not can_search(real.parent, user):
            raise DatabaseUnavailable(
                f"PostgreSQL OS user {user.name!r} cannot reach {real} (a parent directory "
                f"is not searchable): remove {self.root} so pgflow can relocate it"
            )
        if not can_search(self.bindir.resolve(), user):
            raise DatabaseUnavailable(
                f"PostgreSQL binaries in {self.bindir} are not reachable by OS user "
                f"{user.name!r}: set PGFLOW_PG_BINDIR to a system-wide installation"
            )

    # ----------------------------------------------------------------- server

    def _url(self, site: _Site, database: str) -> str:
        host = quote(str(site.socket_dir), safe="/")
        user, database = quote(self.user, safe=""), quote(database, safe="")
        # An explicit port, or a PGPORT in the caller's environment would pick another socket.
        return f"postgresql://{user}@/{database}?host={host}&port={PORT}"

    def _initialised(self, site: _Site) -> bool:
        return (site.data / "PG_VERSION").is_file()

    def _initdb(self, site: _Site, user: OsUser | None) -> None:
        # initdb into a side folder so an interrupted run never leaves a half-made data/.
        scratch = site.root / "data.initdb"
        shutil.rmtree(scratch, ignore_errors=True)
        args = [
            str(self.bindir / "initdb"),
            "-D",
            scratch.name,
            "--auth=trust",
            "-U",
            self.user,
            "-E",
            "UTF8",
            *locale_args(),
        ]
        if self.settings.get("fsync", "on").lower() in _OFF:
            args.append("--no-sync")
        result = self._run(args, site, user, timeout=300)
        if result.returncode != 0:
            shutil.rmtree(scratch, ignore_errors=True)
            raise DatabaseUnavailable(f"initdb failed for {site.data}: {last_line(result.stderr)}")
        scratch.rename(site.data)

    def _start_unless_serving(self, site: _Site, user: OsUser | None) -> None:
        """Reuse a server whose socket accepts connections; otherwise start one.

        A live pid is not enough: a postmaster that was just SIGKILLed lingers for a moment,
        and one that is starting up has not opened its socket yet.
        """
        deadline = time.monotonic() + PG_CTL_WAIT_SECONDS
        while (pid := self._running_pid(site)) is not None:
            if _socket_accepts(site.socket_dir / SOCKET_FILE):
                return
            if time.monotonic() > deadline:
                raise DatabaseUnavailable(
                    f"PostgreSQL (pid {pid}) in {site.data} is running but does not accept "
                    f"connections on {site.socket_dir}; see {site.log}"
                )
            time.sleep(0.05)
        self._start(site, user)

    def _start(self, site: _Site, user: OsUser | None) -> None:
        self._check_version(site)
        _rotate_log(site.log)
        args = [
            "start",
            "-D",
            site.data.name,
            "-l",
            site.log.name,
            "-o",
            self._server_options(site),
            "-w",
            "-t",
            str(PG_CTL_WAIT_SECONDS),
        ]
        # Let a dying postmaster and its orphaned backends go first (they exit on their own).
        wait_for_exit(processes_in(site.data) or set(), timeout=START_RETRY_SECONDS)
        deadline = time.monotonic() + START_RETRY_SECONDS
        while True:
            self._clear_stale_locks(site)
            log_offset = site.log.stat().st_size if site.log.exists() else 0
            result = self._pg_ctl(args, site, user)
            if result.returncode == 0 and self._running_pid(site) is not None:
                return
            problem = log_tail(site.log, log_offset) or one_line(result.stderr)
            if time.monotonic() > deadline or not _TRANSIENT_START.search(problem):
                raise DatabaseUnavailable(
                    f"PostgreSQL in {site.data} failed to start ({site.log}): {problem}"
                )
            time.sleep(0.2)

    def _server_options(self, site: _Site) -> str:
        options = {
            "listen_addresses": "",
            "port": str(PORT),
            "unix_socket_directories": _guc_path(site.socket_dir),
            "unix_socket_permissions": "0700",
            "max_connections": "300",
            **self.settings,
        }
        # pg_ctl pastes -o into a /bin/sh command line, hence the shell quoting.
        return " ".join(f"-c {shlex.quote(f'{name}={value}')}" for name, value in options.items())

    def _check_version(self, site: _Site) -> None:
        made_by = (site.data / "PG_VERSION").read_text().strip()
        running = major_version(self.bindir)
        if running is not None and made_by != str(running):
            raise DatabaseUnavailable(
                f"the cluster in {site.data} was created by PostgreSQL {made_by} but the "
                f"binaries in {self.bindir} are version {running}: set PGFLOW_PG_BINDIR to "
                f"a PostgreSQL {made_by} installation"
            )

    def _running_pid(self, site: _Site) -> int | None:
        pid = _pidfile_pid(site.pidfile)
        return pid if pid is not None and self._is_postmaster(pid, site) else None

    def _is_postmaster(self, pid: int, site: _Site) -> bool:
        """Whether `pid` is alive and is this cluster's postmaster (not a recycled pid)."""
        if not pid_alive(pid):
            return False
        if not has_proc():
            return True  # no /proc: nothing more to check
        try:
            # The postmaster's working directory is its data directory.
            return os.readlink(f"/proc/{pid}/cwd") == str(site.data)
        except PermissionError:
            # Root without CAP_SYS_PTRACE cannot read it; the owner is still visible.
            return proc_uid(pid) == server_uid()
        except OSError:
            return False

    def _clear_stale_locks(self, site: _Site) -> None:
        """Remove lock files naming a zombie or a recycled pid, once nothing runs in data/.

        PostgreSQL only treats a lock file as stale when its pid is gone, so a crashed
        postmaster that nobody has reaped yet would block the start. While any process
        still works in data/ (a dying postmaster, orphaned backends) the lock files stay:
        they are PostgreSQL's guard against two servers on one data directory.
        """
        if processes_in(site.data) != set():
            return
        for lock in (site.pidfile, site.socket_dir / f"{SOCKET_FILE}.lock"):
            pid = _pidfile_pid(lock)
            if pid is not None and pid_exists(pid):
                lock.unlink(missing_ok=True)

    def _create_database(self, site: _Site) -> None:
        deadline = time.monotonic() + PG_CTL_WAIT_SECONDS
        while True:
            try:
                self._create_database_once(site)
                return
            except psycopg.Error as exc:
                problem = one_line(str(exc))
                # The server's own messages are in English: initdb gave it the C locale.
                if time.monotonic() > deadline or not _NOT_READY.search(problem):
                    raise DatabaseUnavailable(
                        f"cannot use the embedded PostgreSQL at {site.socket_dir}: {problem}"
                    ) from exc
            time.sleep(0.1)

    def _create_database_once(self, site: _Site) -> None:
        url = self._url(site, "postgres")
        with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
            found = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)
            ).fetchone()
            if found is None:
                with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                    conn.execute(
                        sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database))
                    )

    # ----------------------------------------------------------------- subprocesses

    def _pg_ctl(
        self, args: list[str], site: _Site, user: OsUser | None
    ) -> subprocess.CompletedProcess[str]:
        # Paths are given relative to the root (the cwd): pg_ctl pastes them into a /bin/sh
        # command line inside double quotes, which a '"' or '$' in the path would break.
        return self._run([str(self.bindir / "pg_ctl"), *args], site, user, timeout=120)

    def _run(
        self, args: list[str], site: _Site, user: OsUser | None, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Run a server binary, as the service user when we are root."""
        try:
            return subprocess.run(
                args,
                capture_output=True,
                text=True,
                check=False,
                stdin=subprocess.DEVNULL,
                env=_child_env(),
                cwd=site.root,  # also: the service user may not be able to enter our cwd
                timeout=timeout,
                user=user.uid if user else None,
                group=user.gid if user else None,
                extra_groups=list(user.groups) if user else None,
            )
        except subprocess.TimeoutExpired as exc:
            raise DatabaseUnavailable(
                f"{Path(args[0]).name} timed out after {timeout:.0f}s; see {site.log}"
            ) from exc
        except OSError as exc:
            raise DatabaseUnavailable(f"cannot run {args[0]}: {exc}") from exc


def embedded_cluster(home: Path) -> Cluster:
    """The cluster kept for a PGFLOW_HOME."""
    return Cluster(Path(home) / "pg")


# --------------------------------------------------------------------------- file helpers


def _pidfile_pid(path: Path) -> int | None:
    try:
        first = path.read_text().split("\n", 1)[0].strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    # A negative pid marks a single-user backend; treat it like any other holder.
    return abs(int(first)) if re.fullmatch(r"-?\d+", first) and int(first) != 0 else None


def _socket_dir_for(real_root: Path) -> Path:
    record = real_root / "socket_dir"
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        recorded = record.read_text().strip()
        if recorded:
            return Path(recorded)
    local = real_root / "sock"
    # libpq splits host on commas, with no way to escape one.
    if len(os.fsencode(local / SOCKET_FILE)) <= MAX_SOCKET_PATH and "," not in str(local):
        return local
    return SHORT_SOCKET_BASE / f"pgflow-{_digest(str(real_root), 12)}"


def _prepare_socket_dir(site: _Site, user: OsUser | None) -> None:
    if site.socket_dir.parent != site.root and not site.socket_record.exists():
        site.socket_record.write_text(f"{site.socket_dir}\n")
    site.socket_dir.mkdir(mode=0o700, exist_ok=True)
    info = site.socket_dir.lstat()
    owners = {os.geteuid(), user.uid if user else os.geteuid()}
    # A shared /tmp lets anyone pre-create the short dir; refuse one we do not own.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid not in owners:
        raise DatabaseUnavailable(
            f"socket directory {site.socket_dir} is not a directory owned by the PostgreSQL "
            "OS user: remove it"
        )
    if user is not None:
        os.chown(site.socket_dir, user.uid, user.gid)
    site.socket_dir.chmod(0o700)


def _symlink(target: Path, link: Path) -> None:
    try:
        link.symlink_to(target, target_is_directory=True)
    except FileExistsError:
        if link.resolve() != target:  # a concurrent pgflow made the same link: fine
            raise DatabaseUnavailable(f"{link} exists and does not lead to {target}") from None


def _adopt(real: Path, user: OsUser) -> None:
    """Give the cluster folder to the service user (the whole tree on first contact)."""
    info = real.lstat()
    if (info.st_uid, info.st_gid) != (user.uid, user.gid):
        for directory, dirnames, filenames in os.walk(real):
            for name in [*dirnames, *filenames]:
                os.chown(Path(directory) / name, user.uid, user.gid, follow_symlinks=False)
        os.chown(real, user.uid, user.gid)
    real.chmod(0o700)


def _rotate_log(log: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if log.stat().st_size > LOG_ROTATE_BYTES:
            log.replace(log.with_name(log.name + ".1"))
