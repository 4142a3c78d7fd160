"""Named SQL queries, parsed once from ``sql/queries/*.sql`` (the package ``pgflow.sql``).

Each statement starts with a ``-- name: <identifier>`` line; the statement runs
until the next such line. Parameters use psycopg's ``%(name)s`` style. Every
statement that reads the clock takes ``coalesce(%(now)s, now())`` where a test
may want to pin time; production passes ``None`` and uses the database clock.

A piece of SQL that several statements share (the claim step every claim ends
with) is written once as ``-- fragment: <identifier>`` and placed into a
statement by a line ``-- include: <identifier>``; fragments are shared across
files and expanded once, at load.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_HEADER = re.compile(r"^--\s*(name|fragment):\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_INCLUDE = re.compile(r"^[ \t]*--\s*include:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def split(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Split a file into its named statements and its fragments, unexpanded."""
    found: dict[str, dict[str, str]] = {"name": {}, "fragment": {}}
    matches = list(_HEADER.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        kind, name = match.group(1), match.group(2)
        if name in found[kind]:
            raise ValueError(f"duplicate {kind} {name!r}")
        found[kind][name] = text[match.end() : end].strip().rstrip(";").strip()
    return found["name"], found["fragment"]


def expand(body: str, fragments: dict[str, str]) -> str:
    """``body`` with every ``-- include:`` line replaced by its fragment."""
    def fragment(match: re.Match[str]) -> str:
        if match.group(1) not in fragments:
            raise ValueError(f"no fragment named {match.group(1)!r}")
        text = fragments[match.group(1)]
        if _INCLUDE.search(text):  # expanded once: an include in it would stay a comment
            raise ValueError(f"fragment {match.group(1)!r} includes another fragment")
        return text
    return _INCLUDE.sub(fragment, body)


@cache
def _all() -> dict[str, str]:
    statements: dict[str, str] = {}
    fragments: dict[str, str] = {}
    folder = resources.files("pgflow.sql").joinpath("queries")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql"):
            named, shared = split(entry.read_text(encoding="utf-8"))
            for kind, into, new in (("query", statements, named),
                                    ("fragment", fragments, shared)):
                for name in new.keys() & into.keys():
                    raise ValueError(f"{kind} {name!r} is defined twice ({entry.name})")
                into.update(new)
    return {name: expand(body, fragments) for name, body in statements.items()}


CACHED_TEXT_MAX = 4096  # psycopg's MAX_CACHED_STATEMENT_LENGTH (psycopg/_queries.py)


def compact(body: str) -> str:
    """``body`` as sent: its first line (a comment that names the statement in
    pg_stat_activity and pg_stat_statements), then its code without comments, blank lines
    or indentation. psycopg parses a statement's placeholders again on every execute once
    its text passes 4 KiB (``CACHED_TEXT_MAX``), and the commented claim and finish
    statements were 6 and 7 KiB: 0.2 ms of the worker's CPU per claim and per finish.
    Inside a string literal (an odd number of quotes before) nothing is taken out."""
    lines = body.splitlines()
    kept = lines[:1]
    quotes = lines[0].count("'") if lines else 0
    for line in lines[1:]:
        if quotes % 2 == 0 and "'" not in line:  # most lines: loaded by every command
            code = line.partition("--")[0].strip()
            if code:
                kept.append(code)
            continue
        literal = quotes % 2 == 1  # the line starts inside a literal: kept whole
        code = _without_comment(line, quotes).rstrip()
        if literal or code.strip():
            kept.append(code if literal else code.lstrip())
        quotes += code.count("'")
    return "\n".join(kept)


def _without_comment(line: str, quotes: int) -> str:
    start = 0
    while (at := line.find("--", start)) >= 0:
        if (quotes + line.count("'", 0, at)) % 2 == 0:
            return line[:at]
        start = at + 2
    return line


@cache
def q(name: str) -> str:
    """The SQL text of the named query, as sent (``compact``: made when first asked for,
    so a command pays for the few statements it runs)."""
    return compact(_all()[name])
