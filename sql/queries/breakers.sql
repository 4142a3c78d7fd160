-- Circuit breakers, one row per external source (pgflow/breakers.py).

-- name: breaker_list
-- Every source with a breaker row, a [sources] entry or named by a job (those without a
-- row are closed), open ones first.
WITH used AS (
    SELECT s.source, count(*) AS jobs
    FROM pgflow.jobs j CROSS JOIN LATERAL unnest(j.sources) AS s(source)
    GROUP BY s.source
), names AS (
    SELECT source FROM pgflow.breakers UNION SELECT source FROM used
    UNION SELECT name FROM pgflow.sources
)
SELECT n.source, coalesce(b.state, 'closed') AS state, b.reason, b.changed_at, b.changed_by,
       coalesce(u.jobs, 0)::int AS jobs, coalesce(b.failures, 0) AS failures, b.opened_at,
       b.cooldown_s, coalesce(b.manual, false) AS manual, b.probe_run,
       CASE WHEN b.state = 'open' AND NOT b.manual
            THEN b.opened_at + make_interval(secs => b.cooldown_s) END AS half_open_at,
       coalesce(s.failure_threshold, 3) AS failure_threshold,
       coalesce(s.cooldown_s, 60) AS base_cooldown_s, s.max_concurrency,
       (SELECT count(*) FROM pgflow.jobs j JOIN pgflow.runs r ON r.job = j.name
        WHERE j.sources @> ARRAY[n.source] AND r.held
          AND r.state IN ('queued', 'retrying'))::int AS held_runs
FROM names n
LEFT JOIN pgflow.breakers b ON b.source = n.source
LEFT JOIN used u ON u.source = n.source
LEFT JOIN pgflow.sources s ON s.name = n.source
ORDER BY coalesce(b.state, 'closed') <> 'closed' DESC, 1

-- name: breaker_get
SELECT b.source, b.state, b.reason, b.changed_at, b.changed_by,
       (SELECT count(*) FROM pgflow.jobs j WHERE b.source = ANY(j.sources))::int AS jobs
FROM pgflow.breakers b WHERE b.source = %(source)s

-- name: breaker_source_used
SELECT EXISTS (SELECT 1 FROM pgflow.jobs WHERE %(source)s = ANY(sources))
       OR EXISTS (SELECT 1 FROM pgflow.sources WHERE name = %(source)s) AS used

-- name: breaker_open
-- By hand: a closed or half_open (or never seen) source opens and stays open until
-- closed by hand; an open one comes back empty (a breaker that opened by itself is
-- made manual: it will not probe).
WITH old AS (
    -- the statement's snapshot: the state before this change
    SELECT state FROM pgflow.breakers WHERE source = %(source)s
), opened AS (
    INSERT INTO pgflow.breakers AS b (source, state, reason, changed_at, changed_by, opened_at,
                                      manual)
    VALUES (%(source)s, 'open', %(reason)s, coalesce(%(now)s, now()), %(by)s,
            coalesce(%(now)s, now()), true)
    ON CONFLICT (source) DO UPDATE SET
        state = 'open', reason = EXCLUDED.reason, changed_at = EXCLUDED.changed_at,
        changed_by = EXCLUDED.changed_by, opened_at = EXCLUDED.opened_at, manual = true,
        probe_run = NULL, probe_at = NULL
    WHERE b.state <> 'open' OR NOT b.manual
    RETURNING source, state, reason, changed_at, changed_by,
              (SELECT count(*) FROM pgflow.jobs j WHERE b.source = ANY(j.sources))::int AS jobs
), logged AS (
    INSERT INTO pgflow.breaker_transitions (source, from_state, to_state, reason, changed_by)
    SELECT o.source, coalesce((SELECT state FROM old), 'closed'), 'open', o.reason, o.changed_by
    FROM opened o WHERE coalesce((SELECT state FROM old), 'closed') <> 'open'
)
SELECT * FROM opened

-- name: breaker_close
WITH old AS (
    -- the statement's snapshot: the state before this change
    SELECT state FROM pgflow.breakers WHERE source = %(source)s
), closed AS (
    UPDATE pgflow.breakers b
    SET state = 'closed', reason = %(reason)s, changed_at = coalesce(%(now)s, now()),
        changed_by = %(by)s, failures = 0, cooldown_s = NULL, reopens = 0, manual = false,
        probe_run = NULL, probe_at = NULL
    WHERE b.source = %(source)s AND b.state <> 'closed'
    RETURNING source, state, reason, changed_at, changed_by,
              (SELECT count(*) FROM pgflow.jobs j WHERE b.source = ANY(j.sources))::int AS jobs
), logged AS (
    INSERT INTO pgflow.breaker_transitions (source, from_state, to_state, reason, changed_by)
    SELECT c.source, (SELECT state FROM old), 'closed', c.reason, c.changed_by FROM closed c
)
SELECT * FROM closed

-- name: breaker_hold_runs
-- A breaker of %(sources)s is no longer closed: their jobs and waiting runs are held
-- (out of the claim indexes). Runs created later copy the job's flag.
WITH jobs AS (
    UPDATE pgflow.jobs j SET held = true
    WHERE j.sources && %(sources)s::text[] AND NOT j.held
    RETURNING j.name
)
UPDATE pgflow.runs r SET held = true
FROM pgflow.jobs j
WHERE j.sources && %(sources)s::text[] AND r.job = j.name
  AND r.state IN ('pending', 'queued', 'retrying') AND NOT r.held
RETURNING r.id

-- name: breaker_release_runs
-- A breaker of %(sources)s closed: jobs none of whose sources has a breaker that is not
-- closed, and their held runs, are released (claimable at once).
WITH free AS (
    SELECT j.name FROM pgflow.jobs j
    WHERE j.sources && %(sources)s::text[]
      AND NOT EXISTS (SELECT 1 FROM pgflow.breakers b
                      WHERE b.source = ANY(j.sources) AND b.state <> 'closed')
), jobs AS (
    UPDATE pgflow.jobs j SET held = false FROM free WHERE j.name = free.name AND j.held
    RETURNING j.name
)
UPDATE pgflow.runs r SET held = false
FROM free
WHERE r.job = free.name AND r.held AND r.state IN ('pending', 'queued', 'retrying')
RETURNING r.id

-- name: breaker_ensure
INSERT INTO pgflow.breakers (source, state)
SELECT DISTINCT unnest(%(sources)s::text[]), 'closed'
ON CONFLICT (source) DO NOTHING

-- name: breaker_lock_sources
-- The breakers of %(sources)s, locked in name order, with their source's settings: a
-- finish batch counting source-unavailable attempts.
SELECT b.source, b.state, b.failures, b.cooldown_s, b.manual, b.probe_run,
       coalesce(s.failure_threshold, 3) AS threshold, coalesce(s.cooldown_s, 60) AS base_s
FROM pgflow.breakers b
LEFT JOIN pgflow.sources s ON s.name = b.source
WHERE b.source = ANY(%(sources)s::text[])
ORDER BY b.source
FOR UPDATE OF b

-- name: breaker_leases_held
-- Which of these (run, attempt, owner) results still hold their lease (locked for the
-- finish that follows): only those count for a breaker. One primary-key probe per result
-- (not indexable: IS NOT DISTINCT FROM, as in live_flush).
SELECT r.id FROM pgflow.runs r
JOIN unnest(%(ids)s::bigint[], %(attempts)s::int[], %(owners)s::text[]) AS h(id, attempt, owner)
  ON r.id = h.id AND r.attempt = h.attempt AND r.lease_owner = h.owner
WHERE r.state IS NOT DISTINCT FROM 'running'
ORDER BY r.id
FOR UPDATE OF r

-- name: breaker_set
-- One decided transition (pgflow/breakers.py: after_unavailable), guarded by the state
-- it was decided from; logged when the state changes.
WITH changed AS (
    UPDATE pgflow.breakers b
    SET state = %(state)s, failures = %(failures)s, cooldown_s = %(cooldown_s)s,
        opened_at = CASE WHEN %(state)s = 'open' AND b.state <> 'open' THEN now()
                         ELSE b.opened_at END,
        reopens = b.reopens + (b.state = 'half_open' AND %(state)s = 'open')::int,
        changed_at = CASE WHEN b.state <> %(state)s THEN now() ELSE b.changed_at END,
        reason = CASE WHEN b.state <> %(state)s THEN %(reason)s ELSE b.reason END,
        changed_by = CASE WHEN b.state <> %(state)s THEN NULL ELSE b.changed_by END,
        manual = CASE WHEN b.state <> %(state)s THEN false ELSE b.manual END,
        probe_run = CASE WHEN %(state)s = 'half_open' THEN b.probe_run END,
        probe_at = CASE WHEN %(state)s = 'half_open' THEN b.probe_at END
    WHERE b.source = %(source)s AND b.state = %(expected)s
    RETURNING b.source
), logged AS (
    INSERT INTO pgflow.breaker_transitions (source, from_state, to_state, reason, run_id)
    SELECT source, %(expected)s, %(state)s, %(reason)s, %(run_id)s FROM changed
    WHERE %(expected)s <> %(state)s
)
SELECT source FROM changed

-- name: breaker_successes
-- Attempts that succeeded (%(ok)s: [{id, sources}], already recorded): a success touching
-- a source resets its count of consecutive failures; the probe of a half_open breaker
-- closes it. Returns the sources closed.
WITH ok AS (
    SELECT * FROM jsonb_to_recordset(%(ok)s::jsonb) AS t(id bigint, sources text[])
), touched AS (
    SELECT DISTINCT unnest(sources) AS source FROM ok
), reset AS (
    UPDATE pgflow.breakers b SET failures = 0
    WHERE b.source IN (SELECT source FROM touched) AND b.state = 'closed' AND b.failures > 0
    RETURNING b.source
), closed AS (
    UPDATE pgflow.breakers b
    SET state = 'closed', failures = 0, cooldown_s = NULL, reopens = 0, probe_run = NULL,
        probe_at = NULL, changed_at = now(), changed_by = NULL, manual = false,
        reason = 'probe run ' || b.probe_run || ' succeeded'
    WHERE b.source IN (SELECT source FROM touched) AND b.state = 'half_open'
      AND b.probe_run IN (SELECT id FROM ok)
    RETURNING b.source, b.reason
), logged AS (
    INSERT INTO pgflow.breaker_transitions (source, from_state, to_state, reason)
    SELECT source, 'half_open', 'closed', reason FROM closed
)
SELECT source FROM closed

-- name: breaker_half_open_due
-- open -> half_open once the cooldown is over (not for breakers opened by hand); any
-- replica may do it, the guard lets one succeed.
WITH due AS (
    UPDATE pgflow.breakers b
    SET state = 'half_open', changed_at = now(), changed_by = NULL, probe_run = NULL,
        probe_at = NULL, reason = 'cooldown over: one probe run goes through'
    WHERE b.state = 'open' AND NOT b.manual
      AND b.opened_at + make_interval(secs => b.cooldown_s) <= now()
    RETURNING b.source, b.reason
), logged AS (
    INSERT INTO pgflow.breaker_transitions (source, from_state, to_state, reason)
    SELECT source, 'open', 'half_open', reason FROM due
)
SELECT source FROM due

-- name: breakers_waiting
-- The claim's periodic look: is a breaker due for half_open, or half_open without a
-- running probe? (a tiny table: costs nothing while every breaker is closed)
SELECT EXISTS (
    SELECT 1 FROM pgflow.breakers b
    WHERE (b.state = 'open' AND NOT b.manual
           AND b.opened_at + make_interval(secs => b.cooldown_s) <= now())
       OR (b.state = 'half_open'
           AND (b.probe_run IS NULL
                OR NOT EXISTS (SELECT 1 FROM pgflow.runs x
                               WHERE x.id = b.probe_run AND x.state = 'running')))
) AS due

-- name: claim_probe
-- The one probe run of each half_open breaker without a running probe, cluster-wide:
-- the breaker's probe_run is set by a compare-and-set on the value this statement read
-- (a concurrent claim that set it first makes the UPDATE match nothing: its re-check
-- sees the new value), and only the runs of breakers so set are claimed. A candidate
-- is a held run of a job touching the source whose other sources' breakers are closed.
WITH cand AS (
    SELECT b.source, b.probe_run AS seen, p.id
    FROM pgflow.breakers b
    CROSS JOIN LATERAL (
        SELECT r.id FROM pgflow.jobs j
        JOIN pgflow.runs r ON r.job = j.name
        WHERE j.sources @> ARRAY[b.source] AND r.state IN ('queued', 'retrying') AND r.held
          AND r.available_at <= now()
          AND NOT EXISTS (SELECT 1 FROM pgflow.breakers o
                          WHERE o.source = ANY(j.sources) AND o.source <> b.source
                            AND o.state <> 'closed')
        ORDER BY r.priority DESC, r.available_at, r.id
        LIMIT 1
        FOR UPDATE OF r SKIP LOCKED
    ) p
    WHERE b.state = 'half_open'
      AND (b.probe_run IS NULL
           OR NOT EXISTS (SELECT 1 FROM pgflow.runs x
                          WHERE x.id = b.probe_run AND x.state = 'running'))
    LIMIT %(limit)s
), probe AS (
    UPDATE pgflow.breakers b SET probe_run = cand.id, probe_at = now()
    FROM cand
    WHERE b.source = cand.source AND b.state = 'half_open'
      AND b.probe_run IS NOT DISTINCT FROM cand.seen
    RETURNING b.probe_run AS id
), picked AS (
    SELECT DISTINCT id FROM probe
),
-- include: claim_step

-- name: breaker_transitions_recent
SELECT source, from_state, to_state, at, reason, changed_by, run_id
FROM pgflow.breaker_transitions ORDER BY id DESC LIMIT %(limit)s

-- name: breaker_transition_counts
SELECT source, to_state, count(*)::bigint AS n
FROM pgflow.breaker_transitions GROUP BY source, to_state

-- name: breakers_open_sources
SELECT source FROM pgflow.breakers WHERE state <> 'closed' ORDER BY source
-- name: breaker_states
SELECT source, state FROM pgflow.breakers ORDER BY source
