"""One-line summaries of command output and server logs, for error messages.

Every error pgflow reports is one line, so the stderr of ``initdb``, ``pg_ctl`` or
``useradd`` and the tail of ``server.log`` are folded into one before they are quoted.
"""

from __future__ import annotations

import os
from pathlib import Path


def one_line(text: str) -> str:
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def log_tail(log: Path, offset: int = 0, lines: int = 3) -> str:
    """The last lines written to `log` after byte `offset`, as one line ("" if none)."""
    try:
        with log.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(offset, size - 4096))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return " | ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:])
