"""Report: triggered by the daily_sales dataset (SPEC §4b), not by a schedule.

One run consumes every daily_sales event recorded since the previous report (a load
that finished while a report was running waits for the next one), so it summarises
each loaded logical time exactly once.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import data_dir


def main() -> None:
    events = json.loads(os.environ.get("PGFLOW_TRIGGER_EVENTS", "[]"))
    loaded = sorted({e["payload"].get("logical_time", "?") for e in events})
    db = sqlite3.connect(data_dir() / "warehouse.db", timeout=10)
    with db:
        total = db.execute("SELECT coalesce(sum(revenue_cents), 0) FROM sales_by_region"
                           " WHERE logical_time IN (SELECT value FROM json_each(?))",
                           (json.dumps(loaded),)).fetchone()[0]
    print(f"report over {len(events)} load(s) {', '.join(loaded)}: revenue {total / 100:.2f}")


if __name__ == "__main__":
    main()
