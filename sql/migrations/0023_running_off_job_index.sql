-- A claim no longer adds an entry to runs_job_idx (issue 16: 2 to 3 µs of PostgreSQL's
-- CPU a run in the bare claim/finish loop, one of the ten index entries a run's two
-- transitions and its attempt write). Running runs get their own index, keyed like
-- runs_job_idx, which takes the place of runs_owner_idx (lease_owner): the claim still
-- writes one entry there. Statements that want a job's runs newest first read both
-- (pgflow.latest_run, or a UNION ALL of the two merged by id); those that look for
-- one owner's running runs read all of runs_running_idx: running runs are few (at most
-- the cluster's total concurrency).
CREATE INDEX runs_settled_job_idx ON pgflow.runs (job, id DESC) WHERE state <> 'running';
CREATE INDEX runs_running_idx ON pgflow.runs (job, id DESC) WHERE state = 'running';
DROP INDEX pgflow.runs_job_idx;
DROP INDEX pgflow.runs_owner_idx;
ALTER INDEX pgflow.runs_settled_job_idx RENAME TO runs_job_idx;

-- A job's newest run (none: no row), from the two indexes above: one probe each. A
-- set-returning SQL function of one SELECT is inlined into the statement that calls it
-- (LEFT JOIN LATERAL pgflow.latest_run(j.name) ...), so it costs what the UNION written
-- out would; a scalar function would run as a call per job (7 times slower).
CREATE FUNCTION pgflow.latest_run(job_name text) RETURNS SETOF pgflow.runs
LANGUAGE sql STABLE AS $$
    SELECT * FROM (
        (SELECT * FROM pgflow.runs WHERE job = job_name AND state <> 'running'
         ORDER BY id DESC LIMIT 1)
        UNION ALL
        (SELECT * FROM pgflow.runs WHERE job = job_name AND state = 'running'
         ORDER BY id DESC LIMIT 1)) newest
    ORDER BY id DESC LIMIT 1
$$;
