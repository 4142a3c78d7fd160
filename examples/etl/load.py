"""Load: upsert agg_<batch>.csv into the sales_by_region table of warehouse.db (SQLite)."""

from __future__ import annotations

import csv
import os
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import batch_name, data_dir

EX_TEMPFAIL = 75  # tells pgflow the warehouse is unavailable (circuit breaker)


def main() -> None:
    logical_time = os.environ["PGFLOW_LOGICAL_TIME"]
    with (data_dir() / f"agg_{batch_name(logical_time)}.csv").open(newline="") as agg:
        rows = [(logical_time, r["region"], int(r["orders"]), int(r["revenue_cents"]))
                for r in csv.DictReader(agg)]
    try:
        db = sqlite3.connect(data_dir() / "warehouse.db", timeout=10)
    except sqlite3.OperationalError as exc:
        print(f"warehouse unavailable: {exc}", file=sys.stderr)
        sys.exit(EX_TEMPFAIL)
    with db:
        db.execute("CREATE TABLE IF NOT EXISTS sales_by_region (logical_time TEXT, region TEXT,"
                   " orders INTEGER, revenue_cents INTEGER, PRIMARY KEY (logical_time, region))")
        db.executemany("INSERT OR REPLACE INTO sales_by_region VALUES (?, ?, ?, ?)", rows)
    print(f"loaded {len(rows)} rows for {logical_time}")


if __name__ == "__main__":
    main()
