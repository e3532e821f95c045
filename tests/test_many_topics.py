"""Pipelines over several topics (issue 19): ``topics: [...]`` and ``topic_pattern``, every
topic-partition with its own txn, range and ledger rows; a topic that starts matching the pattern
between runs is picked up from its start."""

from __future__ import annotations

import time

import pytest
from kafka_truth import ledger_rows, read_topic

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import BackfillParamsError, ConfigError
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


def _sink_coordinates(config) -> list[tuple[str, int, int]]:
    table = storage.table(config.layout.sink).to_pyarrow_table(columns=["_kafka_topic", "_kafka_partition", "_kafka_offset"])
    return list(zip(*(table[c].to_pylist() for c in table.column_names), strict=True))


def _assert_every_record_once(config, bootstrap: str, topics: list[str]) -> None:
    rows = _sink_coordinates(config)
    assert len(rows) == len(set(rows)), "no record twice"
    expected = {(t, p, o) for t in topics for (p, o) in read_topic(bootstrap, t).good}
    assert set(rows) == expected


def test_a_topic_list_and_a_pattern_that_picks_up_a_new_topic(pipeline, spark):
    base = pipeline.topic
    a, b, c = f"{base}_a", f"{base}_b", f"{base}_c"
    for topic in (a, b):
        ensure_topic(pipeline.bootstrap, topic, 2)
    next_id = produce_orders(pipeline.bootstrap, a, 300)
    next_id = produce_orders(pipeline.bootstrap, b, 200, first_id=next_id)

    listed = pipeline.write(topic=None, topics=[a, b], max_records_per_batch=200)
    results = run_pipeline(listed, RunContext("listed"), lambda: spark)
    assert sum(r.total("rows_written") for r in results) == 500 and len(results) == 3
    _assert_every_record_once(listed, pipeline.bootstrap, [a, b])
    committed = {(r["topic"], r["partition"]) for r in ledger_rows(listed) if r["status"] == "committed"}
    assert committed == {(a, 0), (a, 1), (b, 0), (b, 1)}
    table = storage.table(listed.layout.sink)
    for topic in (a, b):
        for p in (0, 1):
            assert table.transaction_version(listed.app_id(topic, p)) is not None, f"a txn for {topic}[{p}]"
    with pytest.raises(BackfillParamsError, match="give the topic to backfill"):
        from offsetlake.backfill import plan_backfill

        plan_backfill(listed, RunContext("which"), None, 0, 10)

    matched = pipeline.write(topic=None, topic_pattern=f"{base}_[a-z]", sink={"table": f"{pipeline.name}_pattern"})
    run_pipeline(matched, RunContext("pattern-1"), lambda: spark)
    _assert_every_record_once(matched, pipeline.bootstrap, [a, b])
    ensure_topic(pipeline.bootstrap, c, 1)  # starts matching between runs
    produce_orders(pipeline.bootstrap, c, 50, first_id=next_id)
    produce_orders(pipeline.bootstrap, a, 10, first_id=next_id + 50)
    run_pipeline(matched, RunContext("pattern-2"), lambda: spark)
    _assert_every_record_once(matched, pipeline.bootstrap, [a, b, c])


def test_exactly_one_topic_source(pipeline):
    with pytest.raises(ConfigError, match="give exactly one of topic, topics, topic_pattern"):
        pipeline.write(topics=["x"])
    with pytest.raises(ConfigError, match="is not a regular expression"):
        pipeline.write(topic=None, topic_pattern="(")


def test_a_deleted_topic_the_pattern_matched_fails_the_run_naming_it(pipeline, spark):
    from confluent_kafka.admin import AdminClient

    from offsetlake.errors import KafkaUnavailableError

    base = pipeline.topic
    kept, retired = f"{base}_kept", f"{base}_retired"
    for topic in (kept, retired):
        ensure_topic(pipeline.bootstrap, topic, 1)
        produce_orders(pipeline.bootstrap, topic, 20)
    config = pipeline.write(topic=None, topic_pattern=f"{base}_.*")
    run_pipeline(config, RunContext("both"), lambda: spark)
    admin = AdminClient({"bootstrap.servers": pipeline.bootstrap})
    admin.delete_topics([retired])[retired].result(15)
    deadline = time.monotonic() + 60  # a real broker drops a deleted topic from its metadata a little later
    while retired in admin.list_topics(timeout=15).topics:
        assert time.monotonic() < deadline, f"{retired} is still listed a minute after its deletion"
        time.sleep(0.5)
    with pytest.raises(KafkaUnavailableError, match=f"topic {retired} matches topic_pattern .* does not list it any more"):
        run_pipeline(config, RunContext("gone"), lambda: spark)
    narrowed = pipeline.write(topic=None, topic_pattern=f"{base}_kept")
    produce_orders(pipeline.bootstrap, kept, 5, first_id=100)
    [batch] = run_pipeline(narrowed, RunContext("narrowed"), lambda: spark)
    assert batch.total("rows_written") == 5
    assert len(_sink_coordinates(narrowed)) == 45, "the retired topic's rows stay"
