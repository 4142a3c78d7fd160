-- Alerts (SPEC §3 [alerts.NAME], deadline; §4d; §7 pgflow.notifications): definitions,
-- incidents, the notification outbox. The design is explained in pgflow/alerts/__init__.py.

-- deadline: a run not succeeded this long after its logical time raises deadline_missed.
ALTER TABLE pgflow.jobs ADD COLUMN deadline_s double precision CHECK (deadline_s > 0);
-- The evaluator looks at the recent runs of the (few) jobs with a deadline.
CREATE INDEX jobs_deadline_idx ON pgflow.jobs (name) WHERE deadline_s IS NOT NULL;

CREATE TABLE pgflow.alerts (
    name        text PRIMARY KEY
                CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.-]*$' AND length(name) <= 128),
    format      text NOT NULL DEFAULT 'json' CHECK (format IN ('json', 'slack')),
    url         text,
    url_env     text,
    secret_env  text,
    events      text[] NOT NULL,          -- notification events this alert receives
    jobs        text[] NOT NULL DEFAULT '{}',  -- globs on job names; empty: every job
    jobs_regex  text[] NOT NULL DEFAULT '{}',  -- the same globs as anchored regexes
    tenants     text[] NOT NULL DEFAULT '{}',  -- empty: every tenant
    definition  jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CHECK ((url IS NULL) <> (url_env IS NULL))
);

-- One row per incident: what fired, for what (key), when, the runs involved, when it ended.
CREATE TABLE pgflow.incidents (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event       text NOT NULL CHECK (event IN ('run_failed', 'deadline_missed', 'breaker_opened',
                    'backlog', 'failure_rate', 'no_leader', 'replica_lost')),
    -- what the incident is about: a job name, a run id, a source, a replica id, 'cluster'
    key         text NOT NULL,
    job         text,
    tenant      text,
    run_id      bigint,
    source      text,
    runs        bigint[] NOT NULL DEFAULT '{}',
    summary     text NOT NULL,
    details     jsonb NOT NULL DEFAULT '{}',
    opened_at   timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    resolved_at timestamptz,
    CHECK (resolved_at IS NULL OR resolved_at >= opened_at)
);
-- At most one open incident per (event, key): two evaluators (a leader change mid-pass,
-- every replica checking no_leader) can never fire the same incident twice.
CREATE UNIQUE INDEX incidents_open_idx ON pgflow.incidents (event, key) WHERE resolved_at IS NULL;
-- A lost replica is announced once, ever (it has no resolution).
CREATE UNIQUE INDEX incidents_replica_lost_idx ON pgflow.incidents (key)
    WHERE event = 'replica_lost';
-- "Has this run (replica) had an incident?" lookups of the evaluator.
CREATE INDEX incidents_key_idx ON pgflow.incidents (event, key);
-- Listings (newest first) and the banner's lookup (any open incident?).
CREATE INDEX incidents_opened_idx ON pgflow.incidents (opened_at DESC, id DESC);
CREATE INDEX incidents_firing_idx ON pgflow.incidents (opened_at DESC) WHERE resolved_at IS NULL;
-- Retention removes resolved incidents after PGFLOW_RETENTION.
CREATE INDEX incidents_resolved_idx ON pgflow.incidents (resolved_at) WHERE resolved_at IS NOT NULL;

-- The outbox: one row per (incident transition x matching alert), written in the
-- transaction of the transition, delivered at least once by any replica.
CREATE TABLE pgflow.notifications (
    id              uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    alert           text NOT NULL,
    incident_id     bigint REFERENCES pgflow.incidents (id) ON DELETE SET NULL,
    event           text NOT NULL,
    status          text NOT NULL CHECK (status IN ('firing', 'resolved')),
    -- the body's fields but `id` (added when sent, the same on every try)
    payload         jsonb NOT NULL,
    delivery        text NOT NULL DEFAULT 'pending'
                    CHECK (delivery IN ('pending', 'delivered', 'given_up')),
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- when a sender may (re)try; a claim pushes it one lease ahead, so a sender that
    -- crashed mid-request leaves a row that is retried once the lease passed
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    give_up_at      timestamptz NOT NULL DEFAULT now() + interval '24 hours',
    delivered_at    timestamptz,
    attempts        integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error      text,
    last_status     integer,  -- HTTP status of the last answer
    CHECK ((delivery = 'delivered') = (delivered_at IS NOT NULL))
);
-- Senders claim due pending rows in this order.
CREATE INDEX notifications_due_idx ON pgflow.notifications (next_attempt_at)
    WHERE delivery = 'pending';
-- The delivery log (newest first) and retention.
CREATE INDEX notifications_created_idx ON pgflow.notifications (created_at DESC);
-- The backlog gauge and the undelivered list.
CREATE INDEX notifications_undelivered_idx ON pgflow.notifications (delivery)
    WHERE delivery <> 'delivered';

-- The evaluator's cursors: how far it has looked at finished runs and breaker transitions.
CREATE TABLE pgflow.alert_cursor (
    singleton         boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    runs_checked_at   timestamptz NOT NULL DEFAULT now(),
    breaker_transition bigint NOT NULL DEFAULT 0
);
INSERT INTO pgflow.alert_cursor (breaker_transition)
SELECT coalesce(max(id), 0) FROM pgflow.breaker_transitions;

-- Per job, the last terminal run (succeeded or failed) the run_failed streak logic saw.
CREATE TABLE pgflow.alert_job_streaks (
    job          text PRIMARY KEY,
    last_run_id  bigint NOT NULL,
    last_finished_at timestamptz NOT NULL
);
