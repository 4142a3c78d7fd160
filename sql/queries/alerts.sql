-- Alerts (pgflow/alerts/): definitions, incidents, the notification outbox.

-- name: policy_alerts_snapshot
SELECT name, definition FROM pgflow.alerts

-- name: policy_upsert_alerts
INSERT INTO pgflow.alerts AS a (name, format, url, url_env, secret_env, events, jobs,
                                jobs_regex, tenants, definition)
SELECT r.name, r.format, r.url, r.url_env, r.secret_env,
       ARRAY(SELECT jsonb_array_elements_text(r.events)),
       ARRAY(SELECT jsonb_array_elements_text(r.jobs)),
       ARRAY(SELECT jsonb_array_elements_text(r.jobs_regex)),
       ARRAY(SELECT jsonb_array_elements_text(r.tenants)), r.definition
FROM jsonb_to_recordset(%(rows)s::jsonb)
    AS r(name text, format text, url text, url_env text, secret_env text, events jsonb,
         jobs jsonb, jobs_regex jsonb, tenants jsonb, definition jsonb)
ON CONFLICT (name) DO UPDATE SET
    format = EXCLUDED.format, url = EXCLUDED.url, url_env = EXCLUDED.url_env,
    secret_env = EXCLUDED.secret_env, events = EXCLUDED.events, jobs = EXCLUDED.jobs,
    jobs_regex = EXCLUDED.jobs_regex, tenants = EXCLUDED.tenants,
    definition = EXCLUDED.definition, updated_at = now()

-- name: policy_prune_alerts
DELETE FROM pgflow.alerts WHERE NOT (name = ANY(%(keep)s::text[])) RETURNING name

-- name: alert_definitions
SELECT name, format, url, url_env, secret_env, events, jobs, tenants, updated_at
FROM pgflow.alerts ORDER BY name

-- name: alert_definition
SELECT name, format, url, url_env, secret_env, events, jobs, tenants
FROM pgflow.alerts WHERE name = %(name)s

-- name: alert_env_names
SELECT DISTINCT v AS name
FROM pgflow.alerts, unnest(ARRAY[url_env, secret_env]) AS v
WHERE v IS NOT NULL

-- ---------------------------------------------------------------- evaluation (leader)

-- fragment: alert_notify
-- One notification per (changed incident row x matching alert): `changed` holds the
-- rows this statement opened or resolved, with the notification's event and payload.
notes AS (
    INSERT INTO pgflow.notifications (alert, incident_id, event, status, payload)
    SELECT a.name, c.id, %(note_event)s, %(status)s,
           %(payload)s::jsonb || jsonb_build_object(
               'at', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'))
    FROM changed c
    JOIN pgflow.alerts a ON %(note_event)s = ANY(a.events)
        AND (c.job IS NULL OR cardinality(a.jobs_regex) = 0
             OR EXISTS (SELECT 1 FROM unnest(a.jobs_regex) p WHERE c.job ~ p))
        AND (c.tenant IS NULL OR cardinality(a.tenants) = 0 OR c.tenant = ANY(a.tenants))
    RETURNING id
)
SELECT (SELECT count(*) FROM changed) AS changed, (SELECT count(*) FROM notes) AS notified

-- name: alert_lock_cursor
-- One evaluator at a time (the leader; a second one waits here, then sees the first's work).
SELECT runs_checked_at, breaker_transition, now() AS now
FROM pgflow.alert_cursor FOR UPDATE

-- name: alert_save_cursor
UPDATE pgflow.alert_cursor
SET runs_checked_at = %(runs_checked_at)s, breaker_transition = %(breaker_transition)s

-- name: alert_open
-- Open an incident unless one is open for (event, key) (or, for replica_lost, ever was).
WITH changed AS (
    INSERT INTO pgflow.incidents (event, key, job, tenant, run_id, source, runs, summary,
                                  details, resolved_at)
    VALUES (%(event)s, %(key)s, %(job)s, %(tenant)s, %(run_id)s, %(source)s,
            %(runs)s::bigint[], %(summary)s, %(details)s::jsonb,
            CASE WHEN %(once)s THEN now() END)
    ON CONFLICT DO NOTHING
    RETURNING id, job, tenant
),
-- include: alert_notify

-- name: alert_resolve
WITH changed AS (
    UPDATE pgflow.incidents
    SET resolved_at = now(), updated_at = now(), details = details || %(details)s::jsonb
    WHERE event = %(event)s AND key = %(key)s AND resolved_at IS NULL
    RETURNING id, job, tenant
),
-- include: alert_notify

-- name: alert_no_leader_open
-- Any replica may run this; the guard is judged in the statement's own snapshot, so a
-- leader that came back a moment ago is seen, and the unique index lets one insert win.
WITH changed AS (
    INSERT INTO pgflow.incidents (event, key, summary, details)
    SELECT 'no_leader', 'cluster', %(summary)s, jsonb_build_object('last_leader', l.replica_id)
    FROM pgflow.leader l
    WHERE l.heartbeat_at < now() - make_interval(secs => %(after_s)s)
    ON CONFLICT DO NOTHING
    RETURNING id, job, tenant
),
-- include: alert_notify

-- name: alert_no_leader_resolve
WITH changed AS (
    UPDATE pgflow.incidents i
    SET resolved_at = now(), updated_at = now(),
        details = i.details || jsonb_build_object('leader', l.replica_id)
    FROM pgflow.leader l
    WHERE i.event = 'no_leader' AND i.key = 'cluster' AND i.resolved_at IS NULL
      AND l.heartbeat_at >= now() - make_interval(secs => %(after_s)s)
    RETURNING i.id, i.job, i.tenant
),
-- include: alert_notify

-- name: alert_leader_age
SELECT replica_id, extract(epoch FROM now() - heartbeat_at)::float8 AS age_s,
       EXISTS (SELECT 1 FROM pgflow.incidents
               WHERE event = 'no_leader' AND key = 'cluster' AND resolved_at IS NULL) AS open
FROM pgflow.leader

-- name: alert_finished_runs
-- Dead letters and successes since the cursor (runs_finished_idx), after the last run
-- of their job the streak logic saw, in finish order. Only the rows that can change a
-- streak come back: dead letters, and successes of a job with an open streak or a dead
-- letter in this window (the bulk of a busy cluster's successes stays in the database).
WITH finished AS (
    SELECT r.id, r.job, r.tenant, r.state, r.finished_at, r.logical_time, r.attempt
    FROM pgflow.runs r
    LEFT JOIN pgflow.alert_job_streaks s ON s.job = r.job
    WHERE r.finished_at > %(since)s
      AND r.state IN ('succeeded', 'failed')
      AND (s.job IS NULL OR (r.finished_at, r.id) > (s.last_finished_at, s.last_run_id))
), failing AS (
    SELECT DISTINCT job FROM finished WHERE state = 'failed'
)
SELECT f.*, a.error
FROM finished f
LEFT JOIN pgflow.attempts a ON f.state = 'failed' AND a.run_id = f.id AND a.attempt = f.attempt
WHERE f.state = 'failed'
   OR f.job IN (SELECT job FROM failing)
   OR EXISTS (SELECT 1 FROM pgflow.incidents i
              WHERE i.event = 'run_failed' AND i.key = f.job AND i.resolved_at IS NULL)
ORDER BY f.finished_at, f.id
LIMIT %(limit)s

-- name: alert_open_streaks
SELECT key AS job, id, runs FROM pgflow.incidents
WHERE event = 'run_failed' AND resolved_at IS NULL AND key = ANY(%(jobs)s::text[])

-- name: alert_append_runs
-- More dead letters of a streak join its incident (a run retried by an operator that
-- fails again is listed once).
UPDATE pgflow.incidents i
SET runs = i.runs || n.runs, updated_at = now(),
    summary = 'job failing: ' || i.key || ', '
              || (cardinality(i.runs) + cardinality(n.runs))::text || ' dead letters in a row'
FROM (SELECT x.id, ARRAY(SELECT r FROM unnest(x.runs) r
                         WHERE NOT r = ANY(o.runs)) AS runs
      FROM jsonb_to_recordset(%(rows)s::jsonb) AS x(id bigint, runs bigint[])
      JOIN pgflow.incidents o ON o.id = x.id) n
WHERE i.id = n.id AND i.resolved_at IS NULL AND cardinality(n.runs) > 0

-- name: alert_save_streaks
INSERT INTO pgflow.alert_job_streaks AS s (job, last_run_id, last_finished_at)
SELECT x.job, x.last_run_id, x.last_finished_at
FROM jsonb_to_recordset(%(rows)s::jsonb) AS x(job text, last_run_id bigint,
                                              last_finished_at timestamptz)
ON CONFLICT (job) DO UPDATE SET last_run_id = EXCLUDED.last_run_id,
    last_finished_at = EXCLUDED.last_finished_at

-- name: alert_deadline_missed
-- Runs of jobs with a deadline, past logical time + deadline and not succeeded, without
-- an incident yet; only ticks of the last %(lookback_s)s are looked at (run_keys'
-- primary key, per job with a deadline).
SELECT r.id, r.job, r.tenant, r.logical_time, r.state, r.attempt, j.deadline_s
FROM pgflow.jobs j
JOIN pgflow.run_keys k ON k.job = j.name
    AND k.logical_time <= now() - make_interval(secs => j.deadline_s)
    AND k.logical_time > now() - make_interval(secs => j.deadline_s + %(lookback_s)s)
JOIN pgflow.runs r ON r.id = k.run_id
WHERE j.deadline_s IS NOT NULL
  AND r.state NOT IN ('succeeded', 'cancelled') AND r.acked_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM pgflow.incidents i
                  WHERE i.event = 'deadline_missed' AND i.key = r.id::text)
ORDER BY r.logical_time
LIMIT %(limit)s

-- name: alert_deadline_settled
-- Open deadline incidents whose run succeeded (resolved), was cancelled or acknowledged,
-- or is gone.
SELECT i.key, i.run_id, i.job, r.state
FROM pgflow.incidents i
LEFT JOIN pgflow.runs r ON r.id = i.run_id
WHERE i.event = 'deadline_missed' AND i.resolved_at IS NULL
  AND (r.id IS NULL OR r.state IN ('succeeded', 'cancelled') OR r.acked_at IS NOT NULL)

-- name: alert_breaker_transitions
SELECT id, source, from_state, to_state, reason FROM pgflow.breaker_transitions
WHERE id > %(after)s ORDER BY id LIMIT %(limit)s

-- name: alert_breaker_drift
-- Breakers whose state and open incident disagree (a transition the log cursor missed).
SELECT b.source, b.state, i.id AS incident
FROM pgflow.breakers b
FULL JOIN (SELECT id, key FROM pgflow.incidents
           WHERE event = 'breaker_opened' AND resolved_at IS NULL) i ON i.key = b.source
WHERE (b.state IN ('open', 'half_open') AND i.id IS NULL)
   OR (i.id IS NOT NULL AND (b.source IS NULL OR b.state = 'closed'))

-- name: alert_cluster_facts
SELECT
    (SELECT oldest_claimable_age_s FROM pgflow.worker_demand)::float8 AS oldest_wait_s,
    count(*) FILTER (WHERE outcome IN ('succeeded', 'failed', 'timed_out', 'lost')) AS attempts,
    count(*) FILTER (WHERE outcome IN ('failed', 'timed_out', 'lost')) AS failed,
    ARRAY(SELECT event FROM pgflow.incidents
          WHERE key = 'cluster' AND resolved_at IS NULL) AS open
FROM pgflow.attempts
WHERE finished_at > now() - make_interval(secs => %(window_s)s)

-- name: alert_lost_replicas
-- Replicas silent for %(dead_s)s that held runs: still leased to them, or reaped (lost)
-- since their last heartbeat.
SELECT p.id, p.host, p.pid, p.heartbeat_at,
       ARRAY(SELECT r.id FROM pgflow.runs r
             WHERE r.lease_owner = p.id AND r.state = 'running') AS held,
       ARRAY(SELECT a.run_id FROM pgflow.attempts a
             WHERE a.finished_at >= p.heartbeat_at AND a.worker_id = p.id
               AND a.outcome = 'lost') AS lost
FROM pgflow.replicas p
WHERE p.heartbeat_at < now() - make_interval(secs => %(dead_s)s)
  AND NOT EXISTS (SELECT 1 FROM pgflow.incidents i
                  WHERE i.event = 'replica_lost' AND i.key = p.id)

-- ---------------------------------------------------------------- delivery (any replica)

-- name: notification_claim
-- Due pending notifications, pushed one lease ahead: a sender that dies mid-request
-- leaves them to be retried once the lease passed. At most %(per_alert)s per alert, and
-- none of the alerts in %(busy)s (already at that many requests on this replica): one
-- receiver that hangs cannot take every slot. An incident's notifications go to an alert
-- one after the other, in the order they were made (firing, then resolved: a receiver
-- never sees an incident resolved before it fired).
WITH due AS (
    SELECT id, alert, next_attempt_at FROM pgflow.notifications n
    WHERE delivery = 'pending' AND next_attempt_at <= now()
      AND NOT (alert = ANY(%(busy)s::text[]))
      AND NOT EXISTS (SELECT 1 FROM pgflow.notifications e
                      WHERE e.incident_id = n.incident_id AND e.alert = n.alert
                        AND e.delivery = 'pending'
                        AND (e.created_at, e.status) < (n.created_at, n.status))
    ORDER BY next_attempt_at
    LIMIT 1000
), ranked AS (
    SELECT id, next_attempt_at,
           row_number() OVER (PARTITION BY alert ORDER BY next_attempt_at) AS rank
    FROM due
), chosen AS (
    SELECT n.id FROM pgflow.notifications n
    WHERE n.id IN (SELECT id FROM ranked WHERE rank <= %(per_alert)s
                   ORDER BY next_attempt_at LIMIT %(limit)s)
      AND n.delivery = 'pending' AND n.next_attempt_at <= now()
    FOR UPDATE SKIP LOCKED
)
UPDATE pgflow.notifications n
SET next_attempt_at = now() + make_interval(secs => %(lease_s)s), attempts = n.attempts + 1
FROM chosen c
WHERE n.id = c.id
RETURNING n.id::text AS id, n.alert, n.event, n.status, n.payload, n.attempts,
          (SELECT row_to_json(a)::jsonb FROM
               (SELECT format, url, url_env, secret_env FROM pgflow.alerts
                WHERE name = n.alert) a) AS target

-- name: notification_delivered
UPDATE pgflow.notifications
SET delivery = 'delivered', delivered_at = now(), last_status = %(status)s, last_error = NULL
WHERE id = %(id)s::uuid AND attempts = %(attempts)s AND delivery = 'pending'
RETURNING id

-- name: notification_failed
-- Retried after %(delay_s)s, or given up once its 24 hours are over.
UPDATE pgflow.notifications
SET last_status = %(status)s, last_error = %(error)s,
    next_attempt_at = now() + make_interval(secs => %(delay_s)s),
    delivery = CASE WHEN now() >= give_up_at OR %(give_up)s THEN 'given_up' ELSE 'pending' END
WHERE id = %(id)s::uuid AND attempts = %(attempts)s AND delivery = 'pending'
RETURNING delivery

-- name: notification_test
-- A test notification, sent at once by the caller (not by the senders).
-- (If the caller dies mid-send, a sender tries it once an hour later, then gives up.)
INSERT INTO pgflow.notifications (alert, event, status, payload, next_attempt_at, give_up_at,
                                  attempts)
VALUES (%(alert)s, 'test', 'firing',
        %(payload)s::jsonb || jsonb_build_object(
            'at', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')),
        now() + interval '1 hour', now(), 1)
RETURNING id::text AS id, payload

-- name: notification_test_result
UPDATE pgflow.notifications
SET delivery = CASE WHEN %(ok)s THEN 'delivered' ELSE 'given_up' END,
    delivered_at = CASE WHEN %(ok)s THEN now() END,
    last_status = %(status)s, last_error = %(error)s
WHERE id = %(id)s::uuid

-- ---------------------------------------------------------------- reading

-- name: incidents_open
SELECT id, event, key, job, tenant, run_id, source, runs, summary, details, opened_at,
       updated_at, resolved_at
FROM pgflow.incidents WHERE resolved_at IS NULL
ORDER BY opened_at DESC LIMIT %(limit)s

-- name: incidents_recent
SELECT id, event, key, job, tenant, run_id, source, runs, summary, details, opened_at,
       updated_at, resolved_at
FROM pgflow.incidents
ORDER BY opened_at DESC, id DESC LIMIT %(limit)s

-- name: incidents_firing_count
-- The banner's lookup on every page (incidents_firing_idx).
SELECT count(*) AS firing, max(opened_at) AS latest FROM pgflow.incidents
WHERE resolved_at IS NULL

-- name: notifications_recent
SELECT id::text AS id, alert, event, status, delivery, created_at, delivered_at,
       next_attempt_at, give_up_at, attempts, last_status, last_error,
       payload ->> 'summary' AS summary
FROM pgflow.notifications
ORDER BY created_at DESC LIMIT %(limit)s

-- name: notification_backlog
SELECT count(*) FILTER (WHERE delivery = 'pending') AS pending,
       count(*) FILTER (WHERE delivery = 'given_up') AS given_up
FROM pgflow.notifications WHERE delivery <> 'delivered'

-- name: incidents_banner
-- The banner on every page: the newest open incidents and how many are open
-- (incidents_firing_idx; the window counts the open set before the limit).
SELECT id, event, key, summary, opened_at, count(*) OVER () AS total
FROM pgflow.incidents WHERE resolved_at IS NULL
ORDER BY opened_at DESC LIMIT %(limit)s

-- name: incidents_open_by_event
SELECT event, count(*) AS open FROM pgflow.incidents WHERE resolved_at IS NULL GROUP BY event
