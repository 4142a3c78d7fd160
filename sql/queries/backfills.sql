-- name: insert_backfill
INSERT INTO pgflow.backfills (job, range_start, range_end, max_concurrency, downstream)
VALUES (%(job)s, %(start)s, %(end)s, %(max_concurrency)s, %(downstream)s)
RETURNING id

-- name: count_backfill_ticks
UPDATE pgflow.backfills SET ticks = %(ticks)s, skipped = %(skipped)s WHERE id = %(id)s

-- name: lock_backfills
-- Releases of one backfill take turns (the leader's top-up and workers finishing its runs).
SELECT id FROM pgflow.backfills
WHERE state = 'running' AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
ORDER BY id
FOR UPDATE

-- name: release_backfill_runs
-- Top running backfills up to their cap. The runs a backfill holds (pending, trigger
-- 'backfill': its job's ticks, the other roots of their DAG runs with --downstream, and
-- downstream runs whose upstreams had already run) become queued, oldest logical time
-- first, while fewer than max_concurrency of its held-and-released runs are queued,
-- running or retrying; runs waiting for upstreams (trigger 'dependency') are not
-- counted. Run it as the statement after lock_backfills (a fresh snapshot that sees
-- every release committed before the lock), so the cap holds.
WITH room AS (
    SELECT b.id,
           b.max_concurrency - (SELECT count(*) FROM pgflow.runs r
                                WHERE r.backfill_id = b.id AND r.trigger = 'backfill'
                                  AND r.state IN ('queued', 'running', 'retrying')) AS free
    FROM pgflow.backfills b
    WHERE b.id = ANY(%(ids)s::bigint[])
), picked AS (
    SELECT p.id
    FROM room
    CROSS JOIN LATERAL (
        SELECT r.id FROM pgflow.runs r
        WHERE r.backfill_id = room.id AND r.state = 'pending' AND r.trigger = 'backfill'
        ORDER BY r.logical_time, r.id
        LIMIT greatest(room.free, 0)
        FOR UPDATE SKIP LOCKED
    ) p
)
UPDATE pgflow.runs r SET state = 'queued', available_at = now()
FROM picked WHERE r.id = picked.id
RETURNING r.id

-- name: complete_backfills
-- The backfills %(ids)s that have nothing left to run are completed. Called in the
-- transactions that end their last runs; the safety net completes any that were missed.
UPDATE pgflow.backfills b SET state = 'completed', finished_at = now()
WHERE b.id = ANY(%(ids)s::bigint[]) AND b.state = 'running'
  AND NOT EXISTS (SELECT 1 FROM pgflow.runs r WHERE r.backfill_id = b.id
                  AND r.state IN ('pending', 'queued', 'running', 'retrying'))
RETURNING id

-- name: list_backfills
SELECT b.*, coalesce(c.counts, '{}') AS counts
FROM pgflow.backfills b
LEFT JOIN LATERAL (
    SELECT jsonb_object_agg(state, n) AS counts
    FROM (SELECT state, count(*) AS n FROM pgflow.runs WHERE backfill_id = b.id GROUP BY state) s
) c ON true
WHERE (%(id)s::bigint IS NULL OR b.id = %(id)s)
ORDER BY b.id DESC
LIMIT %(limit)s

-- name: cancel_backfill
WITH stopped AS (
    UPDATE pgflow.backfills SET state = 'cancelled', finished_at = now()
    WHERE id = %(id)s AND state = 'running'
    RETURNING id
), unstarted AS (
    UPDATE pgflow.runs r SET state = 'cancelled', finished_at = now()
    FROM stopped WHERE r.backfill_id = stopped.id AND r.state IN ('pending', 'queued', 'retrying')
    RETURNING r.id
), started AS (
    UPDATE pgflow.runs r SET cancel_requested = true
    FROM stopped WHERE r.backfill_id = stopped.id AND r.state = 'running'
    RETURNING r.id
)
SELECT (SELECT count(*) FROM stopped) AS stopped,
       ARRAY(SELECT id FROM unstarted) AS cancelled,
       ARRAY(SELECT id FROM started) AS stopping
