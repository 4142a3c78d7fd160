-- Retention and a hot path that ignores history (pgflow/retention.py has the measurements).

-- HOT updates. An update is HOT (no new index entries, the old version pruned in
-- place) only when no indexed column changes and the page has room. A lease renewal
-- changes only lease_expires_at; runs_lease_idx indexed it, so not one renewal was
-- HOT. The reaper finds expired leases among the running runs through runs_owner_idx
-- (partial: only running runs, a few thousand at most), so the index does not pay for
-- the index writes it cost on every renewal and claim.
DROP INDEX pgflow.runs_lease_idx;
-- Replica heartbeats (every second per replica) likewise; the table has a few rows.
DROP INDEX pgflow.replicas_heartbeat_idx;

-- Room on each page for new versions of its rows (renewals, transitions): new pages
-- are filled to 80 %. Autovacuum early and without throttling on the tables that
-- churn: runs (three updates per run, renewals, retention's deletes), attempts (one
-- insert per attempt, retention's deletes), and the one-row-per-replica tables that
-- are updated every second. The defaults (20 % of the table dead before a vacuum)
-- would let a 10,000,000-row runs table carry 2,000,000 dead rows.
ALTER TABLE pgflow.runs SET (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_analyze_threshold = 1000,
    autovacuum_vacuum_cost_delay = 1
);
ALTER TABLE pgflow.attempts SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 1
);
ALTER TABLE pgflow.replicas SET (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 500,
    autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE pgflow.leader SET (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 500,
    autovacuum_vacuum_cost_delay = 0
);
-- Every tick rewrites its job's next_fire_at (indexed by jobs_due_idx).
ALTER TABLE pgflow.jobs SET (
    autovacuum_vacuum_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 1
);

-- What the leader's retention did last: the retention it prunes with (a replica's
-- setting, which `pgflow db status` shows beside the CLI's own), when and how much.
CREATE TABLE pgflow.retention (
    singleton        boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    retention_s      double precision NOT NULL CHECK (retention_s > 0),
    replica_id       text NOT NULL,
    last_pass_at     timestamptz NOT NULL DEFAULT now(),
    last_pass_runs   bigint NOT NULL DEFAULT 0,
    pruned_runs      bigint NOT NULL DEFAULT 0,
    pruned_backfills bigint NOT NULL DEFAULT 0
);
