-- A claim no longer adds an entry to runs_state_idx (issue 16: about 2 µs of
-- PostgreSQL's CPU a run, one of the nine index entries its two transitions wrote).
-- Running runs are few and have their own index, runs_owner_idx (lease_owner) WHERE
-- state = 'running': statements that read them go through it, and those that read every
-- unfinished state spell 'running' as a separate arm of an OR, one index for each.
CREATE INDEX runs_waiting_state_idx ON pgflow.runs (state, id DESC)
    WHERE state NOT IN ('succeeded', 'running');
DROP INDEX pgflow.runs_state_idx;
ALTER INDEX pgflow.runs_waiting_state_idx RENAME TO runs_state_idx;
