"""Extract: write the orders of one logical time to raw_<batch>.csv (generated, deterministic)."""

from __future__ import annotations

import csv
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import batch_name, data_dir

REGIONS = ["eu", "us", "apac"]


def main() -> None:
    logical_time = os.environ["PGFLOW_LOGICAL_TIME"]
    count = int(json.loads(os.environ.get("PGFLOW_PARAMS", "{}")).get("orders", 100))
    rng = random.Random(logical_time)
    target = data_dir() / f"raw_{batch_name(logical_time)}.csv"
    with target.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["order_id", "region", "amount_cents"])
        for order_id in range(count):
            writer.writerow([order_id, rng.choice(REGIONS), rng.randint(100, 50_000)])
    print(f"extracted {count} orders to {target}")


if __name__ == "__main__":
    main()
