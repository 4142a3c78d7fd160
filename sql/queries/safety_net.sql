-- The safety net: runs and backfills that nothing will ever move (pgflow/safety_net.py).
-- Each statement repairs with a guarded UPDATE and counts what it repaired in
-- pgflow.repairs in the same statement.

-- name: repair_pending
-- Pending runs after id %(after)s (at most %(limit)s, in id order: successive calls walk
-- all pending runs through runs_state_idx) that no event will move any more: their
-- upstream runs at their logical time all succeeded (pending_ready) or there is none
-- (pending_no_upstream): queued; one of them failed, was cancelled or is
-- upstream_failed (pending_upstream_failed): upstream_failed. Runs held by a running
-- backfill wait for its release and are left alone.
WITH scanned AS (
    SELECT p.id, p.job, p.logical_time
    FROM pgflow.runs p
    WHERE p.state = 'pending' AND p.id > %(after)s
      AND NOT (p.trigger = 'backfill' AND EXISTS (
          SELECT 1 FROM pgflow.backfills b WHERE b.id = p.backfill_id AND b.state = 'running'))
    ORDER BY p.id
    LIMIT %(limit)s
), verdict AS (
    SELECT s.id,
           CASE WHEN count(*) FILTER (WHERE u.state IN ('failed', 'cancelled',
                                                         'upstream_failed')) > 0
                    THEN 'pending_upstream_failed'
                WHEN count(u.id) = 0 THEN 'pending_no_upstream'
                WHEN count(*) FILTER (WHERE u.state = 'succeeded') = count(u.id)
                    THEN 'pending_ready'
           END AS kind
    FROM scanned s
    LEFT JOIN pgflow.job_deps d ON d.job = s.job
    LEFT JOIN pgflow.run_keys k ON k.job = d.upstream AND k.logical_time = s.logical_time
    LEFT JOIN pgflow.runs u ON u.id = k.run_id
    GROUP BY s.id
), repaired AS (
    UPDATE pgflow.runs p
    SET state = CASE WHEN v.kind = 'pending_upstream_failed' THEN 'upstream_failed'
                     ELSE 'queued' END,
        finished_at = CASE WHEN v.kind = 'pending_upstream_failed' THEN now() END,
        available_at = now()
    FROM verdict v
    WHERE p.id = v.id AND v.kind IS NOT NULL AND p.state = 'pending'
    RETURNING p.id, p.job, p.logical_time, p.state, p.backfill_id, v.kind
), counted AS (
    INSERT INTO pgflow.repairs AS x (kind, total, last_at)
    SELECT kind, count(*), now() FROM repaired GROUP BY kind
    ON CONFLICT (kind) DO UPDATE SET total = x.total + EXCLUDED.total, last_at = now()
)
SELECT (SELECT max(id) FROM scanned) AS last_id,
       (SELECT count(*) FROM scanned) AS scanned,
       coalesce((SELECT jsonb_agg(to_jsonb(r) ORDER BY r.id) FROM repaired r), '[]')
           AS repaired,
       (SELECT pg_notify('pgflow_queue', '') FROM repaired WHERE state = 'queued' LIMIT 1)::text
           AS woke

-- name: repair_leases
-- Running runs whose lease has not expired but whose owner is not a live replica (no
-- row in pgflow.replicas, or a heartbeat older than %(alive_s)s): nothing will renew
-- the lease, and nobody will end the attempt before it expires. Expiring it now hands
-- the run to the reaper (attempt + 1). Attempts younger than %(ttl)s are left alone (a
-- replica starting up may claim before its first heartbeat lands).
WITH orphaned AS (
    SELECT r.id, r.attempt, r.lease_owner
    FROM pgflow.runs r
    WHERE r.state = 'running' AND r.lease_expires_at > now()
      AND r.attempt_started_at < now() - make_interval(secs => %(ttl)s)
      AND NOT EXISTS (SELECT 1 FROM pgflow.replicas x
                      WHERE x.id = r.lease_owner
                        AND x.heartbeat_at > now() - make_interval(secs => %(alive_s)s))
    ORDER BY r.id
    LIMIT %(limit)s
), repaired AS (
    UPDATE pgflow.runs r SET lease_expires_at = now()
    FROM orphaned o
    WHERE r.id = o.id AND r.state = 'running' AND r.attempt = o.attempt
      AND r.lease_owner = o.lease_owner AND r.lease_expires_at > now()
    RETURNING r.id, r.job, r.logical_time, r.attempt, r.lease_owner, 'lease_orphaned' AS kind
), counted AS (
    INSERT INTO pgflow.repairs AS x (kind, total, last_at)
    SELECT kind, count(*), now() FROM repaired GROUP BY kind
    ON CONFLICT (kind) DO UPDATE SET total = x.total + EXCLUDED.total, last_at = now()
)
SELECT * FROM repaired ORDER BY id

-- name: repair_backfills
-- Running backfills with nothing left to run whose last run ended more than %(grace)s
-- seconds ago: the transaction that ended it should have completed the backfill.
WITH done AS (
    SELECT b.id
    FROM pgflow.backfills b
    WHERE b.state = 'running' AND b.created_at < now() - make_interval(secs => %(grace)s)
      AND NOT EXISTS (SELECT 1 FROM pgflow.runs r WHERE r.backfill_id = b.id
                      AND r.state IN ('pending', 'queued', 'running', 'retrying'))
      AND NOT EXISTS (SELECT 1 FROM pgflow.runs r WHERE r.backfill_id = b.id
                      AND r.finished_at > now() - make_interval(secs => %(grace)s))
), repaired AS (
    UPDATE pgflow.backfills b SET state = 'completed', finished_at = now()
    FROM done
    WHERE b.id = done.id AND b.state = 'running'
      AND NOT EXISTS (SELECT 1 FROM pgflow.runs r WHERE r.backfill_id = b.id
                      AND r.state IN ('pending', 'queued', 'running', 'retrying'))
    RETURNING b.id, b.job, 'backfill_finished' AS kind
), counted AS (
    INSERT INTO pgflow.repairs AS x (kind, total, last_at)
    SELECT kind, count(*), now() FROM repaired GROUP BY kind
    ON CONFLICT (kind) DO UPDATE SET total = x.total + EXCLUDED.total, last_at = now()
)
SELECT * FROM repaired ORDER BY id

-- name: repair_totals
-- pgflow_repairs_total{kind}: counted by whichever replica repaired, read by every scrape.
SELECT kind, total FROM pgflow.repairs ORDER BY kind
