-- The safety net (pgflow/safety_net.py) counts every repair here, in the statement that
-- makes it, so pgflow_repairs_total{kind} is cluster-wide whichever replica repaired.
CREATE TABLE pgflow.repairs (
    kind    text PRIMARY KEY,
    total   bigint NOT NULL DEFAULT 0 CHECK (total >= 0),
    last_at timestamptz NOT NULL DEFAULT now()
);

-- A backfill's release takes its held runs (pending, trigger 'backfill') oldest tick
-- first; without this index every release sorted all of its pending runs.
CREATE INDEX runs_backfill_held_idx ON pgflow.runs (backfill_id, logical_time, id)
    WHERE state = 'pending' AND trigger = 'backfill';
