"""The exclusive file lock that serialises pgflow processes working on the same files.

:func:`flock` holds an flock on a lock file, polling until a timeout so that a stuck peer
becomes a readable error instead of a hang. Starting or stopping a cluster and creating the
service OS user take it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from pgflow.errors import DatabaseUnavailable

LOCK_TIMEOUT_SECONDS = 300.0


@contextlib.contextmanager
def flock(path: Path, purpose: str) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing), polling up to a timeout."""
    # os.open fds are not inherited, so a detached server never keeps holding the lock.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DatabaseUnavailable(
                        f"timed out waiting for {path} (another pgflow is {purpose})"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)
