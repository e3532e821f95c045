"""A partition added to the topic between runs is picked up from its log start."""

from __future__ import annotations

from kafka_truth import assert_exactly_once, read_topic, sink_coordinates

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
