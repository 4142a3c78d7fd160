"""Errors a user can act on.

Anything raised as a ``PgflowError`` is printed by the CLI as one line (no
traceback) and returned by the API as a JSON error; its message must name the
thing that is wrong and, where possible, the fix.
"""

from __future__ import annotations


class PgflowError(Exception):
    """Base of every error that is reported to the user as one readable line."""


class ConfigError(PgflowError):
    """A setting has an invalid value."""


class DatabaseUnavailable(PgflowError):
    """The database cannot be reached or started."""

    #: the server is starting, recovering or restarting (or not listening yet): the same
    #: connection may succeed in a moment, unlike a refused login or a missing database
    starting: bool = False


class NotFound(PgflowError):
    """A named job, run or other object does not exist."""


class Conflict(PgflowError):
    """The request is valid but clashes with the current state."""


class InvalidInput(PgflowError):
    """An argument is not acceptable (unknown state, bad limit, bad time range)."""
