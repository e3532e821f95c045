"""Dead letters say why as data (issue 36 item 5): a ``reason_code`` column next to the text
``reason``, from one constructor per cause (``offsetlake.formats.reasons``). A dead-letter table
an older offsetlake created (no ``reason_code``) gains the column; the rows it wrote read the code
as null (``test_lake_written_by_older_offsetlake``), new rows have it."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
from confluent_kafka import Producer

from offsetlake import storage
from offsetlake.dead_letters import DEAD_LETTER_SCHEMA
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.formats import reasons
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

DOC = Path(__file__).resolve().parents[1] / "docs" / "reference" / "dead-letters.md"
OLD_SCHEMA = pa.schema([f for f in DEAD_LETTER_SCHEMA if f.name != "reason_code"])  # as offsetlake wrote it before


def _dead_letters(config) -> list[dict]:
    table = storage.table(config.layout.dead_letters)
    rows = table.to_pyarrow_dataset().to_table(columns=["_kafka_offset", "reason", "reason_code", "batch_id"]).to_pylist()
    return sorted(rows, key=lambda r: r["_kafka_offset"])


def test_each_constructor_gives_its_code_and_the_text_stays():
    assert reasons.code_of(reasons.TOMBSTONE) == "tombstone" and reasons.text_of(reasons.TOMBSTONE) == "tombstone: record has a null value"
    too_large = reasons.record_too_large(12, 10)
    assert reasons.code_of(too_large) == "record_too_large"
    assert reasons.text_of(too_large) == "record_too_large: its key and value hold 12 bytes, more than the pipeline's max_record_bytes (10)"
    assert reasons.code_of(reasons.required_missing("vendor")) == "required_missing"
    key = reasons.key_undecodable(reasons.undecodable("payload ends early"))
    assert reasons.code_of(key) == "key_undecodable" and reasons.text_of(key) == "key: payload ends early"
    assert reasons.code_of("free text") is None and reasons.text_of("free text") == "free text"


def test_the_reference_lists_every_code():
    table = DOC.read_text().split("| `reason_code` | meaning |", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", table, re.M))
    assert listed == set(reasons.CODES), f"docs/reference/dead-letters.md lists {sorted(listed)}, the code has {sorted(reasons.CODES)}"


def test_dead_letters_carry_codes_also_in_a_table_an_older_offsetlake_created(pipeline, spark):
    config = pipeline.write(max_record_bytes=2_000)
    # the dead-letter table as an older offsetlake created it (the rows it wrote: test_lake_written_by_older_offsetlake)
    storage.create_table(config.layout.dead_letters, OLD_SCHEMA, partition_by=None, mode="ignore")

    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 20, partition=0, malformed_every=10)  # offsets 9 and 19 malformed
    producer = Producer({"bootstrap.servers": pipeline.bootstrap})
    producer.produce(pipeline.topic, value=None, key=b"gone", partition=0)  # 20: a tombstone
    producer.produce(pipeline.topic, value=b'{"customer": "no id"}', partition=0)  # 21: order_id is required
    producer.produce(pipeline.topic, value=b'{"order_id": 1, "customer": "' + b"x" * 3_000 + b'"}', partition=0)  # 22
    producer.flush(30)
    run_pipeline(config, RunContext("codes"), lambda: spark)

    assert "reason_code" in storage.table(config.layout.dead_letters).schema().to_arrow().names
    rows = _dead_letters(config)
    coded = {r["_kafka_offset"]: (r["reason_code"], r["reason"]) for r in rows}
    assert {o: code for o, (code, _) in coded.items()} == {
        9: "undecodable",
        19: "undecodable",
        20: "tombstone",
        21: "required_missing",
        22: "record_too_large",
    }
    assert coded[20][1] == "tombstone: record has a null value" and coded[21][1] == "required field 'order_id' is missing or null"
    assert coded[22][1].startswith("record_too_large: its key and value hold")
    assert not any(reasons.SEPARATOR in text for _, text in coded.values()), "the text reason carries no code"
