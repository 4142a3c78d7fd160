"""Python jobs of tests/test_long_runs.py: progress and checkpoints (pgflow.live)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pgflow import Context


def report_progress(ctx: Context) -> None:
    """Reports progress 10,000 times, then a last value, then waits for ``go``."""
    for i in range(10_000):
        ctx.progress(i / 20_000)
    ctx.progress(0.5, "half way")
    go = Path(ctx.params["go"])
    while not go.exists() and not ctx.cancelled.is_set():
        time.sleep(0.05)


def resumable(ctx: Context) -> None:
    """Batches 1..6; each one is checkpointed. Attempt 1 stops after batch 3 until the
    test kills its replica; a later attempt records where it resumed."""
    out = Path(ctx.params["dir"])
    start = (ctx.last_checkpoint or {"batch": 0})["batch"]
    (out / f"attempt-{ctx.attempt}.json").write_text(json.dumps(
        {"resumed_from": ctx.last_checkpoint}))
    for batch in range(start + 1, 7):
        ctx.checkpoint({"batch": batch})
        if ctx.attempt == 1 and batch == 3:
            while not ctx.cancelled.is_set():
                time.sleep(0.05)
            return


def bad_checkpoints(ctx: Context) -> dict[str, Any]:
    """Tries checkpoints that must be refused; records the errors."""
    errors = {}
    for name, value in (("big", "x" * (1024 * 1024 + 1)), ("set", {1, 2}),
                        ("nan", float("nan")), ("nul", "a\x00b")):
        try:
            ctx.checkpoint(value)
        except ValueError as exc:
            errors[name] = str(exc)
    for name, fraction in (("progress_high", 1.5), ("progress_text", "half")):
        try:
            ctx.progress(fraction)  # type: ignore[arg-type]
        except ValueError as exc:
            errors[name] = str(exc)
    ctx.checkpoint({"ok": True})
    Path(ctx.params["out"]).write_text(json.dumps(errors))
    return errors
