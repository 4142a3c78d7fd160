-- API tokens: only the sha256 of a secret is stored; the secret is shown once.

-- name: token_insert
INSERT INTO pgflow.tokens (role, token_hash, prefix, note)
VALUES (%(role)s, %(token_hash)s, %(prefix)s, %(note)s)
RETURNING id, role, prefix, note, created_at

-- name: token_list
SELECT id, role, prefix, note, created_at, last_used_at, revoked_at
FROM pgflow.tokens
ORDER BY id

-- name: token_revoke
UPDATE pgflow.tokens SET revoked_at = coalesce(%(now)s, now())
WHERE id = %(id)s AND revoked_at IS NULL
RETURNING id, role, prefix, note, created_at, last_used_at, revoked_at

-- name: token_get
SELECT id, role, prefix, note, created_at, last_used_at, revoked_at
FROM pgflow.tokens WHERE id = %(id)s

-- name: token_verify
-- The live token with this hash; last_used_at is written at most once a minute per
-- token, so verifying every request does not turn reads into writes.
WITH found AS (
    SELECT id, role, prefix, note, last_used_at FROM pgflow.tokens
    WHERE token_hash = %(token_hash)s AND revoked_at IS NULL
), touched AS (
    UPDATE pgflow.tokens t SET last_used_at = now()
    FROM found f
    WHERE t.id = f.id AND (f.last_used_at IS NULL OR f.last_used_at < now() - interval '1 minute')
)
SELECT id, role, prefix, note FROM found

-- name: token_live
-- A session names its token: the session dies with the token.
SELECT id, role, prefix, note FROM pgflow.tokens WHERE id = %(id)s AND revoked_at IS NULL

-- name: token_admin_exists
SELECT EXISTS (SELECT 1 FROM pgflow.tokens WHERE role = 'admin' AND revoked_at IS NULL)
    AS exists
