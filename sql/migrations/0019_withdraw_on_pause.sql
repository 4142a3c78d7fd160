-- A pause withdraws the runs created ahead of a tick still to come (pgflow/scheduler.py),
-- however it is made: through pgflow (registry.set_paused, an applied file) or with
-- plain SQL on pgflow.jobs, whose paused column is part of the SQL surface. Without this
-- trigger, a tick created up to two seconds before a hand-made pause still fired.
-- The deleted runs are those withdraw_ahead_runs deletes (queued, never started, their
-- tick in the future); the job's fire time moves back to the earliest of them, so the
-- resume creates that tick again. The UPDATE holds the job's row (it waited for a
-- scheduling pass that had it), and each statement here takes a fresh snapshot: the
-- runs such a pass created are seen.
CREATE FUNCTION pgflow.withdraw_ahead_on_pause() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    earliest timestamptz;
BEGIN
    WITH gone AS (
        DELETE FROM pgflow.runs r
        WHERE r.job = NEW.name AND r.state = 'queued' AND r.trigger = 'schedule'
          AND r.attempt = 0 AND r.started_at IS NULL AND r.available_at > now()
          AND r.logical_time > now()
        RETURNING r.logical_time
    )
    SELECT min(logical_time) INTO earliest FROM gone;
    IF earliest IS NOT NULL THEN
        NEW.next_fire_at := least(NEW.next_fire_at, earliest);
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER jobs_withdraw_ahead_on_pause
    BEFORE UPDATE OF paused ON pgflow.jobs
    FOR EACH ROW WHEN (NEW.paused AND NOT OLD.paused)
    EXECUTE FUNCTION pgflow.withdraw_ahead_on_pause();
