-- pgflow.worker_demand: one row saying how much work is waiting for workers, for an
-- autoscaler (KEDA's postgresql trigger, an HPA adapter) or a person (SPEC §7).
--
--   claimable               runs a worker could start now
--   running                 runs running now
--   held                    runs due by time (queued/retrying, available_at <= now())
--                           that the claim holds back: a breaker of one of the job's
--                           sources is open, or the job is at its max_active_runs cap
--   oldest_claimable_age_s  seconds the oldest claimable run has waited (0: none waits)
--
-- Workers to run = ceil((claimable + running) / concurrency per worker): held runs need
-- no worker until their breaker closes or their cap has room.
--
-- Cost: the due runs come from the two partial indexes the claim uses
-- (runs_claimable_idx, runs_claimable_capped_idx) and `running` from a partial index on
-- running runs: one scan of what is waiting, however long the history. The holds
-- mirror claim_runs and claim_capped_runs (sql/queries/queue.sql).
--
-- Extending the holds: each hold is one bound on `startable` per group below (a job's
-- cap per (job, capped) group); a cap shared by several jobs (a tenant's or a source's
-- max_concurrency) bounds the sum of its groups' `startable` in a step between
-- `by_job` and the final select, as `by_tenant` does today without a cap.
CREATE VIEW pgflow.worker_demand AS
WITH due AS (
    SELECT job, tenant, capped, available_at FROM pgflow.runs
    WHERE state IN ('queued', 'retrying') AND NOT capped AND available_at <= now()
    UNION ALL
    SELECT job, tenant, capped, available_at FROM pgflow.runs
    WHERE state IN ('queued', 'retrying') AND capped AND available_at <= now()
), groups AS (
    SELECT job, tenant, capped, count(*) AS due, min(available_at) AS oldest
    FROM due
    GROUP BY job, tenant, capped
), by_job AS MATERIALIZED (  -- each hold evaluated once per group
    SELECT g.tenant, g.due, g.oldest,
           CASE
               -- an open breaker on any of the job's sources holds all of its runs
               WHEN EXISTS (SELECT 1 FROM pgflow.breakers b
                            WHERE b.state = 'open' AND b.source = ANY(j.sources)) THEN 0
               -- a capped job starts as many as its cap has room for (a job deleted or
               -- no longer capped keeps its capped runs to one at a time, as the claim)
               WHEN g.capped THEN least(g.due, greatest(
                   coalesce(j.max_active_runs, 1)
                   - (SELECT count(*) FROM pgflow.runs x
                      WHERE x.job = g.job AND x.state = 'running' AND x.capped), 0))
               ELSE g.due
           END AS startable
    FROM groups g
    LEFT JOIN pgflow.jobs j ON j.name = g.job
), by_tenant AS (
    SELECT tenant, sum(due) AS due, sum(startable) AS startable,
           min(oldest) FILTER (WHERE startable > 0) AS oldest
    FROM by_job
    GROUP BY tenant
)
SELECT coalesce(sum(startable), 0)::bigint AS claimable,
       (SELECT count(*) FROM pgflow.runs WHERE state = 'running') AS running,
       coalesce(sum(due - startable), 0)::bigint AS held,
       coalesce(extract(epoch FROM now() - min(oldest) FILTER (WHERE startable > 0)), 0)::float8
           AS oldest_claimable_age_s
FROM by_tenant;
