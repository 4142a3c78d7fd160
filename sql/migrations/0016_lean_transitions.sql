-- Fewer writes on every run's way through the queue (issue 16; measurements in
-- pgflow/queue.py's notes and the closing note of that issue).

-- The attempts' foreign key checked its run with one query per inserted attempt, on the
-- finish path of every run (about 3 µs a run, 15 % of the finish statement). Every
-- attempt row is inserted by the statement that ends that very attempt on its run's
-- locked row (finish_attempts), so it cannot point at a missing run; retention deletes
-- a run's attempts in the statement that deletes the run (prune_runs).
ALTER TABLE pgflow.attempts DROP CONSTRAINT attempts_run_id_fkey;

-- Listings by state page through this index; succeeded runs, almost all of the history,
-- are listed through the primary key instead (a filter that nearly every row passes),
-- so the finish of a successful run no longer adds an entry here.
DROP INDEX pgflow.runs_state_idx;
CREATE INDEX runs_state_idx ON pgflow.runs (state, id DESC) WHERE state <> 'succeeded';
