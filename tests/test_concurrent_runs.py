"""Invariant 10: two `offsetlake run` processes racing on one pipeline commit each range once."""

from __future__ import annotations

import json

from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake.sample_data import ensure_topic, produce_orders


def test_two_runs_started_together_end_exactly_once(pipeline):
    config = pipeline.write(max_records_per_batch=8_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3)
    produce_orders(pipeline.bootstrap, pipeline.topic, 20_000, malformed_every=333)

    first, second = pipeline.cli_start("run"), pipeline.cli_start("run")
    outputs = [p.communicate(timeout=600) for p in (first, second)]
    for process, (_, err) in zip((first, second), outputs, strict=True):
        assert process.returncode == 0, err[-3000:]
    committed = [json.loads(line) for out, _ in outputs for line in out.splitlines() if line.startswith("{")]
    batch_ids = [c["batch_id"] for c in committed if c["status"] == "committed"]
    assert len(batch_ids) == len(set(batch_ids))

    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    statuses = {r["status"] for r in ledger_rows(config)}
    assert "committed" in statuses
    audit = pipeline.cli("audit")
    assert audit.returncode == 0, audit.stdout
