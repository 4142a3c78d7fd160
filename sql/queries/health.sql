-- The health listener of replicas without the web role (pgflow/health.py).

-- name: health_schema_version
-- Readiness: the database answers, and its schema is not older than this replica's code.
SELECT coalesce(max(version), 0) AS version FROM pgflow.schema_migrations
