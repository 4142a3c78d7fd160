-- The run lifecycle on workers and the reaper: claim, renew, finish.
-- Every transition is guarded by state, attempt and lease owner; callers check
-- which rows came back.

-- name: claim_runs
-- Claim up to %(limit)s runs for one worker, highest priority first, then oldest.
-- Runs of a job that touches a source whose breaker is open stay queued; the check
-- costs one lookup per statement while no breaker is open.
WITH picked AS (
    SELECT id FROM pgflow.runs r
    WHERE state IN ('queued', 'retrying') AND NOT capped AND available_at <= now()
      AND (NOT EXISTS (SELECT 1 FROM pgflow.breakers WHERE state = 'open')
           OR NOT EXISTS (SELECT 1 FROM pgflow.jobs j
                          JOIN pgflow.breakers b ON b.source = ANY(j.sources)
                          WHERE j.name = r.job AND b.state = 'open'))
    ORDER BY priority DESC, available_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE pgflow.runs r
    SET state = 'running', attempt = r.attempt + 1, lease_owner = %(worker)s,
        lease_expires_at = now() + make_interval(secs => %(ttl)s),
        attempt_started_at = now(), started_at = coalesce(r.started_at, now())
    FROM picked
    WHERE r.id = picked.id
    RETURNING r.id, r.job, r.logical_time, r.attempt, r.max_attempts, r.params,
              r.attempt_started_at, r.cancel_requested
)
-- params as JSON text: a command passes it on as is, a Python job decodes it on first use.
SELECT c.id, c.job, c.logical_time, c.attempt, c.max_attempts, c.params::text AS params,
       c.attempt_started_at,
       c.cancel_requested, j.command, j.entrypoint, j.timeout_s, j.backoff_s, j.max_backoff_s,
       j.jitter, j.no_retry_exit_codes
FROM claimed c
LEFT JOIN pgflow.jobs j ON j.name = c.job

-- name: capped_jobs_waiting
-- Jobs with a max_active_runs cap that have claimable runs.
SELECT DISTINCT job FROM pgflow.runs
WHERE state IN ('queued', 'retrying') AND capped AND available_at <= now()
ORDER BY job
LIMIT 100

-- name: lock_capped_jobs
-- Claims of a capped job take turns (transaction-scoped, in name order: no deadlock).
SELECT count(pg_advisory_xact_lock(1885759855, hashtext(job)))  -- class: "pgfo"
FROM (SELECT unnest(%(jobs)s::text[]) AS job ORDER BY 1) j

-- name: claim_capped_runs
-- Run after lock_capped_jobs, as a new statement: its snapshot sees every claim that
-- committed before we got the locks, so the count of running runs is exact. Its claim
-- step repeats claim_runs' on purpose: the hot, uncapped claim stays one statement.
WITH room AS (
    SELECT j.name, j.max_active_runs
               - (SELECT count(*) FROM pgflow.runs x WHERE x.job = j.name AND x.state = 'running'
                  AND x.capped)
               AS free
    FROM pgflow.jobs j
    WHERE j.name = ANY(%(jobs)s::text[])
), picked AS (
    SELECT p.id
    FROM room
    CROSS JOIN LATERAL (
        SELECT r.id, r.priority, r.available_at FROM pgflow.runs r
        WHERE r.job = room.name AND r.state IN ('queued', 'retrying') AND r.capped
          AND r.available_at <= now()
        ORDER BY r.priority DESC, r.available_at, r.id
        LIMIT greatest(coalesce(room.free, 1), 0)
        FOR UPDATE SKIP LOCKED
    ) p
    ORDER BY p.priority DESC, p.available_at, p.id
    LIMIT %(limit)s
), claimed AS (
    UPDATE pgflow.runs r
    SET state = 'running', attempt = r.attempt + 1, lease_owner = %(worker)s,
        lease_expires_at = now() + make_interval(secs => %(ttl)s),
        attempt_started_at = now(), started_at = coalesce(r.started_at, now())
    FROM picked
    WHERE r.id = picked.id
    RETURNING r.id, r.job, r.logical_time, r.attempt, r.max_attempts, r.params,
              r.attempt_started_at, r.cancel_requested
)
-- params as JSON text: a command passes it on as is, a Python job decodes it on first use.
SELECT c.id, c.job, c.logical_time, c.attempt, c.max_attempts, c.params::text AS params,
       c.attempt_started_at,
       c.cancel_requested, j.command, j.entrypoint, j.timeout_s, j.backoff_s, j.max_backoff_s,
       j.jitter, j.no_retry_exit_codes
FROM claimed c
LEFT JOIN pgflow.jobs j ON j.name = c.job

-- name: renew_leases
-- One heartbeat for every run a worker holds; the runs that come back are still its own.
UPDATE pgflow.runs
SET lease_expires_at = now() + make_interval(secs => %(ttl)s)
WHERE lease_owner = %(worker)s AND state = 'running'
RETURNING id, attempt, cancel_requested

-- name: finish_attempts
-- End attempts in bulk. A row only changes while the run is still running the same
-- attempt under the same lease owner; the ids returned are the attempts that counted.
-- For runs that succeeded, the pending runs of their direct downstreams at the same
-- logical time are locked (in id order, so finishers never deadlock on them) and
-- returned as candidates for queue_ready_runs, which must run as the NEXT statement
-- of the same transaction: its fresh snapshot sees an upstream that another
-- transaction finished while we waited for the lock, so two upstreams finishing at
-- once queue their downstream exactly once.
-- The batch comes as one JSON array of objects (cheaper to build than eleven arrays).
WITH result AS (
    SELECT * FROM jsonb_to_recordset(%(results)s::jsonb)
        AS t(id bigint, attempt int, owner text, state text, delay_s float8, outcome text,
             started_at timestamptz, exit_code int, error text, stdout_tail text,
             stderr_tail text)
), finished AS (
    UPDATE pgflow.runs r
    SET state = res.state,
        finished_at = CASE WHEN res.state IN ('succeeded', 'failed', 'cancelled') THEN now() END,
        available_at = CASE WHEN res.state IN ('retrying', 'queued')
                            THEN now() + make_interval(secs => res.delay_s)
                            ELSE r.available_at END,
        -- An interrupted attempt (graceful shutdown) does not use up the budget.
        max_attempts = r.max_attempts + (res.outcome = 'interrupted')::int,
        lease_owner = NULL, lease_expires_at = NULL, attempt_started_at = NULL
    FROM result res
    -- IS NOT DISTINCT FROM (not indexable) keeps the planner on the primary key: with an
    -- indexable owner test it walked runs_owner_idx once per result row.
    WHERE r.id = res.id AND r.attempt IS NOT DISTINCT FROM res.attempt
      AND r.lease_owner IS NOT DISTINCT FROM res.owner AND r.state = 'running'
    RETURNING r.id, r.state, r.job, r.logical_time, r.backfill_id
), recorded AS (
    INSERT INTO pgflow.attempts (run_id, attempt, worker_id, started_at, finished_at, outcome,
                                 exit_code, error, stdout_tail, stderr_tail)
    SELECT res.id, res.attempt, res.owner, res.started_at, now(), res.outcome, res.exit_code,
           res.error, res.stdout_tail, res.stderr_tail
    FROM finished f JOIN result res ON res.id = f.id
), candidates AS (
    SELECT p.id
    FROM finished f
    JOIN pgflow.job_deps d ON d.upstream = f.job
    JOIN pgflow.runs p ON p.job = d.job AND p.logical_time = f.logical_time
    WHERE f.state = 'succeeded' AND p.state = 'pending'
    ORDER BY p.id
    FOR UPDATE OF p
)
SELECT id, state, backfill_id, (SELECT array_agg(id) FROM candidates) AS candidates
FROM finished

-- name: queue_ready_runs
-- Pending runs whose upstreams have all succeeded at their logical time become queued.
-- An upstream job with no run at that time is not part of this DAG run (a sub-DAG
-- trigger, a paused root) and does not hold it back.
UPDATE pgflow.runs p
SET state = 'queued', available_at = now()
WHERE p.id = ANY(%(ids)s::bigint[]) AND p.state = 'pending'
  AND NOT EXISTS (
      SELECT 1 FROM pgflow.job_deps d
      JOIN pgflow.runs u ON u.job = d.upstream AND u.logical_time = p.logical_time
      WHERE d.job = p.job AND u.state <> 'succeeded')
RETURNING id

-- name: fail_downstreams
-- The runs %(ids)s failed or were cancelled: every pending run downstream of them
-- (transitively, same logical time) can no longer run and becomes upstream_failed.
WITH RECURSIVE doomed(job, logical_time) AS (
    SELECT r.job, r.logical_time FROM pgflow.runs r
    WHERE r.id = ANY(%(ids)s::bigint[]) AND r.state IN ('failed', 'cancelled', 'upstream_failed')
    UNION
    SELECT d.job, x.logical_time FROM doomed x JOIN pgflow.job_deps d ON d.upstream = x.job
)
UPDATE pgflow.runs p
SET state = 'upstream_failed', finished_at = now()
FROM doomed x
WHERE p.job = x.job AND p.logical_time = x.logical_time AND p.state = 'pending'
RETURNING p.id

-- name: restore_downstreams
-- Run %(id)s was retried: the upstream_failed runs downstream of it go back to pending.
-- (The caller then re-applies fail_downstreams for other upstreams that are still failed.)
WITH RECURSIVE affected(job, logical_time) AS (
    SELECT job, logical_time FROM pgflow.runs WHERE id = %(id)s
    UNION
    SELECT d.job, a.logical_time FROM affected a JOIN pgflow.job_deps d ON d.upstream = a.job
), restored AS (
    UPDATE pgflow.runs p
    SET state = 'pending', finished_at = NULL
    FROM affected a
    WHERE p.job = a.job AND p.logical_time = a.logical_time AND p.state = 'upstream_failed'
    RETURNING p.id, p.job, p.logical_time
)
SELECT coalesce(array_agg(DISTINCT u.id), '{}') AS still_failed,
       (SELECT count(*) FROM restored) AS restored
FROM restored x
JOIN pgflow.job_deps d ON d.job = x.job
JOIN pgflow.runs u ON u.job = d.upstream AND u.logical_time = x.logical_time
WHERE u.state IN ('failed', 'cancelled') AND u.id <> %(id)s

-- name: expired_leases
-- Runs whose owner stopped renewing. Locked until the reaper's transaction ends, so a
-- late renewal cannot slip between this and finish_attempts.
SELECT r.id, r.job, r.attempt, r.max_attempts, r.lease_owner, r.attempt_started_at,
       r.cancel_requested, j.backoff_s, j.max_backoff_s, j.jitter
FROM pgflow.runs r
LEFT JOIN pgflow.jobs j ON j.name = r.job
WHERE r.state = 'running' AND r.lease_expires_at < now()
ORDER BY r.lease_expires_at
LIMIT %(limit)s
FOR UPDATE OF r SKIP LOCKED

-- name: notify_queue
SELECT pg_notify('pgflow_queue', '')

-- name: create_runs
-- New runs, one per (job, logical_time); a pair that already has a run is skipped
-- (this is what makes a tick exactly-once). With %(downstream)s, each requested job
-- starts a DAG run for its logical time: a requested root brings the other unpaused
-- roots of its DAG (queued, same trigger), and every job downstream of the started
-- jobs gets a 'pending' run that the dependency engine queues when its upstreams
-- succeed. Workers are woken (pgflow_queue) when a queued run was created. A NULL time
-- means the database's now(), to the second.
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
                         params, backfill_id, capped)
SELECT w.job, w.logical_time,
       CASE WHEN w.pending THEN 'pending' ELSE %(state)s END,
       j.max_attempts,
       CASE WHEN w.pending THEN 'dependency' ELSE %(trigger)s END,
       j.tenant, j.priority + %(priority_offset)s,
       CASE WHEN w.requested THEN j.params || coalesce(%(params)s::jsonb, '{}') ELSE j.params END,
       %(backfill_id)s, j.max_active_runs IS NOT NULL
FROM wanted w
JOIN pgflow.jobs j ON j.name = w.job
ORDER BY w.logical_time, w.job
ON CONFLICT (job, logical_time) DO NOTHING
RETURNING id, job, logical_time, state, trigger
)
SELECT id, job, logical_time, state, trigger,
       -- pg_notify sends one message per transaction, however many rows call it.
       CASE WHEN state = 'queued' THEN pg_notify('pgflow_queue', '') END AS woke
FROM inserted

-- name: failed_upstreams
-- The failed or cancelled runs upstream of %(id)s (transitively, same logical time).
WITH RECURSIVE ups(job, logical_time) AS (
    SELECT job, logical_time FROM pgflow.runs WHERE id = %(id)s
    UNION
    SELECT d.upstream, u.logical_time FROM ups u JOIN pgflow.job_deps d ON d.job = u.job
)
SELECT r.id, r.job, r.state
FROM ups u
JOIN pgflow.runs r ON r.job = u.job AND r.logical_time = u.logical_time
WHERE r.state IN ('failed', 'cancelled') AND r.id <> %(id)s
ORDER BY r.id

-- name: create_plain_runs
-- Runs that start no DAG run: ticks and triggers of jobs without downstream jobs (the
-- caller knows, or asks with %(only_lone)s to skip any job that has downstream jobs),
-- and --no-downstream triggers. One INSERT that also wakes the workers; a NULL time
-- means the database's now(), to the second. Same result as create_runs for these jobs.
WITH inserted AS (
    INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant,
                             priority, params, capped)
    SELECT j.name, coalesce(i.logical_time, date_trunc('second', now())), 'queued',
           j.max_attempts, %(trigger)s, j.tenant, j.priority,
           j.params || coalesce(%(params)s::jsonb, '{}'), j.max_active_runs IS NOT NULL
    FROM unnest(%(jobs)s::text[], %(times)s::timestamptz[]) AS i(job, logical_time)
    JOIN pgflow.jobs j ON j.name = i.job
    WHERE NOT %(only_lone)s
       OR NOT EXISTS (SELECT 1 FROM pgflow.job_deps d WHERE d.upstream = j.name)
    ON CONFLICT (job, logical_time) DO NOTHING
    RETURNING id, job, logical_time, state, trigger
)
SELECT id, job, logical_time, state, trigger,
       (SELECT pg_notify('pgflow_queue', ''))::text AS woke  -- once per statement
FROM inserted
