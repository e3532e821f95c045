"""A backfill by time reprocesses exactly the records whose own timestamps fall in the window.

Found by an adversarial run (issue 15, bug 9): producers set record timestamps, so they need not
grow with offsets. With timestamps 00:00 (offsets 0-9), year 3000 (10), 01:00 (11-20), -5 ms
(21), 02:00 (22-31), windows [00:30, 01:30) and [01:30, 02:30) were refused ("selects no
committed offsets") though 10 records match each, [2999, 3001) reprocessed 22 records outside
it, and a start of -1 ms (Kafka's "latest" sentinel) resolved to nothing.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from confluent_kafka import Producer

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.errors import BackfillParamsError
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.runs import execute_recorded_batch, run_pipeline

TAG = """
from pyspark.sql import functions as F


def tag(rows):
    return rows.withColumn("tag", F.lit("reprocessed"))
"""


def _ms(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp() * 1000)


# Records stamped weeks (or decades) ago would be deleted by the broker's time-based retention
# (7 days by default) as soon as it checks: the topic keeps them.
KEEP_OLD_RECORDS = {"retention.ms": "-1"}
STAMPS = (
    [_ms("2026-11-01T00:00:00")] * 10
    + [_ms("3000-01-01T00:00:00")]
    + [_ms("2026-11-01T01:00:00")] * 10
    + [-5]
    + [_ms("2026-11-01T02:00:00")] * 10
)


def _tagged(config) -> list[int]:
    data = storage.table(config.layout.sink).to_pyarrow_dataset().to_table(columns=["_kafka_offset", "tag"]).to_pylist()
    return sorted(r["_kafka_offset"] for r in data if r["tag"] == "reprocessed")


@pytest.mark.parametrize(
    ("start", "end", "selected"),
    [
        ("2026-11-01T00:30:00Z", "2026-11-01T01:30:00Z", list(range(11, 21))),
        ("2026-11-01T01:30:00Z", "2026-11-01T02:30:00Z", list(range(22, 32))),
        ("2999-01-01T00:00:00Z", "3001-01-01T00:00:00Z", [10]),
        ("1969-12-31T23:59:59.990Z", "1970-01-01T00:00:00Z", [21]),
    ],
)
def test_a_time_window_reprocesses_only_the_records_whose_timestamps_fall_in_it(pipeline, spark, start, end, selected):
    config = pipeline.write(max_records_per_batch=1_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1, config=KEEP_OLD_RECORDS)
    producer = Producer({"bootstrap.servers": pipeline.bootstrap})
    for offset, stamp in enumerate(STAMPS):
        producer.produce(pipeline.topic, value=json.dumps({"order_id": offset}).encode(), partition=0, timestamp=stamp)
    assert producer.flush(30) == 0
    run_pipeline(config, RunContext("ingest"), lambda: spark)

    (pipeline.folder / "tag_transform.py").write_text(TAG)
    tagged = pipeline.write(max_records_per_batch=1_000, transform="tag_transform:tag")
    plan = plan_backfill(tagged, RunContext(f"by-time-{start}"), None, from_time=start, to_time=end)
    assert "record times [" in plan.describe(), "the plan says it selects by record time"
    Ledger.of(tagged).record_plan(plan)
    result = execute_recorded_batch(tagged, plan.batch_id, lambda: spark)
    assert result.total("records_read") == len(selected)
    assert _tagged(tagged) == selected, "exactly the records of the window are reprocessed, no other"
    assert storage.table(tagged.layout.sink).to_pyarrow_dataset().count_rows() == len(STAMPS)
    report = audit_pipeline(tagged, against_kafka=True)
    assert report.ok, report.text()

    again = Ledger.of(tagged).plan_by_batch_id(plan.batch_id)
    assert again is not None and again.window == plan.window, "a rerun reads the same window from the ledger"


def test_a_time_window_with_no_committed_offsets_is_refused(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1, config=KEEP_OLD_RECORDS)
    producer = Producer({"bootstrap.servers": pipeline.bootstrap})
    producer.produce(pipeline.topic, value=b'{"order_id": 1}', partition=0, timestamp=_ms("2026-11-01T00:00:00"))
    assert producer.flush(30) == 0
    run_pipeline(config, RunContext("ingest"), lambda: spark)
    with pytest.raises(BackfillParamsError, match=r"record times \[2027-.*selects no committed offsets"):
        plan_backfill(config, RunContext("future"), None, from_time="2027-01-01T00:00:00Z", to_time="2027-02-01T00:00:00Z")
