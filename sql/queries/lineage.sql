-- name: lineage_nodes
-- A job's upstream and downstream closure: depth < 0 upstream, > 0 downstream, with the
-- latest run of each job.
WITH RECURSIVE up(job, depth) AS (
    SELECT %(job)s::text, 0
    UNION
    SELECT d.upstream, u.depth - 1 FROM up u JOIN pgflow.job_deps d ON d.job = u.job
), down(job, depth) AS (
    SELECT %(job)s::text, 0
    UNION
    SELECT d.job, x.depth + 1 FROM down x JOIN pgflow.job_deps d ON d.upstream = x.job
), nodes AS (
    SELECT job, min(depth) AS depth FROM up GROUP BY job
    UNION ALL
    SELECT job, max(depth) FROM down WHERE job <> %(job)s GROUP BY job
)
SELECT n.job, n.depth, latest.id AS run_id, latest.state, latest.logical_time
FROM nodes n
LEFT JOIN LATERAL pgflow.latest_run(n.job) latest ON true
ORDER BY n.depth, n.job

-- name: lineage_edges
SELECT upstream, job FROM pgflow.job_deps
WHERE job = ANY(%(jobs)s::text[]) AND upstream = ANY(%(jobs)s::text[])
ORDER BY upstream, job

-- name: dag_run
-- Every run of one logical time in the DAG (weakly connected jobs) that %(job)s belongs to.
WITH RECURSIVE component(job) AS (
    SELECT %(job)s::text
    UNION
    SELECT CASE WHEN d.upstream = c.job THEN d.job ELSE d.upstream END
    FROM component c JOIN pgflow.job_deps d ON d.upstream = c.job OR d.job = c.job
)
SELECT r.id, r.job, r.state, r.attempt, r.trigger, r.started_at, r.finished_at,
       r.logical_time, r.created_at, r.attempt_started_at,
       ARRAY(SELECT upstream FROM pgflow.job_deps WHERE job = r.job ORDER BY 1) AS depends_on
FROM component c
JOIN pgflow.run_keys k ON k.job = c.job AND k.logical_time = %(logical_time)s
JOIN pgflow.runs r ON r.id = k.run_id
ORDER BY r.id
