"""The chaos soak (tests/chaos.py), short: ``make soak`` runs it for minutes.

PGFLOW_SOAK_SECONDS sets how long the chaos lasts (default 40 s here) and
PGFLOW_SOAK_SEED the random seed (default: a new one, printed on failure).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from chaos import Soak

from pgflow import migrate
from pgflow.embedded import Cluster


@pytest.fixture
def soak(private_cluster: Cluster, tmp_path: Path) -> Iterator[Soak]:
    url = private_cluster.ensure_running()
    with psycopg.connect(url, autocommit=True) as conn:
        migrate.migrate(conn)
    seed = int(os.environ.get("PGFLOW_SOAK_SEED") or random.randrange(1 << 30))
    print(f"chaos soak seed: {seed} (PGFLOW_SOAK_SEED={seed} replays the same actions)")
    running = Soak(private_cluster, url, tmp_path, seed)
    try:
        yield running
    finally:
        running.close()


@pytest.mark.timeout(1800)
def test_chaos_soak_loses_nothing_and_runs_nothing_twice(soak: Soak) -> None:
    soak.start()
    soak.run(float(os.environ.get("PGFLOW_SOAK_SECONDS", "40")))
    report = soak.check()
    print("chaos soak:", report, "\n".join(soak.events))
    assert report["root_runs"] > 0 and report["executed"] > 0
    assert "database restart (immediate)" in soak.events
