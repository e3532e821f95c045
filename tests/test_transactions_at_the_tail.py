"""Open transactions and trailing markers: the run never waits for what it cannot see."""

from __future__ import annotations

import time

from confluent_kafka import Producer
from kafka_truth import assert_exactly_once, last_stable_offsets, read_topic, sink_coordinates

from offsetlake.embedded.sample_data import ensure_topic, order_event, produce_orders, produce_transaction
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


def test_open_transaction_at_tail_is_left_for_the_next_run(pipeline, spark):
    config = pipeline.write(read_timeout_seconds=20)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 2_000)
    producer = Producer({"bootstrap.servers": pipeline.bootstrap, "transactional.id": f"{pipeline.name}-open"})
    producer.init_transactions(30)
    producer.begin_transaction()
    import random
    from datetime import UTC, datetime

    rng = random.Random(1)
    for i in range(100):
        producer.produce(pipeline.topic, order_event(900_000 + i, rng, datetime(2026, 1, 1, tzinfo=UTC)), partition=0)
    producer.flush(30)

    started = time.monotonic()
    results = run_pipeline(config, RunContext("open-txn"), lambda: spark)
    assert time.monotonic() - started < config.read_timeout_seconds, "the run waited on the open transaction"
    assert len(results) == 1
    ids = {oid for _, _, oid in sink_coordinates(config.layout.sink)}
    assert not ids & set(range(900_000, 900_100)), "records of an open transaction leaked into the sink"
    assert len(ids) == 2_000

    producer.commit_transaction(30)
    run_pipeline(config, RunContext("after-commit"), lambda: spark)
    ids = {oid for _, _, oid in sink_coordinates(config.layout.sink)}
    assert set(range(900_000, 900_100)) <= ids
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))


def test_range_ending_in_transaction_marker_completes(pipeline, spark):
    config = pipeline.write(read_timeout_seconds=20)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 500)
    next_id = produce_transaction(pipeline.bootstrap, pipeline.topic, 50, next_id, commit=True, transactional_id=f"{pipeline.name}-m1")
    produce_transaction(pipeline.bootstrap, pipeline.topic, 50, next_id, commit=False, transactional_id=f"{pipeline.name}-m2")
    lso = last_stable_offsets(pipeline.bootstrap, pipeline.topic)[0]
    truth = read_topic(pipeline.bootstrap, pipeline.topic)
    last_record = max(o for (_, o) in truth.good)
    assert last_record < lso - 1, "the range must end in markers/aborted records for this test to mean anything"

    started = time.monotonic()
    results = run_pipeline(config, RunContext("markers"), lambda: spark)
    assert time.monotonic() - started < config.read_timeout_seconds
    assert results[-1].plan.ranges[0].end == lso
    assert_exactly_once(config, truth)
