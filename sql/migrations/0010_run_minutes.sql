-- Runs finished per minute, for the dashboard's 24-hour chart: closed minutes are
-- counted once, cluster-wide, so a dashboard reads at most 1,440 rows here plus the
-- last minutes of runs, whatever the number of runs a day (and whatever the retention:
-- a minute keeps its count after its runs are pruned). Rows older than 25 hours go.
CREATE TABLE pgflow.run_minutes (
    minute    timestamptz PRIMARY KEY CHECK (minute = date_trunc('minute', minute)),
    finished  integer NOT NULL CHECK (finished >= 0),
    succeeded integer NOT NULL CHECK (succeeded >= 0),
    failed    integer NOT NULL CHECK (failed >= 0)
);
