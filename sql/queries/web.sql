-- The web role: API listings, admin pages, the dashboard's aggregates and the metrics
-- scrape. Listings page by key (name or id) through an index; optional filters are
-- `%(x)s IS NULL OR ...` (the web pool does not prepare statements, so each query is
-- planned with its actual values).

-- name: web_jobs_page
-- One page of jobs by name after %(after)s, with each job's latest run
-- (pgflow.latest_run: runs_job_idx and runs_running_idx).
SELECT j.name, j.tenant, j.schedule, j.timezone, j.paused, j.priority, j.next_fire_at,
       ARRAY(SELECT d.upstream FROM pgflow.job_deps d WHERE d.job = j.name ORDER BY 1)
           AS depends_on,
       latest.id AS latest_run_id, latest.state AS latest_state,
       latest.logical_time AS latest_logical_time, latest.finished_at AS latest_finished_at
FROM pgflow.jobs j
LEFT JOIN LATERAL pgflow.latest_run(j.name) latest ON true
WHERE (%(after)s::text IS NULL OR j.name > %(after)s)
  AND (%(search)s::text IS NULL OR strpos(lower(j.name), lower(%(search)s)) > 0)
  AND (%(tenant)s::text IS NULL OR j.tenant = %(tenant)s)
  AND (%(paused)s::bool IS NULL OR j.paused = %(paused)s)
  AND (%(state)s::text IS NULL OR latest.state = %(state)s)
ORDER BY j.name
LIMIT %(limit)s

-- name: web_jobs_count
SELECT count(*)::int AS jobs
FROM pgflow.jobs j
WHERE (%(search)s::text IS NULL OR strpos(lower(j.name), lower(%(search)s)) > 0)
  AND (%(tenant)s::text IS NULL OR j.tenant = %(tenant)s)
  AND (%(paused)s::bool IS NULL OR j.paused = %(paused)s)
  AND (%(state)s::text IS NULL OR (
      SELECT r.state FROM pgflow.latest_run(j.name) r
  ) = %(state)s)

-- name: web_tenants
-- Tenants with their job counts, and their runs waiting or running.
SELECT t.tenant, t.jobs, t.paused,
       coalesce(q.queued, 0)::int AS queued, coalesce(q.running, 0)::int AS running,
       coalesce(q.pending, 0)::int AS pending, coalesce(q.retrying, 0)::int AS retrying
FROM (SELECT tenant, count(*)::int AS jobs, count(*) FILTER (WHERE paused)::int AS paused
      FROM pgflow.jobs GROUP BY tenant) t
FULL JOIN (
    SELECT tenant,
           count(*) FILTER (WHERE state = 'queued') AS queued,
           count(*) FILTER (WHERE state = 'running') AS running,
           count(*) FILTER (WHERE state = 'pending') AS pending,
           count(*) FILTER (WHERE state = 'retrying') AS retrying
    FROM pgflow.runs WHERE (state IN ('pending', 'queued', 'retrying') OR state = 'running')
    GROUP BY tenant
) q USING (tenant)
ORDER BY 1

-- name: web_run
SELECT r.id, r.job, r.logical_time, r.state, r.attempt, r.max_attempts, r.trigger, r.tenant,
       r.priority, r.params, r.available_at, r.lease_owner, r.lease_expires_at,
       r.cancel_requested, r.acked_at, r.backfill_id, r.created_at, r.started_at,
       r.finished_at, r.attempt_started_at, (j.name IS NOT NULL) AS job_exists,
       r.progress, r.progress_message, r.progress_at, r.checkpoint_attempt, r.checkpoint_at
FROM pgflow.runs r
LEFT JOIN pgflow.jobs j ON j.name = r.job
WHERE r.id = %(id)s

-- name: web_job_history
-- The job's latest %(runs)s runs by state, and their finished attempts' durations
-- (runs_job_idx and runs_running_idx merged by id, then the attempts' primary key).
WITH recent AS (
    SELECT id, state FROM
    -- include: runs_of_job
    ORDER BY id DESC LIMIT %(runs)s
)
SELECT (SELECT coalesce(jsonb_object_agg(state, n), '{}')
        FROM (SELECT state, count(*) AS n FROM recent GROUP BY state) s) AS states,
       (SELECT coalesce(array_agg(extract(epoch FROM a.finished_at - a.started_at)::float8
                                  ORDER BY a.finished_at), '{}')
        FROM recent r JOIN pgflow.attempts a ON a.run_id = r.id
        WHERE a.outcome = 'succeeded') AS durations,
       (SELECT count(*) FROM recent r JOIN pgflow.attempts a ON a.run_id = r.id
        WHERE a.outcome <> 'succeeded')::int AS failed_attempts

-- name: web_dag_edges
SELECT upstream, job FROM pgflow.job_deps
WHERE job = ANY(%(jobs)s::text[]) AND upstream = ANY(%(jobs)s::text[])
ORDER BY upstream, job

-- name: web_rollup_minutes
-- Count the closed minutes (ended more than %(settle_s)s ago, so that runs stamped with
-- a transaction's start time have committed) of the last 24 hours that have no row in
-- run_minutes yet, oldest first, at most %(limit)s minutes per call (runs_finished_idx):
-- a dashboard's cost stays bounded even on the first call of a busy installation. Empty
-- minutes get a row of zeros (they are counted too), and rows older than 25 hours go.
-- Web replicas may race: a minute's count is the same whoever inserts it.
WITH bounds AS (
    SELECT greatest(date_trunc('minute', now() - interval '24 hours'),
                    (SELECT max(minute) + interval '1 minute' FROM pgflow.run_minutes))
               AS lower,
           date_trunc('minute', now() - make_interval(secs => %(settle_s)s)) AS upper
), todo AS (
    SELECT m AS minute
    FROM bounds b,
         generate_series(b.lower, least(b.upper, b.lower + make_interval(mins => %(limit)s))
                                  - interval '1 minute', interval '1 minute') AS m
), counted AS (
    SELECT date_trunc('minute', r.finished_at) AS minute, count(*)::int AS finished,
           count(*) FILTER (WHERE r.state = 'succeeded')::int AS succeeded,
           count(*) FILTER (WHERE r.state = 'failed')::int AS failed
    FROM pgflow.runs r
    WHERE r.finished_at >= (SELECT min(minute) FROM todo)
      AND r.finished_at < (SELECT max(minute) + interval '1 minute' FROM todo)
    GROUP BY 1
), forgotten AS (
    DELETE FROM pgflow.run_minutes WHERE minute < now() - interval '25 hours'
)
INSERT INTO pgflow.run_minutes (minute, finished, succeeded, failed)
SELECT t.minute, coalesce(c.finished, 0), coalesce(c.succeeded, 0), coalesce(c.failed, 0)
FROM todo t LEFT JOIN counted c ON c.minute = t.minute
ON CONFLICT (minute) DO NOTHING

-- name: web_dashboard
-- Everything the dashboard shows, in one statement: queue depth, dead letters, the
-- oldest claimable run, replicas and leader, open breakers, and runs finished per
-- minute over the last 24 hours: the counted minutes (run_minutes, see
-- web_rollup_minutes) and, from runs_finished_idx, the minutes after them, at most the
-- last %(live_s)s seconds (older minutes not yet counted show up once they are).
SELECT now() AS now,
       (SELECT coalesce(jsonb_agg(d ORDER BY d.state, d.tenant), '[]')
        FROM (SELECT state, tenant, count(*)::int AS runs FROM pgflow.runs
              WHERE (state IN ('pending', 'queued', 'retrying') OR state = 'running')
              GROUP BY state, tenant) d) AS depth,
       (SELECT count(*)::int FROM pgflow.runs WHERE state = 'failed' AND acked_at IS NULL)
           AS dead_letters,
       (SELECT extract(epoch FROM now() - min(available_at))::float8 FROM pgflow.runs
        WHERE state IN ('queued', 'retrying') AND available_at <= now()) AS oldest_waiting_s,
       (SELECT coalesce(jsonb_agg(x ORDER BY x.id), '[]')
        FROM (SELECT id, host, pid, roles, concurrency, stopping,
                     extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age_s,
                     extract(epoch FROM now() - started_at)::float8 AS uptime_s
              FROM pgflow.replicas) x) AS replicas,
       (SELECT to_jsonb(l) FROM (
            SELECT replica_id, term, extract(epoch FROM now() - heartbeat_at)::float8
                   AS heartbeat_age_s
            FROM pgflow.leader) l) AS leader,
       ARRAY(SELECT source FROM pgflow.breakers WHERE state = 'open' ORDER BY source)
           AS open_breakers,
       (SELECT coalesce(jsonb_agg(m ORDER BY m.minute), '[]')
        FROM (SELECT extract(epoch FROM minute)::bigint AS minute, finished, succeeded, failed
              FROM pgflow.run_minutes
              WHERE minute >= date_trunc('minute', now() - interval '24 hours')
              UNION ALL
              SELECT extract(epoch FROM date_trunc('minute', finished_at))::bigint,
                     count(*)::int, count(*) FILTER (WHERE state = 'succeeded')::int,
                     count(*) FILTER (WHERE state = 'failed')::int
              FROM pgflow.runs
              WHERE finished_at >= greatest(
                        (SELECT max(minute) + interval '1 minute' FROM pgflow.run_minutes),
                        now() - make_interval(secs => %(live_s)s),
                        date_trunc('minute', now() - interval '24 hours'))
                AND finished_at IS NOT NULL
              GROUP BY 1) m) AS minutes

-- name: metrics_scrape
-- One statement per Prometheus scrape. Gauges are read as they are; counters and
-- histograms take the events of [%(since)s, upper): upper lags now() by %(settle)s
-- seconds so that rows stamped with a transaction's start time have committed
-- before their interval is read (each event is counted once, by the scrape whose
-- interval holds it). Durations bucket with width_bucket over negated bounds, which
-- counts the bounds >= a value: Prometheus' "le" (value <= bound) semantics.
WITH bounds AS (
    SELECT now() - make_interval(secs => %(settle)s) AS upper
)
SELECT (SELECT upper FROM bounds) AS upper,
       (SELECT coalesce(jsonb_agg(d), '[]')
        FROM (SELECT state, tenant, count(*)::int AS runs FROM pgflow.runs
              WHERE (state IN ('pending', 'queued', 'retrying') OR state = 'running')
              GROUP BY state, tenant) d) AS depth,
       (SELECT count(*)::int FROM pgflow.runs WHERE state = 'failed' AND acked_at IS NULL)
           AS dead_letters,
       (SELECT coalesce(extract(epoch FROM now() - min(available_at)), 0)::float8
        FROM pgflow.runs
        WHERE state IN ('queued', 'retrying') AND available_at <= now()) AS oldest_waiting_s,
       (SELECT count(*) FILTER (WHERE heartbeat_at > now() - make_interval(secs => %(alive_s)s))
        FROM pgflow.replicas)::int AS replicas_alive,
       (SELECT count(*) FROM pgflow.replicas)::int AS replicas_total,
       (SELECT to_jsonb(l) FROM (
            SELECT replica_id, term, extract(epoch FROM now() - heartbeat_at)::float8
                   AS heartbeat_age_s
            FROM pgflow.leader) l) AS leader,
       ARRAY(SELECT source FROM pgflow.breakers WHERE state = 'open' ORDER BY source)
           AS open_breakers,
       (SELECT coalesce(jsonb_agg(f), '[]')
        FROM (SELECT job, tenant, state AS outcome, count(*)::int AS n
              FROM pgflow.runs, bounds
              WHERE finished_at >= %(since)s AND finished_at < bounds.upper
              GROUP BY job, tenant, state) f) AS finished,
       (SELECT coalesce(jsonb_agg(a), '[]')
        FROM (SELECT r.job, a.outcome, count(*)::int AS n,
                     width_bucket(-extract(epoch FROM a.finished_at - a.started_at)::float8,
                                  %(neg_bounds)s::float8[]) AS bucket,
                     sum(extract(epoch FROM a.finished_at - a.started_at))::float8 AS seconds
              FROM pgflow.attempts a
              JOIN pgflow.runs r ON r.id = a.run_id, bounds
              WHERE a.finished_at >= %(since)s AND a.finished_at < bounds.upper
              GROUP BY r.job, a.outcome, bucket) a) AS attempts,
       (SELECT coalesce(jsonb_agg(s), '[]')
        FROM (SELECT count(*)::int AS n,
                     width_bucket(-greatest(extract(epoch FROM started_at - logical_time), 0)
                                  ::float8, %(neg_lag_bounds)s::float8[]) AS bucket,
                     sum(greatest(extract(epoch FROM started_at - logical_time), 0))::float8
                         AS seconds
              FROM (
                  -- started since the last scrape: running (runs_running_idx), started and
                  -- waiting again (runs_schedule_started_idx), or finished since, which
                  -- they must have been (runs_finished_idx)
                  SELECT started_at, logical_time FROM pgflow.runs
                  WHERE state = 'running' AND trigger = 'schedule' AND started_at >= %(since)s
                  UNION ALL
                  SELECT started_at, logical_time FROM pgflow.runs
                  WHERE trigger = 'schedule' AND started_at IS NOT NULL AND finished_at IS NULL
                    AND state <> 'running' AND started_at >= %(since)s
                  UNION ALL
                  SELECT started_at, logical_time FROM pgflow.runs
                  WHERE finished_at >= %(since)s AND trigger = 'schedule'
                    AND started_at >= %(since)s) r, bounds
              WHERE r.started_at < bounds.upper
              GROUP BY bucket) s) AS lags

-- name: web_tenant_names
SELECT DISTINCT tenant FROM pgflow.jobs ORDER BY 1

-- name: web_now
SELECT now() AS now
