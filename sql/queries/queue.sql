-- The run lifecycle on workers and the reaper: claim, renew, finish.
-- Every transition is guarded by state, attempt and lease owner; callers check
-- which rows came back.

-- fragment: claim_step
-- How every claim ends (claim_runs, claim_capped_runs, claim_probe): the runs of the CTE
-- `picked` (column id) start their next attempt under this worker's lease. params come
-- back as JSON text: a command passes it on as is, a Python job decodes it on first use;
-- so does the checkpoint an earlier attempt stored (pgflow/live.py; NULL almost always).
-- An attempt starts when the claim executes, not when its transaction began: a capped
-- claim's transaction may wait for its locks while runs of the same cap finish, and a
-- start stamped before those finishes would show more attempts overlapping than the cap
-- ever let run. The clock is read after the statement's snapshot, once for all its runs
-- (an uncorrelated subquery is evaluated once).
claimed AS (
    UPDATE pgflow.runs r
    SET state = 'running', attempt = r.attempt + 1, lease_owner = %(worker)s,
        lease_expires_at = now() + make_interval(secs => %(ttl)s),
        attempt_started_at = (SELECT clock_timestamp()),
        started_at = coalesce(r.started_at, (SELECT clock_timestamp())),
        handed_off = false
    -- An array of ids, not a join: a join of the picked few to runs may be planned as a
    -- hash of the whole table, read on every claim.
    WHERE r.id = ANY (ARRAY(SELECT id FROM picked))
    RETURNING r.id, r.job, r.logical_time, r.attempt, r.max_attempts, r.params,
              r.attempt_started_at, r.cancel_requested, r.trigger, r.checkpoint,
              r.backfill_id
)
SELECT c.id, c.job, c.logical_time, c.attempt, c.max_attempts, c.params::text AS params,
       c.attempt_started_at, c.checkpoint::text AS checkpoint,
       -- the events a dataset run consumed (PGFLOW_TRIGGER_EVENTS); other runs skip it
       CASE WHEN c.trigger = 'dataset' THEN (
           SELECT coalesce(jsonb_agg(jsonb_build_object('dataset', e.dataset, 'id', e.id,
                                                        'key', e.key, 'payload', e.payload)
                                     ORDER BY e.id), '[]')::text
           FROM pgflow.dataset_deliveries d JOIN pgflow.dataset_events e ON e.id = d.event_id
           WHERE d.run_id = c.id) END AS trigger_events,
       c.cancel_requested, j.command, j.entrypoint, j.timeout_s, j.backoff_s, j.max_backoff_s,
       j.jitter, j.no_retry_exit_codes, j.sources,
       -- whether a success of this attempt needs nothing after its finish (no backfill, no
       -- downstream job): the worker records such successes without a transaction
       -- (finish_attempts in plain mode); a hint only, the finish checks again. The probe
       -- of job_deps is made only while some dependency exists (evaluated once).
       c.backfill_id IS NULL
           AND NOT ((SELECT EXISTS (SELECT 1 FROM pgflow.job_deps))
                    AND EXISTS (SELECT 1 FROM pgflow.job_deps d WHERE d.upstream = c.job))
           AS plain
FROM claimed c
LEFT JOIN pgflow.jobs j ON j.name = c.job

-- fragment: waiting_tenants
-- The tenants with a claimable uncapped run: a skip scan of runs_claimable_idx, one
-- probe per tenant, whatever the backlog.
tenants(tenant) AS (
    (SELECT tenant FROM pgflow.runs
     WHERE state IN ('queued', 'retrying') AND NOT capped AND NOT held
     ORDER BY tenant LIMIT 1)
    UNION ALL
    SELECT (SELECT r.tenant FROM pgflow.runs r
            WHERE r.state IN ('queued', 'retrying') AND NOT r.capped AND NOT r.held
              AND r.tenant > w.tenant
            ORDER BY r.tenant LIMIT 1)
    FROM tenants w WHERE w.tenant IS NOT NULL
)

-- name: claim_runs
-- Claim up to %(limit)s runs for one worker: highest priority first; among equal
-- priorities, tenants share the slots by weight, cluster-wide (pgflow/policies.py):
-- each waiting tenant (a skip scan of runs_claimable_idx, one probe per tenant) offers
-- its best %(limit)s runs, and a run's place is (running + k) / weight for its tenant's
-- k-th candidate. Runs that count against a cap (capped) or wait for a breaker (held)
-- are not in that index. A breaker opened with plain SQL (no held flags yet) holds its
-- runs too: the check costs one lookup per statement while every breaker is closed.
WITH RECURSIVE
-- include: waiting_tenants
, contest AS MATERIALIZED (
    SELECT count(*) > 1 AS shared FROM tenants WHERE tenant IS NOT NULL
), running AS (
    -- read only when tenants compete
    SELECT tenant, count(*) AS n FROM pgflow.runs
    WHERE state = 'running' AND (SELECT shared FROM contest)
    GROUP BY tenant
), candidates AS (
    SELECT c.id, c.priority, c.available_at, w.tenant, coalesce(t.weight, 1) AS weight
    FROM tenants w
    LEFT JOIN pgflow.tenants t ON t.name = w.tenant
    CROSS JOIN LATERAL (
        SELECT r.id, r.priority, r.available_at FROM pgflow.runs r
        WHERE r.tenant = w.tenant AND r.state IN ('queued', 'retrying') AND NOT r.capped
          AND NOT r.held AND r.available_at <= now()
          AND (NOT EXISTS (SELECT 1 FROM pgflow.breakers WHERE state <> 'closed')
               OR NOT EXISTS (SELECT 1 FROM pgflow.jobs j
                              JOIN pgflow.breakers b ON b.source = ANY(j.sources)
                              WHERE j.name = r.job AND b.state <> 'closed'))
        ORDER BY r.priority DESC, r.available_at, r.id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) c
    WHERE w.tenant IS NOT NULL
), ranked AS (
    SELECT c.id, c.priority, c.available_at,
           (coalesce(n.n, 0) + row_number() OVER (PARTITION BY c.tenant
                                                  ORDER BY c.priority DESC, c.available_at,
                                                           c.id)) / c.weight AS place
    FROM candidates c
    LEFT JOIN running n ON n.tenant = c.tenant
), picked AS (
    -- One tenant waiting (the usual case): its candidates, at most %(limit)s, are the
    -- claim, and the ranking (a sort and a window over them) runs only when tenants compete.
    SELECT id FROM candidates WHERE NOT (SELECT shared FROM contest)
    UNION ALL
    (SELECT id FROM ranked WHERE (SELECT shared FROM contest)
     ORDER BY priority DESC, place, available_at, id LIMIT %(limit)s)
), offered AS (
    -- A claim that leaves slots free offers them to triggers for offer_s seconds (its
    -- next idle claim renews the offer); one that fills them withdraws the offer
    -- (pgflow/handoff.py). No LISTEN session (listen_pid NULL): no offer.
    INSERT INTO pgflow.idle_workers AS i (worker, seq, slots, ttl_s, listen_pid, until)
    SELECT %(worker)s, %(seq)s, %(limit)s - p.n, %(ttl)s, %(listen_pid)s,
           now() + make_interval(secs => %(offer_s)s)
    FROM (SELECT count(*) AS n FROM picked) p
    WHERE %(listen_pid)s::int IS NOT NULL AND p.n < %(limit)s
    ON CONFLICT (worker) DO UPDATE
    SET seq = excluded.seq, slots = excluded.slots, ttl_s = excluded.ttl_s,
        listen_pid = excluded.listen_pid, until = excluded.until
), withdrawn AS (
    DELETE FROM pgflow.idle_workers
    WHERE worker = %(worker)s
      AND (%(listen_pid)s::int IS NULL OR (SELECT count(*) FROM picked) >= %(limit)s)
),
-- include: claim_step

-- name: capped_jobs_waiting
-- Capped jobs with room under every cap that counts their runs (their own, their
-- tenant's, their sources') and a claimable run, best waiting priority first (a job at
-- its cap must not hide the others, whatever their names), and the priority of the
-- best claimable uncapped run: capped runs at least that high are claimed before the
-- uncapped claim, so uncapped work of lower priority never starves them. The waiting
-- jobs come from a skip scan of runs_claimable_capped_idx: one probe per job, not per
-- run; the waiting tenants likewise from runs_claimable_idx.
WITH RECURSIVE waiting(job) AS (
    (SELECT job FROM pgflow.runs
     WHERE state IN ('queued', 'retrying') AND capped AND NOT held ORDER BY job LIMIT 1)
    UNION ALL
    SELECT (SELECT r.job FROM pgflow.runs r
            WHERE r.state IN ('queued', 'retrying') AND r.capped AND NOT r.held
              AND r.job > w.job
            ORDER BY r.job LIMIT 1)
    FROM waiting w WHERE w.job IS NOT NULL
),
-- include: waiting_tenants
, best AS (
    SELECT w.job, b.priority, b.available_at
    FROM waiting w
    LEFT JOIN pgflow.jobs j ON j.name = w.job
    CROSS JOIN LATERAL (
        SELECT r.priority, r.available_at FROM pgflow.runs r
        WHERE r.job = w.job AND r.state IN ('queued', 'retrying') AND r.capped AND NOT r.held
          AND r.available_at <= now()
        ORDER BY r.priority DESC, r.available_at
        LIMIT 1
    ) b
    CROSS JOIN LATERAL (
        -- the room under each cap (NULL: no such cap); a job deleted, or no longer
        -- capped, that still has capped runs: one at a time
        SELECT least(
            CASE WHEN j.name IS NULL OR j.max_active_runs IS NOT NULL OR NOT j.capped
                 THEN coalesce(j.max_active_runs, 1)
                      - (SELECT count(*) FROM pgflow.runs x
                         WHERE x.job = w.job AND x.state = 'running' AND x.capped) END,
            (SELECT t.max_concurrency - (SELECT count(*) FROM pgflow.runs x
                                         WHERE x.tenant = t.name AND x.state = 'running'
                                           AND x.capped)
             FROM pgflow.tenants t
             WHERE t.name = j.tenant AND t.max_concurrency IS NOT NULL),
            (SELECT min(s.max_concurrency - (SELECT count(*) FROM pgflow.jobs sj
                                             JOIN pgflow.runs x ON x.job = sj.name
                                             WHERE sj.sources @> ARRAY[s.name]
                                               AND x.state = 'running' AND x.capped))
             FROM pgflow.sources s
             WHERE s.name = ANY(j.sources) AND s.max_concurrency IS NOT NULL)) AS free
    ) room
    WHERE w.job IS NOT NULL AND coalesce(room.free, 1) > 0
      AND NOT EXISTS (SELECT 1 FROM pgflow.breakers bk
                      WHERE bk.source = ANY(j.sources) AND bk.state <> 'closed')
)
SELECT job, priority,
       (SELECT max(u.priority)
        FROM tenants tw
        CROSS JOIN LATERAL (
            SELECT r.priority FROM pgflow.runs r
            WHERE r.tenant = tw.tenant AND r.state IN ('queued', 'retrying') AND NOT r.capped
              AND NOT r.held AND r.available_at <= now()
              AND (NOT EXISTS (SELECT 1 FROM pgflow.breakers WHERE state <> 'closed')
                   OR NOT EXISTS (SELECT 1 FROM pgflow.jobs j
                                  JOIN pgflow.breakers b ON b.source = ANY(j.sources)
                                  WHERE j.name = r.job AND b.state <> 'closed'))
            ORDER BY r.priority DESC, r.available_at, r.id
            LIMIT 1) u
        WHERE tw.tenant IS NOT NULL) AS uncapped_priority
FROM best
ORDER BY priority DESC, available_at, job
LIMIT 100

-- name: lock_capped_jobs
-- Claims that may touch one capped job, tenant or source take turns: a transaction-
-- scoped lock per key (the jobs, their capped tenants, their capped sources), taken in
-- the order of the keys' hashes, the same total order in every claim: no deadlock.
SELECT count(pg_advisory_xact_lock(1885759855, k))  -- class: "pgfo"
FROM (
    SELECT DISTINCT hashtext(key) AS k FROM (
        SELECT 'job:' || i.job AS key FROM unnest(%(jobs)s::text[]) AS i(job)
        UNION ALL
        SELECT 'tenant:' || t.name FROM pgflow.jobs j
        JOIN pgflow.tenants t ON t.name = j.tenant AND t.max_concurrency IS NOT NULL
        WHERE j.name = ANY(%(jobs)s::text[])
        UNION ALL
        SELECT 'source:' || s.name FROM pgflow.jobs j
        JOIN pgflow.sources s ON s.name = ANY(j.sources) AND s.max_concurrency IS NOT NULL
        WHERE j.name = ANY(%(jobs)s::text[])
    ) keys
    ORDER BY 1
) locks

-- name: claim_capped_runs
-- Run after lock_capped_jobs, as a new statement: its snapshot sees every claim that
-- committed before we got the locks, so the counts of running runs are exact. Each job
-- offers up to the room under its own, its tenant's and its sources' caps; a candidate
-- is kept only if its rank within its tenant, and within every capped source it
-- touches, is inside that cap's room (a run touching two sources needs a slot in both).
-- Its claim step repeats claim_runs' on purpose: the hot, uncapped claim stays one
-- statement. %(min_priority)s (or NULL) limits it to runs that must go before the
-- uncapped claim.
WITH room AS (
    SELECT i.job, coalesce(j.tenant, '') AS tenant, coalesce(j.sources, '{}') AS sources,
           coalesce(t.weight, 1) AS weight,
           CASE WHEN j.name IS NULL OR j.max_active_runs IS NOT NULL OR NOT j.capped
                THEN coalesce(j.max_active_runs, 1)
                     - (SELECT count(*) FROM pgflow.runs x WHERE x.job = i.job
                        AND x.state = 'running' AND x.capped) END AS free
    FROM unnest(%(jobs)s::text[]) AS i(job)
    LEFT JOIN pgflow.jobs j ON j.name = i.job
    LEFT JOIN pgflow.tenants t ON t.name = j.tenant
), tenant_room AS (
    SELECT t.name AS tenant,
           t.max_concurrency - (SELECT count(*) FROM pgflow.runs x
                                WHERE x.tenant = t.name AND x.state = 'running' AND x.capped)
               AS free
    FROM pgflow.tenants t
    WHERE t.max_concurrency IS NOT NULL AND t.name IN (SELECT tenant FROM room)
), source_room AS (
    SELECT s.name AS source,
           s.max_concurrency - (SELECT count(*) FROM pgflow.jobs sj
                                JOIN pgflow.runs x ON x.job = sj.name
                                WHERE sj.sources @> ARRAY[s.name] AND x.state = 'running'
                                  AND x.capped) AS free
    FROM pgflow.sources s
    WHERE s.max_concurrency IS NOT NULL
      AND s.name IN (SELECT unnest(sources) FROM room)
), candidates AS (
    SELECT p.id, p.priority, p.available_at, room.tenant, room.sources, room.weight
    FROM room
    CROSS JOIN LATERAL (
        SELECT r.id, r.priority, r.available_at FROM pgflow.runs r
        WHERE r.job = room.job AND r.state IN ('queued', 'retrying') AND r.capped
          AND NOT r.held AND r.available_at <= now()
          AND r.priority >= coalesce(%(min_priority)s::int, r.priority)
          AND (NOT EXISTS (SELECT 1 FROM pgflow.breakers WHERE state <> 'closed')
               OR NOT EXISTS (SELECT 1 FROM pgflow.breakers b
                              WHERE b.source = ANY(room.sources) AND b.state <> 'closed'))
        ORDER BY r.priority DESC, r.available_at, r.id
        LIMIT greatest(least(room.free,
                             (SELECT tr.free FROM tenant_room tr WHERE tr.tenant = room.tenant),
                             (SELECT min(sr.free) FROM source_room sr
                              WHERE sr.source = ANY(room.sources)),
                             %(limit)s), 0)
        FOR UPDATE SKIP LOCKED
    ) p
), ranked AS (
    SELECT c.id, c.priority, c.available_at,
           row_number() OVER (PARTITION BY c.tenant
                              ORDER BY c.priority DESC, c.available_at, c.id) AS rank,
           c.tenant, c.weight
    FROM candidates c
), by_source AS (
    SELECT c.id, s.source,
           row_number() OVER (PARTITION BY s.source
                              ORDER BY c.priority DESC, c.available_at, c.id) AS rank
    FROM candidates c CROSS JOIN LATERAL unnest(c.sources) AS s(source)
    WHERE s.source IN (SELECT source FROM source_room)
), picked AS (
    SELECT k.id FROM ranked k
    LEFT JOIN tenant_room tr ON tr.tenant = k.tenant
    WHERE (tr.free IS NULL OR k.rank <= tr.free)
      AND NOT EXISTS (SELECT 1 FROM by_source bs JOIN source_room sr ON sr.source = bs.source
                      WHERE bs.id = k.id AND bs.rank > sr.free)
    ORDER BY k.priority DESC, k.rank / k.weight, k.available_at, k.id
    LIMIT %(limit)s
),
-- include: claim_step

-- fragment: give_back_set
-- How a run owned by a worker that never started its attempt goes back (renew_leases'
-- release, give_back_handoff): queued at once (cancelled if a cancel was requested), one
-- more attempt in the budget, the attempt number kept, no attempt row.
    SET state = CASE WHEN r.cancel_requested THEN 'cancelled' ELSE 'queued' END,
        finished_at = CASE WHEN r.cancel_requested THEN now() END,
        available_at = now(), max_attempts = r.max_attempts + 1,
        lease_owner = NULL, lease_expires_at = NULL, attempt_started_at = NULL

-- name: renew_leases
-- One heartbeat for the exact (run, attempt) pairs a worker holds (%(ids)s, %(attempts)s):
-- the pairs that come back (released IS NULL) are still its own, with their cancel flag.
-- With %(release)s, the runs it owns but does not hold are given back in the same
-- statement: a claim that committed but whose reply never reached the worker (the
-- connection died). They are queued again at once (cancelled if a cancel was requested)
-- with one more attempt in the budget; the attempt number is kept, so a fencing token is
-- never handed out twice, and no attempt row is written: that attempt never ran. The
-- worker asks for the release only while none of its claims is in flight.
WITH held AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS h(id, attempt)
), renewed AS (
    -- One primary-key probe per held pair: the running runs' index holds every worker's,
    -- and a join of held with it (or with a CTE scan of held) was planned as a nested
    -- loop over both (40 ms a renewal of 300 at 1,000,000 finished runs). The tests
    -- IS NOT DISTINCT FROM (not indexable) keep it off that index.
    UPDATE pgflow.runs r
    SET lease_expires_at = now() + make_interval(secs => %(ttl)s)
    FROM unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS h(id, attempt)
    WHERE r.id = h.id AND r.attempt = h.attempt
      AND r.lease_owner IS NOT DISTINCT FROM %(worker)s
      AND r.state IS NOT DISTINCT FROM 'running'
    RETURNING r.id, r.attempt, r.cancel_requested
), released AS (
    -- every running run (runs_running_idx: a few thousand at most), checked against the
    -- held pairs once hashed (NOT IN a subquery), not once per run
    UPDATE pgflow.runs r
-- include: give_back_set
    WHERE %(release)s AND r.lease_owner = %(worker)s AND r.state = 'running'
      AND NOT r.handed_off  -- its notification may still be on its way (handoff.py)
      AND (r.id, r.attempt) NOT IN (SELECT id, attempt FROM held)
    RETURNING r.id, r.attempt, r.state, r.backfill_id
)
SELECT id, attempt, cancel_requested, NULL::text AS released, NULL::bigint AS backfill_id
FROM renewed
UNION ALL
SELECT id, attempt, false, state, backfill_id FROM released

-- name: listen_worker
-- The queue's wake-ups, cancels, and the runs triggers hand to this worker, on a channel
-- named by this session's backend pid; the session holds an advisory lock on its pid
-- (class "pgho") for as long as it lives, which is how a trigger tells that the channel
-- is still heard (pgflow/handoff.py).
LISTEN pgflow_queue; LISTEN pgflow_cancel;
DO $$ BEGIN
    EXECUTE format('LISTEN %I', 'pgflow_handoff_' || pg_backend_pid());
    PERFORM pg_advisory_lock(1885825135, pg_backend_pid());
END $$

-- name: give_back_handoff
-- A run handed to this worker that it cannot start (no free slot, draining, its lease
-- deadline already passed): given back as renew_leases gives back unreceived claims.
WITH given AS (
    UPDATE pgflow.runs r
-- include: give_back_set
        , handed_off = false, started_at = NULL  -- a handoff is always a run's first start
    FROM unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS g(id, attempt)
    WHERE r.id = g.id AND r.attempt = g.attempt AND r.lease_owner = %(worker)s
      AND r.state = 'running' AND r.handed_off
    RETURNING r.id, r.state
)
SELECT id, state, (SELECT pg_notify('pgflow_queue', ''))::text AS woke FROM given

-- name: withdraw_offer
-- A worker that stops claiming (drain) takes back its free slots (pgflow/handoff.py).
DELETE FROM pgflow.idle_workers WHERE worker = %(worker)s

-- name: ping
-- A worker's listening connection, quiet for a while, checks that it is still alive.
SELECT 1

-- name: finish_attempts
-- End attempts in bulk. A row only changes while the run is still running the same
-- attempt under the same lease owner; the ids returned are the attempts that counted.
-- For runs that succeeded, the pending runs of their direct downstreams at the same
-- logical time are locked (in id order, so finishers never deadlock on them) and
-- returned as candidates for queue_ready_runs, which must run as the NEXT statement
-- of the same transaction: its fresh snapshot sees an upstream that another
-- transaction finished while we waited for the lock, so two upstreams finishing at
-- once queue their downstream exactly once.
-- The batch comes in two parts (pgflow/queue.py, finish_params): the plain successes of
-- one owner (no output, no error: most results) as binary arrays of their ids, attempts,
-- start times and exit codes, and every other result as one JSON array of objects
-- (cheaper to build than eleven arrays). Arrays cost a tenth of JSON to read here and a
-- fifth to build in the worker (about 4 and 3.5 µs a result less, issue 16).
-- With %(plain)s (queue.finish_plain) it is sent alone, with no transaction around it,
-- and ends only the successes that need nothing after them (see the UPDATE's last test).
-- A cancel requested while the attempt ran wins over every ending but success: the run
-- becomes cancelled, not retrying, queued (interrupted) or failed, whatever the worker
-- decided without knowing. A succeeded attempt stays succeeded: its work is done and
-- cannot be undone. r.cancel_requested is read from the row as locked, so a cancel that
-- commits while this statement waits for the row is seen.
WITH result AS (
    SELECT * FROM jsonb_to_recordset(%(results)s::jsonb)
        AS t(id bigint, attempt int, owner text, state text, delay_s float8, outcome text,
             started_at timestamptz, exit_code int, error text, stdout_tail text,
             stderr_tail text, refund boolean)
        CROSS JOIN (SELECT %(plain)s::boolean AS plain) m
    UNION ALL
    SELECT s.id, s.attempt, %(ok_owner)s::text, 'succeeded', 0::float8, 'succeeded',
           s.started_at, s.exit_code, NULL, NULL, NULL, false, %(plain)s::boolean
    FROM unnest(%(ok_ids)b::bigint[], %(ok_attempts)b::int[],
                %(ok_started)b::timestamptz[], %(ok_exit_codes)b::int[])
        AS s(id, attempt, started_at, exit_code)
), dag AS (
    -- evaluated once: without any dependency, no probe of job_deps per finished run
    SELECT EXISTS (SELECT 1 FROM pgflow.job_deps) AS any_dependency
), finished AS (
    UPDATE pgflow.runs r
    SET state = CASE WHEN r.cancel_requested AND res.state <> 'succeeded' THEN 'cancelled'
                     ELSE res.state END,
        finished_at = CASE WHEN res.state IN ('succeeded', 'failed', 'cancelled')
                                OR r.cancel_requested THEN now() END,
        available_at = CASE WHEN res.state IN ('retrying', 'queued') AND NOT r.cancel_requested
                            THEN now() + make_interval(secs => res.delay_s)
                            ELSE r.available_at END,
        -- An interrupted attempt (graceful shutdown) does not use up the budget, nor does
        -- a source-unavailable one while its breaker opens or is open (refund: the run
        -- waits, held, for the breaker; pgflow/breakers.py).
        max_attempts = r.max_attempts + (res.outcome = 'interrupted' OR res.refund)::int,
        held = r.held OR res.refund,
        lease_owner = NULL, lease_expires_at = NULL, attempt_started_at = NULL
    FROM result res
    -- The rows are found by primary key, one probe per result, whatever the statistics:
    -- the array of ids (as in claim_step) keeps a plan made on a table never analyzed off
    -- a sequential scan of runs, and the tests IS NOT DISTINCT FROM (not indexable) keep
    -- it off the other indexes. With an indexable owner test it walked the owner index once
    -- per result row; with an indexable state test it read the whole 'running' range of
    -- the state index of the time per batch, with the entries left by every run claimed
    -- since the last vacuum (3 million index entries read for 20,000 runs at
    -- concurrency 64).
    WHERE r.id = ANY (ARRAY(SELECT id FROM result)) AND r.id = res.id
      AND r.attempt IS NOT DISTINCT FROM res.attempt
      AND r.lease_owner IS NOT DISTINCT FROM res.owner AND r.state IS NOT DISTINCT FROM 'running'
      -- plain mode (a statement of its own, no transaction around it): only successes whose
      -- finish needs nothing after it, no backfill to complete and no downstream job (in
      -- this statement's snapshot, as the candidates and downstream below read them); the
      -- others stay running for the caller's transactional finish (pgflow/queue.py)
      -- (tested with res.plain, a column of the materialized result: with the parameter
      -- itself, the plan made for plain mode expected one run and probed the whole
      -- result once per run, 12 s a batch of 5,000)
      AND (NOT res.plain
           OR (res.state = 'succeeded' AND NOT res.refund AND r.backfill_id IS NULL
               AND NOT ((SELECT any_dependency FROM dag)
                        AND EXISTS (SELECT 1 FROM pgflow.job_deps d
                                    WHERE d.upstream = r.job))))
    RETURNING r.id, r.state, r.job, r.logical_time, r.backfill_id
), recorded AS (
    INSERT INTO pgflow.attempts (run_id, attempt, worker_id, started_at, finished_at, outcome,
                                 exit_code, error, stdout_tail, stderr_tail)
    SELECT res.id, res.attempt, res.owner, res.started_at, now(), res.outcome, res.exit_code,
           res.error, res.stdout_tail, res.stderr_tail
    FROM finished f JOIN result res ON res.id = f.id
), produced AS (
    -- A succeeded run of a producing job records its datasets' events here, in the
    -- transaction that marks it succeeded: a fenced-off (late, duplicate) finish
    -- matched no row above, so it records none (pgflow/datasets.py).
    INSERT INTO pgflow.dataset_events (dataset, run_id, created_at, payload)
    SELECT p.dataset, f.id, now(),
           -- which job made the data, for which logical time (as PGFLOW_LOGICAL_TIME
           -- spells it, so a consumer can match what the producer wrote)
           jsonb_build_object('job', f.job, 'logical_time',
               to_char(f.logical_time AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
               || CASE WHEN date_trunc('second', f.logical_time) = f.logical_time THEN ''
                       ELSE to_char(f.logical_time AT TIME ZONE 'UTC', '.US') END
               || '+00:00')
    FROM finished f
    JOIN pgflow.jobs j ON j.name = f.job AND j.produces <> '{}'
    CROSS JOIN LATERAL unnest(j.produces) AS p(dataset)
    WHERE f.state = 'succeeded'
      -- evaluated once: without any producing job, no probe of jobs per finished run.
      -- A scalar subquery in jobs_producing_idx's order, not EXISTS (which drops ORDER BY
      -- and LIMIT): jobs just registered have no statistics, and the planner, expecting
      -- most jobs to produce, read all of jobs for the first (10,000 jobs: 2.6 ms).
      AND (SELECT true FROM pgflow.jobs WHERE produces <> '{}' ORDER BY name LIMIT 1)
    RETURNING id, dataset
),
-- include: deliver_events
, candidates AS (
    SELECT p.id
    FROM finished f
    JOIN pgflow.job_deps d ON d.upstream = f.job
    JOIN pgflow.run_keys k ON k.job = d.job AND k.logical_time = f.logical_time
    JOIN pgflow.runs p ON p.id = k.run_id
    WHERE f.state = 'succeeded' AND p.state = 'pending'
      AND (SELECT any_dependency FROM dag)
    ORDER BY p.id
    FOR UPDATE OF p
)
SELECT id, state, backfill_id, (SELECT array_agg(id) FROM candidates) AS candidates,
       -- one wake-up of the leader when an event is waiting for a consumer (evaluated once)
       (SELECT count(*) FROM (SELECT pg_notify('pgflow_datasets', '')
                              FROM (SELECT 1 FROM delivered LIMIT 1) d) n) AS delivered,
       -- whether queue_ready_runs must look for late downstreams (pgflow/deps.py)
       state = 'succeeded' AND (SELECT any_dependency FROM dag)
           AND EXISTS (SELECT 1 FROM pgflow.job_deps d WHERE d.upstream = finished.job)
           AS downstream
FROM finished

-- name: expired_leases
-- Runs whose owner stopped renewing. Locked until the reaper's transaction ends, so a
-- late renewal cannot slip between this and finish_attempts.
SELECT r.id, r.job, r.attempt, r.max_attempts, r.lease_owner, r.attempt_started_at,
       r.cancel_requested, j.backoff_s, j.max_backoff_s, j.jitter
FROM pgflow.runs r
LEFT JOIN pgflow.jobs j ON j.name = r.job
WHERE r.state = 'running' AND r.lease_expires_at < now()
ORDER BY r.lease_expires_at
LIMIT %(limit)s
FOR UPDATE OF r SKIP LOCKED

-- name: notify_queue
SELECT pg_notify('pgflow_queue', '')
