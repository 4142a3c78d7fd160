"""A real PgBouncer (Debian's ``pgbouncer``) in front of the suite's PostgreSQL.

``PgBouncer.start`` writes a pgbouncer.ini for one database in transaction mode, starts
the binary in the foreground on a free loopback port (as the embedded cluster's OS user
when the tests run as root: PgBouncer refuses to run as root, and that user can reach the
cluster's 0700 socket folder) and waits until its admin console answers. ``pools``,
``servers`` and ``clients`` read the admin console (``SHOW POOLS`` ...).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from engine import free_port
from psycopg import conninfo
from psycopg.rows import dict_row

from pgflow.embedded.osuser import service_user

BINARY = "pgbouncer"
# Server settings pgflow gives its direct sessions, given to pooled ones by PgBouncer.
CONNECT_QUERY = "SET jit = off; SET client_connection_check_interval = 1000"


def binary() -> str:
    """The pgbouncer executable, or skip the test saying how to get it."""
    found = shutil.which(BINARY) or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None)
    if found is None:
        pytest.skip("pgbouncer is not installed (make system-deps installs Debian's pgbouncer)")
    return found


@dataclass
class PgBouncer:
    """One running PgBouncer; ``url(database)`` is what clients use."""

    proc: subprocess.Popen[bytes]
    port: int
    user: str
    password: str | None
    folder: Path

    @classmethod
    def start(cls, server_url: str, database: str, folder: Path | None = None, *,
              pool_size: int = 10,
              max_clients: int = 1000, connect_query: str | None = CONNECT_QUERY,
              idle_transaction_timeout: int = 30) -> PgBouncer:
        """Serve ``database`` of the server at ``server_url`` on a free port."""
        exe = binary()
        server = conninfo.conninfo_to_dict(server_url)
        user = str(server.get("user") or os.environ.get("USER") or "postgres")
        password = server.get("password")
        port = free_port()
        # Not under pytest's tmp_path: its 0700 parents keep an unprivileged user out.
        folder = folder or Path(tempfile.mkdtemp(prefix="pgflow-pgbouncer-"))
        entry = [f"host={server.get('host') or '127.0.0.1'}",
                 f"port={server.get('port') or 5432}", f"dbname={database}", f"user={user}"]
        if password:
            entry.append(f"password={password}")
        if connect_query:
            entry.append(f"connect_query='{connect_query}'")
        users = folder / "userlist.txt"
        users.write_text(f'"{user}" ""\n')
        ini = folder / "pgbouncer.ini"
        ini.write_text("\n".join([
            "[databases]", f"{database} = {' '.join(entry)}", "",
            "[pgbouncer]", "listen_addr = 127.0.0.1", f"listen_port = {port}",
            "unix_socket_dir =", "auth_type = trust", f"auth_file = {users}",
            f"admin_users = {user}", "pool_mode = transaction",
            f"default_pool_size = {pool_size}", "min_pool_size = 0", "reserve_pool_size = 0",
            f"max_client_conn = {max_clients}",
            f"idle_transaction_timeout = {idle_transaction_timeout}",
            "log_connections = 0", "log_disconnections = 0",
            f"logfile = {folder / 'pgbouncer.log'}", "",
        ]))
        run_as = service_user(create=True)  # None unless root
        if run_as is not None:
            for path in (folder, users, ini):
                os.chown(path, run_as.uid, run_as.gid)
        proc = subprocess.Popen(
            [exe, str(ini)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True,
            user=run_as.uid if run_as else None, group=run_as.gid if run_as else None,
            extra_groups=[] if run_as else None)
        bouncer = cls(proc, port, user, password, folder)
        bouncer._wait_ready()
        return bouncer

    def url(self, database: str, **extra: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in extra.items())
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}" + (
            f"?{query}" if query else "")

    def _wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                pytest.skip(f"pgbouncer could not start: {err.strip() or self.log()[-500:]}")
            try:
                with self.admin() as conn:
                    conn.execute("SHOW VERSION")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def admin(self) -> psycopg.Connection[dict[str, Any]]:
        """A connection to the admin console (database ``pgbouncer``)."""
        return psycopg.connect(self.url("pgbouncer"), autocommit=True, row_factory=dict_row,
                               connect_timeout=5)

    def show(self, what: str, database: str) -> list[dict[str, Any]]:
        with self.admin() as conn:
            return [row for row in conn.execute(f"SHOW {what}").fetchall()
                    if row["database"] == database]

    def log(self) -> str:
        path = self.folder / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)


def server_connections(pool: dict[str, Any]) -> int:
    """Server connections a ``SHOW POOLS`` row counts, in every state."""
    return sum(int(pool[k]) for k in ("sv_active", "sv_idle", "sv_used", "sv_tested",
                                      "sv_login"))
