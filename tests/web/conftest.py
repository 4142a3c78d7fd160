"""Fixtures for the web role: the app on a test database, tokens of each role, and a
real uvicorn server in a thread (HTTP tests, the browser and the fuzzer use it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# The browser tests drive the system Chromium (Debian package) through Playwright.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                              args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1360, "height": 1000}, timezone_id="UTC")
    opened = context.new_page()
    opened.set_default_timeout(15_000)
    errors: list[str] = []
    opened.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    opened.on("pageerror", lambda e: errors.append(str(e)))
    yield opened
    context.close()
    assert errors == [], errors  # no script errors, no CSP violations
