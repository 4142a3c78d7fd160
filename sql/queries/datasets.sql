-- Datasets and triggers: recording events, delivering them to the jobs that trigger on
-- their dataset, consuming them into runs. Why this is exactly-once: pgflow/datasets.py.

-- fragment: deliver_events
-- After a CTE `produced` (columns id, dataset) of new events: one waiting delivery per
-- job that triggers on the event's dataset (jobs_trigger_on_idx).
delivered AS (
    INSERT INTO pgflow.dataset_deliveries (job, event_id, dataset)
    SELECT j.name, p.id, p.dataset
    FROM produced p
    JOIN pgflow.jobs j ON j.trigger_on @> ARRAY[p.dataset] AND j.trigger_on <> '{}'
    RETURNING event_id
)

-- name: emit_event
-- An event from outside. A repeated (dataset, key) records nothing (no row back: the
-- caller reads the existing one). The leader is woken when a job consumes it.
WITH produced AS (
    INSERT INTO pgflow.dataset_events (dataset, key, payload)
    VALUES (%(dataset)s, %(key)s, %(payload)s::jsonb)
    ON CONFLICT (dataset, key) DO NOTHING
    RETURNING id, dataset, key, run_id, payload, created_at
),
-- include: deliver_events
SELECT id, dataset, key, run_id, payload, created_at,
       (SELECT count(*) FROM (SELECT pg_notify('pgflow_datasets', '') FROM delivered) n)
           AS consumers
FROM produced

-- name: event_by_key
SELECT id, dataset, key, run_id, payload, created_at,
       (SELECT count(*) FROM pgflow.dataset_deliveries d WHERE d.event_id = e.id) AS consumers
FROM pgflow.dataset_events e
WHERE dataset = %(dataset)s AND key = %(key)s

-- fragment: waiting_pairs
-- The (job, dataset) pairs with a waiting delivery, from a skip scan of
-- dataset_deliveries_waiting_idx: one probe per pair, whatever the backlog.
pairs(job, dataset) AS (
    (SELECT job, dataset FROM pgflow.dataset_deliveries
     WHERE run_id IS NULL ORDER BY job, dataset LIMIT 1)
    UNION ALL
    SELECT n.job, n.dataset FROM pairs p
    CROSS JOIN LATERAL (
        SELECT d.job, d.dataset FROM pgflow.dataset_deliveries d
        WHERE d.run_id IS NULL AND (d.job, d.dataset) > (p.job, p.dataset)
        ORDER BY d.job, d.dataset LIMIT 1
    ) n
)

-- name: ready_consumers
-- Consuming jobs whose condition holds over their waiting events, locked until the pass
-- commits: whoever holds a job's row is the only one consuming its events (a second
-- scheduler skips it). The (job, dataset) pairs with a waiting delivery come from a skip
-- scan of dataset_deliveries_waiting_idx (one probe per pair, whatever the backlog); a
-- job whose previous dataset run is not finished waits (runs_dataset_active_idx); a
-- paused job keeps its events.
WITH RECURSIVE
-- include: waiting_pairs
, waiting AS (
    SELECT job, array_agg(dataset) AS datasets FROM pairs GROUP BY job
), ready AS (
    SELECT j.name
    FROM waiting w
    JOIN pgflow.jobs j ON j.name = w.job
    WHERE NOT j.paused AND j.trigger_on <> '{}'
      AND CASE WHEN j.trigger_mode = 'any' THEN w.datasets && j.trigger_on
               ELSE w.datasets @> j.trigger_on END
      AND NOT EXISTS (SELECT 1 FROM pgflow.runs r
                      WHERE r.job = j.name AND r.trigger = 'dataset'
                        AND r.state IN ('pending', 'queued', 'running', 'retrying'))
    ORDER BY j.name
    LIMIT %(batch)s
)
SELECT j.name, j.trigger_on, j.trigger_mode, j.paused,
       EXISTS (SELECT 1 FROM pgflow.job_deps d WHERE d.upstream = j.name) AS in_dag
FROM pgflow.jobs j
WHERE j.name IN (SELECT name FROM ready)
ORDER BY j.name
FOR NO KEY UPDATE OF j SKIP LOCKED

-- name: waiting_events
-- The waiting events of the locked jobs %(jobs)s, read after the lock (a fresh snapshot).
-- At most %(cap)s per job, oldest first, but the oldest event of each dataset before all
-- others, so a capped run of an `all` job still has every dataset.
WITH waiting AS (
    SELECT d.job, d.event_id, d.dataset, e.created_at,
           row_number() OVER (PARTITION BY d.job, d.dataset ORDER BY d.event_id) AS nth
    FROM pgflow.dataset_deliveries d
    JOIN pgflow.jobs j ON j.name = d.job
    JOIN pgflow.dataset_events e ON e.id = d.event_id
    WHERE d.job = ANY(%(jobs)s::text[]) AND d.run_id IS NULL AND d.dataset = ANY(j.trigger_on)
), placed AS (
    SELECT *, row_number() OVER (PARTITION BY job ORDER BY nth > 1, event_id) AS place
    FROM waiting
)
SELECT job, event_id, dataset, created_at FROM placed
WHERE place <= %(cap)s
ORDER BY job, event_id

-- name: consume_deliveries
-- The events go to their run. Every pair must change (the caller checks the count): the
-- job's lock keeps other consumers away, the run_id test is the last word anyway.
UPDATE pgflow.dataset_deliveries d
SET run_id = u.run_id, consumed_at = now()
FROM unnest(%(jobs)s::text[], %(events)s::bigint[], %(runs)s::bigint[])
    AS u(job, event_id, run_id)
WHERE d.job = u.job AND d.event_id = u.event_id AND d.run_id IS NULL

-- name: drop_stale_deliveries
-- Registration: waiting events of datasets a job no longer triggers on are not waiting
-- for anything any more.
DELETE FROM pgflow.dataset_deliveries d
USING pgflow.jobs j
WHERE d.job = j.name AND j.name = ANY(%(jobs)s::text[]) AND d.run_id IS NULL
  AND NOT d.dataset = ANY(j.trigger_on)

-- name: run_trigger_events
-- The events a run consumed (why it fired), oldest first.
SELECT e.id, e.dataset, e.key, e.payload, e.created_at, e.run_id AS producer_run_id,
       pr.job AS producer_job
FROM pgflow.dataset_deliveries d
JOIN pgflow.dataset_events e ON e.id = d.event_id
LEFT JOIN pgflow.runs pr ON pr.id = e.run_id
WHERE d.run_id = %(run_id)s
ORDER BY e.id
LIMIT %(limit)s

-- name: run_trigger_event_count
SELECT count(*) AS n FROM pgflow.dataset_deliveries WHERE run_id = %(run_id)s

-- name: list_datasets
-- Every dataset a job names or an event has: producers, consumers with their waiting
-- events, the newest event. The event datasets come from a skip scan.
WITH RECURSIVE seen(dataset) AS (
    (SELECT dataset FROM pgflow.dataset_events ORDER BY dataset LIMIT 1)
    UNION ALL
    SELECT (SELECT e.dataset FROM pgflow.dataset_events e WHERE e.dataset > s.dataset
            ORDER BY e.dataset LIMIT 1)
    FROM seen s WHERE s.dataset IS NOT NULL
), names AS (
    SELECT dataset FROM seen WHERE dataset IS NOT NULL
    UNION SELECT unnest(produces) FROM pgflow.jobs WHERE produces <> '{}'
    UNION SELECT unnest(trigger_on) FROM pgflow.jobs WHERE trigger_on <> '{}'
)
SELECT n.dataset,
       ARRAY(SELECT j.name FROM pgflow.jobs j
             WHERE j.produces @> ARRAY[n.dataset] AND j.produces <> '{}' ORDER BY j.name)
           AS producers,
       coalesce((SELECT jsonb_agg(jsonb_build_object(
                     'job', j.name, 'mode', j.trigger_mode, 'paused', j.paused,
                     'waiting', (SELECT count(*) FROM pgflow.dataset_deliveries d
                                 WHERE d.job = j.name AND d.dataset = n.dataset
                                   AND d.run_id IS NULL)) ORDER BY j.name)
                 FROM pgflow.jobs j
                 WHERE j.trigger_on @> ARRAY[n.dataset] AND j.trigger_on <> '{}'), '[]')
           AS consumers,
       (SELECT jsonb_build_object('id', e.id, 'key', e.key, 'run_id', e.run_id,
                                  'created_at', e.created_at)
        FROM pgflow.dataset_events e WHERE e.dataset = n.dataset
        ORDER BY e.id DESC LIMIT 1) AS last_event
FROM names n
WHERE %(dataset)s::text IS NULL OR n.dataset = %(dataset)s
ORDER BY n.dataset

-- name: recent_events
-- The newest events of one dataset (its section of the /datasets page).
SELECT e.id, e.key, e.run_id, e.payload, e.created_at,
       (SELECT count(*) FROM pgflow.dataset_deliveries d
        WHERE d.event_id = e.id AND d.run_id IS NULL) AS waiting
FROM pgflow.dataset_events e
WHERE e.dataset = %(dataset)s
ORDER BY e.id DESC
LIMIT %(limit)s

-- name: dataset_metrics
-- /metrics: events stored by dataset (recorded, not yet removed by retention), and events
-- waiting by dataset and consuming job (dataset_deliveries_waiting_idx).
SELECT dataset, NULL::text AS job, count(*) AS n FROM pgflow.dataset_events GROUP BY dataset
UNION ALL
SELECT dataset, job, count(*) FROM pgflow.dataset_deliveries WHERE run_id IS NULL
GROUP BY dataset, job
ORDER BY 1, 2

-- name: prune_dataset_events
-- Retention (pgflow/retention.py): events recorded before the cutoff that no job waits
-- for any more, at most %(limit)s. An event stays while a job still waits for it, and
-- while a run that consumed it may still run (unfinished, or a dead letter an operator
-- may retry: its command reads the events again). Deliveries go with their event.
-- Waiting deliveries for a job that no longer triggers on their dataset (deleted, or
-- redefined by plain SQL) are dropped first; their events go in a later pass.
-- The waiting (job, dataset) pairs come from a skip scan, as in ready_consumers.
WITH RECURSIVE
-- include: waiting_pairs
, stale AS (
    SELECT p.job, p.dataset FROM pairs p
    WHERE NOT EXISTS (SELECT 1 FROM pgflow.jobs j
                      WHERE j.name = p.job AND p.dataset = ANY(j.trigger_on))
), orphans AS (
    DELETE FROM pgflow.dataset_deliveries d USING stale s
    WHERE d.job = s.job AND d.dataset = s.dataset AND d.run_id IS NULL
), doomed AS (
    SELECT e.id FROM pgflow.dataset_events e
    WHERE e.created_at < coalesce(%(now)s::timestamptz, now())
                         - make_interval(secs => %(retention_s)s)
      AND NOT EXISTS (
          SELECT 1 FROM pgflow.dataset_deliveries d
          LEFT JOIN pgflow.runs r ON r.id = d.run_id
          WHERE d.event_id = e.id
            AND (d.run_id IS NULL OR r.finished_at IS NULL
                 OR (r.state = 'failed' AND r.acked_at IS NULL)))
    ORDER BY e.created_at, e.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM pgflow.dataset_events e USING doomed WHERE e.id = doomed.id
RETURNING e.id

-- name: lineage_datasets
-- Datasets around a job's lineage (pgflow/lineage.py): what each job of the graph
-- %(jobs)s produces and triggers on, the producers of what %(job)s triggers on and the
-- consumers of what it produces, each job with its latest run.
WITH own AS (
    SELECT produces, trigger_on FROM pgflow.jobs WHERE name = %(job)s
), links AS (
    SELECT j.name AS job, d.dataset, 'produces' AS role
    FROM pgflow.jobs j CROSS JOIN LATERAL unnest(j.produces) AS d(dataset)
    WHERE j.name = ANY(%(jobs)s::text[]) AND j.produces <> '{}'
    UNION
    SELECT j.name, d.dataset, 'trigger_on'
    FROM pgflow.jobs j CROSS JOIN LATERAL unnest(j.trigger_on) AS d(dataset)
    WHERE j.name = ANY(%(jobs)s::text[]) AND j.trigger_on <> '{}'
    UNION
    SELECT j.name, d.dataset, 'produces'
    FROM own CROSS JOIN pgflow.jobs j CROSS JOIN LATERAL unnest(j.produces) AS d(dataset)
    WHERE j.produces && own.trigger_on AND j.produces <> '{}'
      AND d.dataset = ANY(own.trigger_on)
    UNION
    SELECT j.name, d.dataset, 'trigger_on'
    FROM own CROSS JOIN pgflow.jobs j CROSS JOIN LATERAL unnest(j.trigger_on) AS d(dataset)
    WHERE j.trigger_on && own.produces AND j.trigger_on <> '{}'
      AND d.dataset = ANY(own.produces)
)
SELECT l.job, l.dataset, l.role, latest.id AS run_id, latest.state
FROM links l
LEFT JOIN LATERAL pgflow.latest_run(l.job) latest ON true
ORDER BY l.dataset, l.role, l.job
LIMIT 500
