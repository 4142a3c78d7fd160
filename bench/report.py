"""Ratios against the anchors, the issues' targets, and the human summary."""

from __future__ import annotations

from typing import Any

from bench.stats import ratio


def _get(doc: dict[str, Any], *path: str) -> Any:
    node: Any = doc
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _jobs_per_s(entry: Any) -> float | None:
    return entry.get("jobs_per_s") if isinstance(entry, dict) else None


def compare(doc: dict[str, Any]) -> dict[str, Any]:
    """pgflow vs the anchors measured in the same run."""
    a = doc.get("anchors") or {}
    tp = _get(doc, "figures", "throughput") or {}
    best = _jobs_per_s(tp.get("best"))
    by_replicas = tp.get("best_by_replicas") or {}
    pgq_best = _jobs_per_s(a.get("pgqueuer_best"))
    sql_best = _jobs_per_s(a.get("sqlref_batched_best"))
    lat = _get(doc, "figures", "latency", "ms") or {}
    pgq_lat = (a.get("latency") or {}).get("pgqueuer") or {}
    return {
        "throughput": {
            "pgflow_best_jobs_per_s": best,
            "pgqueuer_best_jobs_per_s": pgq_best,
            "sqlref_batched_best_jobs_per_s": sql_best,
            "procrastinate_best_jobs_per_s": _jobs_per_s(a.get("procrastinate_best")),
            "vs_pgqueuer_best": ratio(best, pgq_best),
            "vs_sqlref_batched_best": ratio(best, sql_best),
            "by_process_count": {
                k: {"pgflow": by_replicas.get(k),
                    "pgqueuer": _jobs_per_s((a.get("pgqueuer_best_by_procs") or {}).get(k)),
                    "ratio": ratio(by_replicas.get(k), _jobs_per_s(
                        (a.get("pgqueuer_best_by_procs") or {}).get(k)))}
                for k in ("1", "2")},
        },
        "seeds": {
            "pgflow_best_runs_per_s": _get(doc, "figures", "seeds", "best", "runs_per_s"),
            "pgqueuer_best_jobs_per_s": pgq_best,
            "vs_pgqueuer_best": ratio(_get(doc, "figures", "seeds", "best", "runs_per_s"),
                                      pgq_best),
            "by_config_vs_pgqueuer_best": {
                f"r{r['replicas']}-c{r['concurrency']}": ratio(r.get("runs_per_s"), pgq_best)
                for r in _get(doc, "figures", "seeds", "runs") or [] if r.get("ok")},
        },
        "latency": {
            "pgflow_p50_ms": lat.get("p50"), "pgflow_p99_ms": lat.get("p99"),
            "pgqueuer_p50_ms": pgq_lat.get("p50_ms"), "pgqueuer_p99_ms": pgq_lat.get("p99_ms"),
            "p50_vs_pgqueuer": ratio(lat.get("p50"), pgq_lat.get("p50_ms")),
        },
    }


def _target(figure: str, metric: str, value: Any, target: str, met: Any) -> dict[str, Any]:
    return {"figure": figure, "metric": metric, "value": value, "target": target,
            "met": None if value is None else bool(met)}


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The issues' Speed targets with the measured values (met: null = not measured)."""
    f = doc.get("figures", {})
    c = doc.get("comparison", {})
    vs_pgq = _get(c, "throughput", "vs_pgqueuer_best")
    vs_sql = _get(c, "throughput", "vs_sqlref_batched_best")
    reg = _get(f, "registration", "apply_wall_s")
    p50 = _get(f, "latency", "ms", "p50")
    p99 = _get(f, "latency", "ms", "p99")
    fan = _get(f, "fanout", "all_runs_visible_after_tick_s")
    hop50 = _get(f, "deps", "chain", "hop_ms", "p50")
    hop99 = _get(f, "deps", "chain", "hop_ms", "p99")
    quiet99 = _get(f, "backfill", "without_backfill_ms", "p99")
    drain99 = _get(f, "backfill", "while_backfill_drains_ms", "p99")
    cmd_ratio = _get(f, "commands", "ratio_to_floor")
    cmd_cli = _get(f, "commands", "cli_under_load", "wall_s_max")
    ds_drain = _get(f, "datasets", "burst_live", "last_emit_to_all_consumed_and_finished_s")
    return [
        _target("registration", "apply 10,000 jobs (s)", reg, "< 5", reg is not None
                and reg < 5),
        _target("throughput", "best / pgqueuer best", vs_pgq, ">= 1.5", (vs_pgq or 0) >= 1.5),
        _target("throughput", "best / bare SQL batched", vs_sql, ">= 0.5", (vs_sql or 0) >= 0.5),
        _target("latency", "p50 ms", p50, "<= 3", (p50 or 1e9) <= 3),
        _target("latency", "p99 ms", p99, "<= 5", (p99 or 1e9) <= 5),
        _target("fanout", "all runs exist after tick (s)", fan, "<= 1", (fan or 1e9) <= 1),
        _target("claim", f"min time ratio with {_get(f, 'claim', 'finished_rows') or 0:,} finished",
                _get(f, "claim", "time_ratio"),
                "min time < 2x, claimable scan flat", _get(f, "claim", "flat")),
        _target("deps", "chain hop p50 ms", hop50, "<= 20", (hop50 or 1e9) <= 20),
        _target("deps", "chain hop p99 ms", hop99, "<= 100", (hop99 or 1e9) <= 100),
        _target("deps", "fan-in evaluations / upstream",
                _get(f, "deps", "fan_out_fan_in", "fan_in_evaluations_per_upstream"), "<= 1",
                _get(f, "deps", "fan_out_fan_in", "bounded")),
        _target("backfill", "prod delay p99 while draining (ms)", drain99,
                "<= 2x no-backfill p99 + 10", drain99 is not None and quiet99 is not None
                and drain99 <= 2 * quiet99 + 10),
        _target("backfill", "backfill overlap <= cap",
                _get(f, "backfill", "backfill_max_overlap"), "<= cap",
                _get(f, "backfill", "cap_respected")),
        _target("commands", "one-tick command runs/s / spawn floor", cmd_ratio, ">= 0.5",
                (cmd_ratio or 0) >= 0.5),
        _target("commands", "jobs list wall s under command load", cmd_cli, "< 1",
                cmd_cli is not None and cmd_cli < 1),
        _target("seeds", "fan-out runs/s / pgqueuer best", _get(c, "seeds", "vs_pgqueuer_best"),
                ">= 1.5", (_get(c, "seeds", "vs_pgqueuer_best") or 0) >= 1.5),
        _target("seeds", "all runs exist after tick, worst config (s)",
                _get(f, "seeds", "worst_visible_after_tick_s"), "<= 1",
                (_get(f, "seeds", "worst_visible_after_tick_s") or 1e9) <= 1),
        *[_target("cli", f"{name} wall s median (idle)", _get(f, "cli", key, "median_s"),
                  "< 0.25", (_get(f, "cli", key, "median_s") or 1e9) < 0.25)
          for name, key in (("pgflow --help", "help"), ("pgflow jobs list", "jobs_list"))],
        _target("datasets", "10,000-event burst: last emit -> all consumed (s)", ds_drain,
                "< 10 s, each event once", ds_drain is not None and ds_drain < 10
                and bool(_get(f, "datasets", "exactly_once"))),
    ]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return "n/a" if value is None else str(value)


def _ms(stats: Any) -> str:
    stats = stats or {}
    return f"p50 {_fmt(stats.get('p50'))} / p99 {_fmt(stats.get('p99'))} ms"


def _memory_line(m: dict[str, Any]) -> str:
    return ", ".join(f"{kind} peak {_fmt(m[kind].get('peak_rss_mib'))} MiB (idle "
                     f"{_fmt(m[kind].get('idle_rss_mib'))})" for kind in ("async", "sync")
                     if isinstance(m.get(kind), dict) and m[kind].get("ok"))


def _claim_line(c: dict[str, Any]) -> str:
    empty: dict[str, Any] = c.get("with_0_finished") or {}
    full: dict[str, Any] = c.get(f"with_{c.get('finished_rows')}_finished") or {}
    return (f"min {_fmt(empty.get('total_ms_min'))} ms -> {_fmt(full.get('total_ms_min'))} ms"
            f" with {c.get('finished_rows'):,} finished (median "
            f"{_fmt(empty.get('total_ms_median'))} -> {_fmt(full.get('total_ms_median'))});"
            " claimable-index blocks "
            f"{empty.get('claimable_scan_blocks')} -> {full.get('claimable_scan_blocks')}, all "
            f"{empty.get('shared_hit_blocks')} -> {full.get('shared_hit_blocks')}")


def _datasets_line(r: dict[str, Any]) -> str:
    live, paused = r.get("burst_live") or {}, r.get("burst_paused") or {}
    return (f"event->run start {_ms(_get(r, 'latency', 'ms'))}; 10,000-event burst:"
            f" {live.get('runs')} runs, all consumed"
            f" {_fmt(live.get('last_emit_to_all_consumed_and_finished_s'))} s after the last"
            f" emit; paused burst -> {paused.get('runs')} run in"
            f" {_fmt(paused.get('resume_to_run_finished_s'))} s; exactly once:"
            f" {r.get('exactly_once')}")


def _web_line(r: dict[str, Any]) -> str:
    result = r.get("result")
    if not isinstance(result, dict):
        return str(result)[:200]
    parts = [f"{k} p50 {_fmt(v.get('p50_ms'))} ms" for k, v in result.items()
             if isinstance(v, dict) and "p50_ms" in v]
    return ", ".join(parts) or str(result)[:200]


FIGURE_LINES: dict[str, Any] = {
    "registration": lambda r: f"{r['jobs']:,} jobs in {_fmt(r['apply_wall_s'])} s "
                              f"(unchanged re-apply {_fmt(r['reapply_unchanged_wall_s'])} s)",
    "latency": lambda r: f"enqueue->start {_ms(r['ms'])}; trigger call {_ms(r['trigger_call_ms'])}",
    "fanout": lambda r: f"{r['jobs']:,} runs visible {_fmt(r['all_runs_visible_after_tick_s'])} s "
                        f"after the tick, all finished {_fmt(r['last_finished_s'])} s",
    "memory": _memory_line,
    "claim": _claim_line,
    "deps": lambda r: f"chain hop {_ms(_get(r, 'chain', 'hop_ms'))}; fan-out/in "
                      f"{_get(r, 'fan_out_fan_in', 'width')} wide in "
                      f"{_fmt(_get(r, 'fan_out_fan_in', 'total_s'))} s, fan-in evaluated "
                      f"{_get(r, 'fan_out_fan_in', 'fan_in_evaluations')} times",
    "backfill": lambda r: f"prod delay {_ms(r.get('without_backfill_ms'))} without, "
                          f"{_ms(r.get('while_backfill_drains_ms'))} while draining "
                          f"(drain {_fmt(r.get('backfill_drain_per_s'))} runs/s, overlap "
                          f"{r.get('backfill_max_overlap')} <= cap {r.get('cap')})",
    "web": lambda r: _web_line(r) if r.get("available") else r.get("note", "not available"),
    "seeds": lambda r: "; ".join(
        f"r{x['replicas']} c{x['concurrency']}: {_fmt(x['runs_per_s'])} runs/s, all created "
        f"{_fmt(x['all_runs_visible_after_tick_s'])} s, {_fmt(x['replica_cpu_ms_per_run'])}+"
        f"{_fmt(x['pg_cpu_ms_per_run'])} CPU ms/run" if x.get("ok") else f"FAILED {x.get('error')}"
        for x in r.get("runs", [])),
    "cli": lambda r: f"pgflow --help {_fmt(_get(r, 'help', 'median_s'))} s, jobs list "
                     f"{_fmt(_get(r, 'jobs_list', 'median_s'))} s (median; python -c pass "
                     f"{_fmt(_get(r, 'python_startup', 'median_s'))} s, CPUs "
                     f"{_fmt(100 * (r.get('cpu_idle_before') or 0))} % idle before, load "
                     f"{' '.join(r.get('loadavg_before') or [])})",
    "commands": lambda r: f"{_fmt(_get(r, 'one_tick', 'runs_per_s'))} runs/s in one tick vs "
                          f"spawn floor {_fmt(r.get('spawn_floor_per_s'))}/s (ratio "
                          f"{_fmt(r.get('ratio_to_floor'))}), "
                          f"{_fmt(_get(r, 'one_tick', 'cpu_ms_per_attempt'))} CPU ms/attempt; "
                          f"jobs list {_fmt(_get(r, 'cli_under_load', 'wall_s_max'))} s max "
                          "under load",
    "datasets": lambda r: _datasets_line(r),
}


def summary_lines(doc: dict[str, Any]) -> list[str]:
    f = doc.get("figures", {})
    c = doc.get("comparison", {})
    lines = [f"== pgflow bench ({doc.get('mode')}) -> {doc.get('results_file')}"]
    a = doc.get("anchors")
    if a is not None:
        lines.append("anchors: " + ("; ".join(
            f"{k} {_fmt(_jobs_per_s(a.get(k)))} jobs/s"
            for k in ("pgqueuer_best", "sqlref_batched_best", "procrastinate_best"))
            if a.get("available") else f"not available ({a.get('reason') or a.get('error')})"))
    for run in _get(f, "throughput", "runs") or []:
        lines.append(f"throughput r={run.get('replicas')} c={run.get('concurrency')}: "
                     + (f"{_fmt(run['jobs_per_s'])} jobs/s, worker "
                        f"{_fmt(run['worker_cpu_ms_per_job'])} ms/job, PG "
                        f"{_fmt(run['pg_cpu_ms_per_job'])} ms/job" if run.get("ok")
                        else f"FAILED {run.get('error')}"))
    tp = c.get("throughput", {})
    lines.append(f"throughput ratio: {_fmt(tp.get('vs_pgqueuer_best'))}x pgqueuer best, "
                 f"{_fmt(tp.get('vs_sqlref_batched_best'))}x bare SQL batched")
    for name, figure in f.items():
        if not figure.get("ok"):
            lines.append(f"{name}: FAILED {figure.get('error')}")
        elif name in FIGURE_LINES:
            lines.append(f"{name}: {FIGURE_LINES[name](figure)}")
    lines.append("targets:")
    for t in doc.get("targets", []):
        mark = {True: "ok  ", False: "MISS", None: "--  "}[t["met"]]
        lines.append(f"  {mark} {t['figure']}: {t['metric']} = {_fmt(t['value'])}"
                     f" (target {t['target']})")
    return lines
