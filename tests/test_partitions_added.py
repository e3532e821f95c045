"""A partition added to the topic between runs is picked up from its log start."""

from __future__ import annotations

from kafka_truth import assert_exactly_once, read_topic

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
