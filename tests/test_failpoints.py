"""A run killed at each named step in turn (new records before each), then a normal run:
exactly once, every planned batch has an outcome in the ledger, audit 0."""

from __future__ import annotations

import signal

import pytest
from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.failpoints import NAMES
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


@pytest.mark.also_on_s3(long=True)  # its S3 run: make torture
def test_crash_at_every_failpoint_then_rerun_is_exactly_once(pipeline, spark):
    config = pipeline.write(max_records_per_batch=6_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    next_id = 0
    for failpoint in NAMES:
        # each crashed run first recovers from the previous crash, then dies at the next step
        next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 4_000, first_id=next_id, malformed_every=250)
        planned_before = {r["batch_id"] for r in ledger_rows(config) if r["status"] == "planned"} \
            if storage.is_table(config.ledger_path) else set()
        crashed = pipeline.cli("run", env={"OFFSETLAKE_FAILPOINT": failpoint})
        assert crashed.returncode == -signal.SIGKILL, (failpoint, crashed.stderr[-2000:])
        assert f"failpoint {failpoint} reached" in crashed.stderr
        planned_now = {r["batch_id"] for r in ledger_rows(config) if r["status"] == "planned"}
        assert planned_now - planned_before, f"the run killed at {failpoint} planned no batch"

    assert run_pipeline(config, RunContext("recovery"), lambda: spark)

    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    rows = ledger_rows(config)
    outcomes = {(r["batch_id"], r["partition"]) for r in rows if r["status"] != "planned"}
    dangling = {(r["batch_id"], r["partition"]) for r in rows if r["status"] == "planned"} - outcomes
    assert not dangling, f"planned ledger rows without an outcome: {sorted(dangling)}"
    # batches killed before their commit were re-planned over, so the ledger says they were superseded
    assert {"committed", "superseded"} <= {r["status"] for r in rows}
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout
