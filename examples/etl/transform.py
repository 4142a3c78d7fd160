"""Transform: aggregate raw_<batch>.csv into totals per region in agg_<batch>.csv."""

from __future__ import annotations

import csv
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import batch_name, data_dir


def main() -> None:
    batch = batch_name(os.environ["PGFLOW_LOGICAL_TIME"])
    totals: Counter[str] = Counter()
    orders: Counter[str] = Counter()
    with (data_dir() / f"raw_{batch}.csv").open(newline="") as raw:
        for row in csv.DictReader(raw):
            totals[row["region"]] += int(row["amount_cents"])
            orders[row["region"]] += 1
    with (data_dir() / f"agg_{batch}.csv").open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["region", "orders", "revenue_cents"])
        for region in sorted(totals):
            writer.writerow([region, orders[region], totals[region]])
    print(f"aggregated {sum(orders.values())} orders into {len(totals)} regions")


if __name__ == "__main__":
    main()
