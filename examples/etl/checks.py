"""Check (a Python entrypoint job): the load wrote one row per region for this logical time."""

from __future__ import annotations

import sqlite3
from typing import Any

from examples.etl.common import data_dir


def row_count_check(ctx: Any) -> None:
    with sqlite3.connect(data_dir() / "warehouse.db") as db:
        (count,) = db.execute("SELECT count(*) FROM sales_by_region WHERE logical_time = ?",
                              (ctx.logical_time.isoformat(),)).fetchone()
    ctx.logger.info("row count checked", rows=count)
    if count == 0:
        raise RuntimeError(f"no rows loaded for {ctx.logical_time.isoformat()}")
