-- Core state tables: job definitions, their dependencies, runs and attempts.
-- Column names here are the public SQL surface (SPEC §7): change them only by adding.

CREATE TABLE pgflow.jobs (
    name            text PRIMARY KEY
                    CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.-]*$' AND length(name) <= 128),
    tenant          text NOT NULL DEFAULT 'default',
    schedule        text,
    timezone        text NOT NULL DEFAULT 'UTC',
    command         jsonb,
    entrypoint      text,
    priority        integer NOT NULL DEFAULT 0,
    timeout_s       double precision CHECK (timeout_s > 0),
    max_active_runs integer CHECK (max_active_runs > 0),
    catchup         text NOT NULL DEFAULT 'latest' CHECK (catchup IN ('latest', 'all', 'none')),
    sources         text[] NOT NULL DEFAULT '{}',
    params          jsonb NOT NULL DEFAULT '{}',
    max_attempts    integer NOT NULL DEFAULT 3 CHECK (max_attempts >= 1),
    backoff_s       double precision NOT NULL DEFAULT 30 CHECK (backoff_s >= 0),
    max_backoff_s   double precision NOT NULL DEFAULT 3600 CHECK (max_backoff_s >= 0),
    jitter          boolean NOT NULL DEFAULT true,
    no_retry_exit_codes integer[] NOT NULL DEFAULT '{}',
    paused          boolean NOT NULL DEFAULT false,
    next_fire_at    timestamptz,
    -- The canonical definition as registered; apply compares it to report unchanged jobs.
    definition      jsonb NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CHECK ((command IS NULL) <> (entrypoint IS NULL)),
    CHECK (schedule IS NOT NULL OR next_fire_at IS NULL)
);

-- The scheduler's hot query: due, unpaused jobs in fire order.
CREATE INDEX jobs_due_idx ON pgflow.jobs (next_fire_at) WHERE NOT paused AND next_fire_at IS NOT NULL;
CREATE INDEX jobs_tenant_idx ON pgflow.jobs (tenant, name);

CREATE TABLE pgflow.job_deps (
    job      text NOT NULL REFERENCES pgflow.jobs (name) ON DELETE CASCADE,
    upstream text NOT NULL REFERENCES pgflow.jobs (name),
    PRIMARY KEY (job, upstream),
    CHECK (job <> upstream)
);
-- Completion looks up the finished job's direct downstreams.
CREATE INDEX job_deps_upstream_idx ON pgflow.job_deps (upstream);

-- Runs outlive their job definition (history stays after delete/prune): no foreign key to jobs.
CREATE TABLE pgflow.runs (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job              text NOT NULL,
    logical_time     timestamptz NOT NULL,
    state            text NOT NULL CHECK (state IN ('pending', 'queued', 'running', 'retrying',
                         'succeeded', 'failed', 'cancelled', 'upstream_failed')),
    -- Number of the current (or last) attempt; also the fencing token of a lease.
    attempt          integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts     integer NOT NULL CHECK (max_attempts >= 1),
    trigger          text NOT NULL CHECK (trigger IN ('schedule', 'manual', 'dependency', 'backfill')),
    tenant           text NOT NULL,
    priority         integer NOT NULL DEFAULT 0,
    params           jsonb NOT NULL DEFAULT '{}',
    -- Earliest time a queued/retrying run may be claimed (backoff ends here).
    available_at     timestamptz NOT NULL DEFAULT now(),
    lease_owner      text,
    lease_expires_at timestamptz,
    cancel_requested boolean NOT NULL DEFAULT false,
    acked_at         timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    finished_at      timestamptz,
    UNIQUE (job, logical_time),
    CHECK ((state IN ('succeeded', 'failed', 'cancelled', 'upstream_failed')) = (finished_at IS NOT NULL)),
    CHECK ((state = 'running') = (lease_owner IS NOT NULL)),
    CHECK ((lease_owner IS NULL) = (lease_expires_at IS NULL)),
    CHECK (state <> 'running' OR attempt >= 1)
);

-- The claim query: claimable runs by priority, then availability.
CREATE INDEX runs_claimable_idx ON pgflow.runs (priority DESC, available_at, id)
    WHERE state IN ('queued', 'retrying');
-- The reaper: running runs by lease expiry.
CREATE INDEX runs_lease_idx ON pgflow.runs (lease_expires_at) WHERE state = 'running';
-- Listings and per-job views, newest first.
CREATE INDEX runs_job_idx ON pgflow.runs (job, id DESC);
CREATE INDEX runs_state_idx ON pgflow.runs (state, id DESC);
-- The dead-letter view.
CREATE INDEX runs_dead_idx ON pgflow.runs (finished_at DESC) WHERE state = 'failed' AND acked_at IS NULL;

CREATE TABLE pgflow.attempts (
    run_id      bigint NOT NULL REFERENCES pgflow.runs (id) ON DELETE CASCADE,
    attempt     integer NOT NULL CHECK (attempt >= 1),
    worker_id   text NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    outcome     text CHECK (outcome IN ('succeeded', 'failed', 'timed_out', 'lost', 'cancelled',
                    'interrupted')),
    exit_code   integer,
    error       text,
    stdout_tail text,
    stderr_tail text,
    PRIMARY KEY (run_id, attempt),
    CHECK ((outcome IS NULL) = (finished_at IS NULL))
);
