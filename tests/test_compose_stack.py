"""The production stack, built and run: `make compose-test` as a test (`make test-stack`, which
.ci/run runs beside `make test`: about four and a half minutes, most of them waiting on containers).

scripts/compose_test.py installs Debian's container engine and Compose if missing, starts the
engine if none runs (and stops only that one), builds the Dockerfile on the official Python image
or, where it cannot be pulled, on a base built from Debian's packages, brings docker-compose.yaml
up with deploy/compose-test.yaml (host networking on 127.0.0.1; the embedded Apache Kafka broker, a Debian PostgreSQL and
the embedded S3 server in place of the official Kafka, Postgres and MinIO images) and drives it
through Airflow's REST API: a scheduled run, a backfill, a run whose Spark driver is killed and
whose ingest is cleared. It fails on the first check that does not hold; this test also reads
what it recorded and checks that nothing of the project is left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / ".compose-test" / "result.json"

pytestmark = [pytest.mark.timeout(2700), pytest.mark.slow, pytest.mark.stack]


def test_the_stack_builds_runs_and_lands_a_scheduled_run_a_backfill_and_a_cleared_rerun_exactly_once() -> None:
    RESULT.unlink(missing_ok=True)
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compose_test.py")], cwd=ROOT, capture_output=True, text=True, timeout=2600
    )
    print(done.stdout[-6000:])
    assert done.returncode == 0, f"compose-test failed:\n{done.stdout[-6000:]}\n{done.stderr[-4000:]}"
    result = json.loads(RESULT.read_text())
    assert result["passed"] is True
    assert result["left_behind"] == [], "down -v left containers, networks or volumes of the project"
    assert result["listeners_off_loopback"] == [], "a container listened beyond 127.0.0.1"
    assert result["scheduled_run"].startswith("scheduled__"), "the first run was not the scheduler's"
    assert result["good"] > 60_000 and result["malformed"] > 0, "the independent read saw less than was produced"
    assert {"ingest", "backfill"} <= set(result["ledger_view_kinds"])
    if result["engine_started"]:  # the engine it started is stopped again: the docker socket no longer answers
        assert subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0
