-- The scheduler: due jobs, advancing their fire times, and the leader election.
-- Runs themselves are created with create_runs (queue.sql).

-- name: scheduler_now
-- The instant one scheduling pass plans against: the pinned time of a test, else the
-- database clock (never the replica's clock).
SELECT coalesce(%(now)s::timestamptz, now()) AS now

-- name: due_jobs
-- Root jobs whose next tick has come, oldest first. Locked for the pass: a second
-- scheduler skips them instead of planning the same ticks. Served by jobs_due_idx.
-- in_dag: the job has downstream jobs, so its tick starts a whole DAG run of dag_runs
-- runs (the job and everything downstream of it), which weighs on the pass's budget.
SELECT name, schedule, timezone, catchup, next_fire_at, in_dag,
       CASE WHEN in_dag THEN (
           WITH RECURSIVE down(job) AS (
               SELECT j.name
               UNION
               SELECT d.job FROM down JOIN pgflow.job_deps d ON d.upstream = down.job)
           SELECT count(*) FROM down)::int
       ELSE 1 END AS dag_runs
FROM pgflow.jobs j,
     LATERAL (SELECT EXISTS (SELECT 1 FROM pgflow.job_deps d WHERE d.upstream = j.name)
              AS in_dag) x
WHERE NOT paused AND next_fire_at IS NOT NULL AND next_fire_at <= %(now)s::timestamptz
ORDER BY next_fire_at
LIMIT %(batch)s
FOR UPDATE SKIP LOCKED

-- name: advance_jobs
-- New fire times in bulk, just after the pass committed the runs of the ticks; NULL
-- stops a job whose schedule can no longer be evaluated (registering it again
-- recomputes the time). Only a job whose fire time is still the one the pass planned
-- from moves: one registered again since then keeps its new time.
UPDATE pgflow.jobs j
SET next_fire_at = a.next_fire_at
FROM unnest(%(names)s::text[], %(planned)s::timestamptz[], %(times)s::timestamptz[])
    AS a(name, planned, next_fire_at)
WHERE j.name = a.name AND j.next_fire_at IS NOT DISTINCT FROM a.planned

-- name: seconds_until_due
-- How long the leader may sleep: until the earliest unpaused fire time (negative when
-- something is already due), NULL when nothing is scheduled.
SELECT extract(epoch FROM min(next_fire_at) - clock_timestamp())::float8 AS seconds
FROM pgflow.jobs
WHERE NOT paused AND next_fire_at IS NOT NULL

-- name: try_leader_lock
SELECT pg_try_advisory_lock(%(key)s) AS won

-- name: claim_leadership
-- Called by the replica that just won the lock: a new term, recorded with the lock
-- session's backend pid so a standby can terminate that session if it freezes.
INSERT INTO pgflow.leader AS l (singleton, replica_id, backend_pid, term, elected_at,
                                heartbeat_at)
VALUES (true, %(replica_id)s, pg_backend_pid(), 1, now(), now())
ON CONFLICT (singleton) DO UPDATE SET
    replica_id = EXCLUDED.replica_id, backend_pid = EXCLUDED.backend_pid, term = l.term + 1,
    elected_at = EXCLUDED.elected_at, heartbeat_at = EXCLUDED.heartbeat_at
RETURNING term

-- name: listen_jobs
-- The leader wakes up when definitions change, or jobs are paused or resumed, and when
-- a dataset event waits for a consumer (pgflow/datasets.py).
LISTEN pgflow_jobs; LISTEN pgflow_datasets

-- name: leader_heartbeat
-- Guarded by replica and term: no row back means this replica no longer leads.
UPDATE pgflow.leader SET heartbeat_at = now()
WHERE replica_id = %(replica_id)s AND term = %(term)s
RETURNING term

-- name: depose_frozen_leader
-- Run by a standby that did not get the lock. Terminates the leader's session only when
-- its heartbeat is older than the TTL (database clock) and that backend still holds the
-- scheduler lock in this database, so a dead leader's recycled pid is never hit.
SELECT l.replica_id, l.term, l.backend_pid,
       pg_terminate_backend(l.backend_pid, %(wait_ms)s) AS terminated
FROM pgflow.leader l
WHERE l.heartbeat_at < now() - make_interval(secs => %(ttl)s)
  AND EXISTS (
    SELECT 1 FROM pg_locks k
    WHERE k.locktype = 'advisory' AND k.granted AND k.pid = l.backend_pid
      AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND k.classid::bigint = %(key_high)s AND k.objid::bigint = %(key_low)s
      AND k.objsubid = 1
  )

-- name: get_leader
SELECT replica_id, backend_pid, term, elected_at, heartbeat_at,
       heartbeat_at < now() - make_interval(secs => %(ttl)s) AS stale
FROM pgflow.leader
