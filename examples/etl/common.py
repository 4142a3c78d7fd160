"""Paths and run context shared by the example ETL steps."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    folder = Path(os.environ.get("ETL_DATA_DIR", "/tmp/pgflow-example"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def batch_name(logical_time: str) -> str:
    """A file-name-safe key for one logical time (one DAG run)."""
    return logical_time.replace(":", "").replace("+", "Z").replace("-", "")
