-- Long runs (pgflow/live.py): what running attempts report, written in one statement per
-- flush for every attempt of a worker, and read back by `runs logs`, the API and the UI.

-- name: live_flush
-- One flush of a worker's running attempts: output chunks (c_*), latest progress and
-- checkpoint (s_*), and chunks to drop past the log limit (p_*). Only attempts the worker
-- still holds count (same run, attempt, lease owner, state running): a fenced worker's
-- late output is dropped like its result. The held rows are share-locked in id order for
-- the statement, so the reaper or an operator cannot take the run between the check and
-- the writes. The ids returned are the attempts that were written.
WITH held AS (
    -- one primary-key probe per pair: tests IS NOT DISTINCT FROM (not indexable) keep the
    -- plan off runs_running_idx, which holds every worker's running runs (a nested loop
    -- over both: 17 ms a flush of 300 attempts, as renew_leases explains)
    SELECT r.id, r.attempt
    FROM pgflow.runs r
    JOIN unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS h(id, attempt)
      ON r.id = h.id AND r.attempt = h.attempt
    WHERE r.lease_owner IS NOT DISTINCT FROM %(worker)s
      AND r.state IS NOT DISTINCT FROM 'running'
    ORDER BY r.id
    FOR SHARE OF r
), written AS (
    INSERT INTO pgflow.run_output (run_id, attempt, pos, stream, data)
    SELECT c.run_id, c.attempt, c.pos, c.stream, c.data
    FROM unnest(%(c_ids)s::bigint[], %(c_attempts)s::int[], %(c_pos)s::bigint[],
                %(c_streams)s::text[], %(c_data)s::bytea[])
         AS c(run_id, attempt, pos, stream, data)
    JOIN held h ON h.id = c.run_id AND h.attempt = c.attempt
    ON CONFLICT (run_id, attempt, pos) DO NOTHING
    RETURNING run_id
), reported AS (
    UPDATE pgflow.runs r
    SET progress = CASE WHEN s.has_progress THEN s.progress ELSE r.progress END,
        progress_message = CASE WHEN s.has_progress THEN s.message ELSE r.progress_message END,
        progress_at = CASE WHEN s.has_progress THEN now() ELSE r.progress_at END,
        checkpoint = CASE WHEN s.checkpoint IS NOT NULL THEN s.checkpoint::jsonb
                          ELSE r.checkpoint END,
        checkpoint_attempt = CASE WHEN s.checkpoint IS NOT NULL THEN r.attempt
                                  ELSE r.checkpoint_attempt END,
        checkpoint_at = CASE WHEN s.checkpoint IS NOT NULL THEN now() ELSE r.checkpoint_at END
    FROM unnest(%(s_ids)s::bigint[], %(s_attempts)s::int[], %(s_has_progress)s::bool[],
                %(s_progress)s::float8[], %(s_messages)s::text[], %(s_checkpoints)s::text[])
         AS s(id, attempt, has_progress, progress, message, checkpoint)
    JOIN held h ON h.id = s.id AND h.attempt = s.attempt
    WHERE r.id = s.id
    RETURNING r.id
), pruned AS (
    DELETE FROM pgflow.run_output o
    USING unnest(%(p_ids)s::bigint[], %(p_attempts)s::int[], %(p_from)s::bigint[],
                 %(p_before)s::bigint[]) AS p(id, attempt, from_pos, before_pos)
    JOIN held h ON h.id = p.id AND h.attempt = p.attempt
    WHERE o.run_id = p.id AND o.attempt = p.attempt AND o.pos >= p.from_pos
      AND o.pos + length(o.data) <= p.before_pos
    RETURNING o.run_id
)
SELECT (SELECT coalesce(jsonb_agg(jsonb_build_array(id, attempt)), '[]') FROM held) AS held,
       (SELECT count(*) FROM written) AS chunks,
       (SELECT count(*) FROM reported) AS reported,
       (SELECT count(*) FROM pruned) AS pruned

-- name: run_output_read
-- An attempt's stored output from byte %(offset)s on: the chunk that holds the offset,
-- then the following ones, at most %(limit)s of them (the primary key's range).
SELECT o.pos, o.stream, o.data
FROM pgflow.run_output o
WHERE o.run_id = %(id)s AND o.attempt = %(attempt)s
  AND o.pos >= coalesce((SELECT max(pos) FROM pgflow.run_output
                         WHERE run_id = %(id)s AND attempt = %(attempt)s
                           AND pos <= %(offset)s), 0)
ORDER BY o.pos
LIMIT %(limit)s

-- name: run_output_attempt
-- Where an attempt stands for a reader: whether it is the one running now, and the
-- tails its finished row kept (the output of attempts that never wrote chunks).
SELECT r.attempt AS current_attempt, r.state,
       (r.state = 'running' AND r.attempt = %(attempt)s) AS running,
       a.attempt IS NOT NULL AS finished, a.stdout_tail, a.stderr_tail,
       EXISTS (SELECT 1 FROM pgflow.run_output o
               WHERE o.run_id = r.id AND o.attempt = %(attempt)s) AS has_chunks
FROM pgflow.runs r
LEFT JOIN pgflow.attempts a ON a.run_id = r.id AND a.attempt = %(attempt)s
WHERE r.id = %(id)s

-- name: run_output_end
-- Where an attempt's stored output ends (its last chunk, by the primary key).
SELECT (SELECT pos + length(data) FROM pgflow.run_output
        WHERE run_id = %(id)s AND attempt = %(attempt)s
        ORDER BY pos DESC LIMIT 1) AS output_end
