"""``offsetlake publish``: a Delta sink's committed batches to a topic, exactly once and in order,
through ingests, a backfill, a rewind and publishers killed before and after their commit. An
independent read_committed reader compares the topic with the sink's history read with plain
deltalake: per sink commit, the rows of its ranges at its version, each published once."""

from __future__ import annotations

import json
import uuid
from collections import Counter

import pytest
from kafka_truth import read_records

from offsetlake import storage
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import ConfigError
from offsetlake.history import sink_commits
from offsetlake.ledger import Ledger
from offsetlake.outbox import publish, read_progress
from offsetlake.plan import RunContext
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import execute_recorded_batch, run_pipeline


def _expected(config) -> list[tuple[int, str, str, tuple]]:
    """(sink version, batch, kind, source record) of every record the sink's history asks for,
    from plain row filtering of each version's table (not the outbox's code)."""
    out = []
    sink = config.layout.sink
    for commit in sorted(sink_commits(storage.table(sink), config.name), key=lambda c: c.version):
        if commit.kind == "rewind":
            out += [(commit.version, commit.batch_id, "rewind", ("undone", b)) for b in commit.entry.rewound]
            continue
        if commit.kind not in ("ingest", "backfill"):
            continue
        spans = [(r.topic, r.partition, r.start, r.end) for r in commit.entry.offset_ranges]
        for row in storage.table(sink, version=commit.version).to_pyarrow_dataset().to_table().to_pylist():
            coordinates = (row["_kafka_topic"], row["_kafka_partition"], row["_kafka_offset"])
            if any(t == coordinates[0] and p == coordinates[1] and s <= coordinates[2] < e for t, p, s, e in spans):
                out.append((commit.version, commit.batch_id, str(commit.kind), coordinates))
    return out


def _published(bootstrap: str, topic: str) -> list[tuple[int, str, str, tuple]]:
    out = []
    for record in read_records(bootstrap, topic):
        h = {k: v.decode() for k, v in record.headers}
        if h["offsetlake.kind"] == "rewind":
            source: tuple = ("undone", json.loads(record.value)["rewound_batch"])
        else:
            source = (h["offsetlake.topic"], int(h["offsetlake.partition"]), int(h["offsetlake.offset"]))
            assert json.loads(record.value)["order_id"] == int(record.key), "the key is the order_id column"
        out.append((int(h["offsetlake.sink_version"]), h["offsetlake.batch"], h["offsetlake.kind"], source))
    return out


def test_publish_sends_every_sink_commit_once_in_order_through_backfill_rewind_and_kills(pipeline, spark):
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

    # killed after producing (nothing of that commit is visible), then after the commit (all of it is)
    killed = pipeline.cli("publish", "--to", out, "--key", "order_id", "--max-batches", "1", env={"OFFSETLAKE_FAILPOINT": "after_produce"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert read_progress(config, out).batch_id == batches[0].plan.batch_id
    killed = pipeline.cli(
        "publish", "--to", out, "--key", "order_id", "--max-batches", "1", env={"OFFSETLAKE_FAILPOINT": "after_kafka_commit"}
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert read_progress(config, out).batch_id == batches[1].plan.batch_id

    # a backfill of part of partition 0 and a rewind to the first batch, then more records
    plan = plan_backfill(config, RunContext("fix"), [0], 50, 250)
    Ledger(config.layout.ledger, config.name).record_plan(plan)
    execute_recorded_batch(config, plan.batch_id, lambda: spark)
    rewind_pipeline(config, batches[0].plan.batch_id, reason="test")
    produce_orders(pipeline.bootstrap, pipeline.topic, 300, first_id=next_id)
    assert run_pipeline(config, RunContext("second"), lambda: spark)

    done = pipeline.cli("publish", "--to", out, "--key", "order_id", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    kinds = [json.loads(line)["kind"] for line in done.stdout.splitlines()]
    assert kinds[:3] == ["ingest", "backfill", "rewind"] and set(kinds[3:]) == {"ingest"}, kinds

    expected, published = _expected(config), _published(pipeline.bootstrap, out)
    assert Counter(published) == Counter(expected)  # every record once, none that should not be
    assert max(Counter(published).values()) == 1
    versions = [v for v, *_ in published]
    assert versions == sorted(versions), "published in sink version order"
    assert any(kind == "backfill" for _, _, kind, _ in published) and any(kind == "rewind" for _, _, kind, _ in published)

    again = publish(config, out, ["order_id"])
    assert again == [] and Counter(_published(pipeline.bootstrap, out)) == Counter(expected)


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
