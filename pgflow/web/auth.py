"""Who may do what over HTTP: bearer tokens, signed session cookies, CSRF, bind policy.

- The API takes ``Authorization: Bearer <token>`` (``pgflow token create``).
- The UI logs in with a token once; the session cookie then carries the token's id,
  a CSRF nonce and an expiry, signed with HMAC-SHA256. No session state lives in the
  process, so any number of web replicas sharing the secret can serve any request.
  Every request re-checks that the token is still live: revoking it ends its sessions.
- The secret is ``PGFLOW_SECRET_KEY`` or ``$PGFLOW_HOME/secret`` (created 0600 on
  first use); replicas behind one load balancer must share it.
- Every state-changing form carries the session's CSRF nonce; SameSite=Lax keeps
  the cookie off cross-site posts as a second line.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psycopg

from pgflow import tokens
from pgflow.errors import ConfigError, PgflowError

SESSION_COOKIE = "pgflow_session"
LOGIN_COOKIE = "pgflow_login"
FLASH_COOKIE = "pgflow_flash"
SESSION_TTL_S = 12 * 3600
LOGIN_TTL_S = 3600
_MIN_SECRET = 16


def load_secret(home: Path, environ: Mapping[str, str] | None = None) -> bytes:
    """The session signing key: ``PGFLOW_SECRET_KEY``, else ``$PGFLOW_HOME/secret``."""
    env = os.environ if environ is None else environ
    configured = env.get("PGFLOW_SECRET_KEY", "").strip()
    if configured:
        if len(configured) < _MIN_SECRET:
            raise ConfigError(f"PGFLOW_SECRET_KEY must be at least {_MIN_SECRET} characters"
                              " (try: python -c 'import secrets; print(secrets.token_hex(32))')")
        return configured.encode()
    path = home / "secret"
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    try:
        home.mkdir(parents=True, exist_ok=True)
        # Write aside, then link into place: a concurrent replica either wins the link
        # (and we read its key) or never sees a half-written file.
        temporary = home / f".secret-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass
        finally:
            temporary.unlink()
        return _read_secret(path)
    except OSError as exc:
        raise ConfigError(f"cannot create the session secret {path}: {exc.strerror or exc};"
                          " set PGFLOW_SECRET_KEY or fix PGFLOW_HOME") from None


def _read_secret(path: Path) -> bytes:
    secret = path.read_bytes().strip()
    if len(secret) < _MIN_SECRET:
        raise ConfigError(f"{path} holds fewer than {_MIN_SECRET} bytes: delete it to regenerate")
    return secret


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Signer:
    """Tamper-proof, expiring values for cookies (HMAC-SHA256 over purpose and payload)."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _mac(self, purpose: str, data: str) -> bytes:
        return hmac.new(self._key, f"{purpose}.{data}".encode(), hashlib.sha256).digest()

    def sign(self, purpose: str, payload: dict[str, Any], ttl_s: float) -> str:
        data = _b64(json.dumps({**payload, "exp": int(time.time() + ttl_s)},
                               separators=(",", ":")).encode())
        return f"{data}.{_b64(self._mac(purpose, data))}"

    def unsign(self, purpose: str, value: str | None) -> dict[str, Any] | None:
        """The payload if ``value`` was signed for ``purpose`` and has not expired."""
        if not value or len(value) > 4096 or value.count(".") != 1:
            return None
        data, mac = value.split(".")
        try:
            if not hmac.compare_digest(_unb64(mac), self._mac(purpose, data)):
                return None
            payload = json.loads(_unb64(data))
        except (binascii.Error, ValueError, UnicodeDecodeError):
            return None
        if not isinstance(payload, dict) or not isinstance(payload.get("exp"), int):
            return None
        return payload if payload["exp"] > time.time() else None


def new_session(signer: Signer, identity: tokens.Identity) -> tuple[str, str]:
    """A session cookie value for ``identity`` and its CSRF nonce."""
    csrf = secrets.token_urlsafe(24)
    return signer.sign("session", {"tid": identity.token_id, "csrf": csrf}, SESSION_TTL_S), csrf


def csrf_matches(expected: str | None, given: str | None) -> bool:
    if not expected or not given:
        return False
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def bearer_secret(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind_allowed(conn: psycopg.Connection[Any], host: str) -> None:
    """Refuse a non-loopback bind while no admin token exists (anyone on the network
    could otherwise reach an admin UI nobody can log into to lock down)."""
    if is_loopback(host) or tokens.admin_exists(conn):
        return
    raise PgflowError(
        f"refusing to serve the web role on {host}: no admin token exists yet;"
        " create one with 'pgflow token create --role admin' or bind to 127.0.0.1")
