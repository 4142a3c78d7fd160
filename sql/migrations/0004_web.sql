-- API tokens and circuit breakers.

CREATE TABLE pgflow.tokens (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    role         text NOT NULL CHECK (role IN ('viewer', 'operator', 'admin')),
    -- sha256 of the secret; the secret itself is shown once and never stored.
    token_hash   text NOT NULL UNIQUE,
    prefix       text NOT NULL,
    note         text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    last_used_at timestamptz,
    revoked_at   timestamptz
);

-- A source whose breaker is open holds back the runs of every job that lists it in
-- `sources` (they stay queued) until an operator closes it.
CREATE TABLE pgflow.breakers (
    source     text PRIMARY KEY,
    state      text NOT NULL DEFAULT 'closed' CHECK (state IN ('closed', 'open')),
    reason     text,
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text
);
