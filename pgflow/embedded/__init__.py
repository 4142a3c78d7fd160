"""Private PostgreSQL clusters: the embedded database and the tests' throwaway servers.

A :class:`Cluster` owns one folder, its *root*: ``data/`` (PGDATA), ``server.log``, a lock
file and usually the socket dir. The decisions that are not obvious:

* **Running as root.** PostgreSQL refuses to run as root, so when pgflow runs as root the
  server binaries run as an unprivileged OS user (``$PGFLOW_PG_OS_USER``, default
  ``pgflow``, created on first use) that owns the root folder. Only the child process
  switches user (gid, supplementary groups, uid); pgflow itself stays root and connects
  anyway, because root passes the socket dir's 0700 mode.
* **Unreachable roots.** That user must be able to search every parent of the root. The
  default home lives under ``/root`` (0700), which we do not loosen: instead the real folder
  goes to ``/var/lib/pgflow/clusters/<hash of the resolved root path>`` and the root
  becomes a symlink to it.
* **Sockets, no TCP.** The server listens only on a unix socket inside a 0700 directory
  owned by the server user; that is what makes trust authentication acceptable. A socket
  path must fit in 107 bytes, so when ``<root>/sock`` is too deep (or holds a comma, which
  a libpq host cannot) the socket dir is ``/tmp/pgflow-<hash>`` instead, recorded in
  ``<root>/socket_dir``. The port is always 5432, also in the URL (a stray PGPORT must not
  win): every cluster has a private socket dir, so any number can run at once.
* **Lifetime.** ``pg_ctl`` starts the server detached in its own session, so it outlives
  the command that started it and later commands for the same root reuse it.
  :meth:`Cluster.ensure_running` is serialised across processes by an flock.
* **Crashes.** After a SIGKILL the postmaster may stay a zombie (PID 1 need not reap it
  promptly) and PostgreSQL then refuses to start over its lock files. Those are removed
  only once no process works in ``data/`` any more, which keeps PostgreSQL's own guard
  against orphaned backends.

The modules: ``binaries`` finds the server binaries, ``osuser`` holds the service OS user
and what it can reach, ``locks`` the flock, ``procs`` the /proc inspection, ``text`` the
one-line error summaries, and ``cluster`` the :class:`Cluster` itself.
"""

from pgflow.embedded.binaries import PostgresNotFound, find_bindir
from pgflow.embedded.cluster import Cluster, embedded_cluster
from pgflow.embedded.osuser import FALLBACK_CLUSTERS

__all__ = ["FALLBACK_CLUSTERS", "Cluster", "PostgresNotFound", "embedded_cluster", "find_bindir"]
