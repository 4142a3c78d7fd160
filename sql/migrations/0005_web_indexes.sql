-- Indexes for the web role: the dashboard's 24-hour chart and the metrics scrape read
-- only what finished (or started) since their last look, by time.

-- Runs finished per minute (dashboard) and runs finished since the last scrape (metrics).
CREATE INDEX runs_finished_idx ON pgflow.runs (finished_at) INCLUDE (state)
    WHERE finished_at IS NOT NULL;
-- Schedule lag (tick -> first start) of scheduled runs that started since the last scrape.
CREATE INDEX runs_schedule_started_idx ON pgflow.runs (started_at)
    WHERE trigger = 'schedule' AND started_at IS NOT NULL;
-- Attempt durations finished since the last scrape.
CREATE INDEX attempts_finished_idx ON pgflow.attempts (finished_at);
