-- Queue health (pgflow/queue_health.py): what slows a Postgres queue down is dead rows
-- its indexes still point to and a held xmin horizon that keeps vacuum from removing
-- them. Both are read from the statistics views (no table is scanned).

-- name: queue_health_tables
-- Live and dead tuples, and the last (auto)vacuum and (auto)analyze, of pgflow's hot
-- tables (the ones every claim, finish, heartbeat or tick updates).
SELECT relname AS "table", n_live_tup::bigint AS live_tuples, n_dead_tup::bigint AS dead_tuples,
       last_autovacuum, last_vacuum, last_autoanalyze, last_analyze,
       autovacuum_count::bigint AS autovacuum_count, n_mod_since_analyze::bigint AS mod_since_analyze
FROM pg_stat_user_tables
WHERE schemaname = 'pgflow' AND relname = ANY(%(tables)s::text[])
ORDER BY relname

-- name: queue_health_horizon
-- The oldest open transaction of another client session of this database (its age and
-- who holds it; never its query text, which may hold secrets), and the xmin horizon: the oldest snapshot (backend_xmin) any session of
-- this database or a WAL sender (hot_standby_feedback) holds, a replication slot's
-- xmin, or a prepared transaction, in transactions (age) — whichever is oldest holds
-- back every vacuum of the queue. Autovacuum workers are left out: a vacuum's own
-- snapshot does not hold back other vacuums. Sessions of other roles show up only to a member of
-- pg_read_all_stats (or a superuser).
SELECT
    (SELECT to_jsonb(o) FROM (
        SELECT pid, usename AS "user", application_name, state, backend_type,
               extract(epoch FROM now() - xact_start)::float8 AS age_s,
               age(backend_xmin)::bigint AS xmin_age
        FROM pg_stat_activity
        WHERE pid <> pg_backend_pid() AND xact_start IS NOT NULL
          AND datname = current_database() AND backend_type = 'client backend'
        ORDER BY xact_start LIMIT 1) o) AS oldest_xact,
    (SELECT to_jsonb(h) FROM (
        SELECT kind, holder, xmin_age FROM (
            SELECT 'session' AS kind,
                   pid::text || coalesce(' (' || nullif(application_name, '') || ')', '')
                       AS holder,
                   age(backend_xmin)::bigint AS xmin_age
            FROM pg_stat_activity
            WHERE pid <> pg_backend_pid() AND backend_xmin IS NOT NULL
              AND backend_type <> 'autovacuum worker'
              AND (datname = current_database() OR backend_type = 'walsender')
            UNION ALL
            SELECT 'replication slot', slot_name::text,
                   greatest(age(xmin), age(catalog_xmin))::bigint
            FROM pg_replication_slots WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL
            UNION ALL
            SELECT 'prepared transaction', gid, age(transaction)::bigint
            FROM pg_prepared_xacts WHERE database = current_database()
        ) holders
        ORDER BY xmin_age DESC LIMIT 1) h) AS horizon
