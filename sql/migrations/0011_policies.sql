-- Policies (SPEC §3, §4c): tenants, sources, automatic circuit breakers, and the claim
-- indexes that keep runs which cannot be claimed out of the hot claim's way.
-- The design is explained in pgflow/policies.py.

CREATE TABLE pgflow.tenants (
    name            text PRIMARY KEY
                    CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.-]*$' AND length(name) <= 128),
    weight          double precision NOT NULL DEFAULT 1 CHECK (weight > 0 AND weight <= 1000000),
    max_concurrency integer CHECK (max_concurrency >= 1),
    definition      jsonb NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE pgflow.sources (
    name              text PRIMARY KEY
                      CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.-]*$' AND length(name) <= 128),
    failure_threshold integer NOT NULL DEFAULT 3 CHECK (failure_threshold >= 1),
    cooldown_s        double precision NOT NULL DEFAULT 60 CHECK (cooldown_s > 0),
    max_concurrency   integer CHECK (max_concurrency >= 1),
    definition        jsonb NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
);

-- Breakers open by themselves now, probe after a cooldown and close on success.
ALTER TABLE pgflow.breakers DROP CONSTRAINT breakers_state_check;
ALTER TABLE pgflow.breakers ADD CONSTRAINT breakers_state_check
    CHECK (state IN ('closed', 'open', 'half_open'));
ALTER TABLE pgflow.breakers
    -- consecutive source-unavailable attempts while closed
    ADD COLUMN failures   integer NOT NULL DEFAULT 0 CHECK (failures >= 0),
    ADD COLUMN opened_at  timestamptz,
    -- the cooldown of the current opening (doubles on every failed probe, capped)
    ADD COLUMN cooldown_s double precision CHECK (cooldown_s > 0),
    ADD COLUMN reopens    integer NOT NULL DEFAULT 0 CHECK (reopens >= 0),
    -- opened by an operator: stays open until closed by hand (no probe)
    ADD COLUMN manual     boolean NOT NULL DEFAULT false,
    -- the one run let through while half_open
    ADD COLUMN probe_run  bigint,
    ADD COLUMN probe_at   timestamptz;
UPDATE pgflow.breakers SET manual = true, opened_at = changed_at WHERE state = 'open';
-- (A breaker opened with plain SQL has no opened_at: it stays open until closed.)
ALTER TABLE pgflow.breakers ADD CONSTRAINT breakers_probe_only_half_open
    CHECK (probe_run IS NULL OR state = 'half_open');

-- Every breaker transition, for `pgflow status`, the UI and the metrics' counter.
CREATE TABLE pgflow.breaker_transitions (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source     text NOT NULL,
    from_state text NOT NULL CHECK (from_state IN ('closed', 'open', 'half_open')),
    to_state   text NOT NULL CHECK (to_state IN ('closed', 'open', 'half_open')),
    at         timestamptz NOT NULL DEFAULT now(),
    reason     text,
    changed_by text,
    run_id     bigint
);
CREATE INDEX breaker_transitions_source_idx ON pgflow.breaker_transitions (source, id DESC);

-- A job is `capped` (constrained) when its runs count against a cap: its own
-- max_active_runs, its tenant's or one of its sources' max_concurrency. It is `held`
-- while a breaker of one of its sources is not closed. Runs copy both when created;
-- apply and breaker transitions re-flag the runs that wait.
ALTER TABLE pgflow.jobs ADD COLUMN capped boolean NOT NULL DEFAULT false;
ALTER TABLE pgflow.jobs ADD COLUMN held boolean NOT NULL DEFAULT false;
UPDATE pgflow.jobs SET capped = max_active_runs IS NOT NULL;
UPDATE pgflow.jobs j SET held = true
WHERE EXISTS (SELECT 1 FROM pgflow.breakers b WHERE b.state <> 'closed' AND b.source = ANY(j.sources));
CREATE INDEX jobs_sources_idx ON pgflow.jobs USING gin (sources);

ALTER TABLE pgflow.runs ADD COLUMN held boolean NOT NULL DEFAULT false;
UPDATE pgflow.runs r SET held = true FROM pgflow.jobs j
WHERE j.name = r.job AND j.held AND r.state IN ('pending', 'queued', 'retrying');

-- The hot claim takes each waiting tenant's best runs (a skip scan over tenants, then
-- one LATERAL ... LIMIT per tenant): the index leads with the tenant. Held runs are in
-- no claim index, so 50,000 of them cost a claim nothing.
DROP INDEX pgflow.runs_claimable_idx;
CREATE INDEX runs_claimable_idx ON pgflow.runs (tenant, priority DESC, available_at, id)
    WHERE state IN ('queued', 'retrying') AND NOT capped AND NOT held;
DROP INDEX pgflow.runs_claimable_capped_idx;
CREATE INDEX runs_claimable_capped_idx ON pgflow.runs (job, priority DESC, available_at, id)
    WHERE state IN ('queued', 'retrying') AND capped AND NOT held;
-- Probes and releases find a source's held runs by job.
CREATE INDEX runs_held_idx ON pgflow.runs (job, priority DESC, available_at, id)
    WHERE state IN ('queued', 'retrying') AND held;
-- A tenant cap counts the tenant's running constrained runs.
CREATE INDEX runs_running_capped_tenant_idx ON pgflow.runs (tenant)
    WHERE state = 'running' AND capped;

-- worker_demand (0009) with the new holds: breakers (open or half_open), tenant and
-- source caps. Same columns.
CREATE OR REPLACE VIEW pgflow.worker_demand AS
WITH due AS (
    SELECT job, tenant, capped, held, available_at FROM pgflow.runs
    WHERE state IN ('queued', 'retrying') AND NOT capped AND NOT held AND available_at <= now()
    UNION ALL
    SELECT job, tenant, capped, held, available_at FROM pgflow.runs
    WHERE state IN ('queued', 'retrying') AND capped AND NOT held AND available_at <= now()
    UNION ALL
    SELECT job, tenant, capped, held, available_at FROM pgflow.runs
    WHERE state IN ('queued', 'retrying') AND held AND available_at <= now()
), groups AS (
    SELECT job, tenant, capped, bool_or(held) AS held, count(*) AS due,
           min(available_at) AS oldest
    FROM due
    GROUP BY job, tenant, capped
), by_job AS MATERIALIZED (
    SELECT g.tenant, g.due, g.oldest,
           CASE
               WHEN g.held OR EXISTS (SELECT 1 FROM pgflow.breakers b
                                      WHERE b.state <> 'closed' AND b.source = ANY(j.sources))
                   THEN 0
               WHEN g.capped THEN least(g.due, greatest(least(
                   CASE WHEN j.name IS NULL OR j.max_active_runs IS NOT NULL OR NOT j.capped
                        THEN coalesce(j.max_active_runs, 1)
                             - (SELECT count(*) FROM pgflow.runs x
                                WHERE x.job = g.job AND x.state = 'running' AND x.capped)
                        ELSE g.due END,
                   (SELECT min(s.max_concurrency
                               - (SELECT count(*) FROM pgflow.jobs sj
                                  JOIN pgflow.runs x ON x.job = sj.name
                                  WHERE sj.sources @> ARRAY[s.name] AND x.state = 'running'
                                    AND x.capped))
                    FROM pgflow.sources s
                    WHERE s.name = ANY(j.sources) AND s.max_concurrency IS NOT NULL)), 0))
               ELSE g.due
           END AS startable
    FROM groups g
    LEFT JOIN pgflow.jobs j ON j.name = g.job
), by_tenant AS (
    SELECT b.tenant, sum(b.due) AS due,
           least(sum(b.startable), max(t.max_concurrency) - (
               SELECT count(*) FROM pgflow.runs x
               WHERE x.tenant = b.tenant AND x.state = 'running' AND x.capped)) AS startable,
           min(b.oldest) FILTER (WHERE b.startable > 0) AS oldest
    FROM by_job b
    LEFT JOIN pgflow.tenants t ON t.name = b.tenant
    GROUP BY b.tenant
), bounded AS (
    SELECT tenant, due, greatest(coalesce(startable, 0), 0) AS startable, oldest
    FROM by_tenant
)
SELECT coalesce(sum(startable), 0)::bigint AS claimable,
       (SELECT count(*) FROM pgflow.runs WHERE state = 'running') AS running,
       coalesce(sum(due - startable), 0)::bigint AS held,
       coalesce(extract(epoch FROM now() - min(oldest) FILTER (WHERE startable > 0)), 0)::float8
           AS oldest_claimable_age_s
FROM bounded;
