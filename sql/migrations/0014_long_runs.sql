-- Long runs (SPEC §4e): live output, progress and checkpoints of running attempts.
-- The design is explained in pgflow/live.py.

-- The latest progress a job reported, and its last checkpoint (kept across attempts of
-- the run; `runs rerun` clears it). Nullable columns without defaults: no table rewrite.
ALTER TABLE pgflow.runs
    ADD COLUMN progress            double precision,
    ADD COLUMN progress_message    text,
    ADD COLUMN progress_at         timestamptz,
    ADD COLUMN checkpoint          jsonb,
    ADD COLUMN checkpoint_attempt  integer,
    ADD COLUMN checkpoint_at       timestamptz;

-- An attempt's output as it was produced: `pos` is the byte offset of `data` in the
-- attempt's combined output (stdout, stderr and pgflow's own notes, in arrival order).
-- Past PGFLOW_LOG_LIMIT the middle is not stored: offsets then have a gap, which
-- readers show as a marker. Removed with its run (retention deletes runs).
CREATE TABLE pgflow.run_output (
    run_id     bigint  NOT NULL REFERENCES pgflow.runs (id) ON DELETE CASCADE,
    attempt    integer NOT NULL CHECK (attempt >= 1),
    pos        bigint  NOT NULL CHECK (pos >= 0),
    stream     text    NOT NULL CHECK (stream IN ('stdout', 'stderr', 'pgflow')),
    data       bytea   NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, attempt, pos)
);
