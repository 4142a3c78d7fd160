-- max_active_runs: runs of a capped job are claimed apart from the rest, under a lock
-- per job, so the cap holds across replicas (see claim_capped_runs). The flag is copied
-- from the job when the run is created.
ALTER TABLE pgflow.runs ADD COLUMN capped boolean NOT NULL DEFAULT false;

DROP INDEX pgflow.runs_claimable_idx;
CREATE INDEX runs_claimable_idx ON pgflow.runs (priority DESC, available_at, id)
    WHERE state IN ('queued', 'retrying') AND NOT capped;
CREATE INDEX runs_claimable_capped_idx ON pgflow.runs (job, priority DESC, available_at, id)
    WHERE state IN ('queued', 'retrying') AND capped;
CREATE INDEX runs_running_capped_idx ON pgflow.runs (job) WHERE state = 'running' AND capped;
