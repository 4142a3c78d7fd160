"""Finding the PostgreSQL server binaries (pgflow.embedded.binaries), on the real host."""

from __future__ import annotations

from pathlib import Path

import pytest

from pgflow.embedded import PostgresNotFound, find_bindir
from pgflow.errors import DatabaseUnavailable


def test_find_bindir_without_path(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name.split(".")[0])
    )
    if not installed:
        pytest.skip("no /usr/lib/postgresql/*/bin here")
    monkeypatch.delenv("PGFLOW_PG_BINDIR", raising=False)
    monkeypatch.setenv("PATH", "")

    assert find_bindir() == installed[-1]


def test_empty_bindir_override_is_not_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PGFLOW_PG_BINDIR", str(tmp_path))

    with pytest.raises(PostgresNotFound) as caught:
        find_bindir()

    message = str(caught.value)
    assert isinstance(caught.value, DatabaseUnavailable)
    assert "\n" not in message
    assert "PGFLOW_DATABASE_URL" in message
