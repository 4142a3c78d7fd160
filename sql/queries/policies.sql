-- Tenants and sources (pgflow/policies.py): definitions, flags, listings.

-- name: policy_tenants_snapshot
SELECT name, definition FROM pgflow.tenants

-- name: policy_sources_snapshot
SELECT name, definition FROM pgflow.sources

-- name: policy_upsert_tenants
INSERT INTO pgflow.tenants AS t (name, weight, max_concurrency, definition)
SELECT r.name, r.weight, r.max_concurrency, r.definition
FROM jsonb_to_recordset(%(rows)s::jsonb)
    AS r(name text, weight float8, max_concurrency int, definition jsonb)
ON CONFLICT (name) DO UPDATE SET
    weight = EXCLUDED.weight, max_concurrency = EXCLUDED.max_concurrency,
    definition = EXCLUDED.definition, updated_at = now()

-- name: policy_upsert_sources
INSERT INTO pgflow.sources AS s (name, failure_threshold, cooldown_s, max_concurrency,
                                 definition)
SELECT r.name, r.failure_threshold, r.cooldown_s, r.max_concurrency, r.definition
FROM jsonb_to_recordset(%(rows)s::jsonb)
    AS r(name text, failure_threshold int, cooldown_s float8, max_concurrency int,
         definition jsonb)
ON CONFLICT (name) DO UPDATE SET
    failure_threshold = EXCLUDED.failure_threshold, cooldown_s = EXCLUDED.cooldown_s,
    max_concurrency = EXCLUDED.max_concurrency, definition = EXCLUDED.definition,
    updated_at = now()

-- name: policy_prune_tenants
DELETE FROM pgflow.tenants WHERE NOT (name = ANY(%(keep)s::text[])) RETURNING name

-- name: policy_prune_sources
DELETE FROM pgflow.sources WHERE NOT (name = ANY(%(keep)s::text[])) RETURNING name

-- name: policy_reflag_jobs
-- A job is capped when a cap counts its runs (its own, its tenant's, a source's) and
-- held while a breaker of one of its sources is not closed. Returns the jobs whose
-- flags changed.
UPDATE pgflow.jobs j SET capped = f.capped, held = f.held
FROM (
    SELECT x.name,
           x.max_active_runs IS NOT NULL
           OR EXISTS (SELECT 1 FROM pgflow.tenants t
                      WHERE t.name = x.tenant AND t.max_concurrency IS NOT NULL)
           OR EXISTS (SELECT 1 FROM pgflow.sources s
                      WHERE s.name = ANY(x.sources) AND s.max_concurrency IS NOT NULL)
               AS capped,
           EXISTS (SELECT 1 FROM pgflow.breakers b
                   WHERE b.source = ANY(x.sources) AND b.state <> 'closed') AS held
    FROM pgflow.jobs x
) f
WHERE j.name = f.name AND (j.capped, j.held) IS DISTINCT FROM (f.capped, f.held)
RETURNING j.name

-- name: policy_reflag_runs
-- The runs of %(jobs)s take their job's flags: waiting runs both, running runs
-- `capped` (so that the caps count them).
UPDATE pgflow.runs r
SET capped = j.capped, held = CASE WHEN r.state = 'running' THEN r.held ELSE j.held END
FROM pgflow.jobs j
WHERE j.name = ANY(%(jobs)s::text[]) AND r.job = j.name
  AND r.state IN ('pending', 'queued', 'retrying', 'running')
  AND (r.capped <> j.capped OR (r.state <> 'running' AND r.held <> j.held))
RETURNING r.id

-- name: policy_tenant_list
-- Every tenant that is defined or named by a job, with its running and queued runs.
WITH names AS (
    SELECT name FROM pgflow.tenants
    UNION
    SELECT DISTINCT tenant FROM pgflow.jobs
), counts AS (
    SELECT tenant, count(*) FILTER (WHERE state = 'running') AS running,
           count(*) FILTER (WHERE state IN ('queued', 'retrying')) AS queued,
           count(*) FILTER (WHERE state IN ('queued', 'retrying') AND held) AS held
    FROM pgflow.runs WHERE (state IN ('queued', 'retrying') OR state = 'running')
    GROUP BY tenant
)
SELECT n.name, coalesce(t.weight, 1)::float8 AS weight, t.max_concurrency,
       t.name IS NOT NULL AS defined,
       (SELECT count(*) FROM pgflow.jobs j WHERE j.tenant = n.name)::int AS jobs,
       coalesce(c.running, 0)::int AS running, coalesce(c.queued, 0)::int AS queued,
       coalesce(c.held, 0)::int AS held
FROM names n
LEFT JOIN pgflow.tenants t ON t.name = n.name
LEFT JOIN counts c ON c.tenant = n.name
ORDER BY n.name

-- name: policy_source_list
SELECT s.name, s.failure_threshold, s.cooldown_s, s.max_concurrency
FROM pgflow.sources s ORDER BY s.name
