-- The schedule-lag metric (metrics_scrape) finds the scheduled runs that started since
-- the last scrape. Those still unfinished come from this index, now partial on
-- finished_at IS NULL; those finished since come from runs_finished_idx, which the
-- scrape reads anyway. So a run's finish no longer adds an entry here: one index
-- write fewer on every scheduled run (issue 16).
DROP INDEX pgflow.runs_schedule_started_idx;
CREATE INDEX runs_schedule_started_idx ON pgflow.runs (started_at)
    WHERE trigger = 'schedule' AND started_at IS NOT NULL AND finished_at IS NULL;
