-- The exactly-once key of a run, (job, logical_time), moves out of pgflow.runs into a
-- table written once per run (issue 16). As a unique index of runs it took a new entry,
-- and a uniqueness check that reads the heap, on each of a run's two transitions that
-- are not HOT updates, the claim and the finish: the largest single cost measured at the
-- seeds' load (a claim and a plain finish of 64 runs: 90 -> 62 µs of backend CPU a run
-- without it; of 500: 53 -> 40). A run's creation pays instead: one plpgsql call, about
-- 7 µs, ahead of its tick. pgflow.runs keeps both columns (they are part of the SQL
-- surface); what looks runs up by them goes through run_keys (run_id is in the index: an
-- index-only probe, then runs' primary key).
--
-- Triggers keep the two tables in step for every writer, pgflow's own statements and
-- hand-written SQL alike:
--   * before a run is inserted, its key is (ON CONFLICT DO NOTHING); a pair that has a
--     run already skips the new row, as the unique index's ON CONFLICT DO NOTHING did.
--     Two transactions creating one pair: the second waits for the first's key and
--     skips its row if the first commits (the same speculative insertion as before);
--   * deleted runs take their keys with them (one statement per DELETE); a TRUNCATE
--     of runs empties run_keys;
--   * no statement of pgflow's changes a run's job or logical time; a hand-written
--     UPDATE that does moves the run's key (and fails on a pair that has a run, as the
--     unique index did). An AFTER trigger on those two columns: a BEFORE ROW UPDATE
--     trigger, whatever its columns, would make every UPDATE of runs fetch and lock each
--     row again (claims and finishes included).
CREATE TABLE pgflow.run_keys (
    job          text NOT NULL,
    logical_time timestamptz NOT NULL,
    run_id       bigint NOT NULL,
    PRIMARY KEY (job, logical_time) INCLUDE (run_id)
);

INSERT INTO pgflow.run_keys (job, logical_time, run_id)
SELECT job, logical_time, id FROM pgflow.runs;

ALTER TABLE pgflow.runs DROP CONSTRAINT runs_job_logical_time_key;

CREATE FUNCTION pgflow.key_new_run() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pgflow.run_keys (job, logical_time, run_id)
    VALUES (NEW.job, NEW.logical_time, NEW.id)
    ON CONFLICT DO NOTHING;
    IF FOUND THEN
        RETURN NEW;
    END IF;
    RETURN NULL;  -- this (job, logical_time) has a run: the row is skipped
END
$$;

CREATE TRIGGER runs_key BEFORE INSERT ON pgflow.runs
    FOR EACH ROW EXECUTE FUNCTION pgflow.key_new_run();

CREATE FUNCTION pgflow.unkey_deleted_runs() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM pgflow.run_keys k USING gone g
    WHERE k.job = g.job AND k.logical_time = g.logical_time AND k.run_id = g.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER runs_unkey AFTER DELETE ON pgflow.runs
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION pgflow.unkey_deleted_runs();

CREATE FUNCTION pgflow.unkey_truncated_runs() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    TRUNCATE pgflow.run_keys;
    RETURN NULL;
END
$$;

CREATE TRIGGER runs_unkey_all AFTER TRUNCATE ON pgflow.runs
    FOR EACH STATEMENT EXECUTE FUNCTION pgflow.unkey_truncated_runs();

CREATE FUNCTION pgflow.move_run_key() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE pgflow.run_keys SET job = NEW.job, logical_time = NEW.logical_time
    WHERE job = OLD.job AND logical_time = OLD.logical_time AND run_id = OLD.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER runs_key_moves AFTER UPDATE OF job, logical_time ON pgflow.runs
    FOR EACH ROW
    WHEN (OLD.job IS DISTINCT FROM NEW.job OR OLD.logical_time IS DISTINCT FROM NEW.logical_time)
    EXECUTE FUNCTION pgflow.move_run_key();

-- A pause's withdrawal of the ticks created ahead (0019) found the job's future runs
-- through the unique index; it now finds them through their keys.
CREATE OR REPLACE FUNCTION pgflow.withdraw_ahead_on_pause() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    earliest timestamptz;
BEGIN
    WITH gone AS (
        DELETE FROM pgflow.runs r
        USING pgflow.run_keys k
        WHERE k.job = NEW.name AND k.logical_time > now() AND r.id = k.run_id
          AND r.state = 'queued' AND r.trigger = 'schedule'
          AND r.attempt = 0 AND r.started_at IS NULL AND r.available_at > now()
        RETURNING r.logical_time
    )
    SELECT min(logical_time) INTO earliest FROM gone;
    IF earliest IS NOT NULL THEN
        NEW.next_fire_at := least(NEW.next_fire_at, earliest);
    END IF;
    RETURN NEW;
END
$$;
