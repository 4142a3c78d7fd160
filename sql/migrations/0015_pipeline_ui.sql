-- The dashboard's named panels (pgflow/web/dashboard_panels.py).

-- Recent failures and the most-failing jobs of the last 24 hours: dead-lettered runs by
-- finish time, with the job in the index (an index-only scan over the day's failures,
-- never over the day's successes). Only failed runs are in it: it costs nothing on
-- the claim/finish path of runs that succeed.
CREATE INDEX runs_failed_idx ON pgflow.runs (finished_at) INCLUDE (job)
    WHERE state = 'failed';

-- The slowest runs of each closed hour of the last 24 hours: a handful of rows an hour
-- (the slowest run of each of the hour's SLOWEST_PER_HOUR slowest jobs), counted once,
-- cluster-wide, by whichever web replica computes its dashboard first. The overall top
-- jobs by their longest run are exactly among the per-hour tops (a job whose longest
-- run is in hour h and that beats all but k-1 jobs overall beats all but k-1 in h), so
-- the dashboard reads 24 small rows plus the current hour's runs, whatever the number
-- of runs a day. Rows older than 25 hours go.
CREATE TABLE pgflow.slow_hours (
    hour    timestamptz PRIMARY KEY CHECK (hour = date_trunc('hour', hour)),
    slowest jsonb NOT NULL
);
