"""A click group whose subcommands are imported when they are used.

Design note
===========

``pgflow --help`` and ``pgflow jobs list`` should answer at once, but the command
modules pull in the registry (pydantic models, croniter), the replica (structlog,
starlette) and the database driver. :class:`LazyGroup` holds a table *name ->
(``"module:attr"``, short help)*: resolving a name imports only that one module, and
the root ``--help`` lists every command with the short help of the table, importing
none of them. The short help is the first sentence of the command's docstring;
``tests/test_cli_startup.py`` checks that each entry matches the command it names, so
the table cannot drift from the docstrings. Adding a command group is one table line.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import click


class LazyCommand(NamedTuple):
    """Where a subcommand lives (``"module:attr"``) and its one-line help."""

    target: str
    short_help: str


class LazyGroup(click.Group):
    """A group that imports a subcommand's module only when the subcommand is resolved."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lazy_commands: dict[str, LazyCommand] = {}

    def add_lazy(self, table: dict[str, LazyCommand]) -> None:
        self.lazy_commands.update(table)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            self.add_command(resolve(self.lazy_commands[cmd_name].target), cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Like click's, with the table's short help for commands not imported yet."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            if name in self.commands:
                command = self.commands[name]
                if command.hidden:
                    continue
                rows.append((name, command.get_short_help_str(limit)))
            else:
                # click's own shortening of a help text, on a stand-in command
                stand_in = click.Command(name, help=self.lazy_commands[name].short_help)
                rows.append((name, stand_in.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def resolve(target: str) -> click.Command:
    """The command object named by ``"module:attr"``."""
    module_name, _, attr = target.partition(":")
    command = getattr(importlib.import_module(module_name), attr)
    if not isinstance(command, click.Command):
        raise TypeError(f"{target} is not a click command")
    return command
