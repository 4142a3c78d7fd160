"""Read-only queries through libpq itself (ctypes), for the commands that must answer at
once: ``pgflow jobs list`` on a small machine spends 120-200 ms importing psycopg (and
the asyncio, typing and metadata modules it pulls in), more than everything else the
command does together. The library is the one psycopg uses — psycopg_binary's own copy,
else the system's ``libpq.so.5`` — so connection strings, TLS, authentication and error
messages are libpq's, exactly as through psycopg.

Only what such a command needs: one connection, statements with ``%(name)s`` parameters
sent as text, text results turned into the Python values psycopg would give for the
types pgflow's listings use. ``open_session`` returns None when libpq cannot be loaded
or the session would not read back as expected (a DateStyle other than ISO); callers
then take the psycopg path. Writes, migrations and the replica always use psycopg.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from pgflow.dbconfig import unreachable
from pgflow.errors import PgflowError

_CONNECTION_OK = 0
_TUPLES_OK, _COMMAND_OK = 2, 1
_PRIMARY_MESSAGE = ord("M")  # PG_DIAG_MESSAGE_PRIMARY
_PARAM = re.compile(r"%\((\w+)\)s|%%")

_lib: ctypes.CDLL | None = None
_tried = False


class QueryFailed(PgflowError):
    """The server refused a statement (or the connection broke): ``database error:`` and
    the first line of libpq's message, as the CLI shows a psycopg error."""

    def __init__(self, message: bytes | None) -> None:
        super().__init__(f"database error: {_first_line(message, 'query failed')}")


def _candidates() -> list[str]:
    """psycopg_binary's bundled libpq first (the one psycopg would load), then the
    system's."""
    found = []
    spec = importlib.util.find_spec("psycopg_binary")
    if spec is not None and spec.origin is not None:
        libs = Path(spec.origin).parent.parent / "psycopg_binary.libs"
        found += sorted(str(p) for p in libs.glob("libpq-*.so*"))
    return [*found, "libpq.so.5"]


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        _declare(lib)
        _lib = lib
        break
    return _lib


def _declare(lib: ctypes.CDLL) -> None:
    p, s, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
    for name, args, result in (
        ("PQconnectdbParams", [ctypes.POINTER(s), ctypes.POINTER(s), i], p),
        ("PQstatus", [p], i),
        ("PQerrorMessage", [p], s),
        ("PQparameterStatus", [p, s], s),
        ("PQexecParams", [p, s, i, p, ctypes.POINTER(s), p, p, i], p),
        ("PQresultStatus", [p], i),
        ("PQresultErrorMessage", [p], s),
        ("PQresultErrorField", [p, i], s),
        ("PQntuples", [p], i),
        ("PQnfields", [p], i),
        ("PQfname", [p, i], s),
        ("PQftype", [p, i], ctypes.c_uint),
        ("PQgetvalue", [p, i, i], s),
        ("PQgetisnull", [p, i, i], i),
        ("PQclear", [p], None),
        ("PQfinish", [p], None),
    ):
        function = getattr(lib, name)
        function.argtypes = args
        function.restype = result


def _strings(values: Sequence[str | None]) -> Any:
    array = (ctypes.c_char_p * (len(values) + 1))()
    for k, value in enumerate(values):
        array[k] = None if value is None else value.encode()
    array[len(values)] = None
    return array


def _first_line(message: bytes | None, fallback: str) -> str:
    lines = (message or b"").decode("utf-8", "replace").strip().splitlines()
    return lines[0] if lines else fallback


class Session:
    """One libpq connection; ``rows`` runs a statement and returns dict rows."""

    def __init__(self, lib: ctypes.CDLL, handle: int) -> None:
        self._lib = lib
        self._handle: int | None = handle

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        text, values = _positional(sql, params or {})
        lib = self._lib
        result = lib.PQexecParams(self._handle, text.encode(), len(values), None,
                                  _strings(values), None, None, 0)
        if not result:
            raise QueryFailed(lib.PQerrorMessage(self._handle))
        try:
            status = lib.PQresultStatus(result)
            if status == _COMMAND_OK:
                return []
            if status != _TUPLES_OK:
                # the primary message, as psycopg words it (no "ERROR:  " severity)
                raise QueryFailed(lib.PQresultErrorField(result, _PRIMARY_MESSAGE)
                                  or lib.PQresultErrorMessage(result))
            return _decode(lib, result)
        finally:
            lib.PQclear(result)

    def close(self) -> None:
        if self._handle is not None:
            self._lib.PQfinish(self._handle)
            self._handle = None


def open_session(url: str, *, session_setup: str | None = None) -> Session | None:
    """A connection to ``url``, or None when libpq is not loadable here or the server's
    DateStyle is not ISO (its text timestamps are read only in that style). A refused
    connection raises DatabaseUnavailable (``dbconfig.unreachable``), as ``db.connect`` does."""
    lib = _load()
    if lib is None:
        return None
    keywords = ["dbname", "connect_timeout", "client_encoding"]
    handle = lib.PQconnectdbParams(_strings(keywords), _strings([url, "10", "UTF8"]), 1)
    if not handle:
        return None  # out of memory in libpq: let psycopg try
    session = Session(lib, handle)
    if lib.PQstatus(handle) != _CONNECTION_OK:
        message = (lib.PQerrorMessage(handle) or b"").decode("utf-8", "replace")
        session.close()
        raise unreachable(url, message)
    datestyle = (lib.PQparameterStatus(handle, b"DateStyle") or b"").decode()
    if not datestyle.startswith("ISO"):
        session.close()
        return None
    if session_setup:
        try:
            session.rows(session_setup)
        except BaseException:
            session.close()
            raise
    return session


def _positional(sql: str, params: Mapping[str, Any]) -> tuple[str, list[str | None]]:
    """``%(name)s`` placeholders as ``$n`` (one number per name) and their text values."""
    order: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "%"
        if name not in order:
            order[name] = len(order) + 1
        return f"${order[name]}"

    text = _PARAM.sub(number, sql)
    return text, [_param_text(params[name]) for name in order]


def _param_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot send a {type(value).__name__} as a text parameter")


def _decode(lib: ctypes.CDLL, result: int) -> list[dict[str, Any]]:
    fields = range(lib.PQnfields(result))
    names = [lib.PQfname(result, f).decode() for f in fields]
    readers = [_reader(lib.PQftype(result, f), names[f]) for f in fields]
    rows = []
    for r in range(lib.PQntuples(result)):
        row: dict[str, Any] = {}
        for f in fields:
            if lib.PQgetisnull(result, r, f):
                row[names[f]] = None
            else:
                row[names[f]] = readers[f](lib.PQgetvalue(result, r, f).decode())
        rows.append(row)
    return rows


def _text_array(text: str) -> list[str | None]:
    """A one-dimensional array literal (``{a,"b c",NULL}``) as a list of strings."""
    if text == "{}":
        return []
    items: list[str | None] = []
    current: list[str] = []
    quoted = was_quoted = False
    k = 1
    while k < len(text) - 1:
        char = text[k]
        if quoted and char == "\\":
            k += 1
            current.append(text[k])
        elif char == '"':
            quoted = not quoted
            was_quoted = True
        elif char == "," and not quoted:
            items.append(_array_item(current, was_quoted))
            current, was_quoted = [], False
        else:
            current.append(char)
        k += 1
    items.append(_array_item(current, was_quoted))
    return items


def _array_item(chars: list[str], was_quoted: bool) -> str | None:
    item = "".join(chars)
    return None if item == "NULL" and not was_quoted else item


_TEXT_OIDS = {25, 1043, 19, 18, 1042}  # text, varchar, name, char, bpchar
_READERS: dict[int, Callable[[str], Any]] = {
    16: lambda text: text == "t",
    20: int, 21: int, 23: int,
    700: float, 701: float,
    1184: datetime.fromisoformat, 1114: datetime.fromisoformat,
    114: json.loads, 3802: json.loads,
    1009: _text_array, 1015: _text_array,  # text[], varchar[]
}


def _reader(oid: int, column: str) -> Callable[[str], Any]:
    if oid in _TEXT_OIDS:
        return str
    if oid in _READERS:
        return _READERS[oid]
    raise TypeError(f"column {column!r}: type oid {oid} is not read by pgflow.libpq")
