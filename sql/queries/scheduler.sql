-- The scheduler: due jobs, advancing their fire times, and the leader election.
-- Runs themselves are created with create_runs (queue.sql).

-- name: scheduler_now
-- The instant one scheduling pass plans against: the pinned time of a test, else the
-- database clock (never the replica's clock).
SELECT coalesce(%(now)s::timestamptz, now()) AS now

-- name: due_jobs
-- Root jobs whose next tick has come, oldest first, and jobs without downstream jobs
-- whose next tick comes by %(horizon)s (created ahead: claimable from their tick on).
-- Locked for the pass: a second scheduler skips them instead of planning the same
-- ticks. Served by jobs_due_idx.
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
WHERE NOT paused AND next_fire_at IS NOT NULL
  AND next_fire_at <= %(horizon)s::timestamptz
  AND (next_fire_at <= %(now)s::timestamptz OR NOT in_dag)
ORDER BY next_fire_at
LIMIT %(batch)s
FOR UPDATE SKIP LOCKED

-- name: advance_jobs
-- New fire times in bulk, in the transaction that created the runs of the ticks; NULL
-- stops a job whose schedule can no longer be evaluated (registering it again
-- recomputes the time). Only a job whose fire time is still the one the pass planned
-- from moves (the pass holds the rows locked; the guard keeps a hand-run pass, which
-- may not, from moving a time someone else set).
UPDATE pgflow.jobs j
SET next_fire_at = a.next_fire_at
FROM unnest(%(names)s::text[], %(planned)s::timestamptz[], %(times)s::timestamptz[])
    AS a(name, planned, next_fire_at)
WHERE j.name = a.name AND j.next_fire_at IS NOT DISTINCT FROM a.planned

-- name: lock_jobs_for_withdrawal
-- Before withdraw_ahead_runs, as a statement of its own: wait for a scheduling pass
-- that holds any of these jobs, so that the withdrawal (a later snapshot) sees the runs
-- it created ahead and the fire times it moved.
SELECT count(*) AS locked FROM (
    SELECT name FROM pgflow.jobs WHERE name = ANY(%(names)s::text[]) ORDER BY name FOR UPDATE
) j

-- name: withdraw_ahead_runs
-- Runs of jobs %(names)s created ahead of a tick still to come (queued, never started,
-- available_at in the future) are deleted, as if the pass had not created them yet;
-- for the jobs in %(rewind)s the fire time moves back to the earliest withdrawn tick, so
-- the next pass creates it again as the job now stands (the others are getting a new
-- fire time from their caller). A claim that won the race took its run: no longer
-- queued, it stays. A pause takes the same runs in its trigger
-- (sql/migrations/0019_withdraw_on_pause.sql; a test keeps the two in step).
WITH gone AS (
    DELETE FROM pgflow.runs r
    USING pgflow.run_keys k
    -- logical_time > now() is implied (available_at is the tick): it keys run_keys' index
    WHERE k.job = ANY(%(names)s::text[]) AND k.logical_time > now() AND r.id = k.run_id
      AND r.state = 'queued' AND r.trigger = 'schedule'
      AND r.attempt = 0 AND r.started_at IS NULL AND r.available_at > now()
    RETURNING r.job, r.logical_time
), rewound AS (  -- runs whatever the final SELECT reads (a data-modifying CTE)
    UPDATE pgflow.jobs j SET next_fire_at = least(j.next_fire_at, g.first)
    FROM (SELECT job, min(logical_time) AS first FROM gone GROUP BY job) g
    WHERE j.name = g.job AND j.name = ANY(%(rewind)s::text[])
)
SELECT count(*) AS withdrawn FROM gone

-- name: seconds_until_due
-- How long the leader may sleep (negative: something is due already; NULL: nothing is
-- scheduled) until
--   due:     the next pass: the earliest unpaused fire time, %(ahead_s)s seconds
--            earlier for a job without downstream jobs (its run is created ahead);
--   release: the earliest tick in %(releases)s (runs created ahead that become
--            claimable then: the leader wakes the workers at that instant, or at once
--            when it was busy past it).
-- Only the 100 earliest fire times are looked at, one probe of job_deps each: past
-- them, any job's pass is no earlier than the 100th fire time minus %(ahead_s)s, which
-- bounds the answer when there are more.
WITH first AS (
    SELECT j.next_fire_at,
           EXISTS (SELECT 1 FROM pgflow.job_deps d WHERE d.upstream = j.name) AS in_dag
    FROM pgflow.jobs j
    WHERE NOT paused AND next_fire_at IS NOT NULL
    ORDER BY next_fire_at
    LIMIT 100
), due AS (
    SELECT least(min(CASE WHEN in_dag THEN next_fire_at
                          ELSE next_fire_at - make_interval(secs => %(ahead_s)s) END),
                 CASE WHEN count(*) = 100
                      THEN max(next_fire_at) - make_interval(secs => %(ahead_s)s) END) AS at
    FROM first
)
SELECT extract(epoch FROM (SELECT at FROM due) - clock_timestamp())::float8 AS due,
       extract(epoch FROM (SELECT min(t) FROM unnest(%(releases)s::timestamptz[]) AS t)
                          - clock_timestamp())::float8 AS release

-- name: release_ticks
-- Wake the workers at the instant %(at)s (runs created ahead become claimable then):
-- the server sleeps until its own clock reaches it, so a claim that the NOTIFY sets off
-- never starts before the tick.
SELECT pg_sleep(greatest(0, extract(epoch FROM %(at)s::timestamptz - clock_timestamp()))),
       pg_notify('pgflow_queue', '')

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
