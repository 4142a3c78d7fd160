"""Connection budget, and what may go through PgBouncer (``PGFLOW_POOLER_URL``).

Design note
===========

Budget. One replica opens a few long-lived connections per role, each owned by one
loop, so that no loop waits behind another's statement (a lease renewal must not queue
behind a claim, nor a claim behind a batch of completions):

============================  =====================  ==========  ==========================
role                          connection             kind        why
============================  =====================  ==========  ==========================
every replica                 replica heartbeat      poolable    one UPDATE every TTL/3
every replica                 alert sender           poolable    one claim a second (alerts/)
scheduler (leader or standby) lock session           **direct**  session advisory lock
worker                        claim                  poolable    one statement / transaction
worker                        completions            poolable    one transaction per flush
worker                        lease renewals         poolable    one transaction per beat
worker                        live output            poolable    one statement per flush
                                                                 (opened at the first news)
worker                        LISTEN                 **direct**  notifications are per session
reaper                        reap                   poolable    one transaction per pass
web                           pool of 1 to 10        poolable    one statement per query
``--health-bind``             readiness check        poolable    opened at the first /readyz
CLI command, ``serve`` start  one                    poolable    migrations: direct
============================  =====================  ==========  ==========================

So an all-roles replica holds 2 direct and 7 to 17 poolable connections, a worker-only
replica 1 direct and 5 or 6 poolable (live output: pgflow/live.py). Without
``PGFLOW_POOLER_URL`` every one of them goes to ``PGFLOW_DATABASE_URL``; with it, only
the direct ones do, and PostgreSQL sees one lock session per scheduler-role replica,
one LISTEN session per worker-role replica and PgBouncer's pool, however many replicas
there are.

What must stay direct, and why. A transaction-mode pooler gives each *transaction* some
server session; a session's state does not follow the client from one transaction to
the next.
* The leader's lock session holds ``pg_try_advisory_lock`` (a session lock), records its
  own ``pg_backend_pid()`` for standbys to terminate when it freezes, LISTENs on
  ``pgflow_jobs`` and runs every scheduling transaction: they must commit only while the
  lock is held (leader.py). Through a pooler the lock would stay on a server session
  that another client then uses, and the pid would name someone else's session.
* LISTEN (worker and leader): notifications go to the server session that listens.
* Migrations (``pgflow db migrate``, and those any command applies when some are
  pending) wait for an advisory lock inside their transaction while another process
  migrates, then run DDL: on the pool, replicas starting together would each hold a
  server session while they wait, and leave none for claims. They go direct.
Everything else is single statements or short explicit transactions, each complete in
itself, with ``pg_advisory_xact_lock`` at most (capped claims): safe on any session.

What a pooled connection gives up. pgflow never prepares (``prepare_threshold=None``:
PgBouncer before 1.21 cannot follow named prepared statements across server sessions,
and Debian 12 ships 1.18) and never SETs anything on it (the SET would land on one
server session and stay there for other clients). The session settings pgflow gives its
direct connections come from PgBouncer instead:
* ``jit = off`` and ``client_connection_check_interval`` (a backend notices within a
  second that PgBouncer dropped it because the client went away mid-statement) by the
  database entry's ``connect_query``; ``advice`` warns at ``pgflow serve`` when they
  are missing;
* ``idle_in_transaction_session_timeout`` by PgBouncer's ``idle_transaction_timeout``
  (a client frozen inside a transaction is cut off and its row locks released);
* the statement timeout by the client: every statement of the worker and the reaper is
  bounded (``db.bounded``) and closes its connection past the bound, and PgBouncer then
  closes the server session it was using.
Libpq's startup ``options`` are never sent (PgBouncer refuses them), and the TCP
keepalive settings of ``db.connect_async`` apply between the replica and PgBouncer.
"""

from __future__ import annotations

from typing import Any

import psycopg

from pgflow.queries import q


def advice(conn: psycopg.Connection[dict[str, Any]]) -> list[str]:
    """What sessions through the pooler (``conn`` is one) lack of the settings pgflow gives
    its direct sessions, as sentences for the operator; empty when nothing."""
    found = conn.execute(q("pooled_session_settings")).fetchone()
    assert found is not None
    wanted = []
    if found["jit"] != "off":
        wanted.append("SET jit = off")
    if found["connection_check"] in ("0", "0ms"):
        wanted.append("SET client_connection_check_interval = 1000")
    if not wanted:
        return []
    return [f"sessions through PGFLOW_POOLER_URL lack pgflow's session settings: add"
            f" connect_query='{'; '.join(wanted)}' to the database's entry in pgbouncer.ini"
            " (README: Connection budget and PgBouncer)"]
