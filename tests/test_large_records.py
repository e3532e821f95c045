"""A record is a row or a dead letter by its own bytes, on both data paths (issue 35, finding 5).

Before: one partition holding small, 50 MB, small, 95 MB, small valid JSON records, read in one
consume call, gave 3 rows and 2 dead letters "value does not parse as JSON matching the declared
schema": the chunk exceeded pyarrow's 64 MiB parse block, so it fell back whole to Spark's
``from_json``, whose Jackson refuses strings over 20,000,000 characters; the 50 MB record alone
was a row. Now the size rule is ``max_record_bytes`` (``reader.record_size_problems``): above it
a dead letter ``record_too_large`` naming both sizes, below it decoded whatever its neighbours.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import pyarrow as pa
import pytest
import yaml
from confluent_kafka import Producer
from kafka_truth import TopicTruth, assert_exactly_once, last_stable_offsets, read_records

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.config import DEFAULT_MAX_RECORD_BYTES, MAX_RECORD_BYTES_CEILING, load_pipeline
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.errors import ConfigError
from offsetlake.formats.json_records import parse_json_values
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

MB = 1_000_000
SCHEMA = {"order_id": "long", "note": "string", "amount": "double"}
# a real Kafka broker refuses records over 1 MiB unless the topic (and producer) allow them; the
# whole partition (< 200 MB) fits in one fetch of offsetlake's consumer (receive.message.max.bytes)
TOPIC_CONFIG = {"max.message.bytes": str(200 * MB), "retention.ms": "-1"}
JACKSON_MAX_STRING = 20_000_000  # Jackson's default StreamReadConstraints.maxStringLength


@dataclass(frozen=True)
class Sent:
    key: bytes | None
    value: bytes
    order_id: int
    reason: str | None  # None: a row


def _order(order_id: int, note_chars: int) -> bytes:
    return json.dumps({"order_id": order_id, "note": "x" * note_chars}).encode()


def _order_of_size(order_id: int, size: int) -> bytes:
    """An order whose JSON is exactly ``size`` bytes."""
    value = _order(order_id, size - len(_order(order_id, 0)))
    assert len(value) == size
    return value


def _single_quoted(order_id: int, note_chars: int) -> bytes:
    """Valid for Spark's ``from_json`` (single quotes allowed), refused by pyarrow: parsed in Spark."""
    return f"{{'order_id': {order_id}, 'note': '{'y' * note_chars}'}}".encode()


def _produce(bootstrap: str, topic: str, records: list[Sent]) -> None:
    ensure_topic(bootstrap, topic, 1, config=TOPIC_CONFIG)
    producer = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 200 * MB})
    for r in records:
        producer.produce(topic, key=r.key, value=r.value, partition=0)
    assert producer.flush(120) == 0


def _truth(bootstrap: str, topic: str, records: list[Sent]) -> TopicTruth:
    """What the sink and the dead letters must hold, from a plain consumer's view of the topic
    (coordinates) and what each record was produced to be."""
    found = read_records(bootstrap, topic, timeout_s=120)
    assert [(r.key, r.value) for r in found] == [(s.key, s.value) for s in records]
    good = {(r.partition, r.offset): s.order_id for r, s in zip(found, records, strict=True) if s.reason is None}
    bad = {(r.partition, r.offset) for r, s in zip(found, records, strict=True) if s.reason is not None}
    return TopicTruth(good, bad, last_stable_offsets(bootstrap, topic))


def _run_both_paths(pipeline, spark, tmp_path, caplog, **overrides):
    """The same topic into two lakes: the direct path (read tasks write the rows), then the
    Spark path (``data_path``); the two configs."""
    configs = []
    for path in ("direct", "spark"):
        config = pipeline.write(
            lake=str(tmp_path / path), format={"type": "json", "schema": SCHEMA, "required": ["order_id"]}, data_path=path, **overrides
        )
        with caplog.at_level(logging.INFO, logger="offsetlake.batch"):
            caplog.clear()
            [result] = run_pipeline(config, RunContext(f"large-{path}"), lambda: spark)
            assert f"path={path}" in caplog.text, path
        configs.append((path, config, result))
    return configs


def _check(config, truth: TopicTruth, records: list[Sent], path: str) -> None:
    """Every record a row with its whole note or a dead letter with its reason, exactly once."""
    assert_exactly_once(config, truth)
    rows = storage.table(config.layout.sink).to_pyarrow_table(columns=["_kafka_offset", "order_id", "note"]).to_pylist()
    notes = {r["_kafka_offset"]: len(r["note"]) for r in rows}
    dead = (
        {r["_kafka_offset"]: r for r in storage.table(config.layout.dead_letters).to_pyarrow_table().to_pylist()}
        if storage.is_table(config.layout.dead_letters)
        else {}
    )
    for offset, sent in enumerate(records):
        if sent.reason is None:
            assert offset in notes, (
                f"{path}: offset {offset} ({len(sent.value)} bytes) is not a row: {dead[offset]['reason'] if offset in dead else 'lost'}"
            )
            assert notes[offset] == len(json.loads(sent.value.replace(b"'", b'"'))["note"]), (path, offset)
        else:
            assert dead[offset]["reason"] == sent.reason, (path, offset)
            assert dead[offset]["value"] == sent.value and dead[offset]["key"] == sent.key, (path, offset)
    assert audit_pipeline(config, against_kafka=True).ok, path


@pytest.mark.parametrize("limit", [0, -1, MAX_RECORD_BYTES_CEILING + 1, "big"])
def test_a_max_record_bytes_no_read_task_can_keep_is_refused_when_the_pipeline_loads(tmp_path, limit):
    path = tmp_path / "orders_x.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "orders_x",
                "topic": "orders",
                "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
                "format": {"type": "json", "schema": SCHEMA},
                "max_record_bytes": limit,
            }
        )
    )
    with pytest.raises(ConfigError, match=f"{path}.*max_record_bytes"):
        load_pipeline(str(path))
    path.write_text(path.read_text().replace(f"max_record_bytes: {limit}", "max_record_bytes: 1000"))
    assert load_pipeline(str(path)).max_record_bytes == 1000


def test_a_value_longer_than_a_parse_block_is_parsed_with_its_neighbours():
    """In the read task: a chunk whose values together exceed pyarrow's 64 MiB block is parsed,
    not left whole to Spark (each value null here meant: Spark decides)."""
    # the sizes: the 95 MB value spans three 64 MiB blocks (pyarrow's reader takes two)
    values = [_order(0, 10), _order(1, 50 * MB), _order(2, 10), _order(3, 95 * MB), _order(4, 10)]
    struct = pa.struct([pa.field("order_id", pa.int64()), pa.field("note", pa.string()), pa.field("_corrupt_record", pa.string())])
    parsed = parse_json_values(values, struct)  # type: ignore[arg-type]  # list[bytes] is a list[bytes | None]
    assert parsed.is_null().to_pylist() == [False] * 5
    assert [len(n) for n in parsed.field("note").to_pylist()] == [10, 50 * MB, 10, 95 * MB, 10]


@pytest.mark.local_lake
def test_large_valid_records_are_rows_whatever_their_neighbours_on_both_paths(pipeline, spark, tmp_path, caplog):
    """The issue's partition (small, 50 MB, small, 95 MB, small) and a 30 MB record, all valid,
    in one consume call: every one a row under the default max_record_bytes, on both paths."""
    sizes = [10, 50 * MB, 10, 95 * MB, 10, 30 * MB, 10]
    records = [Sent(None, _order(i, chars), i, None) for i, chars in enumerate(sizes)]
    assert max(len(r.value) for r in records) <= DEFAULT_MAX_RECORD_BYTES
    _produce(pipeline.bootstrap, pipeline.topic, records)
    truth = _truth(pipeline.bootstrap, pipeline.topic, records)

    for path, config, result in _run_both_paths(pipeline, spark, tmp_path, caplog):
        assert result.total("rows_written") == len(records) and result.total("dead_letters") == 0, path
        _check(config, truth, records, path)


@pytest.mark.local_lake
def test_a_record_over_max_record_bytes_is_a_record_too_large_dead_letter_on_both_paths(pipeline, spark, tmp_path, caplog):
    """Above the pipeline's limit (key and value together) a dead letter saying both sizes; at
    the limit and below, rows, also those only Spark's ``from_json`` parses (single quotes) with
    strings longer than Jackson's default limit; the small neighbours unaffected."""
    limit = 25 * MB

    def too_large(size: int) -> str:
        return f"record_too_large: its key and value hold {size} bytes, more than the pipeline's max_record_bytes ({limit})"

    big_key = b"k" * (12 * MB)
    over_with_key = _order_of_size(5, limit - len(big_key) + 1)
    records = [
        Sent(None, _order(0, 10), 0, None),
        Sent(None, _order(1, 22 * MB), 1, None),  # above Jackson's default string limit
        Sent(None, _single_quoted(2, 10), 2, None),  # pyarrow refuses: its piece goes to Spark
        Sent(None, _single_quoted(3, 22 * MB), 3, None),  # Spark parses a 22 M-character string
        # more digits than Jackson's default 1,000: pyarrow reads it (infinity), so must Spark
        Sent(None, b'{"order_id": 9, "note": "n", "amount": 1' + b"0" * 1100 + b"}", 9, None),
        Sent(None, _order_of_size(4, limit + 1), 4, too_large(limit + 1)),
        Sent(big_key, over_with_key, 5, too_large(limit + 1)),  # each below the limit, together over
        Sent(b"k6", b"{broken", 6, "value does not parse as JSON matching the declared schema"),
        Sent(None, _order_of_size(7, limit), 7, None),  # exactly the limit: a row
        Sent(None, _order(8, 10), 8, None),
    ]
    assert len(_single_quoted(3, 22 * MB)) > JACKSON_MAX_STRING
    _produce(pipeline.bootstrap, pipeline.topic, records)
    truth = _truth(pipeline.bootstrap, pipeline.topic, records)

    for path, config, result in _run_both_paths(pipeline, spark, tmp_path, caplog, max_record_bytes=limit):
        assert result.total("rows_written") == 7 and result.total("dead_letters") == 3, path
        _check(config, truth, records, path)
        amounts = storage.table(config.layout.sink).to_pyarrow_table(columns=["order_id", "amount"]).to_pylist()
        assert {r["order_id"]: r["amount"] for r in amounts}[9] == float("inf"), path
