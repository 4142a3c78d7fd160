-- Dependencies between runs of one logical time (a DAG run): creating DAG runs,
-- settling runs that (re)enter pending, queueing downstreams when their upstreams
-- succeed, failing and restoring them. Why this is race-free: pgflow/deps.py.
--
-- A pending run is *held* (waiting for its backfill to release it, not for upstreams)
-- when its trigger is 'backfill' and its backfill is running; dependency statements
-- leave held runs alone.

-- name: create_runs
-- New runs, one per (job, logical_time); a pair that already has a run is skipped by
-- the trigger that inserts its key (pgflow.run_keys, migration 0024: this is what makes
-- a tick exactly-once). With %(downstream)s, each requested job starts a DAG run for
-- its logical time: a requested root brings the other unpaused roots of its DAG
-- (queued, same trigger), and every job downstream of the started jobs gets a
-- 'pending' run that the dependency engine queues when its upstreams succeed. Workers
-- are woken (pgflow_queue) when a queued run was created. A NULL time means the
-- database's now(), to the second.
WITH RECURSIVE input AS (
    SELECT DISTINCT i.job, coalesce(i.logical_time, date_trunc('second', now())) AS logical_time
    FROM unnest(%(jobs)s::text[], %(times)s::timestamptz[]) AS i(job, logical_time)
), component(job, logical_time) AS (
    SELECT i.job, i.logical_time FROM input i
    WHERE %(downstream)s AND NOT EXISTS (SELECT 1 FROM pgflow.job_deps d WHERE d.job = i.job)
    UNION
    SELECT CASE WHEN d.upstream = c.job THEN d.job ELSE d.upstream END, c.logical_time
    FROM component c
    JOIN pgflow.job_deps d ON d.upstream = c.job OR d.job = c.job
), started AS (
    SELECT job, logical_time, true AS requested FROM input
    UNION
    SELECT c.job, c.logical_time, false FROM component c
    JOIN pgflow.jobs j ON j.name = c.job
    WHERE NOT j.paused AND NOT EXISTS (SELECT 1 FROM pgflow.job_deps d WHERE d.job = c.job)
), closure(job, logical_time) AS (
    SELECT d.job, s.logical_time FROM started s
    JOIN pgflow.job_deps d ON d.upstream = s.job
    WHERE %(downstream)s
    UNION
    SELECT d.job, c.logical_time FROM closure c JOIN pgflow.job_deps d ON d.upstream = c.job
), wanted AS (
    SELECT DISTINCT ON (job, logical_time) job, logical_time, requested, pending
    FROM (
        SELECT job, logical_time, requested, false AS pending FROM started
        UNION ALL
        SELECT job, logical_time, false, true FROM closure
    ) w
    ORDER BY job, logical_time, requested DESC, pending
), inserted AS (
INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant, priority,
                         params, backfill_id, capped, held)
SELECT w.job, w.logical_time,
       CASE WHEN w.pending THEN 'pending' ELSE %(state)s END,
       j.max_attempts,
       CASE WHEN w.pending THEN 'dependency' ELSE %(trigger)s END,
       j.tenant, j.priority + %(priority_offset)s,
       CASE WHEN w.requested THEN j.params || coalesce(%(params)s::jsonb, '{}') ELSE j.params END,
       %(backfill_id)s, j.capped, j.held  -- policy flags (pgflow/policies.py)
FROM wanted w
JOIN pgflow.jobs j ON j.name = w.job
ORDER BY w.logical_time, w.job
RETURNING id, job, logical_time, state, trigger
)
SELECT id, job, logical_time, state, trigger,
       -- pg_notify sends one message per transaction, however many rows call it.
       CASE WHEN state = 'queued' THEN pg_notify('pgflow_queue', '') END AS woke
FROM inserted

-- name: create_plain_runs
-- Runs that start no DAG run: ticks and triggers of jobs without downstream jobs (the
-- caller knows, or asks with %(only_lone)s to skip any job that has downstream jobs),
-- and --no-downstream triggers. One INSERT that also wakes the workers; a NULL time
-- means the database's now(), to the second. Same result as create_runs for these jobs.
WITH inserted AS (
    INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant,
                             priority, params, capped, held, available_at)
    SELECT j.name, coalesce(i.logical_time, date_trunc('second', now())), 'queued',
           j.max_attempts, %(trigger)s, j.tenant, j.priority,
           j.params || coalesce(%(params)s::jsonb, '{}'), j.capped, j.held,
           -- a tick created ahead (pgflow/scheduler.py) is claimable from its time on
           CASE WHEN %(trigger)s = 'schedule' THEN greatest(now(), i.logical_time)
                ELSE now() END
    FROM unnest(%(jobs)s::text[], %(times)s::timestamptz[]) AS i(job, logical_time)
    JOIN pgflow.jobs j ON j.name = i.job
    WHERE NOT %(only_lone)s
       OR NOT EXISTS (SELECT 1 FROM pgflow.job_deps d WHERE d.upstream = j.name)
    RETURNING id, job, logical_time, state, trigger
)
SELECT id, job, logical_time, state, trigger,
       (SELECT pg_notify('pgflow_queue', ''))::text AS woke  -- once per statement
FROM inserted

-- name: create_plain_run
-- One manual run as create_plain_runs makes them (pgflow.runs.trigger: on the latency
-- path), from scalar parameters: its plan does not depend on how many pairs come, so a
-- session that prepared it plans it once. With %(handoff)s, a run that could start at
-- once (not capped, no breaker open, small enough for a notification) is handed to an
-- idle worker's offer when there is one: created running under that worker's lease, and
-- the claim row goes to the worker's own channel (pgflow/handoff.py). Otherwise it is
-- queued and the workers are woken.
WITH job AS (
    SELECT j.name, j.max_attempts, j.tenant, j.priority, j.capped, j.held,
           j.params || coalesce(%(params)s::jsonb, '{}') AS params, j.command, j.entrypoint,
           j.timeout_s, j.backoff_s, j.max_backoff_s, j.jitter, j.no_retry_exit_codes,
           j.sources
    FROM pgflow.jobs j
    WHERE j.name = %(job)s::text
      AND (NOT %(only_lone)s
           OR NOT EXISTS (SELECT 1 FROM pgflow.job_deps d WHERE d.upstream = j.name))
), offer AS (
    SELECT i.worker, i.seq, i.ttl_s, i.listen_pid
    FROM pgflow.idle_workers i, job j
    WHERE %(handoff)s AND i.slots > 0 AND i.until > now()
      AND NOT j.capped AND NOT j.held
      -- what varies in the notification's size, well under its 8,000 bytes
      AND octet_length(j.params::text) + octet_length(coalesce(j.command::text, j.entrypoint))
          + octet_length(j.sources::text) + octet_length(j.no_retry_exit_codes::text)
          + octet_length(j.name) < 6000
      AND NOT EXISTS (SELECT 1 FROM pgflow.breakers WHERE state <> 'closed')
      -- its LISTEN session still holds its lock (listen_worker): a worker killed a
      -- moment ago gets nothing (the shared lock taken otherwise ends with this statement)
      AND NOT pg_try_advisory_xact_lock_shared(1885825135, i.listen_pid)
    ORDER BY i.until DESC
    LIMIT 1
    FOR UPDATE OF i SKIP LOCKED
), inserted AS (
    -- clock_timestamp(), not now(): the lease starts after the offer was made, which is
    -- what the worker's own deadline for it counts from (pgflow/handoff.py)
    INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant,
                             priority, params, capped, held, available_at, attempt,
                             lease_owner, lease_expires_at, attempt_started_at, started_at,
                             handed_off)
    SELECT j.name, coalesce(%(logical_time)s::timestamptz, date_trunc('second', now())),
           CASE WHEN o.worker IS NULL THEN 'queued' ELSE 'running' END,
           j.max_attempts, 'manual', j.tenant, j.priority, j.params, j.capped, j.held, now(),
           CASE WHEN o.worker IS NULL THEN 0 ELSE 1 END, o.worker,
           clock_timestamp() + make_interval(secs => o.ttl_s),
           CASE WHEN o.worker IS NOT NULL THEN clock_timestamp() END,
           CASE WHEN o.worker IS NOT NULL THEN clock_timestamp() END,
           o.worker IS NOT NULL
    FROM job j LEFT JOIN offer o ON true
    RETURNING id, job, logical_time, state, trigger, attempt, max_attempts, params,
              attempt_started_at, lease_owner
), taken AS (
    UPDATE pgflow.idle_workers i SET slots = i.slots - 1
    FROM offer o
    WHERE i.worker = o.worker AND EXISTS (SELECT 1 FROM inserted WHERE lease_owner IS NOT NULL)
)
SELECT r.id, r.job, r.logical_time, r.state, r.trigger,
       CASE WHEN r.lease_owner IS NULL THEN pg_notify('pgflow_queue', '')
            ELSE pg_notify('pgflow_handoff_' || o.listen_pid, json_build_object(
                'worker', o.worker, 'seq', o.seq, 'id', r.id, 'job', r.job,
                'logical_time', r.logical_time,
                'attempt', r.attempt, 'max_attempts', r.max_attempts,
                'params', r.params::text, 'attempt_started_at', r.attempt_started_at,
                'command', j.command, 'entrypoint', j.entrypoint, 'timeout_s', j.timeout_s,
                'backoff_s', j.backoff_s, 'max_backoff_s', j.max_backoff_s,
                'jitter', j.jitter, 'no_retry_exit_codes', j.no_retry_exit_codes,
                'sources', j.sources)::text) END::text AS woke
FROM inserted r
CROSS JOIN job j
LEFT JOIN offer o ON true

-- name: pending_runs_of_jobs
-- The pending runs of jobs whose upstream edges just changed (registration).
SELECT id FROM pgflow.runs WHERE job = ANY(%(jobs)s::text[]) AND state = 'pending' ORDER BY id

-- name: older_transactions
-- Whether a transaction of this database that began before %(since)s (NULL: now, the
-- instant returned as since) still runs: a registration waits for them before settling
-- its re-wired runs again (pgflow/registry.py). Sessions of other roles show no
-- xact_start without pg_read_all_stats: not waited for.
WITH t AS (SELECT coalesce(%(since)s::timestamptz, clock_timestamp()) AS since)
SELECT t.since, EXISTS (
    SELECT 1 FROM pg_stat_activity
    WHERE datname = current_database() AND pid <> pg_backend_pid()
      AND backend_type = 'client backend' AND xact_start < t.since
) AS any
FROM t

-- name: lock_upstream_runs
-- Settling, step 1: share-lock the upstream runs (same logical time) of the pending runs
-- %(ids)s and of the pending runs of backfill %(backfill)s, in id order. A transaction
-- that ends one of them (finish, cancel, retry, dooming) updates its row, so it either
-- committed before this lock was granted (step 2, a new statement, sees its result) or
-- waits for our commit (and its own next statement sees our pending runs). Runs created
-- by this transaction (%(fresh)s, or of the new backfill) are invisible to everyone else
-- and need no lock.
SELECT count(*) AS locked FROM (
    SELECT u.id
    FROM pgflow.runs p
    JOIN pgflow.job_deps d ON d.job = p.job
    JOIN pgflow.run_keys k ON k.job = d.upstream AND k.logical_time = p.logical_time
    JOIN pgflow.runs u ON u.id = k.run_id
    WHERE p.id IN (SELECT unnest(%(ids)s::bigint[])
                   UNION ALL
                   SELECT r.id FROM pgflow.runs r
                   WHERE r.backfill_id = %(backfill)s::bigint AND r.state = 'pending')
      AND p.state = 'pending'
      AND NOT u.id = ANY(%(fresh)s::bigint[])
      AND (%(backfill)s::bigint IS NULL OR u.backfill_id IS DISTINCT FROM %(backfill)s::bigint)
    ORDER BY u.id
    FOR SHARE OF u
) locked

-- name: settle_pending
-- Settling, step 2 (the statement after lock_upstream_runs): every pending run of the
-- set whose upstream runs at its logical time all succeeded (or that has none: an
-- upstream job without a run does not hold it back) is queued; one with a failed,
-- cancelled or upstream_failed upstream becomes upstream_failed (the caller then fails
-- its pending closure with fail_downstreams). With %(hold)s, a ready run of a backfill
-- is held for the backfill's release instead of queued (so the backfill's cap covers
-- ticks whose upstreams ran before it). Rows are locked in id order, as finishers do.
WITH target AS (
    SELECT p.id, p.job, p.logical_time
    FROM pgflow.runs p
    WHERE p.id IN (SELECT unnest(%(ids)s::bigint[])
                   UNION ALL
                   SELECT r.id FROM pgflow.runs r
                   WHERE r.backfill_id = %(backfill)s::bigint AND r.state = 'pending')
      AND p.state = 'pending'
      AND NOT (p.trigger = 'backfill' AND EXISTS (
          SELECT 1 FROM pgflow.backfills b WHERE b.id = p.backfill_id AND b.state = 'running'))
    ORDER BY p.id
    FOR UPDATE OF p
), verdict AS (
    SELECT t.id,
           coalesce(bool_or(u.state IN ('failed', 'cancelled', 'upstream_failed')), false)
               AS doomed,
           coalesce(bool_and(u.state = 'succeeded'), true) AS ready
    FROM target t
    LEFT JOIN pgflow.job_deps d ON d.job = t.job
    LEFT JOIN pgflow.run_keys k ON k.job = d.upstream AND k.logical_time = t.logical_time
    LEFT JOIN pgflow.runs u ON u.id = k.run_id
    GROUP BY t.id
), changed AS (
    UPDATE pgflow.runs p
    SET state = CASE WHEN v.doomed THEN 'upstream_failed'
                     WHEN %(hold)s AND p.backfill_id IS NOT NULL THEN 'pending'
                     ELSE 'queued' END,
        trigger = CASE WHEN NOT v.doomed AND %(hold)s AND p.backfill_id IS NOT NULL
                       THEN 'backfill' ELSE p.trigger END,
        finished_at = CASE WHEN v.doomed THEN now() END,
        available_at = now()
    FROM verdict v
    WHERE p.id = v.id AND p.state = 'pending' AND (v.doomed OR v.ready)
    RETURNING p.id, p.state, p.backfill_id
)
SELECT ARRAY(SELECT id FROM changed WHERE state = 'queued' ORDER BY id) AS queued,
       ARRAY(SELECT id FROM changed WHERE state = 'upstream_failed' ORDER BY id) AS doomed,
       ARRAY(SELECT id FROM changed WHERE state = 'pending' ORDER BY id) AS held,
       ARRAY(SELECT DISTINCT backfill_id FROM changed WHERE backfill_id IS NOT NULL)
           AS backfills,
       -- pg_notify sends one message per transaction, however often it is called.
       (SELECT pg_notify('pgflow_queue', '') FROM changed WHERE state = 'queued' LIMIT 1)::text
           AS woke

-- name: queue_ready_runs
-- Completion, the statement after finish_attempts (fresh snapshot): the pending runs
-- %(ids)s that finish_attempts locked are queued when their upstreams at their logical
-- time have all succeeded (an upstream job with no run at that time does not hold them
-- back). The pending downstreams of the runs %(finished)s that just succeeded which
-- finish_attempts could not see (``late``: created, retried or re-wired by a transaction
-- that committed after its snapshot, see pgflow/deps.py) are locked here, in id order,
-- and returned: the caller runs this statement again on them, so their check also sees
-- every upstream that finished while we waited for their locks.
WITH late AS (
    SELECT p.id
    FROM pgflow.runs f
    JOIN pgflow.job_deps d ON d.upstream = f.job
    JOIN pgflow.run_keys k ON k.job = d.job AND k.logical_time = f.logical_time
    JOIN pgflow.runs p ON p.id = k.run_id
    WHERE f.id = ANY(%(finished)s::bigint[]) AND f.state = 'succeeded'
      AND p.state = 'pending' AND NOT p.id = ANY(%(ids)s::bigint[])
    ORDER BY p.id
    FOR UPDATE OF p
), queued AS (
    UPDATE pgflow.runs p
    SET state = 'queued', available_at = now()
    WHERE p.id = ANY(%(ids)s::bigint[]) AND p.state = 'pending'
      AND NOT (p.trigger = 'backfill' AND EXISTS (
          SELECT 1 FROM pgflow.backfills b WHERE b.id = p.backfill_id AND b.state = 'running'))
      AND NOT EXISTS (
          SELECT 1 FROM pgflow.job_deps d
          JOIN pgflow.run_keys k ON k.job = d.upstream AND k.logical_time = p.logical_time
          JOIN pgflow.runs u ON u.id = k.run_id
          WHERE d.job = p.job AND u.state <> 'succeeded')
    RETURNING p.id, p.backfill_id
)
SELECT ARRAY(SELECT id FROM queued ORDER BY id) AS queued,
       ARRAY(SELECT DISTINCT id FROM late ORDER BY id) AS late,
       ARRAY(SELECT DISTINCT backfill_id FROM queued WHERE backfill_id IS NOT NULL)
           AS backfills

-- name: fail_downstreams
-- The runs %(ids)s failed, were cancelled or became upstream_failed: every pending run
-- downstream of them (transitively, same logical time) can no longer run and becomes
-- upstream_failed. Callers repeat it on the runs it returns until it returns none (a
-- new statement sees pending runs that a transaction we waited for committed).
WITH RECURSIVE doomed(job, logical_time) AS (
    SELECT r.job, r.logical_time FROM pgflow.runs r
    WHERE r.id = ANY(%(ids)s::bigint[]) AND r.state IN ('failed', 'cancelled', 'upstream_failed')
    UNION
    SELECT d.job, x.logical_time FROM doomed x JOIN pgflow.job_deps d ON d.upstream = x.job
)
UPDATE pgflow.runs p
SET state = 'upstream_failed', finished_at = now()
FROM doomed x
JOIN pgflow.run_keys k ON k.job = x.job AND k.logical_time = x.logical_time
WHERE p.id = k.run_id AND p.state = 'pending'
RETURNING p.id, p.backfill_id

-- name: restore_downstreams
-- Run %(id)s was retried: the upstream_failed runs downstream of it (transitively, same
-- logical time) go back to pending. The caller settles them at once: those with another
-- upstream that is still failed, cancelled or upstream_failed fail again.
WITH RECURSIVE affected(job, logical_time) AS (
    SELECT job, logical_time FROM pgflow.runs WHERE id = %(id)s
    UNION
    SELECT d.job, a.logical_time FROM affected a JOIN pgflow.job_deps d ON d.upstream = a.job
)
UPDATE pgflow.runs p
SET state = 'pending', finished_at = NULL
FROM affected a
JOIN pgflow.run_keys k ON k.job = a.job AND k.logical_time = a.logical_time
WHERE p.id = k.run_id AND p.state = 'upstream_failed'
RETURNING p.id

-- name: failed_upstreams
-- The failed or cancelled runs upstream of %(id)s (transitively, same logical time).
WITH RECURSIVE ups(job, logical_time) AS (
    SELECT job, logical_time FROM pgflow.runs WHERE id = %(id)s
    UNION
    SELECT d.upstream, u.logical_time FROM ups u JOIN pgflow.job_deps d ON d.job = u.job
)
SELECT r.id, r.job, r.state
FROM ups u
JOIN pgflow.run_keys k ON k.job = u.job AND k.logical_time = u.logical_time
JOIN pgflow.runs r ON r.id = k.run_id
WHERE r.state IN ('failed', 'cancelled') AND r.id <> %(id)s
ORDER BY r.id

