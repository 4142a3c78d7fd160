-- Idle workers offer their free slots; a trigger hands its run to one of them in its
-- own statement (pgflow/handoff.py). One row per worker (its id is its replica's),
-- written by the worker's idle claims and taken from by triggers.
CREATE TABLE pgflow.idle_workers (
    worker text PRIMARY KEY,
    seq bigint NOT NULL,          -- which of the worker's claims wrote the offer
    slots int NOT NULL CHECK (slots >= 0),
    ttl_s float8 NOT NULL,        -- the worker's lease TTL: a handed-off run's lease
    listen_pid int NOT NULL,      -- the backend of its LISTEN session: the handoff channel
    until timestamptz NOT NULL    -- the offer lapses unless renewed (a frozen worker)
);

-- A run handed off is not given back by its worker's heartbeat (the notification may
-- still be on its way); the claim that starts a later attempt clears it.
ALTER TABLE pgflow.runs ADD COLUMN handed_off boolean NOT NULL DEFAULT false;
