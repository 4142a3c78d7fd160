"""``make bench``: pgflow's performance figures, measured side by side with the anchors.

``python -m bench.run`` starts (or reuses) one stock PostgreSQL cluster, runs the
anchor harness (procrastinate, pgqueuer, a bare SQL queue) on it, measures pgflow
on the same cluster, and prints one JSON document (also written to
``bench/results/run-<timestamp>.json``, replica logs under ``bench/results/logs/``)
with a short summary on stderr. ``--quick`` is a ~2-minute subset, ``--only``
picks figures, ``--skip-anchors`` skips the anchors.

Environment: ``BENCH_PG_URL`` (use a running server), ``BENCH_PGROOT`` /
``BENCH_PGPORT`` (the private cluster otherwise started), ``PGFLOW_ANCHORS_DIR``
(the anchor harness, default ``/work/shared/bench``), ``PGFLOW_ANCHORS_PYTHON``.

Modules: ``cluster`` (the server), ``procs`` (replica processes, /proc), ``context``
(fresh database, workload helpers), one module per figure (``registration``,
``throughput``, ``latency``, ``fanout``, ``memory``, ``claim``, ``deps``,
``backfill``, ``web``, ``commands``, ``history``, ``policies``, ``seeds``: the fan-out of
one 10,000-job tick on full replicas, ``cli``: command start-up), ``anchors`` and ``report``
(ratios, targets, summary).
"""
