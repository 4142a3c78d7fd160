-- DAG runs and backfills.

CREATE TABLE pgflow.backfills (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job             text NOT NULL,
    range_start     timestamptz NOT NULL,
    range_end       timestamptz NOT NULL,
    max_concurrency integer NOT NULL CHECK (max_concurrency >= 1),
    downstream      boolean NOT NULL DEFAULT false,
    state           text NOT NULL DEFAULT 'running'
                    CHECK (state IN ('running', 'completed', 'cancelled')),
    ticks           integer NOT NULL DEFAULT 0,
    skipped         integer NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    CHECK (range_start < range_end),
    CHECK ((state = 'running') = (finished_at IS NULL))
);
CREATE INDEX backfills_running_idx ON pgflow.backfills (id) WHERE state = 'running';

ALTER TABLE pgflow.runs ADD COLUMN backfill_id bigint REFERENCES pgflow.backfills (id);
CREATE INDEX runs_backfill_idx ON pgflow.runs (backfill_id, state) WHERE backfill_id IS NOT NULL;
-- Runs of one logical time are found through the (job, logical_time) unique key: a bare
-- logical_time index would mislead dependency checks into scanning a wide DAG run.
