"""A keyed lake written before keyed state had a table of its own (main 7450f63: delete markers,
folded states and contributions as hidden rows of the sink) is continued by this code: the
state moves to the state table in one recorded sink commit per pipeline, exactly once, also when
the move dies between its two commits, and from then on a plain reader sees only rows (issue 51,
item 4).

The lake under ``tests/data/lake-keyed-v1`` was written by ``scripts/make_keyed_upgrade_lake.py``
with that version's code: an upsert sink with deletes and an hourly aggregate, each through ingest
batches, a backfill and more batches. Its records are re-produced here into a fresh topic of the
same name at the same offsets and timestamps.
"""

from __future__ import annotations

import base64
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from kafka_truth import PRIVATE_COLUMNS, delete_topic, keyed_sink_rows
from orders_truth import committed_rows, same

from offsetlake import failpoints, state_table, storage
from offsetlake.audit import audit_pipeline
from offsetlake.config import load_pipeline
from offsetlake.engine_replay import replay
from offsetlake.formats import CHANGE, DELETE
from offsetlake.history import sink_commits
from offsetlake.kafka import topic_ids
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

DATA = Path(__file__).resolve().parent / "data" / "lake-keyed-v1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from make_keyed_upgrade_lake import SINKS, TOPIC, pipeline_body, produce  # noqa: E402


def _reproduce(bootstrap: str, manifest: dict) -> None:
    """The old topic again: same partitions, records, offsets and timestamps."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    if TOPIC in admin.list_topics(timeout=30).topics:
        delete_topic(bootstrap, TOPIC)
    admin.create_topics([NewTopic(TOPIC, num_partitions=manifest["partitions"], replication_factor=1)])[TOPIC].result(30)
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5})
    delivered: list[tuple[int, int]] = []
    for r in manifest["records"]:
        producer.produce(
            TOPIC,
            value=base64.b64decode(r["value"]) if r["value"] is not None else None,
            key=base64.b64decode(r["key"]) if r["key"] is not None else None,
            partition=r["partition"],
            timestamp=r["timestamp_ms"],
            on_delivery=lambda err, m, want=r["offset"]: delivered.append((m.offset() if err is None else -1, want)),
        )
    assert producer.flush(60) == 0
    assert len(delivered) == len(manifest["records"]) and all(got == want for got, want in delivered)


def _same_topic_id(lake: Path, old: str, new: str | None) -> None:
    """The re-produced topic is the old one again: the topic id the lake's entries recorded
    becomes the new topic's (in every commit of its logs, and in the history cache beside them),
    so invariant 16's check sees the topic the records were committed from."""
    assert new is not None
    for log in [*lake.glob("*/_delta_log/*.json"), *lake.glob("*/_offsetlake_history/*.json")]:
        text = log.read_text()
        if old in text:
            log.write_text(text.replace(old, new))


def _oracle(config, source) -> dict[tuple, dict]:
    rows = committed_rows(source)
    if config.sink.mode == "upsert":
        newest: dict[tuple, dict | None] = {}
        for r in sorted(rows, key=lambda r: (r["_kafka_partition"], r["_kafka_offset"])):  # a key lives in one partition
            newest[(r["_kafka_key"],)] = None if r.get(CHANGE) == DELETE else r
        return {k: v for k, v in newest.items() if v is not None}
    return replay(config, [r for r in rows if r.get(CHANGE) != DELETE])


def _check(config, source) -> None:
    """A plain read of the sink (no filter; no private column in its schema) equals the oracle."""
    schema = storage.table(config.layout.sink).schema().to_arrow().names
    assert not [c for c in schema if c in PRIVATE_COLUMNS], schema
    group = ["_kafka_key"] if config.sink.mode == "upsert" else ["currency", "window_start", "window_end"]
    rows = keyed_sink_rows(config.layout.sink)
    actual = {tuple(r[c] for c in group): r for r in rows}
    assert len(actual) == len(rows)
    columns = (
        ["order_id", "customer", "amount", "currency", "created_at"]
        if config.sink.mode == "upsert"
        else list(SINKS[config.name]["measures"])
    )
    same(_oracle(config, source), actual, columns)


def _crash(_name: str) -> None:
    raise failpoints.SimulatedCrash()


def test_a_keyed_lake_with_its_state_inside_the_sink_moves_it_out_once(broker, tmp_path, spark):
    manifest = json.loads((DATA / "records.json").read_text())
    expected = json.loads((DATA / "expected.json").read_text())
    _reproduce(broker.bootstrap, manifest)
    lake = tmp_path / "lake"
    shutil.copytree(DATA / "lake", lake)
    source = SimpleNamespace(bootstrap=broker.bootstrap, topic=TOPIC)
    configs = {}
    for name in SINKS:
        file = tmp_path / f"{name}.yaml"
        body = pipeline_body(name, broker.bootstrap, str(lake))
        if body["sink"]["mode"] == "aggregate":  # the moved state folds at the next batch: its records are older than 1s
            body["sink"] = {**body["sink"], "fold_after": "1s"}
        file.write_text(yaml.safe_dump(body, sort_keys=False))
        configs[name] = load_pipeline(str(file))
    _same_topic_id(lake, manifest["topic_id"], topic_ids(configs["keyed_upsert"], [TOPIC])[TOPIC])

    for name, config in configs.items():
        before = storage.table(config.layout.sink)
        assert before.to_pyarrow_dataset().count_rows() == expected["sink_rows_with_state"][name]
        assert state_table.pinned_version(before) is None and "_offsetlake_hidden" in before.schema().to_arrow().names

        # the move dies between its state commit and its sink commit: the sink is as it was
        with failpoints.on("after_state_commit", _crash), pytest.raises(failpoints.SimulatedCrash):
            run_pipeline(config, RunContext(f"move-crash-{name}"), lambda: spark, emit=lambda _: None)
        after_crash = storage.table(config.layout.sink)
        assert after_crash.version() == before.version() and storage.table(config.layout.state).version() >= 1

        # the next run moves it (and reads nothing new: every record was committed)
        assert run_pipeline(config, RunContext(f"move-{name}"), lambda: spark, emit=lambda _: None) == []
        moves = [c for c in sink_commits(storage.table(config.layout.sink), name) if c.kind == "state_move"]
        assert len(moves) == 1, moves
        state = state_table.pinned(config, storage.table(config.layout.sink))
        assert state is not None and state.to_pyarrow_dataset().count_rows() == expected["sink_rows_with_state"][name]
        _check(config, source)
        report = audit_pipeline(config, against_kafka=True)
        assert report.ok, report.text()

        # exactly once: nothing moves again
        run_pipeline(config, RunContext(f"again-{name}"), lambda: spark, emit=lambda _: None)
        assert len([c for c in sink_commits(storage.table(config.layout.sink), name) if c.kind == "state_move"]) == 1

    produce(broker.bootstrap, 80, seed=9)
    for name, config in configs.items():
        assert run_pipeline(config, RunContext(f"after-{name}"), lambda: spark, emit=lambda _: None)
        _check(config, source)
        report = audit_pipeline(config, against_kafka=True)
        assert report.ok, report.text()
        if config.sink.engine is not None:
            assert report.against_kafka.get("folded"), "the moved contributions fold at the first batch after the move"
