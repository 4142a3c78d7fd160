"""Handoff: a trigger gives its run straight to an idle worker.

A claim after the trigger's commit costs a wake-up and a second committed round trip
(about 1.6 ms of the 3.4 ms from ``pgflow.runs.trigger`` to the job's first line on a
small machine). When a worker sits idle, the trigger's own statement can do the claim's
work instead: it creates the run ``running`` under the worker's lease, and the claim row
travels in the notification that would have woken the worker anyway. The worker starts
the job when the notification arrives, with no statement in between.

The offer. A worker's claim that leaves slots free also writes, in the same statement,
an offer (``pgflow.idle_workers``: its free slots, its lease TTL, the backend pid of its
LISTEN session, a sequence number, ``until``, ``OFFER_S`` ahead). An idle worker claims
every second, so it renews the offer; a claim that fills the slots withdraws it, and so
does a drain. A trigger (``create_plain_run``, one statement) takes one slot of a live
offer with ``FOR UPDATE SKIP LOCKED``, when the run could start at once anyway: not
capped, no breaker open, its LISTEN session alive (the session holds an advisory lock
on its own pid: a worker killed a moment ago gets nothing), and small enough for one
notification. Only an
autocommit trigger outside a transaction hands off (``may_hand_off``): a transaction
held open would hold the offer's row, and its notification would wait for its commit.

Why a handed-off lease is safe (the worker's books: pgflow/worker.py). The worker's
local deadline for the run is the instant it *sent* the claim that wrote the offer the
trigger consumed (named by ``seq`` in the notification) plus its TTL. The trigger saw
that offer, so it ran after the offer's commit, and its lease starts at its
``clock_timestamp()``, later still: the database's expiry is never earlier than the
worker's deadline, as for a claim. A notification that arrives while the worker's own
claim is in flight waits for that claim to return (the slots it fills come first). One
that arrives after the deadline, or when the worker has no free slot or is draining, is
given back (``give_back_handoff``: queued again, the attempt not used up).

Misdirected notifications. A channel is named by a backend pid, and pids are reused:
after a database restart another worker's new LISTEN session may hold the pid of a
lapsed offer. The notification names the worker the run was handed to; any other
worker ignores it (the run's lease then expires, as for a lost notification).

The queue is not consulted. An offer means its worker's claim, at most a second ago,
left slots free because nothing claimable was left for them; a run queued since wakes
the same worker, whose next claim takes it into the slots the handoff left. Tenant
weights and priorities order runs that compete for slots; runs offered free slots do
not compete.

Lost notifications. A notification is lost only with the LISTEN session it was sent
to; the run is then owned but never received. The heartbeat's release of such runs
(``renew_leases``) skips handed-off ones (``runs.handed_off``): a notification still on
its way would be released under the worker, which would start it after another worker
had. So an unreceived handoff waits for its lease to expire, and the reaper retries it
like any attempt whose worker vanished. A worker frozen (SIGSTOP) while its offer is
live can receive handoffs for at most ``OFFER_S``; they end the same way.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import psycopg
from psycopg import pq

from pgflow.claimed import Claimed

OFFER_S = 1.5  # an idle worker renews its offer every second (worker.POLL_S)
CHANNEL_PREFIX = "pgflow_handoff_"  # + the LISTEN session's pid, as the SQL spells it

_TIMES = ("logical_time", "attempt_started_at")


def may_hand_off(conn: psycopg.Connection[Any]) -> bool:
    """Whether a trigger on ``conn`` may hand its run off: an autocommit statement with no
    transaction open (see the module docstring)."""
    return conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE


def decode(payload: str) -> tuple[str, int, Claimed]:
    """The worker the run was handed to, the offer's ``seq`` and the claim row (as
    ``claim_runs`` returns it) of a handoff notification."""
    row = json.loads(payload)
    worker, seq = str(row.pop("worker")), int(row.pop("seq"))
    for key in _TIMES:
        row[key] = datetime.fromisoformat(row[key])
    row.update(checkpoint=None, trigger_events=None, cancel_requested=False)
    return worker, seq, Claimed(**row)
