"""A run killed at each named step in turn (new records before each), then a normal run:
exactly once, every planned batch has an outcome in the ledger, audit 0."""

from __future__ import annotations

import pytest
from crash_runs import assert_every_plan_has_an_outcome, crash_at_every_failpoint
from kafka_truth import assert_exactly_once, read_topic

from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


@pytest.mark.also_on_s3
def test_crash_at_every_failpoint_then_rerun_is_exactly_once(pipeline, spark):
    config = pipeline.write(max_records_per_batch=6_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    crash_at_every_failpoint(pipeline, config, 4_000)

    assert run_pipeline(config, RunContext("recovery"), lambda: spark)

    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    rows = assert_every_plan_has_an_outcome(config)
    # batches killed before their commit were re-planned over, so the ledger says they were superseded
    assert {"committed", "superseded"} <= {r["status"] for r in rows}
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout
