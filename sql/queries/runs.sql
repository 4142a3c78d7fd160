-- Operator actions on runs (trigger, list, show, retry, cancel, ack) and the cluster
-- status. Every state change is one UPDATE guarded by the states it may start from;
-- the caller checks whether a row came back and re-reads the run to explain a refusal.

-- name: run_db_second
-- The database clock, to the second: the default logical time of a manual trigger.
SELECT date_trunc('second', coalesce(%(now)s::timestamptz, now())) AS now

-- name: run_job_names
-- Only read to suggest a name after a miss.
SELECT name FROM pgflow.jobs ORDER BY name

-- name: run_by_logical_time
SELECT r.id, r.state FROM pgflow.run_keys k JOIN pgflow.runs r ON r.id = k.run_id
WHERE k.job = %(job)s AND k.logical_time = %(logical_time)s

-- fragment: run_list_filters
-- The optional filters every listing of runs takes (null: no filter).
AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
AND (%(trigger)s::text IS NULL OR trigger = %(trigger)s)
AND (%(since)s::timestamptz IS NULL OR logical_time >= %(since)s)
AND (%(until)s::timestamptz IS NULL OR logical_time < %(until)s)

-- fragment: run_columns
-- What a listing shows of each run.
SELECT id, job, logical_time, state, attempt, max_attempts, trigger, tenant, priority,
       cancel_requested, acked_at, backfill_id, created_at, started_at, finished_at

-- name: runs_list_all
-- Listings (CLI, API, pages) take the filter's own index, and page with id < cursor
-- (an index condition).
-- include: run_columns
FROM pgflow.runs
WHERE id < coalesce(%(before_id)s::bigint, 9223372036854775807)
  -- include: run_list_filters
ORDER BY id DESC
LIMIT %(limit)s

-- fragment: runs_of_job
-- The runs of job %(job)s as one table: those not running (runs_job_idx) and the running
-- ones (runs_running_idx: a claim writes no runs_job_idx entry, migration 0023). The
-- planner pushes a listing's conditions into both arms and merges them by id.
(SELECT * FROM pgflow.runs WHERE job = %(job)s AND state <> 'running'
 UNION ALL
 SELECT * FROM pgflow.runs WHERE job = %(job)s AND state = 'running') AS runs

-- name: runs_list_by_job
-- A job's runs newest first (runs_of_job).
-- include: run_columns
FROM
-- include: runs_of_job
WHERE id < coalesce(%(before_id)s::bigint, 9223372036854775807)
  AND (%(state)s::text IS NULL OR state = %(state)s)
  -- include: run_list_filters
ORDER BY id DESC
LIMIT %(limit)s

-- name: runs_list_by_state
-- include: run_columns
FROM pgflow.runs
WHERE state = %(state)s
  AND id < coalesce(%(before_id)s::bigint, 9223372036854775807)
  -- include: run_list_filters
ORDER BY id DESC
LIMIT %(limit)s

-- name: runs_floor
-- Run listings with a filter that their index does not cover (tenant, trigger, logical
-- time, or a state within a job) read at most %(scan)s index entries per page: this is
-- the id of the entry %(scan)s places below the cursor on the index the page walks
-- (runs_job_idx merged with runs_running_idx, runs_state_idx -- runs_running_idx for
-- the few running runs -- or the primary key), or NULL when fewer are left. Only the
-- branch taken runs (each subquery is an init plan).
SELECT CASE
    WHEN %(job)s::text IS NOT NULL THEN
        (SELECT id FROM
         -- include: runs_of_job
         WHERE id < %(before_id)s ORDER BY id DESC OFFSET %(scan)s LIMIT 1)
    WHEN %(state)s::text IS NOT NULL THEN
        (SELECT id FROM pgflow.runs WHERE state = %(state)s AND id < %(before_id)s
         ORDER BY id DESC OFFSET %(scan)s LIMIT 1)
    ELSE
        (SELECT id FROM pgflow.runs WHERE id < %(before_id)s
         ORDER BY id DESC OFFSET %(scan)s LIMIT 1)
    END AS floor

-- fragment: run_page_filters
WHERE id < %(before_id)s AND id > coalesce(%(floor)s::bigint, 0)
  AND (%(state)s::text IS NULL OR state = %(state)s)

-- name: runs_page
-- One page of runs, newest first: ids below %(before_id)s and above %(floor)s (see
-- runs_floor), optional filters as in the listings above (not a job: runs_page_of_job).
-- include: run_columns
     , progress, progress_message
FROM pgflow.runs
-- include: run_page_filters
  -- include: run_list_filters
ORDER BY id DESC
LIMIT %(limit)s

-- name: runs_page_of_job
-- runs_page of one job (runs_of_job).
-- include: run_columns
     , progress, progress_message
FROM
-- include: runs_of_job
-- include: run_page_filters
  -- include: run_list_filters
ORDER BY id DESC
LIMIT %(limit)s

-- name: run_get
SELECT r.id, r.job, r.logical_time, r.state, r.attempt, r.max_attempts, r.trigger, r.tenant,
       r.priority, r.params, r.available_at, r.lease_owner, r.lease_expires_at,
       r.cancel_requested, r.acked_at, r.created_at, r.started_at, r.finished_at,
       (j.name IS NOT NULL) AS job_exists,
       r.progress, r.progress_message, r.progress_at, r.checkpoint_attempt, r.checkpoint_at
FROM pgflow.runs r
LEFT JOIN pgflow.jobs j ON j.name = r.job
WHERE r.id = %(id)s

-- name: run_attempts
-- Finished attempts come from the table; the one in progress lives on the run row.
SELECT attempt, worker_id, started_at, finished_at, outcome, exit_code, error,
       stdout_tail, stderr_tail
FROM pgflow.attempts
WHERE run_id = %(id)s
UNION ALL
SELECT attempt, lease_owner, attempt_started_at, NULL, NULL, NULL, NULL, NULL, NULL
FROM pgflow.runs
WHERE id = %(id)s AND state = 'running'
ORDER BY attempt

-- fragment: pending_if_upstreams
-- A run going again: pending when it has upstream runs at its logical time (the caller
-- settles it at once: deps.settle), queued otherwise.
CASE WHEN EXISTS (
         SELECT 1 FROM pgflow.job_deps d
         JOIN pgflow.run_keys k ON k.job = d.upstream AND k.logical_time = r.logical_time
         WHERE d.job = r.job)
     THEN 'pending' ELSE 'queued' END

-- name: run_retry
-- A fresh attempt budget on top of the attempts already used; the job must still exist.
-- A run with upstream runs at its logical time goes back to pending, and the caller
-- settles it at once (deps.settle): it is queued only once they have all succeeded.
UPDATE pgflow.runs r
SET state =
    -- include: pending_if_upstreams
    ,
    max_attempts = r.attempt + j.max_attempts, finished_at = NULL,
    acked_at = NULL, cancel_requested = false, available_at = coalesce(%(now)s, now())
FROM pgflow.jobs j
WHERE r.id = %(id)s AND r.state IN ('failed', 'cancelled') AND j.name = r.job
RETURNING r.id, r.job, r.state, r.attempt, r.max_attempts

-- name: run_cancel
-- Unstarted runs are cancelled here; a running one is flagged and its worker told, and
-- the worker (or the reaper, if it is gone) records the final state.
WITH changed AS (
    UPDATE pgflow.runs
    SET state = CASE WHEN state = 'running' THEN state ELSE 'cancelled' END,
        finished_at = CASE WHEN state = 'running' THEN NULL
                           ELSE coalesce(%(now)s, now()) END,
        cancel_requested = true
    WHERE id = %(id)s AND state IN ('pending', 'queued', 'retrying', 'running')
    RETURNING id, job, state, lease_owner, backfill_id
), told AS (
    SELECT pg_notify('pgflow_cancel', id::text) FROM changed WHERE state = 'running'
)
SELECT id, job, state, lease_owner, backfill_id, (SELECT count(*) FROM told) AS notified
FROM changed

-- name: run_ack
UPDATE pgflow.runs
SET acked_at = coalesce(%(now)s, now())
WHERE id = %(id)s AND state = 'failed' AND acked_at IS NULL
RETURNING id, job, state, acked_at

-- name: runs_dead_letters
-- Failed and not yet acknowledged, newest first, with the last attempt's error.
SELECT r.id, r.job, r.logical_time, r.attempt, r.trigger, r.tenant, r.finished_at,
       a.outcome, a.exit_code, a.error
FROM pgflow.runs r
LEFT JOIN pgflow.attempts a ON a.run_id = r.id AND a.attempt = r.attempt
WHERE r.state = 'failed' AND r.acked_at IS NULL
ORDER BY r.finished_at DESC
LIMIT %(limit)s

-- name: status_replicas
-- Ages by the database clock: replicas' own clocks may disagree.
SELECT id, host, pid, roles, version, concurrency, stopping, started_at, heartbeat_at,
       round(extract(epoch FROM now() - heartbeat_at)::numeric, 3)::float8 AS heartbeat_age_s,
       heartbeat_at > now() - make_interval(secs => %(alive_ttls)s * %(ttl)s) AS alive
FROM pgflow.replicas
ORDER BY id

-- name: status_leader
SELECT l.replica_id, l.backend_pid, l.term, l.elected_at, l.heartbeat_at, r.host, r.pid,
       round(extract(epoch FROM now() - l.heartbeat_at)::numeric, 3)::float8 AS heartbeat_age_s,
       l.heartbeat_at < now() - make_interval(secs => %(ttl)s) AS stale
FROM pgflow.leader l
LEFT JOIN pgflow.replicas r ON r.id = l.replica_id

-- name: status_queue_depth
-- Only the non-terminal states: runs_state_idx (waiting runs) and runs_running_idx (running
-- ones) skip the finished history.
SELECT state, tenant, count(*) AS runs
FROM pgflow.runs
WHERE (state IN ('pending', 'queued', 'retrying') OR state = 'running')
GROUP BY state, tenant
ORDER BY state, tenant

-- name: status_dead_letters
SELECT count(*) AS dead_letters FROM pgflow.runs WHERE state = 'failed' AND acked_at IS NULL

-- name: bulk_runs_begin
-- pgflow.runs.keys_inserted_after: the key trigger is off for this transaction's load
-- (an ALTER TABLE, undone by bulk_runs_end or a rollback).
ALTER TABLE pgflow.runs DISABLE TRIGGER runs_key

-- name: bulk_runs_last_id
SELECT coalesce(max(id), 0) AS last_id FROM pgflow.runs

-- name: bulk_runs_keys
INSERT INTO pgflow.run_keys (job, logical_time, run_id)
SELECT job, logical_time, id FROM pgflow.runs WHERE id > %(after)s

-- name: bulk_runs_end
ALTER TABLE pgflow.runs ENABLE TRIGGER runs_key
