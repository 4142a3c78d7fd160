"""The embedded cluster launcher, against real PostgreSQL processes (no mocks)."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest

from pgflow.embedded import FALLBACK_CLUSTERS, Cluster, embedded_cluster
from pgflow.errors import PgflowError

FAST = {"fsync": "off", "full_page_writes": "off"}
AS_ROOT = os.geteuid() == 0
MakeCluster = Callable[[Path], Cluster]


def _mkdtemp(mode: int = 0o755) -> Path:
    """A short folder under /tmp; mkdtemp makes 0700, which the server user cannot enter."""
    folder = Path(tempfile.mkdtemp(prefix="pgft-", dir="/tmp"))
    folder.chmod(mode)
    return folder


@pytest.fixture
def tmp_dir() -> Iterator[Path]:
    folder = _mkdtemp()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def make_cluster() -> Iterator[MakeCluster]:
    """Clusters of a test's own, destroyed afterwards whatever happened."""
    made: list[Cluster] = []

    def make(root: Path) -> Cluster:
        made.append(Cluster(root, settings=FAST))
        return made[-1]

    yield make
    for cluster in made:
        cluster.destroy()


@pytest.fixture(scope="module")
def shared() -> Iterator[Cluster]:
    """One cluster for the tests that do not need their own; the root is a fresh mkdtemp."""
    root = Path(tempfile.mkdtemp(prefix="pgft-shared-", dir="/tmp"))
    cluster = Cluster(root, settings=FAST)
    try:
        yield cluster
    finally:
        cluster.destroy()
        shutil.rmtree(root, ignore_errors=True)


def _scalar(url: str, query: str) -> object:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def _postmasters(data_dir: Path) -> list[int]:
    """Live postmasters working in `data_dir` (their children work there too)."""
    # One read of each process's stat: a child that exits between two reads must not
    # look like a process without a parent.
    parents: dict[int, int] = {}
    for pid in _proc_pids():
        if _cwd(pid) != str(data_dir):
            continue
        fields = _stat_fields(pid)
        if fields[0] not in ("Z", "X"):
            parents[pid] = int(fields[1])
    return sorted(pid for pid, ppid in parents.items() if ppid not in parents)


def _proc_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return ["X", "0"]


def _ids(pid: int) -> tuple[int, int]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["Uid"].split()[0]), int(fields["Gid"].split()[0])


# --------------------------------------------------------------------------- shared cluster


def test_fresh_root_gives_a_working_url(shared: Cluster) -> None:
    url = shared.ensure_running()

    assert url == shared.url
    assert url == f"postgresql://pgflow@/pgflow?host={shared.socket_dir}&port=5432"
    assert _scalar(url, "SELECT 1") == 1
    assert _scalar(url, "SELECT current_database()") == "pgflow"
    assert _scalar(url, "SHOW listen_addresses") == ""
    assert _scalar(url, "SHOW max_connections") == "300"
    assert _scalar(url, "SHOW synchronous_commit") == "on"
    assert _scalar(url, "SHOW fsync") == "off"


def test_second_ensure_running_reuses_the_server(shared: Cluster) -> None:
    shared.ensure_running()
    pid = shared.postmaster_pid()

    assert shared.ensure_running() == shared.url
    assert pid is not None
    assert shared.postmaster_pid() == pid
    # Backends orphaned by an earlier test's kill() may take a moment to exit.
    deadline = time.monotonic() + 10
    while _postmasters(shared.data_dir) != [pid] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _postmasters(shared.data_dir) == [pid]


@pytest.mark.skipif(not AS_ROOT, reason="only root switches to a service user")
def test_server_runs_as_an_unprivileged_user(shared: Cluster) -> None:
    shared.ensure_running()
    pid = shared.postmaster_pid()
    assert pid is not None

    uid, gid = _ids(pid)
    assert uid != 0
    assert gid != 0
    socket_dir = shared.socket_dir.stat()
    assert socket_dir.st_uid == uid
    assert stat.S_IMODE(socket_dir.st_mode) == 0o700
    assert shared.data_dir.stat().st_uid == uid


def test_stop_then_ensure_running_keeps_data(shared: Cluster) -> None:
    url = shared.ensure_running()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (x int)")

    assert shared.stop() is True
    assert not shared.is_running()
    assert shared.stop() is False
    assert shared.ensure_running() == url
    assert _scalar(url, "SELECT to_regclass('kept') IS NOT NULL") is True


def test_kill_then_start_recovers_committed_rows(shared: Cluster) -> None:
    url = shared.ensure_running()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE survivors (x int)")
        conn.execute("INSERT INTO survivors VALUES (1), (2)")
    old_pid = shared.postmaster_pid()

    shared.kill()

    assert not shared.is_running()
    assert _postmasters(shared.data_dir) == []
    assert (shared.data_dir / "postmaster.pid").exists()  # stale, as after a real crash
    shared.start()
    assert shared.postmaster_pid() not in (None, old_pid)
    assert _scalar(url, "SELECT count(*) FROM survivors") == 2


def test_raw_sigkill_of_the_postmaster_alone_then_ensure_running(shared: Cluster) -> None:
    url = shared.ensure_running()
    idle = psycopg.connect(url)  # a backend left orphaned by the kill
    pid = shared.postmaster_pid()
    assert pid is not None

    os.kill(pid, signal.SIGKILL)  # no waiting: it may still be dying when we restart

    assert shared.ensure_running() == url
    assert shared.postmaster_pid() not in (None, pid)
    assert _scalar(url, "SELECT 1") == 1
    idle.close()


# --------------------------------------------------------------------------- own clusters


def _ensure_in_child(root: str, barrier: Barrier, results: Queue[object]) -> None:
    barrier.wait(30)
    try:
        cluster = Cluster(Path(root), settings=FAST)
        results.put((cluster.ensure_running(), cluster.postmaster_pid()))
    except Exception as exc:
        results.put(repr(exc))


def test_concurrent_ensure_running_starts_one_server(
    tmp_dir: Path, make_cluster: MakeCluster
) -> None:
    cluster = make_cluster(tmp_dir / "pg")
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    results: Queue[object] = context.Queue()
    children = [
        context.Process(target=_ensure_in_child, args=(str(cluster.root), barrier, results))
        for _ in range(2)
    ]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(30)

    assert outcomes[0] == outcomes[1], outcomes
    assert isinstance(outcomes[0], tuple), outcomes  # not an error message
    url, pid = outcomes[0]
    assert _postmasters(cluster.data_dir) == [pid]
    assert _scalar(url, "SELECT 1") == 1


@pytest.mark.skipif(not AS_ROOT, reason="the relocation only applies to root")
def test_home_under_a_private_root_folder_uses_a_symlink() -> None:
    parent = _mkdtemp(mode=0o700)  # like /root: the service user cannot pass
    home = parent / "home"
    assert embedded_cluster(home).root == home / "pg"
    cluster = Cluster(home / "pg", settings=FAST)  # what embedded_cluster makes, but fast
    try:
        url = cluster.ensure_running()

        link = home / "pg"
        assert cluster.root == link
        assert link.is_symlink()
        real = link.resolve()
        digest = hashlib.sha256(str(parent.resolve() / "home" / "pg").encode()).hexdigest()
        assert real == FALLBACK_CLUSTERS / digest[:16]
        assert cluster.data_dir == real / "data"
        assert stat.S_IMODE(parent.stat().st_mode) == 0o700  # left alone
        assert _scalar(url, "SELECT 1") == 1
    finally:
        cluster.destroy()
        shutil.rmtree(parent, ignore_errors=True)
    assert not link.exists()
    assert not real.exists()


def test_long_root_path_uses_a_short_socket_dir(tmp_dir: Path, make_cluster: MakeCluster) -> None:
    root = tmp_dir / ("d" * 60) / ("e" * 40) / "pg"
    assert len(str(root / "sock" / ".s.PGSQL.5432")) > 107
    cluster = make_cluster(root)

    url = cluster.ensure_running()

    host = parse_qs(urlsplit(url).query)["host"][0]
    assert host.startswith("/tmp/pgflow-")
    assert Path(host) == cluster.socket_dir
    assert stat.S_IMODE(Path(host).stat().st_mode) == 0o700
    assert (root / "socket_dir").read_text().strip() == host
    assert _scalar(url, "SELECT 1") == 1
    cluster.destroy()
    assert not Path(host).exists()


# --------------------------------------------------------------------------- no server


def test_settings_may_not_disable_durability_or_move_the_socket(tmp_dir: Path) -> None:
    with pytest.raises(PgflowError, match="synchronous_commit"):
        Cluster(tmp_dir, settings={"synchronous_commit": "off"})
    with pytest.raises(PgflowError, match="listen_addresses"):
        Cluster(tmp_dir, settings={"listen_addresses": "*"})
