"""Schemathesis fuzzes the API from its own OpenAPI document against a real server:
no request it can generate may get a 5xx, and responses must match the document."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from engine import add_job
from webhelpers import Conn, ServerThread, finished_run

from pgflow import tokens

ST = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
MAX_EXAMPLES = os.environ.get("PGFLOW_FUZZ_EXAMPLES", "15")
SEED = os.environ.get("PGFLOW_FUZZ_SEED", "1")
# Semantics a JSON Schema cannot state (a valid cron string, an existing upstream, an
# open breaker to close) make some schema-valid bodies 404/409/422 by design.
EXCLUDED = "positive_data_acceptance,use_after_free,ensure_resource_availability"


@pytest.mark.timeout(900)
@pytest.mark.skipif(ST is None, reason="schemathesis is not installed (pip install schemathesis)")
def test_no_generated_request_gets_a_server_error(server: ServerThread, conn: Conn,
                                                  tmp_path: Path) -> None:
    add_job(conn, "a", entrypoint="jobfuncs:noop", schedule="0 * * * *", sources=["warehouse"])
    add_job(conn, "b", entrypoint="jobfuncs:noop", depends_on=["a"])
    finished_run(conn, "b", __import__("datetime").datetime.now(__import__("datetime").UTC))
    admin = tokens.create(conn, "admin")
    result = subprocess.run(
        [str(ST), "run", f"{server.url}/api/v1/openapi.json", "--header",
         f"Authorization: Bearer {admin}", "--max-examples", MAX_EXAMPLES, "--checks", "all",
         "--exclude-checks", EXCLUDED, "--workers", "1", "--request-timeout", "30",
         "--no-color", "--seed", SEED],
        capture_output=True, text=True, timeout=880, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
