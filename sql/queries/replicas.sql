-- name: heartbeat_replica
-- Registers the replica on first call (or after it was forgotten) and refreshes it after.
INSERT INTO pgflow.replicas (id, host, pid, roles, version, concurrency, stopping)
VALUES (%(id)s, %(host)s, %(pid)s, %(roles)s, %(version)s, %(concurrency)s, %(stopping)s)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), stopping = EXCLUDED.stopping

-- name: deregister_replica
DELETE FROM pgflow.replicas WHERE id = %(id)s

-- name: forget_dead_replicas
-- Replicas silent for a long time are gone; their runs were reaped long before. So are
-- the offers of workers that stopped renewing them (pgflow/handoff.py).
WITH lapsed AS (
    DELETE FROM pgflow.idle_workers
    WHERE until < now() - make_interval(secs => %(after_s)s)
)
DELETE FROM pgflow.replicas
WHERE heartbeat_at < now() - make_interval(secs => %(after_s)s)
RETURNING id
