"""The scheduler's lock connection gives up on a silent database (the watchdog of
``pgflow.leader``): a frozen primary or a partition that drops packets raises no socket
error, since a kernel still acknowledges TCP, so only the client can notice."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import Conn, Replicas, wait_for_leader
from test_partition import Relay


@pytest.fixture
def relay(db_url: str) -> Iterator[Relay]:
    handle = Relay(db_url)
    yield handle
    handle.close()


@pytest.fixture
def cut_off(relay: Relay, tmp_path: Path) -> Iterator[Replicas]:
    started = Replicas(relay.url, tmp_path)
    yield started
    started.close()


def test_a_leader_whose_database_goes_silent_closes_its_lock_connection(
        conn: Conn, relay: Relay, cut_off: Replicas) -> None:
    leader = cut_off.start("a", roles=("scheduler",), lease_ttl=4)
    wait_for_leader(conn, leader, timeout=60)
    since = leader.log_size()
    relay.silence()  # every statement from now on waits for an answer that never comes
    failed = leader.wait_log("scheduler connection failed", since=since, timeout=60)
    assert "no answer from the database for 5s" in failed["error"], failed
    leader.wait_log("scheduler leadership ended", since=since)
