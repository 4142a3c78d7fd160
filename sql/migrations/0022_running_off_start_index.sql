-- A scheduled run's claim no longer adds an entry to runs_schedule_started_idx (issue
-- 16): the metric that reads it (metrics_scrape's schedule lag) finds the running runs
-- through runs_owner_idx (they are few), and this index keeps the others that started
-- and are not finished (retrying or queued again after an attempt: fewer still).
CREATE INDEX runs_waiting_started_idx ON pgflow.runs (started_at)
    WHERE trigger = 'schedule' AND started_at IS NOT NULL AND finished_at IS NULL
      AND state <> 'running';
DROP INDEX pgflow.runs_schedule_started_idx;
ALTER INDEX pgflow.runs_waiting_started_idx RENAME TO runs_schedule_started_idx;
