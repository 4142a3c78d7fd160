-- finish_attempts asks once per statement whether any job produces a dataset before it
-- looks up the job of every finished run for its datasets (issue 16: 1,500 buffer hits
-- of a 500-run finish). This partial index answers that question without reading the
-- jobs table: it holds only the producing jobs.
CREATE INDEX jobs_producing_idx ON pgflow.jobs (name) WHERE produces <> '{}';
