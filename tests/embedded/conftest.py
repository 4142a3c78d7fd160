"""The embedded launcher's tests need PostgreSQL server binaries on this host."""

from __future__ import annotations

import pytest

from pgflow.embedded import PostgresNotFound, find_bindir


@pytest.fixture(scope="module", autouse=True)
def _need_postgres() -> None:
    try:
        find_bindir()
    except PostgresNotFound:
        pytest.skip("PostgreSQL server binaries are not installed")
