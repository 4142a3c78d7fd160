"""pgflow/libpq.py: the read-only path of short commands gives what psycopg gives, refuses
what it cannot read the same way, and the commands fall back to psycopg (which applies
pending migrations) whenever it is not usable."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from alerting import apply_toml
from psycopg.rows import dict_row

from pgflow import libpq
from pgflow.cli import run
from pgflow.errors import DatabaseUnavailable
from pgflow.queries import q

PIPELINE = """
[tenants.acme]
weight = 2

[jobs."a.first-job"]
schedule = "*/5 * * * *"
timezone = "Asia/Kolkata"
command = "true"

[jobs.downstream]
depends_on = ["a.first-job", "plain"]
command = "true"

[jobs.plain]
schedule = "*/5 * * * *"
timezone = "Asia/Kolkata"
tenant = "acme"
priority = 7
command = "true"
"""


def _session(url: str) -> libpq.Session:
    session = libpq.open_session(url)
    assert session is not None, "libpq did not load: psycopg_binary ships it"
    return session


def test_list_jobs_reads_the_same_rows_as_psycopg(conn: psycopg.Connection[Any], db_url: str,
                                                  tmp_path: Path) -> None:
    apply_toml(conn, tmp_path / "jobs.toml", PIPELINE)
    conn.execute("UPDATE pgflow.jobs SET paused = true WHERE name = 'plain'")
    session = _session(db_url)
    try:
        for params in ({"tenant": None, "limit": 100}, {"tenant": "acme", "limit": 100},
                       {"tenant": None, "limit": 1}, {"tenant": "nobody", "limit": 5}):
            expected = conn.execute(q("list_jobs"), params).fetchall()
            assert session.rows(q("list_jobs"), params) == expected
        rows = session.rows(q("list_jobs"), {"tenant": None, "limit": 100})
    finally:
        session.close()
    assert rows[1]["depends_on"] == ["a.first-job", "plain"]
    assert [r["paused"] for r in rows] == [False, False, True]
    assert isinstance(rows[0]["next_fire_at"], datetime) and rows[1]["next_fire_at"] is None


def test_values_of_every_type_read_like_psycopg(conn: psycopg.Connection[Any],
                                                db_url: str) -> None:
    statement = """SELECT %(n)s::int AS i, %(n)s::bigint AS big, 2.5::float8 AS f,
        NULL::text AS none, 'a''b'::text AS quote, %(flag)s::bool AS flag,
        '2026-03-29 01:30:00.25+00'::timestamptz AS at, now() AS now,
        '2026-01-01 00:00:00'::timestamp AS naive,
        ARRAY['x', NULL, 'NULL', 'back\\slash', 'q"uote', '{br}', 'a,b', ''] AS arr,
        '{}'::text[] AS empty,
        '{"k": [1, "v"]}'::jsonb AS doc, '%%' AS percent, %(n)s + 1 AS again"""
    params = {"n": 41, "flag": True}
    session = _session(db_url)
    try:
        for zone in ("UTC", "America/St_Johns", "Asia/Kathmandu"):
            session.rows(f"SET TimeZone = '{zone}'")
            conn.execute(f"SET TimeZone = '{zone}'")
            expected = conn.execute(statement, params).fetchone()
            got = session.rows(statement, params)[0]
            assert {k: v for k, v in got.items() if k != "now"} == \
                   {k: v for k, v in expected.items() if k != "now"}
            assert got["at"] == datetime(2026, 3, 29, 1, 30, 0, 250000, tzinfo=UTC)
    finally:
        session.close()


def test_a_refused_statement_raises_its_first_line(db_url: str) -> None:
    session = _session(db_url)
    try:
        with pytest.raises(libpq.QueryFailed) as refused:
            session.rows("SELECT * FROM pgflow.nothing")
        assert str(refused.value) == ('database error: relation "pgflow.nothing" does not'
                                      ' exist')  # as the CLI words a psycopg error
        with pytest.raises(TypeError, match="type oid 1186"):
            session.rows("SELECT interval '1 day' AS span")
        assert session.rows("SELECT 1 AS still") == [{"still": 1}]  # the session survives
    finally:
        session.close()


def test_an_unreachable_server_is_database_unavailable_with_the_password_hidden() -> None:
    with pytest.raises(DatabaseUnavailable) as caught:
        libpq.open_session("postgresql://someone:secret@127.0.0.1:1/none")
    text = str(caught.value)
    assert text.startswith("cannot connect to postgresql://someone:***@127.0.0.1:1/none: ")
    assert "secret" not in text and "\n" not in text


def test_only_an_iso_datestyle_is_read(db_url: str, conn: psycopg.Connection[Any],
                                       tmp_path: Path) -> None:
    apply_toml(conn, tmp_path / "jobs.toml", PIPELINE)
    database = conn.execute("SELECT current_database() AS d").fetchone()["d"]
    conn.execute(f'ALTER DATABASE "{database}" SET DateStyle = \'ISO, DMY\'')
    session = _session(db_url)
    try:
        params = {"tenant": None, "limit": 10}
        assert session.rows(q("list_jobs"), params) == conn.execute(q("list_jobs"), params
                                                                   ).fetchall()
    finally:
        session.close()
    # Timestamps in another style are left to psycopg (which refuses them as well).
    conn.execute(f'ALTER DATABASE "{database}" SET DateStyle = \'German, DMY\'')
    assert libpq.open_session(db_url) is None


def test_jobs_list_on_an_unmigrated_database_migrates_through_psycopg(
        empty_db_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PGFLOW_DATABASE_URL", empty_db_url)
    assert run(["jobs", "list", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == [] and "applied" in err and "migration(s)" in err
    with psycopg.connect(empty_db_url, row_factory=dict_row) as check:
        assert check.execute("SELECT count(*) AS n FROM pgflow.schema_migrations"
                             ).fetchone()["n"] > 0
    assert run(["jobs", "list", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == [] and err == ""


def test_placeholders_become_numbered_text_parameters() -> None:
    text, values = libpq._positional(
        "SELECT %(a)s, %(b)s, %(a)s, '%%', %(when)s, %(none)s, %(yes)s",
        {"a": 1, "b": "x", "when": datetime(2026, 1, 2, tzinfo=UTC), "none": None,
         "yes": False})
    assert text == "SELECT $1, $2, $1, '%', $3, $4, $5"
    assert values == ["1", "x", "2026-01-02T00:00:00+00:00", None, "false"]
    with pytest.raises(TypeError, match="cannot send a list"):
        libpq._positional("SELECT %(x)s", {"x": [1]})
    with pytest.raises(KeyError):
        libpq._positional("SELECT %(missing)s", {})
