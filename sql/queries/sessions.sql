-- Session settings of a replica's own connections (see pgflow/db.py).

-- name: session_setup
-- Every direct session: pgflow's statements are short OLTP statements, but the row
-- estimates of the recursive DAG queries can pass jit_above_cost, and compiling then
-- costs about a second each.
SET jit = off

-- name: session_limits
-- Worker and reaper sessions: no statement, and no transaction left idle, outlasts
-- %(timeout)s; a client that vanished mid-statement is noticed within a second (PG 14+);
-- server-side TCP probes like the client's (ignored on a unix socket). JIT off as everywhere.
-- Times in UTC whatever the server's zone: a job's logical time is a UTC datetime (as
-- PGFLOW_LOGICAL_TIME spells it), and psycopg loads and dumps those with datetime's own
-- UTC, where a named zone ('Etc/UTC', a Debian server's default) cost 0.2 to 0.3 µs a
-- value (0.7 µs a run at the claim and the finish, issue 16). Nothing in these sessions
-- depends on the zone (date_trunc to the second only).
SELECT set_config('TimeZone', 'UTC', false),
       set_config('jit', 'off', false),
       set_config('statement_timeout', %(timeout)s, false),
       set_config('idle_in_transaction_session_timeout', %(timeout)s, false),
       set_config('client_connection_check_interval', '1s', false),
       set_config('tcp_keepalives_idle', '5', false),
       set_config('tcp_keepalives_interval', '2', false),
       set_config('tcp_keepalives_count', '3', false),
       set_config('tcp_user_timeout', '10000', false)

-- name: pooled_session_settings
-- What sessions through PgBouncer run with: pgflow sets nothing on them, PgBouncer's
-- connect_query does (pgflow/pooler.py).
SELECT current_setting('jit') AS jit,
       current_setting('client_connection_check_interval') AS connection_check

-- name: generic_plans
-- A worker's claim session plans each of its statements once: the claim is a large
-- statement whose planning (about 0.75 ms) cost more than its execution at batches of
-- 64 runs, and its plan does not depend on the values (the generic plans are checked
-- at 1,000,000 finished runs in tests/test_hot_path_plans.py). Direct sessions only:
-- a pooled session prepares nothing and keeps no setting (pgflow/pooler.py).
SELECT set_config('plan_cache_mode', 'force_generic_plan', false)

-- name: replan
-- Drops the session's prepared statements (psycopg forgets them too, on this command's
-- tag): the worker's claim session plans its statements again, for the table as it is
-- now (pgflow/worker.py, Worker._replan_if_stale).
DEALLOCATE ALL

-- name: applied_migrations
-- The migrations a database has (pgflow/cli/_base.py: a read-only command checks the
-- schema is current before reading through libpq).
SELECT version FROM pgflow.schema_migrations
