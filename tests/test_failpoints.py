"""A run killed at each named step, then a normal run: exactly once, ledger complete, audit 0."""

from __future__ import annotations

import signal

import pytest
from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake.failpoints import NAMES
from offsetlake.sample_data import ensure_topic, produce_orders


@pytest.mark.parametrize("failpoint", NAMES)
def test_crash_at_failpoint_then_rerun_is_exactly_once(pipeline, failpoint):
    config = pipeline.write(max_records_per_batch=6_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 9_000, malformed_every=250)

    crashed = pipeline.cli("run", env={"OFFSETLAKE_FAILPOINT": failpoint})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert f"failpoint {failpoint} reached" in crashed.stderr
    rows_after_crash = ledger_rows(config)
    assert any(r["status"] == "planned" for r in rows_after_crash)

    rerun = pipeline.cli("run")
    assert rerun.returncode == 0, rerun.stderr[-3000:]

    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    rows = ledger_rows(config)
    outcomes = {(r["batch_id"], r["partition"]) for r in rows if r["status"] != "planned"}
    dangling = {(r["batch_id"], r["partition"]) for r in rows if r["status"] == "planned"} - outcomes
    assert not dangling, f"planned ledger rows without an outcome: {sorted(dangling)}"
    audit = pipeline.cli("audit")
    assert audit.returncode == 0, audit.stdout
