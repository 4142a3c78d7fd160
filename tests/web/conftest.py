"""Fixtures for the web role: the app on a test database, tokens of each role, and a
real uvicorn server in a thread (HTTP tests, the browser and the fuzzer use it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from webhelpers import ROLES, SECRET, Conn, ServerThread, auth

from pgflow import tokens
from pgflow.config import Settings, load_settings
from pgflow.web import create_app


@pytest.fixture
def settings(tmp_path: Path, db_url: str) -> Settings:
    return load_settings({"PGFLOW_HOME": str(tmp_path / "home")}, database_url=db_url,
                         lease_ttl=30)


@pytest.fixture
def app(db_url: str, settings: Settings) -> Starlette:
    return create_app(db_url, settings, secret=SECRET, pool_size=4)


@pytest.fixture
def secrets_by_role(conn: Conn) -> dict[str, str]:
    return {role: tokens.create(conn, role, note=f"{role} for tests") for role in ROLES}


@pytest.fixture
def server(app: Starlette) -> Iterator[ServerThread]:
    with ServerThread(app) as running:
        yield running


@pytest.fixture
def client(server: ServerThread) -> Iterator[httpx.Client]:
    """HTTP to the real server (redirects are not followed: tests look at them)."""
    with httpx.Client(base_url=server.url, follow_redirects=False, timeout=30) as http:
        yield http


@pytest.fixture
def as_role(client: httpx.Client, secrets_by_role: dict[str, str]
            ) -> dict[str, dict[str, str]]:
    """Authorization headers by role."""
    return {role: auth(secret) for role, secret in secrets_by_role.items()}
