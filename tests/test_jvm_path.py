"""The ``jvm`` data path (Spark's Kafka source reads, ``from_json`` decodes) gives every record
the fate the read tasks give it: the same sink rows and the same dead letters, reason by reason,
for hostile values, keys, headers, sizes and timestamps; and a batch whose timestamps the source
cannot read is read, whole, by the read tasks, saying why."""

from __future__ import annotations

import json
import logging

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_truth import assert_exactly_once, read_topic
from raw_records import produce_raw
from test_hostile_input import CASES, PARSE_CASES
from test_properties import EXAMPLES, json_texts, scenes  # noqa: F401  # scenes: the fixture

from offsetlake import failpoints, storage
from offsetlake.audit import audit_pipeline
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import ConfigError
from offsetlake.history import sink_commits
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

YEAR_10000_MS = 253_402_300_800_000
DEEP = [b'{"order_id": 40, "x": ' + b"[" * (d - 1) + b"]" * (d - 1) + b"}" for d in (1_000, 1_001, 5_000)]
TRICKS = [
    b'{"order_id": 41, "customer": "\\ud800x"}',
    b'{"order_id": 42, "customer": "\\ud83d\\ude00"}',
    b'{"order_id": 43} 42',
    b'{"order_id": 44}]',
    b'{"order_id": 45},"y":2',
    b' \t{"order_id": 46}\n ',
    b'{"order_id": 47, "customer": "\\ud83d\\ude00", "x": ' + b"[" * 998 + b"]" * 998 + b"}",
]


def _topic(bootstrap: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    config = {"max.message.bytes": str(4 * 1024 * 1024), "retention.ms": "-1", "message.timestamp.type": "CreateTime"}
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1, config=config)])[topic].result(30)


def _produce(bootstrap: str, topic: str, records: list[tuple]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 4 * 1024 * 1024})
    for key, value, headers, stamp in records:
        producer.produce(topic, key=key, value=value, headers=headers, partition=0, **({"timestamp": stamp} if stamp else {}))
    assert producer.flush(60) == 0


def _lake(config) -> tuple[list[dict], list[dict]]:
    """Sink rows and dead letters, by offset, every column but the batch's own."""
    sink = sorted(storage.table(config.layout.sink).to_pyarrow_table().to_pylist(), key=lambda r: r["_kafka_offset"])
    dead = []
    if storage.is_table(config.layout.dead_letters):
        dead = sorted(storage.table(config.layout.dead_letters).to_pyarrow_table().to_pylist(), key=lambda r: r["_kafka_offset"])
    for row in [*sink, *dead]:
        for column in ("batch_id", "_offsetlake_batch_id", "dead_lettered_at"):
            row.pop(column, None)
    return sink, dead


def _run(pipeline, spark, path: str, **overrides) -> tuple:
    config = pipeline.write(lake=str(pipeline.folder / f"lake_{path}"), data_path=path, **overrides)
    [result] = run_pipeline(config, RunContext(f"path-{path}"), lambda: spark, emit=lambda _: None)
    [commit] = sink_commits(storage.table(config.layout.sink), config.name)
    return config, result, commit.entry.data_path


@pytest.mark.local_lake
def test_the_jvm_path_gives_every_record_the_fate_the_read_tasks_give(pipeline, spark, caplog):
    _topic(pipeline.bootstrap, pipeline.topic)
    values = [*PARSE_CASES, *DEEP, *TRICKS]
    stamps = [-1, YEAR_10000_MS - 1, YEAR_10000_MS, 2**45, -5]
    records = [(key, value, headers, None) for _, key, value, headers, _ in CASES]
    records += [(b"k%d" % i, value, None, None) for i, value in enumerate(values)]
    records += [(b"t", b'{"order_id": 50}', None, stamp) for stamp in stamps]
    records += [(b"x" * 10, b'{"order_id": 51, "customer": "' + b"y" * 1_500_000 + b'"}', None, None)]  # above max_record_bytes
    _produce(pipeline.bootstrap, pipeline.topic, records)
    produce_raw(pipeline.bootstrap, pipeline.topic, 0, b'{"order_id": 52}', [(b"ok", b"\x00\xff")])

    with caplog.at_level(logging.INFO, logger="offsetlake"):
        jvm_config, jvm_result, jvm_path = _run(pipeline, spark, "jvm", max_record_bytes=1_400_000)
    tasks_config, tasks_result, tasks_path = _run(pipeline, spark, "spark", max_record_bytes=1_400_000)

    assert (jvm_path, tasks_path) == ("jvm", "spark")
    assert "path=jvm" in caplog.text and "the pipeline says data_path: jvm" in caplog.text
    jvm_sink, jvm_dead = _lake(jvm_config)
    tasks_sink, tasks_dead = _lake(tasks_config)
    assert jvm_result.total("records_read") == tasks_result.total("records_read") == len(records) + 1
    assert [r["_kafka_offset"] for r in jvm_sink] == [r["_kafka_offset"] for r in tasks_sink]
    assert repr(jvm_sink) == repr(tasks_sink)  # repr: NaN equals NaN
    assert [(d["_kafka_offset"], d["reason"]) for d in jvm_dead] == [(d["_kafka_offset"], d["reason"]) for d in tasks_dead]
    assert repr(jvm_dead) == repr(tasks_dead)
    reasons = " | ".join(d["reason"] for d in jvm_dead)
    for expected in (
        "more than one JSON value",
        "unpaired UTF-16 surrogate",
        "nests JSON 1001 levels deep",
        f"record timestamp {YEAR_10000_MS} ms is outside",
        "key: is not UTF-8 text (byte 1)",
        "value is not valid UTF-8",
        "record_too_large: its key and value hold 1500042 bytes",
        "tombstone",
    ):
        assert expected in reasons, expected


@pytest.mark.local_lake
@pytest.mark.parametrize(
    ("stamp", "why"),
    [(2**62, "overflows Spark's microseconds"), (-30_610_224_000_000, "before 1582-10-15")],
    ids=["overflow", "julian"],
)
def test_a_timestamp_the_kafka_source_cannot_read_sends_the_batch_to_the_read_tasks(pipeline, spark, caplog, stamp, why):
    _topic(pipeline.bootstrap, pipeline.topic)
    records = [(b"k", json.dumps({"order_id": i}).encode(), None, stamp if i == 3 else None) for i in range(6)]
    _produce(pipeline.bootstrap, pipeline.topic, records)
    with caplog.at_level(logging.INFO, logger="offsetlake"):
        jvm_config, jvm_result, jvm_path = _run(pipeline, spark, "jvm")
    tasks_config, _, _ = _run(pipeline, spark, "spark")
    assert jvm_path == "spark", "the ledger records the path that read the batch"
    assert f"{why}" in caplog.text and "the read tasks read the batch" in caplog.text
    assert jvm_result.total("records_read") == 6
    assert repr(_lake(jvm_config)) == repr(_lake(tasks_config))


def test_data_path_jvm_is_refused_for_what_the_jvm_path_cannot_decode(pipeline):
    with pytest.raises(ConfigError) as refused:
        pipeline.write(format={"type": "avro", "schema_registry": {"url": "http://127.0.0.1:1"}}, data_path="jvm")
    assert f"data_path: pipeline {pipeline.name} cannot take the jvm path: the JVM path decodes plain JSON values" in str(refused.value)
    assert pipeline.write(data_path="jvm").data_path == "jvm"


@pytest.mark.also_on_s3
def test_a_jvm_batch_crashed_before_its_commit_is_read_again_exactly_once(pipeline, spark):
    config = pipeline.write(data_path="jvm", max_records_per_batch=3_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 5_000, malformed_every=250)

    def crash(_name: str) -> None:
        raise failpoints.SimulatedCrash()

    for name in ("after_read", "after_files_written"):
        with failpoints.on(name, crash), pytest.raises(failpoints.SimulatedCrash):
            run_pipeline(config, RunContext(f"crash-{name}"), lambda: spark, emit=lambda _: None)
    assert run_pipeline(config, RunContext("recovery"), lambda: spark, emit=lambda _: None)

    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    assert {c.entry.data_path for c in sink_commits(storage.table(config.layout.sink), config.name)} == {"jvm"}
    assert audit_pipeline(config, against_kafka=True).ok


keys = st.one_of(st.none(), st.binary(max_size=6), st.sampled_from([b"\xff\xfe", b"k\x00", "é".encode()]))
stamps = st.one_of(
    st.none(), st.sampled_from([-1, 1, YEAR_10000_MS - 1, YEAR_10000_MS, 2**50, -5, 253_402_300_799_999 + 7]), st.integers(1, 2**41)
)


@settings(max_examples=max(EXAMPLES * 2, 8), deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(records=st.lists(st.tuples(keys, json_texts(), stamps), min_size=1, max_size=8))
def test_any_records_get_the_same_rows_and_dead_letters_on_the_jvm_path(spark, scenes, records):  # noqa: F811  # the fixture
    scene = scenes()
    _produce(scene.bootstrap, scene.topic, [(key, value, None, stamp) for key, value, stamp in records])
    lakes = []
    for path in ("jvm", "spark"):
        config = scene.write(lake=str(scene.folder / f"lake_{path}"), data_path=path)
        [result] = run_pipeline(config, RunContext(f"any-{path}"), lambda: spark, emit=lambda _: None)
        assert result.total("records_read") == len(records)
        [commit] = sink_commits(storage.table(config.layout.sink), config.name)
        assert commit.entry.data_path == path
        lakes.append(repr(_lake(config)))
    assert lakes[0] == lakes[1]


def test_every_value_the_read_tasks_fault_is_one_the_jvm_hands_them(spark):
    """``structure_suspects`` (JVM) must mark every value ``structure_problem`` (the read tasks)
    finds fault with: random texts from JSON's own pieces, and the hand-made tricks."""
    import random

    from pyspark.sql import functions as F

    from offsetlake.formats.json_records import structure_problem, structure_suspects

    pieces = [b"{", b"}", b"[", b"]", b'"', b",", b":", b"1", b" ", b"\\", b"u", b"d", b"8", b"a", b'"a"', b"null", b'{"a":1}', b"\n"]
    rng = random.Random(37)
    values = [v for v in (*PARSE_CASES, *DEEP, *TRICKS) if v is not None]
    values += [b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 14))) for _ in range(5_000)]
    frame = spark.createDataFrame([(v,) for v in values], "value binary")
    marked = {bytes(r.value) for r in frame.where(structure_suspects(F.col("value"))).collect()}
    faulted = [v for v in values if structure_problem(v) is not None]
    assert len(faulted) > 500, "the random texts must hold many faulted values"
    missed = [v for v in faulted if v not in marked]
    assert not missed, f"values the read tasks fault that the JVM judged alone: {missed[:5]}"
    assert len(marked) < len(values), "the JVM must judge some values alone"
