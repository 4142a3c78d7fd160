-- name: lock_registry
-- Registrations validate against the whole graph, so they take turns.
SELECT pg_advisory_xact_lock(7451170143917352001)

-- name: registry_snapshot
SELECT j.name, j.schedule, j.timezone, j.definition, j.next_fire_at,
       coalesce(array_agg(d.upstream ORDER BY d.upstream) FILTER (WHERE d.upstream IS NOT NULL),
                '{}') AS depends_on
FROM pgflow.jobs j
LEFT JOIN pgflow.job_deps d ON d.job = j.name
GROUP BY j.name

-- name: upsert_jobs
INSERT INTO pgflow.jobs AS j (name, tenant, schedule, timezone, command, entrypoint, priority,
    timeout_s, max_active_runs, catchup, sources, params, max_attempts, backoff_s, max_backoff_s,
    jitter, no_retry_exit_codes, next_fire_at, definition, deadline_s)
SELECT r.name, r.tenant, r.schedule, r.timezone, r.command, r.entrypoint, r.priority,
    r.timeout_s, r.max_active_runs, r.catchup,
    ARRAY(SELECT jsonb_array_elements_text(r.sources)), r.params, r.max_attempts, r.backoff_s,
    r.max_backoff_s, r.jitter, ARRAY(SELECT jsonb_array_elements_text(r.no_retry_exit_codes))::int[],
    r.next_fire_at, r.definition, r.deadline_s
FROM jsonb_to_recordset(%(rows)s::jsonb) AS r(name text, tenant text, schedule text,
    timezone text, command jsonb, entrypoint text, priority int, timeout_s float8,
    max_active_runs int, catchup text, sources jsonb, params jsonb, max_attempts int,
    backoff_s float8, max_backoff_s float8, jitter bool, no_retry_exit_codes jsonb,
    next_fire_at timestamptz, definition jsonb, deadline_s float8)
ON CONFLICT (name) DO UPDATE SET
    tenant = EXCLUDED.tenant, schedule = EXCLUDED.schedule, timezone = EXCLUDED.timezone,
    command = EXCLUDED.command, entrypoint = EXCLUDED.entrypoint, priority = EXCLUDED.priority,
    timeout_s = EXCLUDED.timeout_s, max_active_runs = EXCLUDED.max_active_runs,
    catchup = EXCLUDED.catchup, sources = EXCLUDED.sources, params = EXCLUDED.params,
    max_attempts = EXCLUDED.max_attempts, backoff_s = EXCLUDED.backoff_s,
    max_backoff_s = EXCLUDED.max_backoff_s, jitter = EXCLUDED.jitter,
    no_retry_exit_codes = EXCLUDED.no_retry_exit_codes, deadline_s = EXCLUDED.deadline_s,
    -- Same schedule: keep the row's current fire time (the scheduler may have advanced it
    -- since the registry read it), so re-registering never repeats or skips a tick.
    next_fire_at = CASE WHEN j.schedule IS NOT DISTINCT FROM EXCLUDED.schedule
                             AND j.timezone = EXCLUDED.timezone
                        THEN coalesce(j.next_fire_at, EXCLUDED.next_fire_at)
                        ELSE EXCLUDED.next_fire_at END,
    definition = EXCLUDED.definition, updated_at = now()

-- name: delete_deps
DELETE FROM pgflow.job_deps WHERE job = ANY(%(jobs)s::text[])

-- name: insert_deps
INSERT INTO pgflow.job_deps (job, upstream)
SELECT * FROM unnest(%(dep_jobs)s::text[], %(dep_upstreams)s::text[])

-- name: delete_jobs
-- History stays: runs are kept, but runs that have not started yet are cancelled
-- and running ones are asked to stop. Returns the backfills of the cancelled runs (the
-- caller completes those left with nothing to run). No pending run downstream can be
-- left behind: a job is only removed together with, or after, the jobs depending on it.
WITH gone AS (
    DELETE FROM pgflow.jobs WHERE name = ANY(%(names)s::text[]) RETURNING name
), unstarted AS (
    UPDATE pgflow.runs SET state = 'cancelled', finished_at = now()
    WHERE job IN (SELECT name FROM gone) AND state IN ('pending', 'queued', 'retrying')
    RETURNING backfill_id
), started AS (
    UPDATE pgflow.runs SET cancel_requested = true
    WHERE job IN (SELECT name FROM gone) AND state = 'running'
)
SELECT name,
       ARRAY(SELECT DISTINCT backfill_id FROM unstarted WHERE backfill_id IS NOT NULL)
           AS backfills
FROM gone

-- name: downstreams_of
SELECT job, upstream FROM pgflow.job_deps
WHERE upstream = ANY(%(names)s::text[]) AND NOT job = ANY(%(names)s::text[])
ORDER BY job

-- name: notify_jobs_changed
SELECT pg_notify('pgflow_jobs', '')

-- name: list_jobs
SELECT j.name, j.tenant, j.schedule, j.timezone, j.paused, j.next_fire_at, j.priority,
       coalesce(array_agg(d.upstream ORDER BY d.upstream) FILTER (WHERE d.upstream IS NOT NULL),
                '{}') AS depends_on
FROM pgflow.jobs j
LEFT JOIN pgflow.job_deps d ON d.job = j.name
WHERE (%(tenant)s::text IS NULL OR j.tenant = %(tenant)s)
GROUP BY j.name
ORDER BY j.name
LIMIT %(limit)s

-- name: get_job
SELECT j.name, j.tenant, j.schedule, j.timezone, j.paused, j.next_fire_at, j.definition,
       j.created_at, j.updated_at,
       ARRAY(SELECT upstream FROM pgflow.job_deps WHERE job = j.name ORDER BY 1) AS depends_on,
       ARRAY(SELECT job FROM pgflow.job_deps WHERE upstream = j.name ORDER BY 1) AS downstream
FROM pgflow.jobs j
WHERE j.name = %(name)s

-- name: set_paused
UPDATE pgflow.jobs SET paused = %(paused)s, updated_at = now()
WHERE name = %(name)s
RETURNING name, paused
