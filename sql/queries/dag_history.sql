-- The root job page's pipeline history (pgflow/web/dag_history.py): its latest DAG runs
-- (logical times) and every run of its DAG at those times, for the end-to-end trend and
-- the grid. Bounded: %(times)s logical times (run_keys' primary key, backwards) and
-- at most %(max_jobs)s jobs, so at most times × jobs run-key probes.

-- name: dag_history_times
SELECT logical_time FROM pgflow.run_keys WHERE job = %(job)s
ORDER BY logical_time DESC LIMIT %(times)s

-- name: dag_history_jobs
-- The DAG (weakly connected jobs) %(job)s belongs to, each with its upstreams.
WITH RECURSIVE component(job) AS (
    SELECT %(job)s::text
    UNION
    SELECT CASE WHEN d.upstream = c.job THEN d.job ELSE d.upstream END
    FROM component c JOIN pgflow.job_deps d ON d.upstream = c.job OR d.job = c.job
)
SELECT c.job, ARRAY(SELECT upstream FROM pgflow.job_deps WHERE job = c.job ORDER BY 1)
           AS depends_on
FROM component c ORDER BY c.job <> %(job)s, c.job LIMIT %(max_jobs)s

-- name: dag_history_runs
SELECT r.id, r.job, r.logical_time, r.state, r.trigger, r.created_at, r.started_at,
       r.finished_at
FROM unnest(%(jobs)s::text[]) AS j(job)
CROSS JOIN unnest(%(times)s::timestamptz[]) AS t(at)
JOIN pgflow.run_keys k ON k.job = j.job AND k.logical_time = t.at
JOIN pgflow.runs r ON r.id = k.run_id
