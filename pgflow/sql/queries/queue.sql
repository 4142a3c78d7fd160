-- The run lifecycle on workers and the reaper: claim, renew, finish.
-- Every transition is guarded by state, attempt and lease owner; callers check
-- which rows came back.

-- name: claim_runs
-- Claim up to %(limit)s runs for one worker, highest priority first, then oldest.
WITH picked AS (
    SELECT id FROM pgflow.runs
    WHERE state IN ('queued', 'retrying') AND available_at <= now()
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
SELECT c.id, c.job, c.logical_time, c.attempt, c.max_attempts, c.params, c.attempt_started_at,
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
WITH result AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(owners)s::text[],
                         %(states)s::text[], %(delays)s::float8[], %(outcomes)s::text[],
                         %(started)s::timestamptz[], %(exit_codes)s::int[], %(errors)s::text[],
                         %(stdouts)s::text[], %(stderrs)s::text[])
        AS t(id, attempt, owner, state, delay_s, outcome, started_at, exit_code, error,
             stdout_tail, stderr_tail)
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
    WHERE r.id = res.id AND r.attempt = res.attempt AND r.lease_owner = res.owner
      AND r.state = 'running'
    RETURNING r.id, r.state
), recorded AS (
    INSERT INTO pgflow.attempts (run_id, attempt, worker_id, started_at, finished_at, outcome,
                                 exit_code, error, stdout_tail, stderr_tail)
    SELECT res.id, res.attempt, res.owner, res.started_at, now(), res.outcome, res.exit_code,
           res.error, res.stdout_tail, res.stderr_tail
    FROM finished f JOIN result res ON res.id = f.id
)
SELECT id, state FROM finished

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
-- (this is what makes a tick exactly-once). The caller sends notify_queue in the same
-- transaction when anything was created.
INSERT INTO pgflow.runs (job, logical_time, state, max_attempts, trigger, tenant, priority,
                         params)
SELECT i.job, i.logical_time, 'queued', j.max_attempts, %(trigger)s, j.tenant, j.priority,
       j.params || coalesce(%(params)s::jsonb, '{}')
FROM unnest(%(jobs)s::text[], %(times)s::timestamptz[]) AS i(job, logical_time)
JOIN pgflow.jobs j ON j.name = i.job
ON CONFLICT (job, logical_time) DO NOTHING
RETURNING id, job, logical_time
