-- Datasets and triggers (SPEC §3 produces / trigger_on / trigger_mode, §4b).
-- The design (a ledger of events, one delivery row per event and consuming job,
-- consumed by id in the transaction that creates the run) is in pgflow/datasets.py.

-- jobs: the dataset keys, derived from the stored definition so that registration
-- writes them with everything else (a job registered before this migration has none).
CREATE FUNCTION pgflow.text_array(value jsonb) RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN coalesce(ARRAY(SELECT jsonb_array_elements_text(
                              CASE WHEN jsonb_typeof(value) = 'array' THEN value END)),
                    '{}');

ALTER TABLE pgflow.jobs
    ADD COLUMN produces text[] NOT NULL
        GENERATED ALWAYS AS (pgflow.text_array(definition -> 'produces')) STORED,
    ADD COLUMN trigger_on text[] NOT NULL
        GENERATED ALWAYS AS (pgflow.text_array(definition -> 'trigger_on')) STORED,
    ADD COLUMN trigger_mode text NOT NULL
        GENERATED ALWAYS AS (coalesce(definition ->> 'trigger_mode', 'all')) STORED;
-- An event is delivered to the jobs that trigger on its dataset.
CREATE INDEX jobs_trigger_on_idx ON pgflow.jobs USING gin (trigger_on)
    WHERE trigger_on <> '{}';

ALTER TABLE pgflow.runs DROP CONSTRAINT runs_trigger_check;
ALTER TABLE pgflow.runs ADD CONSTRAINT runs_trigger_check
    CHECK (trigger IN ('schedule', 'manual', 'dependency', 'backfill', 'dataset'));

CREATE TABLE pgflow.dataset_events (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    dataset    text NOT NULL
               CHECK (dataset ~ '^[A-Za-z0-9][A-Za-z0-9_.-]*$' AND length(dataset) <= 128),
    -- an outside emit's idempotency key (NULL: none)
    key        text CHECK (length(key) BETWEEN 1 AND 512),
    -- the producing run (NULL: emitted from outside); runs may be pruned before it
    run_id     bigint,
    payload    jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(payload) = 'object'),
    created_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (dataset, key)
);
-- The newest events of a dataset (datasets list, the page); retention by age.
CREATE INDEX dataset_events_dataset_idx ON pgflow.dataset_events (dataset, id);
CREATE INDEX dataset_events_created_idx ON pgflow.dataset_events (created_at, id);

-- One row per (consuming job, event): waiting while run_id IS NULL, consumed by run
-- run_id afterwards. The primary key is the exactly-once guarantee itself.
CREATE TABLE pgflow.dataset_deliveries (
    job         text NOT NULL,
    event_id    bigint NOT NULL REFERENCES pgflow.dataset_events (id) ON DELETE CASCADE,
    dataset     text NOT NULL,
    run_id      bigint REFERENCES pgflow.runs (id) ON DELETE CASCADE,
    consumed_at timestamptz,
    PRIMARY KEY (job, event_id),
    CHECK ((run_id IS NULL) = (consumed_at IS NULL))
);
-- The leader's pass: which (job, dataset) pairs have waiting events (a skip scan).
CREATE INDEX dataset_deliveries_waiting_idx ON pgflow.dataset_deliveries (job, dataset, event_id)
    WHERE run_id IS NULL;
-- Why a run fired (its page, its command's PGFLOW_TRIGGER_EVENTS); the run cascade.
CREATE INDEX dataset_deliveries_run_idx ON pgflow.dataset_deliveries (run_id)
    WHERE run_id IS NOT NULL;
-- The event cascade, and retention's "still waiting?" test.
CREATE INDEX dataset_deliveries_event_idx ON pgflow.dataset_deliveries (event_id);

-- A consumer's previous dataset run still going holds the next one back.
CREATE INDEX runs_dataset_active_idx ON pgflow.runs (job)
    WHERE trigger = 'dataset' AND state IN ('pending', 'queued', 'running', 'retrying');
-- Producers of a dataset (datasets list, lineage).
CREATE INDEX jobs_produces_idx ON pgflow.jobs USING gin (produces) WHERE produces <> '{}';
