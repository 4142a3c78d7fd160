-- Session settings of a replica's own connections (see pgflow/db.py).

-- name: session_limits
-- Worker and reaper sessions: no statement, and no transaction left idle, outlasts
-- %(timeout)s; a client that vanished mid-statement is noticed within a second (PG 14+);
-- server-side TCP probes like the client's (ignored on a unix socket). JIT off as everywhere.
SELECT set_config('jit', 'off', false),
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
