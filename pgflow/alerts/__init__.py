"""Alerts (SPEC §4d): incidents evaluated from table facts, an outbox, webhooks.

Parts: ``definitions`` (the ``[alerts.NAME]`` model), ``evaluate`` (the leader's
pass and the any-replica ``no_leader`` check), ``outbox`` (notification rows, the
sender every replica runs, listings, test sends), ``webhook`` (bodies, signature,
a small asyncio HTTP client), ``secrets`` (the env vars alerts read, kept from jobs).

Design note
===========

Facts, not callbacks. Every event is judged from rows another part of pgflow
already commits: dead letters and successes (``runs.state``/``finished_at``), the
breaker transition log, claimable runs, finished attempts, the leader row, the
replica heartbeats. A run whose worker was SIGKILLed (the reaper dead-letters
it), that never started (nobody claimed it by its deadline) or that a frozen
replica held is seen the same way as one a worker reported: nothing depends on
the process that ran it being alive to say so.

Exactly once per transition. An incident is a row of ``pgflow.incidents``; the
partial unique index ``incidents_open_idx`` allows one *open* incident per
(event, key) (key: the job for ``run_failed``, the run for ``deadline_missed``,
the source for breakers, ``cluster`` for ``backlog``/``failure_rate``/``no_leader``),
and ``incidents_replica_lost_idx`` one ``replica_lost`` per replica ever. Opening
is ``INSERT … ON CONFLICT DO NOTHING RETURNING``, resolving is ``UPDATE … WHERE
resolved_at IS NULL RETURNING``: only the statement that changed a row gets it
back, and only that statement's transaction writes the notifications of the
transition (one per matching ``[alerts.NAME]``) into ``pgflow.notifications``.
The transition and its notifications commit together or not at all, so a crash
between the two cannot lose a page, and a second evaluator racing the first
either waits for its commit (and then conflicts: nothing) or sees the row.

``run_failed`` streaks. The leader reads the runs that finished since its cursor
(``alert_cursor.runs_checked_at`` minus a slack for transactions that committed
late, through ``runs_finished_idx``) and, per job, those after the last run the
streak logic already saw (``alert_job_streaks``), in finish order: a dead letter
with no open incident opens one (pages); more dead letters of the same streak are
appended to its ``runs`` (no page); a success resolves it (``run_recovered``).
Retried attempts are not dead letters and give nothing. The cursor, the per-job
marks and the incidents are written in one transaction.

Leader changes. The evaluation runs on the leader's lock connection, in one
transaction per pass: a deposed leader's session is terminated, which rolls back
whatever it was writing, and a frozen one that wakes up has no connection left.
The new leader starts from the persisted cursors, so nothing is skipped; if two
evaluators ever overlap anyway, the unique indexes make the second one's
transitions no-ops. ``no_leader`` is judged by every replica (the leader may be
the thing that is gone), which is exactly why it needs the index: many replicas
try the insert, one wins.

Cost. A pass reads indexed slices only: runs finished since the cursor
(``runs_finished_idx``), recent ticks of the jobs that have a ``deadline`` (the
``run_keys``' ``(job, logical_time)`` key), the breaker log after its cursor, open
incidents (``incidents_firing_idx``), silent replicas; ``backlog`` and
``failure_rate`` (the waiting runs, 15 min of attempts) every 30 s only. Timings
are module constants; tests shorten them with ``PGFLOW_ALERTS_*`` variables read
at import (internal, not settings).

Delivery (``outbox``). Any replica claims due rows with ``FOR UPDATE SKIP
LOCKED`` and pushes their ``next_attempt_at`` one lease ahead in the claiming
statement, so a sender that dies mid-request leaves a row that another retries.
Each request has its own timeout and runs as its own task (a bounded number in
flight), so a receiver that hangs or answers 500 holds only its own rows. Failures
back off exponentially with full jitter until ``give_up_at`` (24 h after creation),
then the row is ``given_up`` and shown as undelivered. A result is recorded with a
guarded UPDATE (same id, same attempt count, still pending): a late answer from a
sender whose lease expired changes nothing. At least once: a receiver may get a
notification twice and drops repeats by its ``id``.
"""

from __future__ import annotations

import os

# Events an [alerts.NAME] may subscribe to: the §4d events and their resolutions.
EVENTS = ("run_failed", "run_recovered", "deadline_missed", "breaker_opened", "breaker_closed",
          "backlog", "failure_rate", "no_leader", "replica_lost")
# The event a notification of an incident's resolution carries.
RESOLVED_EVENT = {"run_failed": "run_recovered", "breaker_opened": "breaker_closed"}


def knob(name: str, default: float) -> float:
    """An internal timing (tests shorten it), read at import: before ``pgflow serve``
    scrubs ``PGFLOW_*`` from the environment."""
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default
