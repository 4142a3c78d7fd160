-- The execution engine: replicas, scheduler leadership, the running attempt on the run row.

-- While a run is running, its current attempt lives on the run row (owner, start);
-- the attempts table gets the row when the attempt ends (one write per attempt).
ALTER TABLE pgflow.runs ADD COLUMN attempt_started_at timestamptz;
ALTER TABLE pgflow.runs ADD CONSTRAINT runs_running_has_start
    CHECK (state <> 'running' OR attempt_started_at IS NOT NULL);

CREATE TABLE pgflow.replicas (
    id           text PRIMARY KEY,
    host         text NOT NULL,
    pid          integer NOT NULL,
    roles        text[] NOT NULL,
    version      text NOT NULL,
    concurrency  integer NOT NULL DEFAULT 0,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    stopping     boolean NOT NULL DEFAULT false
);
CREATE INDEX replicas_heartbeat_idx ON pgflow.replicas (heartbeat_at);

-- One row: who leads scheduling. The advisory lock decides; this row lets standbys see a
-- leader whose process froze while its session (and lock) stayed open.
CREATE TABLE pgflow.leader (
    singleton    boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    replica_id   text NOT NULL,
    backend_pid  integer NOT NULL,
    term         bigint NOT NULL,
    elected_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);

-- Attempts are written when they end; list a run's attempts in order.
ALTER TABLE pgflow.attempts ALTER COLUMN finished_at SET DEFAULT now();

-- Lease renewal: one statement per replica renews all the runs it holds.
CREATE INDEX runs_owner_idx ON pgflow.runs (lease_owner) WHERE state = 'running';
