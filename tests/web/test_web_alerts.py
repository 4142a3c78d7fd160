"""deploy/prometheus/alerts.yml: valid for promtool, unit-tested, and naming only metrics
that pgflow exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
from engine import add_job
from test_web_metrics import metrics_for, scrape
from webhelpers import Conn, finished_run

from pgflow import breakers

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install -y prometheus)")


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run([str(PROMTOOL), "check", "rules", str(RULES)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 13 rules found" in result.stdout


@needs_promtool
def test_the_alerts_fire_when_they_should() -> None:
    result = subprocess.run([str(PROMTOOL), "test", "rules", "alerts_test.yml"],
                            capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_use_only_exported_metrics(conn: Conn) -> None:
    metrics = metrics_for(conn)
    scrape(metrics)
    add_job(conn, "a", entrypoint="jobfuncs:noop")
    finished_run(conn, "a", datetime(2026, 1, 1, tzinfo=UTC), "failed", seconds=0.0)
    breakers.open_breaker(conn, "warehouse", None, "test")
    exported = {name for name, _ in scrape(metrics)}
    used = set(re.findall(r"\b(pgflow_[a-z_]+)\b", RULES.read_text()))
    assert used <= exported, used - exported
