"""Real PostgreSQL for every test.

The session starts one throwaway cluster (the embedded launcher, in a temp
folder, fsync off: nothing here survives an OS crash anyway) unless
``PGFLOW_TEST_DATABASE_URL`` names a server. All migrations are applied once to
a template database; each test gets its own ``CREATE DATABASE … TEMPLATE``
copy. Fault-injection tests take ``private_cluster``: a cluster of their own
that they may kill and restart.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from procs import Replicas
from psycopg import sql
from psycopg.rows import dict_row

from pgflow import migrate
from pgflow.embedded import Cluster

DROP = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
FAST_SETTINGS = {"fsync": "off", "full_page_writes": "off"}


def with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + database))


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """URL of a server where tests may create databases."""
    external = os.environ.get("PGFLOW_TEST_DATABASE_URL")
    if external:
        yield external
        return
    root = Path(tempfile.mkdtemp(prefix="pgflow-test-"))
    cluster = Cluster(root, settings=FAST_SETTINGS)
    try:
        yield cluster.ensure_running()
    finally:
        cluster.destroy()
        shutil.rmtree(root, ignore_errors=True)


def _admin(server_url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(server_url, autocommit=True)


@pytest.fixture(scope="session")
def template_db(server_url: str) -> Iterator[str]:
    name = f"pgflow_tpl_{os.getpid()}"
    with _admin(server_url) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    with psycopg.connect(with_database(server_url, name), autocommit=True) as conn:
        migrate.migrate(conn)
    yield name
    with _admin(server_url) as admin:
        admin.execute(DROP.format(sql.Identifier(name)))


@pytest.fixture
def empty_db_url(server_url: str) -> Iterator[str]:
    """A new database with nothing in it (for migration tests)."""
    yield from _database(server_url, None)


@pytest.fixture
def db_url(server_url: str, template_db: str) -> Iterator[str]:
    """A new, fully migrated database for this test only."""
    yield from _database(server_url, template_db)


def _database(server_url: str, template: str | None) -> Iterator[str]:
    name = f"pgflow_t_{uuid.uuid4().hex[:12]}"
    create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        create += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    with _admin(server_url) as admin:
        admin.execute(create)
    yield with_database(server_url, name)
    with _admin(server_url) as admin:
        admin.execute(DROP.format(sql.Identifier(name)))


@pytest.fixture
def conn(db_url: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as connection:
        yield connection


@pytest.fixture
def private_cluster() -> Iterator[Cluster]:
    """A cluster of this test's own, which it may kill (``kill()``) and restart."""
    root = Path(tempfile.mkdtemp(prefix="pgflow-pc-"))
    cluster = Cluster(root, settings=FAST_SETTINGS)
    cluster.ensure_running()
    try:
        yield cluster
    finally:
        cluster.destroy()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def replicas(db_url: str, tmp_path: Path) -> Iterator[Replicas]:
    """Real ``pgflow serve`` replicas of this test (tests/procs.py), closed after it."""
    started = Replicas(db_url, tmp_path)
    yield started
    started.close()
