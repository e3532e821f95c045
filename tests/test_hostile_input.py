"""Garbage on the topic and in the arguments: a clear error or a dead-letter row, never a lost
record and never a stack trace as the only message."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from conftest import ROOT

from offsetlake import storage
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

BIG = 1_300_000  # bytes: above the 1 MiB default limits of Kafka clients and brokers


def _create_topic(bootstrap: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic_config = {"max.message.bytes": str(4 * 1024 * 1024)}  # a real Kafka needs it for the large values
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1, config=topic_config)])[topic].result(30)


def _order(order_id: int, **extra: object) -> bytes:
    return json.dumps(
        {"order_id": order_id, "customer": "c1", "amount": 1.5, "currency": "EUR", "created_at": "2026-11-01T00:00:00Z", **extra}
    ).encode()


CASES = [
    # (name, key, value, headers, expected: None = sink row, else the dead-letter reason)
    ("null key", None, _order(1), None, None),
    ("tombstone", b"k", None, None, "tombstone: record has a null value"),
    ("non-UTF-8 value", b"k", b'{"order_id": 2, "customer": "\xff\xfe"}', None, "value is not valid UTF-8"),
    ("large valid value", b"k", _order(3, note="x" * BIG), None, None),
    ("large garbage value", b"k", b"\xff" * BIG, None, "value is not valid UTF-8"),
    (
        "wrong type for a field",
        b"k",
        b'{"order_id": "four", "customer": "c1"}',
        None,
        "value does not parse as JSON matching the declared schema",
    ),
    ("a JSON array", b"k", b"[1, 2, 3]", None, "value is not a JSON object"),
    ("not JSON at all", b"k", b"order 6 placed", None, "value is not a JSON object"),
    ("missing required field", b"k", b'{"customer": "c1"}', None, "required field 'order_id' is missing or null"),
    ("odd header bytes", b"\x00k", _order(9), [("h\u00e9", b"\x00\xff\x80"), ("empty", b""), ("none", None)], None),
    (
        "odd header bytes on a dead letter",
        b"\x00",
        b"{not json",
        [("h\u00e9", b"\x00\xff\x80")],
        "value does not parse as JSON matching the declared schema",
    ),
    (
        "non-UTF-8 key (key_format: string)",
        b"\x00\xff",
        _order(11),
        None,
        "key: is not UTF-8 text (byte 1); key_format: bytes keeps keys as they are",
    ),
]


def test_hostile_records_become_sink_rows_or_explained_dead_letters(pipeline, spark):
    _create_topic(pipeline.bootstrap, pipeline.topic)
    config = pipeline.write()
    producer = Producer({"bootstrap.servers": pipeline.bootstrap, "message.max.bytes": 4 * 1024 * 1024})
    for _, key, value, headers, _ in CASES:
        producer.produce(pipeline.topic, key=key, value=value, headers=headers, partition=0)
    assert producer.flush(60) == 0

    assert run_pipeline(config, RunContext("hostile"), lambda: spark)

    sink = storage.table(config.layout.sink).to_pyarrow_dataset().to_table(columns=["_kafka_offset", "order_id"]).to_pylist()
    dead = storage.table(config.layout.dead_letters).to_pyarrow_dataset().to_table().to_pylist()
    in_sink = {r["_kafka_offset"]: r["order_id"] for r in sink}
    in_dead = {r["_kafka_offset"]: r for r in dead}
    assert len(sink) == len(in_sink) and len(dead) == len(in_dead), "no record may appear twice"
    for offset, (name, key, value, headers, reason) in enumerate(CASES):
        if reason is None:
            assert offset in in_sink and offset not in in_dead, f"{name}: expected a sink row"
            assert in_sink[offset] == json.loads(value)["order_id"], name
        else:
            assert offset in in_dead and offset not in in_sink, f"{name}: expected a dead letter"
            row = in_dead[offset]
            assert row["reason"] == reason, f"{name}: {row['reason']}"
            assert row["value"] == value and row["key"] == key, f"{name}: the original bytes must be kept"
            if headers:
                assert [(h["key"], h["value"]) for h in row["headers"]] == list(headers), name
    assert len(in_sink) + len(in_dead) == len(CASES)
    assert pipeline.cli("audit", "--against-kafka").returncode == 0


@pytest.mark.local_lake
def test_hostile_arguments_fail_with_a_message_and_write_nothing(pipeline):
    for args, message in [
        (["run", "../x"], "pipeline name '../x' is not allowed: pipeline names are [a-z0-9_]+"),
        (["status", "Orders-X"], "pipeline name 'Orders-X' is not allowed"),
        (["run", "no_such_pipeline"], "no pipeline 'no_such_pipeline' in"),
        (["run", "/nonexistent/x.yaml"], "pipeline file /nonexistent/x.yaml does not exist"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "offsetlake", "--pipelines-dir", str(pipeline.folder), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert done.returncode == 2, (args, done.stderr[-2000:])
        assert message in done.stderr and "Traceback" not in done.stderr, (args, done.stderr[-2000:])
    assert not pipeline.lake.exists()
    body = pipeline.file.read_text()
    pipeline.file.write_text(body.replace(f"name: {pipeline.name}", "name: ../x"))
    done = pipeline.cli("run")
    assert done.returncode == 2 and "'../x' is not allowed" in done.stderr and "Traceback" not in done.stderr
    pipeline.file.write_text(body + "\nsurprise_field: 1\n")
    done = pipeline.cli("run")
    assert done.returncode == 2 and "surprise_field: Extra inputs are not permitted" in done.stderr, done.stderr[-1000:]
    assert not pipeline.lake.exists()


@pytest.mark.local_lake
def test_secrets_never_reach_logs_ledger_metadata_reports_or_output(pipeline):
    """A marker password in the Kafka options: grep every output and every file the runs wrote."""
    marker = f"MARKER-{uuid.uuid4().hex}"
    _create_topic(pipeline.bootstrap, pipeline.topic)
    (pipeline.folder / f"{pipeline.name}.expectations.yaml").write_text(
        "expectations:\n  - expect_column_values_to_not_be_null: {column: customer}\n"
    )
    config = pipeline.write(
        kafka={
            "bootstrap_servers": pipeline.bootstrap,
            "options": {"client.id": "secrets-test", "sasl.username": "svc", "sasl.password": marker, "ssl.key.password": marker},
        },
        validation={"on_failure": "fail"},
    )
    producer = Producer({"bootstrap.servers": pipeline.bootstrap})
    for i in range(50):
        producer.produce(pipeline.topic, value=_order(i, customer=None if i == 7 else "c1"), partition=0)
    producer.produce(pipeline.topic, value=b"{broken", partition=0)
    assert producer.flush(30) == 0

    outputs = []
    failed = pipeline.cli("run", "--log-level", "DEBUG", "--run-id", "secret-run")  # fails validation
    assert failed.returncode == 3, failed.stderr[-2000:]
    outputs.append(failed)
    pipeline.write(kafka=config.kafka.model_dump(), validation={"on_failure": "quarantine"})
    for args in (["run", "--log-level", "DEBUG", "--run-id", "secret-run"], ["status"], ["ledger"], ["ledger", "--json"], ["audit"]):
        done = pipeline.cli(*args)
        assert done.returncode == 0, (args, done.stderr[-2000:])
        outputs.append(done)
    for done in outputs:
        assert marker not in done.stdout and marker not in done.stderr, done.args
    written = [p for p in pipeline.lake.rglob("*") if p.is_file()]
    assert any(p.suffix == ".html" for p in written) and any("_delta_log" in str(p) for p in written)
    leaked = [str(p) for p in written if marker.encode() in p.read_bytes()]
    assert not leaked, f"the Kafka password was written to {leaked}"


PARSE_CASES = [
    _order(1),
    None,
    b'{"order_id": 2, "customer": "\xff"}',
    b"[1, 2]",
    b"order 3",
    b"",
    b"   ",
    b"{}",
    b'{"customer": "no id"}',
    b'{"order_id": "4"}',
    b'{"order_id": 5.0}',
    b'{"order_id": 99999999999999999999}',
    b"{'order_id': 6}",
    b'{"order_id": 7, "order_id": 8}',
    b'{"order_id": 9}{"order_id": 10}',
    b'{\n  "order_id": 11\n}',
    b'{"order_id": 12, "amount": NaN}',
    b'{"order_id": 13, "amount": 3}',
    b'{"order_id": 14, "customer": 7}',
    b'{"order_id": 15, "customer": {"nested": [1]}}',
    b'{"order_id": 16, "created_at": 1700000000}',
    b'{"order_id": 17, "created_at": "2026-11-22"}',
    b'{"order_id": 18, "created_at": "2026-11-22 10:00:00.5+01:00"}',
    b'{"order_id": 19, "created_at": "yesterday"}',
    b'{"order_id": 20, "created_at": "2026-11-22T10:00:00.1234567Z"}',
    b'{"Order_Id": 21}',
    b'{"order_id": 22, "customer": "caf\\u00e9", "extra": {"deep": true}}',
    b'  {"order_id": 23}  ',
    b'{"order_id": null}',
    b'{"order_id": 24, "currency": "EUR"} trailing',
    b'"just a string"',
    b"42",
    b"null",
    b"\x00\x01",
]


def _decisions(spark, decoder, values: list) -> list[str]:
    """What one chunk of ``values`` becomes, value by value: (parsed fields, dead-letter reason),
    as text so NaN equals NaN. Built as a read task builds it (decode_chunk), finished by Spark."""
    import pyarrow as pa

    from offsetlake.formats import PARSED, PARSED_IN_READ, REASON

    chunk = decoder.decode_chunk(values)
    problems = chunk.problems or [None] * len(values)
    table = pa.table(
        {
            "value": pa.array(values, pa.binary()),
            "offset": pa.array(range(len(values)), pa.int64()),
            "read_problem": pa.array(problems, pa.string()),
            PARSED_IN_READ: chunk.parsed,
        }
    )
    from pyspark.sql import functions as F

    frame = decoder.decode_in_spark(spark.createDataFrame(table)).withColumn(REASON, F.coalesce(F.col("read_problem"), F.col(REASON)))
    rows = {r["offset"]: r for r in frame.select("offset", PARSED, REASON).collect()}
    return [str((rows[i][PARSED] if rows[i][REASON] is None else None, rows[i][REASON])) for i in range(len(values))]


def test_what_a_value_becomes_never_depends_on_the_values_around_it(pipeline, spark, monkeypatch):
    """The read tasks parse JSON with pyarrow and leave what it refuses to Spark's from_json
    (offsetlake.formats.json_records); which one takes a value follows chunk boundaries, so
    fetch timing. Found by an adversarial run (issue 15, bug 8): JSON nested 5,000 levels deep
    was a row when its chunk parsed in pyarrow and a dead letter when a malformed neighbour sent
    the chunk to Spark. Every tricky value here must get the same answer alone, among good
    values and next to malformed ones (the read task takes the chunk apart) and from Spark
    alone (pyarrow refusing every value)."""
    from offsetlake.formats import decoder_for

    config = pipeline.write()
    decoder = decoder_for(config)
    assert decoder.read_type() is not None, "the test pipeline's schema must be one the read tasks parse"
    deep = [1_000, 1_001, 5_000]  # nesting levels, the value's outer object included
    cases = (
        PARSE_CASES
        + [b'{"order_id": 30, "x": ' + b"[" * (d - 1) + b"]" * (d - 1) + b"}" for d in deep]
        + [
            b'{"order_id": 31, "customer": "\\ud800x"}',
            b'{"order_id": 32, "customer": "\\udc00"}',
            b'{"order_id": 33, "customer": "\\ud83d\\ude00"}',
            b'{"order_id": 34, "customer": "a\\\\ud800"}',
            # a surrogate pair 1,000 levels deep: checking the pair must not outgrow the recursion limit
            b'{"order_id": 35, "customer": "\\ud83d\\ude00", "x": ' + b"[" * 998 + b"]" * 998 + b"}",
        ]
    )
    alone = [_decisions(spark, decoder, [case])[0] for case in cases]
    good = [_order(1000 + i) for i in range(150)]
    among_good = _decisions(spark, decoder, [v for case in cases for v in (*good, case)])[150::151]
    # a cut record, a tombstone, a value of the wrong type (a parse error naming its row) and one
    # whose error names none (a number pyarrow cannot convert) around each case
    bad = [b"{broken", None, b'{"order_id": "not a number"}', b'{"order_id": 1.5}']
    among_bad = _decisions(spark, decoder, [v for case in cases for v in (*bad, case, *good[:40])])[len(bad) :: len(bad) + 41]
    import pyarrow as pa

    from offsetlake.formats import json_records

    monkeypatch.setattr(json_records, "parse_json_values", lambda values, struct: pa.nulls(len(values), struct))
    by_spark = _decisions(spark, decoder, cases)
    monkeypatch.undo()
    for case, a, g, b, s in zip(cases, alone, among_good, among_bad, by_spark, strict=True):
        assert a == g == b == s, f"value {case[:80]!r}: alone {a}, among good values {g}, next to malformed ones {b}, by Spark {s}"
    decided = dict(zip(cases, alone, strict=True))
    assert "more than one JSON value" in decided[b'{"order_id": 9}{"order_id": 10}'], "the second object must not vanish"
    assert "unpaired UTF-16 surrogate" in decided[cases[-5]] and "unpaired UTF-16 surrogate" in decided[cases[-4]]
    assert "None)" in decided[cases[-3]] and "None)" in decided[cases[-2]], "a valid pair and an escaped backslash are rows"
    assert "None)" in decided[cases[-1]], "a valid pair 1,000 levels deep is a row"
    assert decided[cases[-8]].endswith("None)"), "1,000 levels is what Spark reads: a row"
    assert "nests JSON 1001 levels deep" in decided[cases[-7]] and "nests JSON 5000 levels deep" in decided[cases[-6]]
    reasons = {a.rsplit(", ", 1)[-1] for a in alone}
    assert len(reasons) >= 8, f"the cases should cover several dead-letter reasons: {reasons}"


def test_the_read_task_leaves_only_the_bad_records_of_a_chunk_to_spark(pipeline):
    """A chunk pyarrow refuses whole is taken apart (``json_records.parse_json_values``): its
    tombstones and cut records are left out, a wrong-typed value is found by the row its parse
    error names, and every good record is parsed in the read task. Before, the chunk was halved
    down to pieces of 64 records and each piece with a bad record went to Spark whole: a chunk
    7 % bad, as the fault campaign writes, settled none of its records (RELIABILITY.md, round 18)."""
    import random

    from offsetlake.formats import decoder_for

    decoder = decoder_for(pipeline.write())
    rng = random.Random(7)
    for size in (11, 300, 5_000):
        values: list[bytes | None] = []
        for i in range(size):
            draw = rng.random()
            order = _order(i)
            values.append(order[: rng.randrange(1, len(order) - 1)] if draw < 0.03 else None if draw < 0.07 else order)
        values[size // 2] = b'{"order_id": "not a number"}'  # pyarrow names its row
        chunk = decoder.decode_chunk(values)
        assert chunk.parsed is not None and chunk.settled is not None
        good = [i for i, v in enumerate(values) if v is not None and v.endswith(b"}") and b"not a number" not in v]
        assert [i for i, s in enumerate(chunk.settled) if s] == good, f"a chunk of {size}: every good record settles, no other"
        assert chunk.parsed.take(good).to_pylist() == [decoder.decode_chunk([values[i]]).parsed.to_pylist()[0] for i in good]
