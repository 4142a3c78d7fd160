-- Re-runs (pgflow/rerun.py): a finished run runs again as its next attempt, optionally
-- with its downstream runs at the same logical time; a backfill re-runs existing ticks.
-- Every change is guarded by the finished states it may start from; callers compare
-- the rows that came back with what they asked for.

-- fragment: rerun_reset
-- What a re-run starts from: a fresh attempt budget on top of the attempts used, no
-- checkpoint, no progress (retry keeps the checkpoint; a re-run starts clean).
max_attempts = r.attempt + j.max_attempts, finished_at = NULL, acked_at = NULL,
    cancel_requested = false, available_at = now(),
    checkpoint = NULL, checkpoint_attempt = NULL, checkpoint_at = NULL,
    progress = NULL, progress_message = NULL, progress_at = NULL

-- name: run_rerun
-- A finished run whose job still exists: queued, or pending when it has upstream runs at
-- its logical time (the caller settles it at once, as a retry does).
UPDATE pgflow.runs r
SET state =
    -- include: pending_if_upstreams
    ,
    -- include: rerun_reset
FROM pgflow.jobs j
WHERE r.id = %(id)s AND r.state IN ('succeeded', 'failed', 'cancelled', 'upstream_failed')
  AND j.name = r.job
RETURNING r.id, r.job, r.state, r.attempt, r.max_attempts, r.logical_time, r.backfill_id

-- name: rerun_downstream_closure
-- Every run downstream of the runs %(ids)s at their logical time (transitively),
-- locked in id order so that two re-runs, a finisher or a settler never see it change
-- between this look and the update.
WITH RECURSIVE down(id, job, logical_time) AS (
    SELECT r.id, r.job, r.logical_time FROM pgflow.runs r WHERE r.id = ANY(%(ids)s::bigint[])
    UNION
    SELECT n.id, n.job, n.logical_time
    FROM down
    JOIN pgflow.job_deps d ON d.upstream = down.job
    JOIN pgflow.run_keys k ON k.job = d.job AND k.logical_time = down.logical_time
    JOIN pgflow.runs n ON n.id = k.run_id
)
SELECT r.id, r.job, r.state
FROM pgflow.runs r
WHERE r.id IN (SELECT id FROM down) AND NOT r.id = ANY(%(ids)s::bigint[])
ORDER BY r.id
FOR UPDATE OF r

-- name: rerun_pend_runs
-- Finished runs %(ids)s wait for their upstreams again (their backfill, if given).
UPDATE pgflow.runs r
SET state = 'pending', backfill_id = coalesce(%(backfill_id)s, r.backfill_id),
    -- include: rerun_reset
FROM pgflow.jobs j
WHERE r.id = ANY(%(ids)s::bigint[])
  AND r.state IN ('succeeded', 'failed', 'cancelled', 'upstream_failed') AND j.name = r.job
RETURNING r.id

-- name: backfill_reprocess
-- A backfill's existing ticks in %(states)s become its own held runs (pending, trigger
-- backfill, its priority): the leader releases them under its cap like new ticks.
WITH picked AS (
    SELECT r.id FROM pgflow.run_keys k
    JOIN pgflow.runs r ON r.id = k.run_id
    WHERE k.job = %(job)s AND k.logical_time = ANY(%(times)s::timestamptz[])
      AND r.state = ANY(%(states)s::text[])
      AND r.backfill_id IS DISTINCT FROM %(backfill_id)s
    ORDER BY r.id
    FOR UPDATE OF r
)
UPDATE pgflow.runs r
SET state = 'pending', trigger = 'backfill', backfill_id = %(backfill_id)s,
    priority = j.priority + %(priority_offset)s,
    -- include: rerun_reset
FROM picked, pgflow.jobs j
WHERE r.id = picked.id AND j.name = r.job AND r.state = ANY(%(states)s::text[])
RETURNING r.id
