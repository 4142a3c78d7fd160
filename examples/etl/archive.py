"""Archive: copy raw_<batch>.csv into the orders table of warehouse.db in batches, and
resume at the last committed batch after a crash (pgflow checkpoints, SPEC §4e).

The pattern: each batch is idempotent (INSERT OR REPLACE on the order's key) and is
committed before its checkpoint is reported, so an attempt that dies between the two
only redoes that one batch, and one that dies at hour 4 of 5 resumes at hour 4.
"""

from __future__ import annotations

import csv
import json
import os
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import batch_name, data_dir

BATCH = 100


def report(**message: object) -> None:
    """One JSON line to pgflow's control pipe (progress, checkpoint); outside pgflow
    (PGFLOW_CONTROL unset) nothing is reported."""
    path = os.environ.get("PGFLOW_CONTROL")
    if path:
        with open(path, "w") as control:
            control.write(json.dumps(message) + "\n")


def main() -> None:
    logical_time = os.environ["PGFLOW_LOGICAL_TIME"]
    with (data_dir() / f"raw_{batch_name(logical_time)}.csv").open(newline="") as raw:
        rows = [(logical_time, int(r["order_id"]), r["region"], int(r["amount_cents"]))
                for r in csv.DictReader(raw)]
    done = json.loads(os.environ.get("PGFLOW_CHECKPOINT", "null")) or {"batches": 0}
    batches = [rows[i : i + BATCH] for i in range(0, len(rows), BATCH)]
    if done["batches"]:
        print(f"resuming after batch {done['batches']} of {len(batches)}")
    db = sqlite3.connect(data_dir() / "warehouse.db", timeout=10)
    db.execute("CREATE TABLE IF NOT EXISTS orders (logical_time TEXT, order_id INTEGER,"
               " region TEXT, amount_cents INTEGER, PRIMARY KEY (logical_time, order_id))")
    for number, batch in enumerate(batches, start=1):
        if number <= done["batches"]:
            continue
        with db:  # one transaction per batch: committed, then checkpointed
            db.executemany("INSERT OR REPLACE INTO orders VALUES (?, ?, ?, ?)", batch)
        report(checkpoint={"batches": number}, progress=number / len(batches),
               message=f"archived batch {number} of {len(batches)}")
    print(f"archived {len(rows)} orders for {logical_time}")


if __name__ == "__main__":
    main()
