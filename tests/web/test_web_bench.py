"""The web bench (make bench) runs end to end; here on a small database."""

from __future__ import annotations

from pgflow.web.bench import bench_web


def test_bench_measures_every_page(db_url: str) -> None:
    figures = bench_web(db_url, requests=3, jobs=50, runs_per_job=4)
    assert figures["jobs"] == 50
    for page in ("dashboard", "dashboard_cache_expired", "jobs_list", "job_detail",
                 "root_job_detail", "dag_run", "api_runs_page"):
        assert figures[page]["n"] >= 1
        assert 0 < figures[page]["p95_ms"] < 5000
