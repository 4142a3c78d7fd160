"""Tokens, signed cookies, the session secret and the bind policy."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from webhelpers import Conn

from pgflow import tokens
from pgflow.errors import ConfigError, Conflict, InvalidInput, NotFound, PgflowError
from pgflow.web.auth import Signer, bearer_secret, check_bind_allowed, is_loopback, load_secret


def test_a_token_is_shown_once_and_only_its_hash_is_stored(conn: Conn) -> None:
    secret = tokens.create(conn, "operator", note="ci")
    assert secret.startswith("pgf_") and len(secret) > 40
    stored = conn.execute("SELECT * FROM pgflow.tokens").fetchone()
    assert stored is not None
    assert secret not in str(stored.values())
    assert stored["token_hash"] == tokens.hash_secret(secret)
    [listed] = tokens.list_tokens(conn)
    assert listed["prefix"] == secret[:10] and listed["note"] == "ci"
    identity = tokens.verify(conn, secret)
    assert identity is not None and identity.role == "operator"
    assert identity.allows("viewer") and identity.allows("operator")
    assert not identity.allows("admin")
    assert tokens.list_tokens(conn)[0]["last_used_at"] is not None
    assert tokens.verify(conn, secret + "x") is None
    assert tokens.verify(conn, "not-even-prefixed") is None


def test_revoke(conn: Conn) -> None:
    secret = tokens.create(conn, "viewer")
    token_id = tokens.list_tokens(conn)[0]["id"]
    assert tokens.revoke(conn, token_id)["revoked_at"] is not None
    assert tokens.verify(conn, secret) is None
    assert tokens.live(conn, token_id) is None
    with pytest.raises(Conflict, match="already revoked"):
        tokens.revoke(conn, token_id)
    with pytest.raises(NotFound, match="no token 999"):
        tokens.revoke(conn, 999)
    with pytest.raises(NotFound):
        tokens.revoke(conn, 2**70)


def test_roles_are_checked(conn: Conn) -> None:
    with pytest.raises(InvalidInput, match="unknown role 'root'"):
        tokens.create(conn, "root")
    assert [tokens.role_allows("admin", r) for r in tokens.ROLES] == [True, True, True]
    assert [tokens.role_allows("viewer", r) for r in tokens.ROLES] == [True, False, False]


def test_a_public_bind_needs_an_admin_token(conn: Conn) -> None:
    check_bind_allowed(conn, "127.0.0.1")
    check_bind_allowed(conn, "::1")
    check_bind_allowed(conn, "localhost")
    with pytest.raises(PgflowError, match=r"no admin token exists yet.*token create --role admin"):
        check_bind_allowed(conn, "0.0.0.0")
    tokens.create(conn, "operator")
    with pytest.raises(PgflowError):
        check_bind_allowed(conn, "10.0.0.5")
    tokens.create(conn, "admin")
    check_bind_allowed(conn, "0.0.0.0")
    tokens.revoke(conn, tokens.list_tokens(conn)[-1]["id"])
    with pytest.raises(PgflowError):
        check_bind_allowed(conn, "0.0.0.0")


def test_the_secret_is_created_private_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = load_secret(home, environ={})
    assert len(first) >= 32
    assert stat.S_IMODE(os.stat(home / "secret").st_mode) == 0o600
    assert load_secret(home, environ={}) == first
    assert load_secret(home, environ={"PGFLOW_SECRET_KEY": "k" * 20}) == b"k" * 20
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(home, environ={"PGFLOW_SECRET_KEY": "short"})
    assert list(home.iterdir()) == [home / "secret"]


def test_signed_values_resist_tampering_and_expire() -> None:
    signer = Signer(b"k" * 32)
    value = signer.sign("session", {"tid": 1}, 60)
    assert signer.unsign("session", value) == {"tid": 1, "exp": pytest.approx(time.time() + 60,
                                                                              abs=2)}
    assert signer.unsign("flash", value) is None
    assert Signer(b"j" * 32).unsign("session", value) is None
    data, mac = value.split(".")
    assert signer.unsign("session", data + "x." + mac) is None
    assert signer.unsign("session", "garbage") is None
    assert signer.unsign("session", "a.b.c") is None
    assert signer.unsign("session", None) is None
    assert signer.unsign("session", signer.sign("session", {}, -1)) is None


def test_headers_and_addresses() -> None:
    assert bearer_secret("Bearer abc") == "abc"
    assert bearer_secret("bearer  abc ") == "abc"
    assert bearer_secret("Basic abc") is None
    assert bearer_secret("Bearer") is None
    assert is_loopback("127.0.0.53") and is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")
    assert not is_loopback(None)
