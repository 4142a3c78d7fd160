-- Demand for workers (the view pgflow.worker_demand, migration 0009): what an autoscaler
-- reads, and the /metrics gauges.

-- name: worker_demand
SELECT claimable, running, held, oldest_claimable_age_s FROM pgflow.worker_demand
