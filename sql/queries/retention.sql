-- Retention (pgflow/retention.py): finished runs older than PGFLOW_RETENTION are deleted
-- with their attempts, in short batches, by the leader. The cutoff is
-- coalesce(%(now)s, now()) - %(retention_s)s seconds.
--
-- A run may go when all of these hold (prune_runs and prune_preview must agree; the
-- tests check that they do):
--   * it finished before the cutoff in a terminal state: succeeded, cancelled,
--     upstream_failed, or failed and acknowledged (a dead letter stays until acked);
--   * no run of a direct downstream job at the same logical time is still pending,
--     queued, running or retrying: a pending run reads its upstreams' runs, and a
--     missing upstream run means "not part of this DAG run" (queue_ready_runs), so the
--     upstream stays until its downstreams are done;
--   * if it is upstream_failed, no run of a direct upstream job at the same logical
--     time is a dead letter (failed, not acked) or upstream_failed itself: retrying
--     that dead letter must find it to resume it (restore_downstreams). Such a chain
--     goes one level per pass once the dead letter is acknowledged.

-- fragment: prunable_run
-- Run r may go: finished before the cutoff, not a dead letter still waiting for an
-- operator, no downstream run at its logical time still to come, and (upstream_failed)
-- no upstream an operator may still retry. Each dependency test reads job_deps first and
-- then one run by its key (run_keys; a scalar subquery cannot be turned into a join that
-- starts from the queue).
r.finished_at < coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(retention_s)s)
AND (r.state IN ('succeeded', 'cancelled', 'upstream_failed')
     OR (r.state = 'failed' AND r.acked_at IS NOT NULL))
AND NOT EXISTS (
    SELECT 1 FROM pgflow.job_deps d
    WHERE d.upstream = r.job
      AND (SELECT p.state IN ('pending', 'queued', 'running', 'retrying')
           FROM pgflow.run_keys k JOIN pgflow.runs p ON p.id = k.run_id
           WHERE k.job = d.job AND k.logical_time = r.logical_time))
AND (r.state <> 'upstream_failed' OR NOT EXISTS (
    SELECT 1 FROM pgflow.job_deps d
    WHERE d.job = r.job
      AND (SELECT u.state = 'upstream_failed' OR (u.state = 'failed' AND u.acked_at IS NULL)
           FROM pgflow.run_keys k JOIN pgflow.runs u ON u.id = k.run_id
           WHERE k.job = d.upstream AND k.logical_time = r.logical_time)))

-- name: prune_runs
-- One batch: the %(limit)s oldest finished runs after the cursor (%(after_finished)s,
-- %(after_id)s; NULLs start at the oldest) are the candidates (runs_finished_idx); those
-- that may go are locked SKIP LOCKED (a run an operator is retrying or acking right now
-- is left for the next pass, and nobody ever waits for this statement) and deleted with
-- their attempts (attempts have no foreign key: migration 0016); tables whose rows hang
-- off a run by an ON DELETE CASCADE key (log chunks, dataset deliveries) go through it.
-- Returns how many candidates were looked at, the cursor to continue from, and the
-- deleted runs per state.
WITH candidates AS (
    SELECT r.id, r.finished_at
    FROM pgflow.runs r
    WHERE r.finished_at IS NOT NULL
      AND r.finished_at < coalesce(%(now)s::timestamptz, now())
                          - make_interval(secs => %(retention_s)s)
      -- The first test is the index condition (runs_finished_idx has no id): the scan
      -- starts at the cursor, not at the dead index entries of the batches before it.
      AND r.finished_at >= coalesce(%(after_finished)s::timestamptz, '-infinity')
      AND (r.finished_at, r.id) > (coalesce(%(after_finished)s::timestamptz, '-infinity'),
                                   coalesce(%(after_id)s::bigint, 0))
    ORDER BY r.finished_at, r.id
    LIMIT %(limit)s
), doomed AS (
    SELECT r.id, r.state
    FROM pgflow.runs r
    WHERE r.id IN (SELECT id FROM candidates)
      -- Rechecked on the row as locked: a run retried since the snapshot no longer matches.
      AND
      -- include: prunable_run
    FOR UPDATE OF r SKIP LOCKED
), gone AS (
    DELETE FROM pgflow.runs r USING doomed d WHERE r.id = d.id
    RETURNING r.state
), gone_attempts AS (
    -- by the attempts' primary key (a join was planned as a scan of all attempts)
    DELETE FROM pgflow.attempts a WHERE a.run_id = ANY (ARRAY(SELECT id FROM doomed))
), last AS (
    SELECT finished_at, id FROM candidates ORDER BY finished_at DESC, id DESC LIMIT 1
)
SELECT (SELECT count(*) FROM candidates)::int AS scanned,
       (SELECT finished_at FROM last) AS after_finished,
       (SELECT id FROM last) AS after_id,
       (SELECT coalesce(jsonb_object_agg(state, n), '{}')
        FROM (SELECT state, count(*)::int AS n FROM gone GROUP BY state) s) AS runs

-- name: prune_backfills
-- Backfills that ended before the cutoff and have no run left (runs_backfill_idx).
DELETE FROM pgflow.backfills b
WHERE b.id IN (
    SELECT x.id FROM pgflow.backfills x
    WHERE x.state <> 'running'
      AND x.finished_at < coalesce(%(now)s::timestamptz, now())
                          - make_interval(secs => %(retention_s)s)
      AND NOT EXISTS (SELECT 1 FROM pgflow.runs r WHERE r.backfill_id = x.id)
    ORDER BY x.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED)
RETURNING b.id

-- name: prune_preview
-- What prune_runs would delete now (same rules), by state, with the oldest and newest
-- finished_at among them: `pgflow db prune --dry-run`. Reads every candidate.
SELECT r.state, count(*)::bigint AS runs, min(r.finished_at) AS oldest,
       max(r.finished_at) AS newest
FROM pgflow.runs r
WHERE r.finished_at IS NOT NULL
  AND
  -- include: prunable_run
GROUP BY r.state
ORDER BY r.state

-- name: retention_status
-- For `db status`: the cutoff, how many finished runs are past it (counted through
-- runs_finished_idx up to %(cap)s, so the answer stays cheap on any history; `capped`
-- says the real number is higher), how many of those are dead letters that stay until
-- acknowledged (runs_dead_idx), and the oldest finished run.
SELECT c.cutoff, p.n AS past_retention, p.n >= %(cap)s AS capped,
       (SELECT count(*) FROM pgflow.runs
        WHERE state = 'failed' AND acked_at IS NULL AND finished_at < c.cutoff)::int
           AS dead_letters_kept,
       (SELECT min(finished_at) FROM pgflow.runs WHERE finished_at IS NOT NULL) AS oldest_finished
FROM (SELECT coalesce(%(now)s::timestamptz, now())
             - make_interval(secs => %(retention_s)s) AS cutoff) c
CROSS JOIN LATERAL (
    SELECT count(*)::int AS n
    FROM (SELECT 1 FROM pgflow.runs
          WHERE finished_at IS NOT NULL AND finished_at < c.cutoff LIMIT %(cap)s) x
) p

-- name: record_prune
-- The leader's retention after a call of Pruner.run (one row, totals accumulate).
INSERT INTO pgflow.retention AS t (singleton, retention_s, replica_id, last_pass_at,
                                   last_pass_runs, pruned_runs, pruned_backfills)
VALUES (true, %(retention_s)s, %(replica_id)s, now(), %(runs)s, %(runs)s, %(backfills)s)
ON CONFLICT (singleton) DO UPDATE SET
    retention_s = EXCLUDED.retention_s, replica_id = EXCLUDED.replica_id,
    last_pass_at = EXCLUDED.last_pass_at, last_pass_runs = EXCLUDED.last_pass_runs,
    pruned_runs = t.pruned_runs + EXCLUDED.pruned_runs,
    pruned_backfills = t.pruned_backfills + EXCLUDED.pruned_backfills

-- name: retention_leader
SELECT retention_s, replica_id, last_pass_at, last_pass_runs, pruned_runs, pruned_backfills,
       round(extract(epoch FROM now() - last_pass_at)::numeric, 3)::float8 AS last_pass_age_s
FROM pgflow.retention

-- name: prune_alert_history
-- Notifications (delivered or given up) and resolved incidents older than the cutoff
-- (pgflow/alerts): bounded batches, like backfills.
WITH notes AS (
    DELETE FROM pgflow.notifications n
    WHERE n.id IN (
        SELECT x.id FROM pgflow.notifications x
        WHERE x.created_at < coalesce(%(now)s::timestamptz, now())
                             - make_interval(secs => %(retention_s)s)
          AND x.delivery <> 'pending'
        ORDER BY x.created_at
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED)
    RETURNING n.id
), incidents AS (
    DELETE FROM pgflow.incidents i
    WHERE i.id IN (
        SELECT x.id FROM pgflow.incidents x
        WHERE x.resolved_at < coalesce(%(now)s::timestamptz, now())
                              - make_interval(secs => %(retention_s)s)
        ORDER BY x.resolved_at
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED)
    RETURNING i.id
), streaks AS (  -- the streak marks of jobs deleted long ago
    DELETE FROM pgflow.alert_job_streaks s
    WHERE s.last_finished_at < coalesce(%(now)s::timestamptz, now())
                               - make_interval(secs => %(retention_s)s)
      AND NOT EXISTS (SELECT 1 FROM pgflow.jobs j WHERE j.name = s.job)
    RETURNING s.job
)
SELECT (SELECT count(*) FROM notes) AS notifications, (SELECT count(*) FROM incidents) AS incidents,
       (SELECT count(*) FROM streaks) AS streaks
