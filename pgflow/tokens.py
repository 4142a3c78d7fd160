"""API tokens: ``pgflow token create|list|revoke`` and request authentication.

A token is a random secret shown once at creation; only its sha256 is stored, with
a short prefix so that ``token list`` can tell tokens apart. Roles are ordered:
a viewer reads, an operator also acts on runs, jobs' pause/trigger, backfills and
breakers, and an admin also registers and deletes jobs (that runs code on workers).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

import psycopg

from pgflow.errors import Conflict, InvalidInput, NotFound
from pgflow.queries import q

Conn = psycopg.Connection[dict[str, Any]]

ROLES = ("viewer", "operator", "admin")
SECRET_PREFIX = "pgf_"
_SHOWN_PREFIX = len(SECRET_PREFIX) + 6
_MAX_SECRET = 200
_MAX_NOTE = 500
_MAX_ID = 2**63 - 1


@dataclass(frozen=True)
class Identity:
    """Who a request acts as: a live token's id and role."""

    token_id: int
    role: str
    prefix: str
    note: str | None

    def allows(self, needed: str) -> bool:
        return role_allows(self.role, needed)

    @property
    def actor(self) -> str:
        """How actions by this token are recorded (breakers' changed_by)."""
        label = f"token {self.token_id} ({self.role}"
        return label + (f", {self.note})" if self.note else ")")


def role_allows(have: str, needed: str) -> bool:
    """Whether role ``have`` may do what needs role ``needed`` (viewer < operator < admin)."""
    return ROLES.index(have) >= ROLES.index(needed)


def check_role(role: str) -> None:
    if role not in ROLES:
        raise InvalidInput(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def create(conn: Conn, role: str, note: str | None = None) -> str:
    """Create a token of ``role`` and return its secret (shown once, never stored)."""
    check_role(role)
    if note is not None and (len(note) > _MAX_NOTE or "\x00" in note):
        raise InvalidInput(f"a token note is plain text of at most {_MAX_NOTE} characters")
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    conn.execute(q("token_insert"), {"role": role, "token_hash": hash_secret(secret),
                                     "prefix": secret[:_SHOWN_PREFIX], "note": note})
    return secret


def list_tokens(conn: Conn) -> list[dict[str, Any]]:
    """Every token (revoked ones too), oldest first; secrets are not recoverable."""
    return conn.execute(q("token_list")).fetchall()


def revoke(conn: Conn, token_id: int) -> dict[str, Any]:
    """Revoke a token: its bearer requests and UI sessions stop working at once."""
    if not 0 < token_id <= _MAX_ID:
        raise NotFound(f"no token {token_id} (see 'pgflow token list')")
    row = conn.execute(q("token_revoke"), {"id": token_id, "now": None}).fetchone()
    if row is not None:
        return row
    existing = conn.execute(q("token_get"), {"id": token_id}).fetchone()
    if existing is None:
        raise NotFound(f"no token {token_id} (see 'pgflow token list')")
    raise Conflict(f"token {token_id} was already revoked at {existing['revoked_at'].isoformat()}")


def verify(conn: Conn, secret: str) -> Identity | None:
    """The identity of a live token with this secret, or None."""
    secret = secret.strip()
    if not secret.startswith(SECRET_PREFIX) or len(secret) > _MAX_SECRET:
        return None
    row = conn.execute(q("token_verify"), {"token_hash": hash_secret(secret)}).fetchone()
    return _identity(row)


def live(conn: Conn, token_id: int) -> Identity | None:
    """The identity of token ``token_id`` if it is not revoked (sessions re-check this)."""
    if not 0 < token_id <= _MAX_ID:
        return None
    return _identity(conn.execute(q("token_live"), {"id": token_id}).fetchone())


def admin_exists(conn: Conn) -> bool:
    row = conn.execute(q("token_admin_exists")).fetchone()
    return bool(row and row["exists"])


def _identity(row: dict[str, Any] | None) -> Identity | None:
    if row is None:
        return None
    return Identity(int(row["id"]), str(row["role"]), str(row["prefix"]), row["note"])
