"""``offsetlake publish``: a Delta sink's changes to a topic, exactly once and in order, so that a
consumer following the guide's rule holds the table's rows after every version. Through ingests, a
backfill whose new transform filters rows out (issue 48, finding 5), a rewind that undoes it
(finding 3), a foreign DELETE, and publishers killed before and after their commit. An independent
read_committed reader replays the topic by the rule and compares it with the sink's history read
with plain deltalake at every version (``kafka_truth.check_outbox_replay``)."""

from __future__ import annotations

import json
import uuid

import pytest
from deltalake import DeltaTable
from kafka_truth import check_outbox_replay, outbox_view, read_records, sink_rows_view

from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import ConfigError
from offsetlake.ledger import Ledger
from offsetlake.outbox import check_outbox, publish, read_progress
from offsetlake.plan import RunContext
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import execute_recorded_batch, run_pipeline

FILTER = """
from pyspark.sql import functions as F


def without_every_fourth(rows):
    return rows.where(F.col("order_id") % 4 != 0)
"""


def _published(bootstrap: str, topic: str) -> list[tuple[int, str, str]]:
    """(sink version, kind, op) of every record, in topic order."""
    out = []
    for record in read_records(bootstrap, topic):
        h = {k: v.decode() for k, v in record.headers}
        assert h["offsetlake.op"] in ("row", "delete")
        if h["offsetlake.op"] == "row":
            assert json.loads(record.value)["order_id"] == int(record.key), "the key is the order_id column"
        else:
            assert record.value is None
        out.append((int(h["offsetlake.sink_version"]), h["offsetlake.kind"], h["offsetlake.op"]))
    return out


def test_a_consumer_of_the_outbox_equals_the_table_at_every_version(pipeline, spark):
    config = pipeline.write(max_records_per_batch=400)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    out = f"{pipeline.topic}-outbox"
    ensure_topic(pipeline.bootstrap, out, 1)  # one partition: the topic's order is the publish order
    next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, malformed_every=41)
    batches = run_pipeline(config, RunContext("first"), lambda: spark)
    assert len(batches) == 3

    with pytest.raises(ConfigError, match=r"--key names \['no_such'\], not columns of the sink"):
        publish(config, out, ["no_such"])
    first = publish(config, out, ["order_id"], max_batches=1)
    assert [p.batch_id for p in first] == [batches[0].plan.batch_id]

    # killed after producing (nothing of that version is visible), then after the commit (all of it is)
    killed = pipeline.cli("publish", "--to", out, "--key", "order_id", "--max-batches", "1", env={"OFFSETLAKE_FAILPOINT": "after_produce"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert read_progress(config, out).batch_id == batches[0].plan.batch_id
    killed = pipeline.cli(
        "publish", "--to", out, "--key", "order_id", "--max-batches", "1", env={"OFFSETLAKE_FAILPOINT": "after_kafka_commit"}
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert read_progress(config, out).batch_id == batches[1].plan.batch_id

    # a backfill of part of partition 0 with a transform that now filters rows out (finding 5)
    (pipeline.folder / "outbox_filter.py").write_text(FILTER)
    config = pipeline.write(max_records_per_batch=400, transform="outbox_filter:without_every_fourth")
    plan = plan_backfill(config, RunContext("fix"), [0], 50, 250)
    Ledger(config.layout.ledger, config.name).record_plan(plan)
    execute_recorded_batch(config, plan.batch_id, lambda: spark)
    publish(config, out, ["order_id"])
    assert check_outbox_replay(pipeline.bootstrap, out, config.layout.sink) >= 0
    deletes = [v for v, kind, op in _published(pipeline.bootstrap, out) if kind == "backfill" and op == "delete"]
    assert deletes, "the backfill's filtered coordinates must be published as deletes"

    # a rewind to the first batch undoes the backfill: the earlier rows come back (finding 3)
    rewind_pipeline(config, batches[0].plan.batch_id, reason="test")
    publish(config, out, ["order_id"])
    restored = [v for v, kind, op in _published(pipeline.bootstrap, out) if kind == "rewind" and op == "row"]
    assert restored, "the rewind must publish the rows it restored"
    check_outbox_replay(pipeline.bootstrap, out, config.layout.sink)

    # a foreign DELETE (delta-rs, as any Delta writer) is published as deletes too
    DeltaTable(config.layout.sink.path).delete("order_id % 10 = 3")
    produce_orders(pipeline.bootstrap, pipeline.topic, 300, first_id=next_id)
    assert run_pipeline(config, RunContext("second"), lambda: spark)
    done = pipeline.cli("publish", "--to", out, "--key", "order_id", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    kinds = [json.loads(line)["kind"] for line in done.stdout.splitlines()]
    assert kinds[0] == "foreign" and set(kinds[1:]) == {"ingest"}, kinds
    last = check_outbox_replay(pipeline.bootstrap, out, config.layout.sink)
    assert outbox_view(pipeline.bootstrap, out, last) == sink_rows_view(config.layout.sink, last) != {}
    versions = [v for v, _, _ in _published(pipeline.bootstrap, out)]
    assert versions == sorted(versions), "published in sink version order"

    check = check_outbox(config, out)
    assert check.ok and check.version == last, check.text()
    assert publish(config, out, ["order_id"]) == []
    assert pipeline.cli("publish", "--to", out, "--check").returncode == 0

    # the outbox's own check finds what a consumer would get wrong: a stray row
    from confluent_kafka import Producer

    stray = Producer({"bootstrap.servers": pipeline.bootstrap})
    headers = [("offsetlake.topic", pipeline.topic.encode()), ("offsetlake.partition", b"0"), ("offsetlake.offset", b"999999")]
    stray.produce(out, b'{"order_id": 1}', headers=[*headers, ("offsetlake.sink_version", b"1"), ("offsetlake.op", b"row")])
    stray.flush(30)
    found = pipeline.cli("publish", "--to", out, "--check")
    assert found.returncode == 1 and "offset 999999: the table has 0 row(s), a consumer holds 1" in found.stdout, found.stdout


def test_publish_refuses_what_it_cannot_publish(pipeline, broker):
    keyed = pipeline.write(sink={"mode": "upsert", "key": ["order_id"]})
    with pytest.raises(ConfigError, match="append sink; this one is sink.mode upsert"):
        publish(keyed, "anything")
    config = pipeline.write()
    missing = f"missing-{uuid.uuid4().hex[:6]}"
    with pytest.raises(ConfigError, match=f"topic '{missing}' does not exist: create it first"):
        publish(config, missing)
    bad = pipeline.cli("publish", "--to", missing, "--max-batches", "0")
    assert bad.returncode == 2 and "--max-batches must be at least 1" in bad.stderr
