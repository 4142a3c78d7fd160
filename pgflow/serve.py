"""``pgflow serve``: one process that plays any of the scheduler, worker, reaper
and web roles, coordinating with other replicas only through PostgreSQL.

Shutdown (SIGTERM or SIGINT): the replica stops scheduling and claiming, lets
running attempts finish for ``grace`` seconds, then interrupts the rest and puts
their runs straight back in the queue (outcome ``interrupted``, no attempt used
up), so a rolling deploy never waits for a lease to expire. A second signal
skips the grace.

Secrets: once its settings are loaded, the replica takes pgflow's and libpq's
variables out of its own environment (``pgflow.environment``): the database URL
keeps what libpq would have read from them, the web role gets the session key
passed in, and Python jobs, which run in this process, no longer find them in
``os.environ``. Commands run under the replica's supervisor process
(``pgflow.supervisor``), started at the first command and let go at the end of the
shutdown, which kills whatever command still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pgflow import environment, health, reaper, supervisor
from pgflow.alerts import outbox as alert_outbox
from pgflow.alerts import secrets as alert_secrets
from pgflow.config import DEFAULT_RETENTION_S, Settings
from pgflow.errors import PgflowError
from pgflow.log import get_logger
from pgflow.replica import Replica, run_heartbeat
from pgflow.worker import Worker

# Container allocations (net of frees) between two collections of the young generation,
# against CPython's 700: a run allocates a few dozen (its claim row, task, logger,
# result), and each collection walked the hundreds of attempts in flight, about 5 % of a
# replica's CPU in a burst of no-op runs (py-spy, issue 16).
YOUNG_COLLECTION_ALLOCATIONS = 50_000


@dataclass(frozen=True)
class ServeOptions:
    url: str
    roles: tuple[str, ...]
    concurrency: int
    grace: float
    lease_ttl: float
    bind: str
    settings: Settings
    retention: float = DEFAULT_RETENTION_S  # finished runs are pruned by the leader after this
    web_required: bool = True  # False when web is only one of the default roles
    health_bind: str | None = None  # /healthz and /readyz without the web role (pgflow.health)
    # PGFLOW_SECRET_KEY as it was before the environment was scrubbed (see serve)
    secret_env: Mapping[str, str] = field(default_factory=dict)
    # PGFLOW_POOLER_URL: a transaction-mode PgBouncer for the transactional paths; the
    # leader's lock session and LISTEN stay on ``url`` (pgflow/pooler.py)
    pooler_url: str | None = None

    @property
    def pooled_url(self) -> str:
        """Where transactional work goes: the pooler when there is one."""
        return self.pooler_url or self.url

    @property
    def pooled(self) -> bool:
        return self.pooler_url is not None


def serve(options: ServeOptions) -> None:
    """Run the replica until SIGTERM/SIGINT; raise PgflowError if a required role failed."""
    # Entrypoints name modules relative to where the replica runs, as with `pgflow apply`.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    options = hide_secrets(options)
    freeze_startup_heap()
    # The standard loop, not uvloop: when the server ends a session, libpq closes the
    # socket that psycopg still watches, and libuv then aborts the whole process (an
    # assertion in uv__io_poll) -- the chaos soak's pg_terminate_backend found it.
    failure = asyncio.run(_serve(options))
    if any(t.name.startswith("pgflow-job") and t.is_alive() for t in threading.enumerate()):
        # A sync job that ignores ctx.cancelled would hold the exit (the interpreter joins
        # pool threads at exit); its run is already back in the queue, so leave now.
        if failure:
            print(f"error: {failure}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if failure else 0)
    if failure:
        raise PgflowError(failure)


def freeze_startup_heap() -> None:
    """Hand what startup made (modules, settings, pydantic schemas: some 70,000 objects)
    to the collector's permanent generation. A replica allocates a few containers per run;
    every full collection traversed all of them, about 40 ms on a small machine, a stall
    of the event loop in the middle of a burst of runs (two per 10,000 runs). What runs,
    jobs and connections create afterwards is collected as usual, the young generation
    less often (``YOUNG_COLLECTION_ALLOCATIONS``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS)


def hide_secrets(options: ServeOptions) -> ServeOptions:
    """Take pgflow's and libpq's variables out of ``os.environ`` (jobs must not see
    them); the options returned carry what the replica still needs of them."""
    url = environment.pin_libpq(options.url, os.environ)
    pooler = options.pooler_url and environment.pin_libpq(options.pooler_url, os.environ)
    key = {k: os.environ[k] for k in ("PGFLOW_SECRET_KEY",) if k in os.environ}
    # url_env/secret_env of [alerts]: for the senders only
    alert_secrets.capture(os.environ, pooler or url, pooled=bool(pooler))
    environment.scrub(os.environ)
    return replace(options, url=url, pooler_url=pooler or None,
                   secret_env={**key, **options.secret_env})


async def _serve(options: ServeOptions) -> str | None:
    replica = Replica.new(options.roles, options.concurrency if "worker" in options.roles else 0)
    log = get_logger(replica=replica.id)
    shutdown = asyncio.Event()
    failed: list[str] = []  # why a required role stopped the replica
    worker: Worker | None = None

    stop = asyncio.Event()  # the replica's heartbeat and the reaper: until the very end
    stop_scheduling = asyncio.Event()  # at once on shutdown, so a standby takes over
    stopping = asyncio.Event()  # shown in pgflow status while draining
    tasks = [_supervised("heartbeat", lambda: run_heartbeat(
        options.pooled_url, replica, options.lease_ttl, stop, stopping, log,
        pooled=options.pooled), stop, log)]
    if "scheduler" in options.roles:
        # imported for this role only: a worker replica started under load spends its
        # first half second importing, and each import competes with the replicas at work
        from pgflow.leader import run_scheduler

        tasks.append(_supervised("scheduler", lambda: run_scheduler(
            options.url, replica.id, options.lease_ttl, stop_scheduling, log,
            retention_s=options.retention, public_url=options.settings.ui_url),
            stop_scheduling, log))
    tasks.append(_supervised("alerts", lambda: alert_outbox.run_sender(  # every replica
        options.pooled_url, public_url=options.settings.ui_url, lease_ttl=options.lease_ttl,
        stop=stop, log=log, pooled=options.pooled), stop, log))
    if "reaper" in options.roles:
        tasks.append(_supervised("reaper", lambda: reaper.run_reaper(
            options.pooled_url, options.lease_ttl, stop, log, pooled=options.pooled),
            stop, log))
    if "web" in options.roles:
        # Imported only here: the web stack is a third of a replica's start-up imports
        # (0.3 s of CPU), which worker-only replicas skip (issue 16).
        from pgflow.web import run_web
        from pgflow.web.auth import load_secret

        web = _supervised("web", lambda: run_web(
            options.pooled_url, options.settings, options.bind, stop, log,
            secret=load_secret(options.settings.home, options.secret_env),
            pooled=options.pooled), stop, log)
        web.add_done_callback(
            lambda task: _web_ended(task, shutdown if options.web_required else None, failed,
                                    log))
        tasks.append(web)
    if "worker" in options.roles:
        worker = Worker(options.url, replica.id, options.concurrency, options.lease_ttl, log,
                        pooler_url=options.pooler_url, log_limit=options.settings.log_limit)
        worker.start()
    if options.health_bind:
        tasks.append(health.start(options, tasks, worker, stopping, stop, log))
    _on_signals(shutdown, worker, log)
    log.info("replica started", roles=list(options.roles), concurrency=replica.concurrency,
             pid=replica.pid)

    await shutdown.wait()
    log.info("shutting down", grace_s=options.grace)
    stopping.set()
    stop_scheduling.set()
    if worker is not None:
        await worker.drain(options.grace)
    supervisor.close_for_loop()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    log.info("replica stopped")
    return failed[0] if failed else None


def _web_ended(task: asyncio.Task[None], shutdown: asyncio.Event | None, failed: list[str],
               log: Any) -> None:
    """The web role could not start (port taken, public bind refused). Asked for by name
    (--role web), the replica stops; as one of the default roles (several replicas on one
    host share the port), the replica goes on without it."""
    if task.cancelled() or task.exception() is None:
        return
    if shutdown is not None:
        log.error("web role failed; stopping the replica", error=str(task.exception()))
        failed.append(str(task.exception()))
        shutdown.set()
    else:
        log.warning("web role not started; the other roles go on", error=str(task.exception()))


def _supervised(name: str, role: Callable[[], Awaitable[None]], stop: asyncio.Event,
                log: Any) -> asyncio.Task[None]:
    """Run a role until ``stop``; roles handle database errors themselves, and anything else
    (a bug) is logged and the role restarted rather than left dead in a live process."""

    async def run() -> None:
        while not stop.is_set():
            try:
                await role()
                return
            except (asyncio.CancelledError, PgflowError):
                raise  # a PgflowError is a setup problem (port taken...): restarting won't help
            except Exception:
                log.exception("role failed; restarting it", role=name)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

    return asyncio.create_task(run(), name=name)


def _on_signals(shutdown: asyncio.Event, worker: Worker | None, log: Any) -> None:
    loop = asyncio.get_running_loop()

    first: list[float] = []

    def handle(sig: signal.Signals) -> None:
        # A signal sent to the process and to its group (timeout, some supervisors) arrives
        # twice at once; only a deliberate second signal cuts the grace short.
        now = loop.time()
        if first and now - first[0] > 1.0 and worker is not None:
            log.warning("second signal: interrupting running attempts now", signal=sig.name)
            worker.hurry()
        first[:] = first or [now]
        shutdown.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle, sig)
