"""Named SQL queries, parsed once from ``sql/queries/*.sql`` (the package ``pgflow.sql``).

Each statement starts with a ``-- name: <identifier>`` line; the statement runs
until the next such line. Parameters use psycopg's ``%(name)s`` style. Every
statement that reads the clock takes ``coalesce(%(now)s, now())`` where a test
may want to pin time; production passes ``None`` and uses the database clock.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME_LINE = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def parse(text: str) -> dict[str, str]:
    """Split a file of named statements into {name: sql}."""
    found: dict[str, str] = {}
    matches = list(_NAME_LINE.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        body = text[match.end() : end].strip().rstrip(";").strip()
        if match.group(1) in found:
            raise ValueError(f"duplicate query name {match.group(1)!r}")
        found[match.group(1)] = body
    return found


@cache
def _all() -> dict[str, str]:
    found: dict[str, str] = {}
    folder = resources.files("pgflow.sql").joinpath("queries")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql"):
            for name, sql in parse(entry.read_text(encoding="utf-8")).items():
                if name in found:
                    raise ValueError(f"query {name!r} is defined twice ({entry.name})")
                found[name] = sql
    return found


def q(name: str) -> str:
    """The SQL text of the named query."""
    return _all()[name]
