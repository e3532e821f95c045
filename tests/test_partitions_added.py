"""A partition added to the topic between runs is picked up from its log start."""

from __future__ import annotations

from kafka_truth import assert_exactly_once, ledger_rows, read_topic, sink_coordinates

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


def test_partition_added_between_runs_arrives(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 3_000)
    run_pipeline(config, RunContext("before"), lambda: spark)

    ensure_topic(pipeline.bootstrap, pipeline.topic, 4)
    produce_orders(pipeline.bootstrap, pipeline.topic, 500, first_id=50_000, partition=3)
    produce_orders(pipeline.bootstrap, pipeline.topic, 500, first_id=60_000, partition=2)
    results = run_pipeline(config, RunContext("after"), lambda: spark)

    planned_partitions = {r.partition for res in results for r in res.plan.ranges if r.size}
    assert {2, 3} <= planned_partitions
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))


def test_partitions_added_to_a_running_latest_pipeline_are_read_from_their_log_start(pipeline, spark):
    """Issue 35 finding 7: `start: latest` says where a new pipeline begins; partitions created
    after its first commit hold only records written while it ran, and none of them is skipped."""
    from offsetlake.audit import audit_pipeline

    config = pipeline.write(start="latest")
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 10, first_id=90_000)  # before the pipeline: skipped
    run_pipeline(config, RunContext("anchor"), lambda: spark)
    produce_orders(pipeline.bootstrap, pipeline.topic, 100)
    first = run_pipeline(config, RunContext("first"), lambda: spark)
    assert sum(r.total("rows_written") for r in first) == 100

    ensure_topic(pipeline.bootstrap, pipeline.topic, 4)
    for partition in range(4):  # 200 records round robin over the four partitions
        produce_orders(pipeline.bootstrap, pipeline.topic, 50, first_id=1_000 * (partition + 1), partition=partition)
    after = run_pipeline(config, RunContext("after"), lambda: spark)

    assert sum(r.total("rows_written") for r in after) == 200
    starts = {(r.partition, r.start) for res in after for r in res.plan.ranges if r.partition >= 2 and r.size}
    assert starts == {(2, 0), (3, 0)}
    truth = read_topic(pipeline.bootstrap, pipeline.topic)
    skipped = {c for c, order_id in truth.good.items() if order_id >= 90_000}  # written before the anchor
    assert len(skipped) == 10
    assert len(truth.good) == 310
    rows = {(p, o) for p, o, _ in sink_coordinates(config.layout.sink)}
    assert rows == set(truth.good) - skipped
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()


def test_records_deleted_from_a_partition_added_later_before_its_first_read_are_a_gap(pipeline, spark):
    """RELIABILITY rounds 7 and 11 (seeds 3901, 5101): a partition added while the pipeline ran
    held only records written since, all due; those deleted before its first read are lost, so
    the run refuses (``on_offsets_lost: fail``) or records them as a gap (``skip``), as it does for
    a partition it has read; before, they were skipped without a trace."""
    from test_offsets_lost import _delete_before

    from offsetlake.audit import audit_pipeline
    from offsetlake.errors import OffsetsLostError

    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 30, partition=0)
    run_pipeline(config, RunContext("before"), lambda: spark)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 20, first_id=7_000, partition=1)
    _delete_before(pipeline.bootstrap, pipeline.topic, 1, 16)
    version = storage.table(config.layout.sink).version()

    try:
        run_pipeline(config, RunContext("refused"), lambda: spark)
    except OffsetsLostError as err:
        said = str(err)
    else:
        raise AssertionError("a partition's lost first records must not be skipped silently")
    assert f"{pipeline.topic}[1]" in said and "[0, 16)" in said and "added after the pipeline began" in said, said
    assert storage.table(config.layout.sink).version() == version, "the refusal writes nothing"

    config = pipeline.write(on_offsets_lost="skip")
    run_pipeline(config, RunContext("skip"), lambda: spark)
    gaps = [(r["partition"], r["start_offset"], r["end_offset"]) for r in ledger_rows(config) if r["status"] == "gap"]
    assert gaps == [(1, 0, 16)]
    rows = sorted(o for p, o, _ in sink_coordinates(config.layout.sink) if p == 1)
    assert rows == [16, 17, 18, 19]
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()
