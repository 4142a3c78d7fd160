-- Circuit breakers, one row per external source an operator has opened or closed.

-- name: breaker_list
-- Every source with a breaker row or named by a job (those without a row are closed),
-- open ones first.
WITH used AS (
    SELECT s.source, count(*) AS jobs
    FROM pgflow.jobs j CROSS JOIN LATERAL unnest(j.sources) AS s(source)
    GROUP BY s.source
)
SELECT coalesce(b.source, u.source) AS source, coalesce(b.state, 'closed') AS state,
       b.reason, b.changed_at, b.changed_by, coalesce(u.jobs, 0)::int AS jobs
FROM pgflow.breakers b
FULL JOIN used u ON u.source = b.source
ORDER BY coalesce(b.state, 'closed') = 'open' DESC, 1

-- name: breaker_get
SELECT b.source, b.state, b.reason, b.changed_at, b.changed_by,
       (SELECT count(*) FROM pgflow.jobs j WHERE b.source = ANY(j.sources))::int AS jobs
FROM pgflow.breakers b WHERE b.source = %(source)s

-- name: breaker_source_used
SELECT EXISTS (SELECT 1 FROM pgflow.jobs WHERE %(source)s = ANY(sources)) AS used

-- name: breaker_open
-- Only a closed (or never seen) source opens; an open one comes back empty.
INSERT INTO pgflow.breakers AS b (source, state, reason, changed_at, changed_by)
VALUES (%(source)s, 'open', %(reason)s, coalesce(%(now)s, now()), %(by)s)
ON CONFLICT (source) DO UPDATE SET
    state = 'open', reason = EXCLUDED.reason, changed_at = EXCLUDED.changed_at,
    changed_by = EXCLUDED.changed_by
WHERE b.state = 'closed'
RETURNING source, state, reason, changed_at, changed_by,
          (SELECT count(*) FROM pgflow.jobs j WHERE b.source = ANY(j.sources))::int AS jobs

-- name: breaker_close
UPDATE pgflow.breakers b
SET state = 'closed', reason = %(reason)s, changed_at = coalesce(%(now)s, now()),
    changed_by = %(by)s
WHERE b.source = %(source)s AND b.state = 'open'
RETURNING source, state, reason, changed_at, changed_by,
          (SELECT count(*) FROM pgflow.jobs j WHERE b.source = ANY(j.sources))::int AS jobs

-- name: breakers_open_sources
SELECT source FROM pgflow.breakers WHERE state = 'open' ORDER BY source
