-- The dashboard's named panels (pgflow/web/panels.py): recent failures, running runs,
-- the most-failing and the slowest jobs of the last 24 hours. Every statement reads a
-- bounded slice through an index: the day's failures (runs_failed_idx), the running
-- runs (the 'running' partial indexes), the slow_hours rows and the current hour of
-- runs_finished_idx, never the day's history as a whole.

-- name: web_rollup_slow_hours
-- Count the closed hours (ended more than %(settle_s)s ago) of the last 24 hours that
-- have no slow_hours row yet, newest first, at most %(limit)s per call: the slowest run
-- of each job that finished in the hour, the %(per_hour)s slowest of them kept
-- (runs_finished_idx over that hour only). An hour without runs gets an empty list.
-- Web replicas may race: an hour's row is the same whoever inserts it.
WITH todo AS (
    SELECT h AS hour
    FROM generate_series(date_trunc('hour', now() - interval '24 hours'),
                         date_trunc('hour', now() - make_interval(secs => %(settle_s)s))
                             - interval '1 hour',
                         interval '1 hour') AS h
    WHERE NOT EXISTS (SELECT 1 FROM pgflow.slow_hours s WHERE s.hour = h)
    ORDER BY h DESC
    LIMIT %(limit)s
), longest AS (
    SELECT DISTINCT ON (t.hour, r.job) t.hour, r.job, r.id AS run_id, r.state,
           extract(epoch FROM r.finished_at - r.started_at)::float8 AS seconds
    FROM todo t
    JOIN pgflow.runs r ON r.finished_at >= t.hour AND r.finished_at < t.hour + interval '1 hour'
    WHERE r.started_at IS NOT NULL
    ORDER BY t.hour, r.job, seconds DESC, r.id
), ranked AS (
    SELECT l.*, row_number() OVER (PARTITION BY l.hour ORDER BY l.seconds DESC, l.job) AS rank
    FROM longest l
), forgotten AS (
    DELETE FROM pgflow.slow_hours WHERE hour < now() - interval '25 hours'
)
INSERT INTO pgflow.slow_hours (hour, slowest)
SELECT t.hour,
       coalesce((SELECT jsonb_agg(jsonb_build_object('job', x.job, 'run_id', x.run_id,
                                                     'state', x.state, 'seconds', x.seconds)
                                  ORDER BY x.rank)
                 FROM ranked x WHERE x.hour = t.hour AND x.rank <= %(per_hour)s), '[]')
FROM todo t
ON CONFLICT (hour) DO NOTHING

-- name: web_dashboard_panels
-- The panels' rows in one statement. Failures: the latest %(limit)s dead-lettered runs
-- with their last attempt's error, and the jobs with the most failures among the day's
-- latest %(failures_scan)s (runs_failed_idx, index-only). Running: how many, and the
-- %(limit)s whose attempt has run longest. Slowest: the counted hours of slow_hours and,
-- live, the runs finished since the last hour that can be counted (at most an hour and
-- %(settle_s)s seconds of runs_finished_idx).
SELECT now() AS now,
       (SELECT coalesce(jsonb_agg(f ORDER BY f.finished_at DESC, f.id DESC), '[]')
        FROM (SELECT r.id, r.job, r.logical_time, r.finished_at, r.attempt, r.acked_at,
                     left(a.error, 300) AS error, a.outcome, a.exit_code
              FROM (SELECT id FROM pgflow.runs
                    WHERE state = 'failed' AND finished_at IS NOT NULL
                    ORDER BY finished_at DESC LIMIT %(limit)s) latest
              JOIN pgflow.runs r ON r.id = latest.id
              LEFT JOIN pgflow.attempts a ON a.run_id = r.id AND a.attempt = r.attempt) f
       ) AS failures,
       (SELECT coalesce(jsonb_agg(j ORDER BY j.failures DESC, j.last_failed_at DESC), '[]')
        FROM (SELECT job, count(*)::int AS failures, max(finished_at) AS last_failed_at
              FROM (SELECT job, finished_at FROM pgflow.runs
                    WHERE state = 'failed' AND finished_at >= now() - interval '24 hours'
                    ORDER BY finished_at DESC LIMIT %(failures_scan)s) day
              GROUP BY job
              ORDER BY failures DESC, last_failed_at DESC
              LIMIT %(limit)s) j
       ) AS failing,
       (SELECT count(*)::int FROM (
            SELECT 1 FROM pgflow.runs
            WHERE state = 'failed' AND finished_at >= now() - interval '24 hours'
            LIMIT %(failures_scan)s) day) AS failures_day,
       (SELECT count(*)::int FROM pgflow.runs WHERE state = 'running') AS running_total,
       (SELECT coalesce(jsonb_agg(x ORDER BY x.age_s DESC, x.id), '[]')
        FROM (SELECT id, job, logical_time, attempt, max_attempts, lease_owner,
                     attempt_started_at, progress, progress_message,
                     extract(epoch FROM now() - attempt_started_at)::float8 AS age_s
              FROM pgflow.runs WHERE state = 'running'
              ORDER BY attempt_started_at, id LIMIT %(limit)s) x
       ) AS running,
       (SELECT coalesce(jsonb_agg(s.slowest), '[]') FROM pgflow.slow_hours s
        WHERE s.hour >= date_trunc('hour', now() - interval '24 hours')) AS slow_hours,
       (SELECT coalesce(jsonb_agg(l), '[]')
        FROM (SELECT job, run_id, state, seconds
              FROM (SELECT DISTINCT ON (r.job) r.job, r.id AS run_id, r.state,
                           extract(epoch FROM r.finished_at - r.started_at)::float8 AS seconds
                    FROM pgflow.runs r
                    WHERE r.finished_at >= date_trunc('hour',
                                                      now() - make_interval(secs => %(settle_s)s))
                      AND r.started_at IS NOT NULL
                    ORDER BY r.job, seconds DESC, r.id) per_job
              ORDER BY seconds DESC, job LIMIT %(per_hour)s) l
       ) AS slow_live
