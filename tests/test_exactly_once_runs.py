"""Two runs with new records in between land every committed record once, no aborted ones."""

from __future__ import annotations

import json

import pytest
from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders, produce_transaction
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


def _contiguous_from_zero(rows: list[dict], lso: dict[int, int]) -> None:
    committed = [r for r in rows if r["status"] == "committed"]
    for partition, end in lso.items():
        spans = sorted((r["start_offset"], r["end_offset"]) for r in committed if r["partition"] == partition)
        assert spans, f"no committed range for partition {partition}"
        assert spans[0][0] == 0, f"partition {partition} starts at {spans[0][0]}"
        for (_, prev_end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start == prev_end, f"partition {partition}: gap or overlap at {prev_end}/{start}"
        assert spans[-1][1] == end, f"partition {partition} ends at {spans[-1][1]}, LSO is {end}"


@pytest.mark.also_on_s3
def test_two_runs_land_every_committed_record_once(pipeline, spark, capsys):
    config = pipeline.write(max_records_per_batch=30_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3)
    next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 40_000, malformed_every=997)
    next_id = produce_transaction(pipeline.bootstrap, pipeline.topic, 300, next_id, commit=True, transactional_id=f"{pipeline.name}-c")
    aborted_from = next_id
    next_id = produce_transaction(pipeline.bootstrap, pipeline.topic, 300, next_id, commit=False, transactional_id=f"{pipeline.name}-a")
    aborted = set(range(aborted_from, next_id))

    first = run_pipeline(config, RunContext("run-1"), lambda: spark)
    assert len(first) >= 2, "max_records_per_batch=30000 must split 40k records into several batches"
    summaries = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [s["batch_id"] for s in summaries] == [r.plan.batch_id for r in first]
    assert all(s["status"] == "committed" for s in summaries)

    produce_orders(pipeline.bootstrap, pipeline.topic, 10_000, first_id=next_id + 1000, malformed_every=499)
    second = run_pipeline(config, RunContext("run-2"), lambda: spark)
    assert second, "new records must make a second batch"

    truth = read_topic(pipeline.bootstrap, pipeline.topic)
    assert sum(1 for _ in truth.good) >= 50_000 - 200
    assert_exactly_once(config, truth)
    from kafka_truth import sink_coordinates

    assert not aborted & {oid for _, _, oid in sink_coordinates(config.layout.sink)}, "aborted records leaked"
    _contiguous_from_zero(ledger_rows(config), truth.lso)
    assert all(
        r["status"] != "planned" or any(o["batch_id"] == r["batch_id"] and o["status"] != "planned" for o in ledger_rows(config))
        for r in ledger_rows(config)
    )

    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "OK" in audit.stdout

    # file statistics must let readers prune correctly: a filter on each coordinate finds every row
    import pyarrow.compute as pc

    dataset = storage.table(config.layout.sink).to_pyarrow_dataset()
    total = dataset.count_rows()
    assert dataset.count_rows(filter=pc.field("_kafka_topic") == pipeline.topic) == total
    assert sum(dataset.count_rows(filter=pc.field("_kafka_partition") == p) for p in range(3)) == total
    assert dataset.count_rows(filter=pc.field("_kafka_offset") >= 0) == total


def test_caught_up_run_plans_nothing_and_starts_no_spark(pipeline):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)

    def no_spark():
        raise AssertionError("Spark must not start when there is nothing to read")

    assert run_pipeline(config, RunContext("empty"), no_spark) == []
