"""`offsetlake audit` catches tampering; `ledger rebuild` recreates the ledger from the sink."""

from __future__ import annotations

import pytest
from deltalake import write_deltalake
from kafka_truth import ledger_rows
from s3_tools import delete_tree

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


def test_audit_reports_a_row_copied_behind_its_back(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 2_000)
    run_pipeline(config, RunContext("r"), lambda: spark)
    assert pipeline.cli("audit").returncode == 0

    sink = storage.table(config.layout.sink)
    row = sink.to_pyarrow_dataset().head(1)
    write_deltalake(sink, row, mode="append")

    audit = pipeline.cli("audit")
    assert audit.returncode == 1
    partition, offset = row["_kafka_partition"][0].as_py(), row["_kafka_offset"][0].as_py()
    assert f"{pipeline.topic}[{partition}] offset {offset} appears 2 times" in audit.stdout


@pytest.mark.also_on_s3
def test_ledger_rebuild_from_sink_history_alone(pipeline, spark):
    config = pipeline.write(max_records_per_batch=1_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 3_000)
    results = run_pipeline(config, RunContext("r"), lambda: spark)
    before = sorted(
        (r["batch_id"], r["partition"], r["start_offset"], r["end_offset"], r["sink_version"])
        for r in ledger_rows(config)
        if r["status"] == "committed"
    )
    assert len({b for b, *_ in before}) == len(results) >= 3

    # Compaction (what keeps planning flat as history grows) changes files, never rows.
    ledger = Ledger(config.layout.ledger, config.name)
    rows_before, files_before = ledger.rows().to_pylist(), len(storage.table(config.layout.ledger).file_uris())
    assert files_before > 2
    assert ledger.compact_if_fragmented(max_files=2)
    assert ledger.rows().to_pylist() == rows_before
    assert len(storage.table(config.layout.ledger).file_uris()) == 1
    assert not ledger.compact_if_fragmented(max_files=2)

    delete_tree(config.layout.ledger)
    rebuilt = pipeline.cli("ledger", "rebuild")
    assert rebuilt.returncode == 0, rebuilt.stderr
    after = sorted(
        (r["batch_id"], r["partition"], r["start_offset"], r["end_offset"], r["sink_version"])
        for r in ledger_rows(config)
        if r["status"] == "committed"
    )
    assert after == before
    shown = pipeline.cli("ledger")
    assert shown.returncode == 0 and results[0].plan.batch_id in shown.stdout
    assert pipeline.cli("audit").returncode == 0


def test_status_shows_lag_per_partition(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, partition=0)
    run_pipeline(config, RunContext("r"), lambda: spark)
    produce_orders(pipeline.bootstrap, pipeline.topic, 250, first_id=9_000, partition=1)
    import json

    status = pipeline.cli("status", "--json")
    assert status.returncode == 0, status.stderr
    parts = {p["partition"]: p for p in json.loads(status.stdout)["partitions"]}
    assert parts[0]["lag"] == 0 and parts[0]["committed_end"] == 1_000
    assert parts[1]["lag"] == 250
