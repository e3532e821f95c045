"""Keyed sinks (issue 19): ``sink.mode: upsert`` keeps one row per key, the newest record's;
a tombstone deletes its key; the merge is one commit with the batch's txns and ledger entry."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from kafka_truth import keyed_sink_rows, last_stable_offsets, read_records, replay_by_key

from offsetlake import failpoints, storage
from offsetlake.audit import audit_pipeline
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.history import sink_commits
from offsetlake.ledger import Ledger
from offsetlake.maintenance import maintain
from offsetlake.plan import RunContext
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import execute_recorded_batch, run_pipeline


def _produce(bootstrap: str, topic: str, records: list[tuple[int, bytes | None, bytes | None]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for partition, key, value in records:
        producer.produce(topic, key=key, value=value, partition=partition)
    assert producer.flush(30) == 0


def _updates(n: int, keys: int, partitions: int, seed: int, delete_share: float = 0.1) -> list[tuple[int, bytes | None, bytes | None]]:
    """``n`` updates over ``keys`` keys, each key always in the same partition, some tombstones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randrange(keys)
        value = (
            None
            if rng.random() < delete_share
            else json.dumps(
                {"order_id": i, "customer": f"c{k}", "amount": float(i), "currency": "EUR", "created_at": "2026-11-23T10:00:00Z"}
            ).encode()
        )
        out.append((k % partitions, f"k{k}".encode(), value))
    return out


def _sink_by_key(config) -> dict[str, dict]:
    rows = keyed_sink_rows(config.layout.sink)
    keys = [r["_kafka_key"] for r in rows]
    assert len(keys) == len(set(keys)), "a key appears more than once"
    return {r["_kafka_key"]: r for r in rows}


def _expected(pipeline) -> dict[str, dict]:
    records = read_records(pipeline.bootstrap, pipeline.topic)
    return replay_by_key(
        records,
        key_of=lambda r: r.key.decode(),
        row_of=lambda r: None if r.value is None else {**json.loads(r.value), "_kafka_partition": r.partition, "_kafka_offset": r.offset},
    )


def _assert_converged(config, pipeline) -> None:
    expected = _expected(pipeline)
    actual = _sink_by_key(config)
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))[:10]
    for key, row in expected.items():
        got = actual[key]
        assert (got["order_id"], got["amount"], got["_kafka_partition"], got["_kafka_offset"]) == (
            row["order_id"],
            row["amount"],
            row["_kafka_partition"],
            row["_kafka_offset"],
        ), key


def _assert_audit_passes(config) -> None:
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()


def _crash(name: str) -> None:
    raise failpoints.SimulatedCrash()


@pytest.mark.torture
def test_20k_updates_over_2k_keys_with_crashes_between_batches_converge_and_audit_against_kafka(pipeline, spark):
    """A crash at each failpoint in turn over 20k updates: two minutes of batches, so ``make
    torture`` runs it. In ``make test`` its ground is held by test_failpoints (a crash at every
    failpoint, then the rerun), the keyed property tests (test_properties,
    test_merge_engine_properties: upsert and engine sinks crashed at a random failpoint, the
    state one included, against a replay), test_readers_agree (a crash between a keyed batch's
    two commits, read back by plain readers) and the CI-seed fault campaign (keyed crashes and
    audits against Kafka)."""
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3)
    config = pipeline.write(max_records_per_batch=2_500, sink={"mode": "upsert", "key": ["_kafka_key"]})
    updates = _updates(20_000, 2_000, 3, seed=19, delete_share=0.12)
    names = failpoints.NAMES + failpoints.STATE_NAMES
    rounds = len(names)
    share = len(updates) // rounds
    for i, name in enumerate(names):
        _produce(pipeline.bootstrap, pipeline.topic, updates[i * share : (i + 1) * share if i < rounds - 1 else None])
        # each round: a run dies at one step of a batch (as a SIGKILL would leave it), the next recovers
        with failpoints.on(name, _crash), pytest.raises(failpoints.SimulatedCrash):
            run_pipeline(config, RunContext(f"crash-{name}"), lambda: spark)
        run_pipeline(config, RunContext(f"after-{name}"), lambda: spark)
    _assert_converged(config, pipeline)
    assert run_pipeline(config, RunContext("nothing-new"), lambda: spark) == []
    commits = [c for c in sink_commits(storage.table(config.layout.sink), config.name)]
    merged = [c.entry.merge for c in commits if getattr(c.entry, "merge", None) is not None]
    assert sum(m["deleted"] for m in merged) > 0 and sum(m["updated"] for m in merged) > 0
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "rows compared with their key's newest record" in audit.stdout, audit.stdout

    # the audit sees a key written twice, and a row that is not its key's newest record
    table = storage.table(config.layout.sink)
    some = table.to_pyarrow_table().slice(0, 1)
    older = some.set_column(some.schema.get_field_index("amount"), "amount", pa.array([-1.0]))
    storage.append(config.layout.sink, older)
    report = audit_pipeline(config, against_kafka=True)
    assert not report.ok
    assert "has 2 rows in the keyed sink" in report.text() and "a row differs from its newest record" in report.text()


def _debezium_events(seed: int) -> tuple[list[tuple[int, bytes | None, bytes | None]], list[str]]:
    """Change events of a `customers` table (id, name, tier) over 2 partitions, as Debezium's
    Postgres connector writes them: a snapshot (r), creates, updates, deletes each followed by a
    tombstone, re-creates after a delete; some with Kafka Connect's {schema, payload} wrapper.
    Returns the events and the reasons of the malformed ones, in order."""
    rng = random.Random(seed)
    events: list[tuple[int, bytes | None, bytes | None]] = []
    live: dict[int, dict] = {}
    lsn = 1000

    def emit(op: str, before: dict | None, after: dict | None, key: int) -> None:
        nonlocal lsn
        lsn += 7
        body = {
            "before": before,
            "after": after,
            "op": op,
            "ts_ms": 1_700_000_000_000 + lsn,
            "source": {"ts_ms": 1_700_000_000_000 + lsn - 3, "lsn": lsn, "db": "shop", "table": "customers"},
        }
        value = {"schema": {"type": "struct"}, "payload": body} if rng.random() < 0.3 else body
        events.append((key % 2, json.dumps({"id": key}).encode(), json.dumps(value).encode()))

    for i in range(40):  # the snapshot
        live[i] = {"id": i, "name": f"n{i}", "tier": 1}
        emit("r", None, live[i], i)
    for _ in range(600):
        i = rng.randrange(60)
        if i not in live:
            live[i] = {"id": i, "name": f"new{i}", "tier": 0}
            emit("c", None, live[i], i)
        elif rng.random() < 0.15:
            emit("d", live.pop(i), None, i)
            events.append((i % 2, json.dumps({"id": i}).encode(), None))  # the tombstone after a delete
        else:
            before = live[i]
            live[i] = {**before, "tier": before["tier"] + 1, "name": f"{before['name']}+"}
            emit("u", before, live[i], i)
    bad = [
        (0, b'{"id": 1}', json.dumps({"before": None, "after": {"id": 1}, "op": "x", "source": {}}).encode()),
        (0, b'{"id": 2}', json.dumps({"before": None, "after": None, "op": "u", "source": {}}).encode()),
        (1, b'{"id": 3}', json.dumps({"before": None, "after": None, "op": "d", "source": {}}).encode()),
        (1, b'{"id": 5}', json.dumps({"id": 5, "name": "not an envelope"}).encode()),
    ]
    reasons = [
        "debezium envelope: op 'x' is not c, r, u or d",
        "debezium envelope: op 'u' without after",
        "debezium envelope: op 'd' without before (the table's REPLICA IDENTITY gives no key)",
        "debezium envelope: no op (not a change event)",
    ]
    return events[:300] + bad + events[300:], reasons


def _replay_debezium(records) -> dict[int, dict]:
    table: dict[int, dict] = {}
    for r in records:
        if r.value is None:
            continue  # a tombstone: nothing
        event = json.loads(r.value)
        event = event.get("payload", event)
        if event.get("op") in ("c", "r", "u") and event.get("after"):
            table[event["after"]["id"]] = {**event["after"], "_cdc_op": event["op"], "_cdc_lsn": event["source"]["lsn"]}
        elif event.get("op") == "d" and event.get("before"):
            table.pop(event["before"]["id"], None)
    return table


def test_a_debezium_topic_gives_the_table_its_changes_replayed_in_order_give(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    events, reasons = _debezium_events(seed=5)
    _produce(pipeline.bootstrap, pipeline.topic, events[:400])
    config = pipeline.write(
        max_records_per_batch=150,
        key_format="none",
        format={"type": "json", "envelope": "debezium", "schema": {"id": "long", "name": "string", "tier": "int"}, "required": ["id"]},
        sink={"mode": "upsert", "key": ["id"]},
    )
    run_pipeline(config, RunContext("snapshot"), lambda: spark)
    _produce(pipeline.bootstrap, pipeline.topic, events[400:])
    run_pipeline(config, RunContext("changes"), lambda: spark)

    expected = _replay_debezium(read_records(pipeline.bootstrap, pipeline.topic))
    rows = keyed_sink_rows(config.layout.sink)
    assert len(rows) == len({r["id"] for r in rows}), "one row per id"
    got = {r["id"]: r for r in rows}
    assert set(got) == set(expected)
    for i, row in expected.items():
        assert {k: got[i][k] for k in row} == row, i
        assert got[i]["_cdc_ts_ms"] == 1_700_000_000_000 + row["_cdc_lsn"] - 3
    dead = storage.table(config.layout.dead_letters).to_pyarrow_table().sort_by("_kafka_offset").to_pylist()
    assert sorted(d["reason"] for d in dead) == sorted(reasons), [d["reason"] for d in dead]
    _assert_audit_passes(config)


def test_a_debezium_topic_in_an_append_sink_is_its_change_log(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    events, reasons = _debezium_events(seed=6)
    _produce(pipeline.bootstrap, pipeline.topic, events)
    config = pipeline.write(
        key_format="none", format={"type": "json", "envelope": "debezium", "schema": {"id": "long", "name": "string", "tier": "int"}}
    )
    [batch] = run_pipeline(config, RunContext("log"), lambda: spark)
    tombstones = sum(1 for _, _, v in events if v is None)
    rows = storage.table(config.layout.sink).to_pyarrow_table().to_pylist()
    assert len(rows) == len(events) - tombstones - len(reasons), "every change a row; tombstones none"
    assert batch.total("dead_letters") == len(reasons)
    deletes = [r for r in rows if r["_cdc_op"] == "d"]
    assert deletes and all(r["id"] is not None for r in deletes), "a delete's row is its before"


def test_a_backfill_of_an_old_range_never_brings_back_an_older_value_and_repeating_it_changes_nothing(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    rng = random.Random(7)
    records = []
    for i in range(240):
        k = rng.randrange(40 if i < 120 else 25)  # keys 25..39 have no record after the backfilled range
        value = (
            None
            if rng.random() < 0.12
            else json.dumps(
                {
                    "order_id": i,
                    "customer": f"c{k}",
                    "amount": float(i),
                    "currency": "EUR",
                    "created_at": "2026-11-23T10:00:00Z",
                    "note": f"n{i}",
                }
            ).encode()
        )
        records.append((0, f"k{k}".encode(), value))
    _produce(pipeline.bootstrap, pipeline.topic, records)
    schema = {"order_id": "long", "customer": "string", "amount": "double", "currency": "string", "created_at": "timestamp"}
    keyed = {"mode": "upsert", "key": ["_kafka_key"]}
    config = pipeline.write(max_records_per_batch=100, sink=keyed, format={"type": "json", "schema": schema})
    run_pipeline(config, RunContext("ingest"), lambda: spark)
    before = _sink_by_key(config)

    newest = {}
    for offset, (_, key, value) in enumerate(records):
        newest[key.decode()] = (offset, value)
    deleted_later = {
        k
        for k, (o, v) in newest.items()
        if v is None
        and o >= 120
        and any(key.decode() == k and value is not None and off < 120 for off, (_, key, value) in enumerate(records))
    }
    assert deleted_later, "the data has keys with a value in the backfilled range and a later delete"
    assert any(o < 120 and v is not None for o, v in newest.values()), "and keys whose newest record is in it"

    # the pipeline now reads one more field; the backfill reprocesses [0, 120)
    config = pipeline.write(max_records_per_batch=100, sink=keyed, format={"type": "json", "schema": {**schema, "note": "string"}})
    _backfill(config, spark, 0, 120)
    after = _sink_by_key(config)
    assert set(after) == set(before), "no key came back, none went"
    for key, row in after.items():
        offset, value = newest[key]
        assert row["_kafka_offset"] == offset and row["amount"] == before[key]["amount"], key
        # rows whose record was reprocessed have the new field; the newer ones were left alone
        assert row["note"] == (json.loads(value)["note"] if offset < 120 else None), key
    version = storage.table(config.layout.sink).version()

    _backfill(config, spark, 0, 120)
    assert _sink_by_key(config) == after
    assert storage.table(config.layout.sink).version() == version + 1, "one commit, no change"
    _assert_audit_passes(config)


def _backfill(config, spark, start: int, end: int) -> None:
    """What ``offsetlake backfill --from-offset --to-offset`` does, in this process."""
    plan = plan_backfill(config, RunContext(f"backfill-{start}-{end}"), from_offset=start, to_offset=end)
    Ledger.of(config).record_plan(plan)
    execute_recorded_batch(config, plan.batch_id, lambda: spark)


def test_rewind_restores_a_keyed_sink_as_of_a_batch_and_compaction_brings_no_deleted_key_back(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    updates = _updates(900, 80, 2, seed=11, delete_share=0.2)
    config = pipeline.write(max_records_per_batch=300, sink={"mode": "upsert", "key": ["_kafka_key"], "file_rows": 20})
    _produce(pipeline.bootstrap, pipeline.topic, updates[:300])
    *_, first = run_pipeline(config, RunContext("first"), lambda: spark)
    at_first = _sink_by_key(config)
    _produce(pipeline.bootstrap, pipeline.topic, updates[300:])
    run_pipeline(config, RunContext("second"), lambda: spark)
    _assert_converged(config, pipeline)

    files = len(storage.table(config.layout.sink).file_uris())
    assert files >= 3, "file_rows keeps the merge's files small"
    [sink_report, *_] = maintain(config, retention_hours=1)
    assert sink_report.compacted_from > 1
    _assert_converged(config, pipeline)  # no deleted key is back, no key lost

    result = rewind_pipeline(config, first.plan.batch_id, reason="test")
    assert not result.plan.noop
    assert _sink_by_key(config) == at_first, "the table as it was right after the first batch"
    run_pipeline(config, RunContext("again"), lambda: spark)
    _assert_converged(config, pipeline)
    _assert_audit_passes(config)


_VALUE = {
    "type": "record",
    "name": "Value",
    "namespace": "shop.public.customers",
    "fields": [{"name": "id", "type": "long"}, {"name": "name", "type": "string"}, {"name": "tier", "type": "int"}],
}
_ENVELOPE = {
    "type": "record",
    "name": "Envelope",
    "namespace": "shop.public.customers",
    "fields": [
        {"name": "before", "type": ["null", _VALUE], "default": None},
        {"name": "after", "type": ["null", "shop.public.customers.Value"], "default": None},
        {
            "name": "source",
            "type": {
                "type": "record",
                "name": "Source",
                "namespace": "io.debezium.connector.postgresql",
                "fields": [
                    {"name": "ts_ms", "type": "long"},
                    {"name": "db", "type": "string"},
                    {"name": "lsn", "type": ["null", "long"], "default": None},
                ],
            },
        },
        {"name": "op", "type": "string"},
        {"name": "ts_ms", "type": ["null", "long"], "default": None},
    ],
}


def test_debezium_avro_events_through_the_registry_keyed_by_the_record_key(pipeline, spark, schema_registry):
    """Avro Debezium events (the envelope as the registry's value schema), the sink keyed by the
    Kafka key: a delete whose before is null still deletes its key."""
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    serialize = AvroSerializer(schema_registry.client(), json.dumps(_ENVELOPE), conf={"auto.register.schemas": True})
    context = SerializationContext(pipeline.topic, MessageField.VALUE)
    rng = random.Random(3)
    live: dict[int, dict] = {}
    records: list[tuple[int, bytes | None, bytes | None]] = []
    for n in range(400):
        i = rng.randrange(30)
        if i in live and rng.random() < 0.2:
            before = live.pop(i) if rng.random() < 0.5 else (live.pop(i) and None)  # some deletes carry no before
            event = {"before": before, "after": None, "op": "d", "source": {"ts_ms": n, "db": "shop", "lsn": n}}
            records.append((0, f"{i}".encode(), serialize(event, context)))
            records.append((0, f"{i}".encode(), None))
            continue
        op = "u" if i in live else "c"
        live[i] = {"id": i, "name": f"n{n}", "tier": n % 5}
        event = {"before": None, "after": live[i], "op": op, "source": {"ts_ms": n, "db": "shop", "lsn": n}, "ts_ms": n}
        records.append((0, f"{i}".encode(), serialize(event, context)))
    _produce(pipeline.bootstrap, pipeline.topic, records)
    config = pipeline.write(
        max_records_per_batch=150,
        format={"type": "avro", "envelope": "debezium", "schema_registry": schema_registry.settings},
        sink={"mode": "upsert", "key": ["_kafka_key"]},
    )
    run_pipeline(config, RunContext("avro-cdc"), lambda: spark)
    rows = keyed_sink_rows(config.layout.sink)
    got = {int(r["_kafka_key"]): {"id": r["id"], "name": r["name"], "tier": r["tier"]} for r in rows}
    assert got == live
    assert all(r["_cdc_op"] in ("c", "u") and r["_cdc_lsn"] == r["_cdc_ts_ms"] for r in rows)
    dead = storage.table(config.layout.dead_letters).to_pyarrow_table() if storage.is_table(config.layout.dead_letters) else None
    assert dead is None or dead.num_rows == 0, dead["reason"].to_pylist()[:3]


def test_a_stream_over_two_topics_into_a_keyed_sink_converges(pipeline, spark):
    """Stream mode takes the same path: micro-batches over two topics merged by key."""
    import threading
    import time

    from offsetlake.stream import StopControl, StreamOptions, run_stream

    a, b = f"{pipeline.topic}_a", f"{pipeline.topic}_b"
    for topic in (a, b):
        ensure_topic(pipeline.bootstrap, topic, 2)
    config = pipeline.write(topic=None, topics=[a, b], max_records_per_batch=500, sink={"mode": "upsert", "key": ["_kafka_key"]})
    stop = StopControl()
    options = StreamOptions(trigger_interval=0.5, lease_ttl=6, run_id="keyed-stream")
    worker = threading.Thread(target=lambda: run_stream(config, options, lambda: spark, stop, lambda _: None))
    worker.start()
    try:
        for wave in range(3):
            for topic in (a, b):  # keys are per topic here: each topic's keys stay in their partition
                _produce(
                    pipeline.bootstrap,
                    topic,
                    [(p, f"{topic}-{k.decode()}".encode(), v) for p, k, v in _updates(400, 60, 2, seed=wave * 10 + len(topic))],
                )
            time.sleep(1)
        expected = {}
        for topic in (a, b):
            records = read_records(pipeline.bootstrap, topic)
            expected.update(
                replay_by_key(records, key_of=lambda r: r.key.decode(), row_of=lambda r: None if r.value is None else json.loads(r.value))
            )
        lso = {(t, p): end for t in (a, b) for p, end in last_stable_offsets(pipeline.bootstrap, t).items()}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            table = storage.open_table(config.layout.sink)
            ends = {tp: table.transaction_version(config.app_id(*tp)) if table else None for tp in lso}
            if ends == lso:
                break
            time.sleep(0.5)
        assert ends == lso
    finally:
        stop.request("test done")
        worker.join(60)
    got = _sink_by_key(config)
    assert {k: r["order_id"] for k, r in got.items()} == {k: r["order_id"] for k, r in expected.items()}
    _assert_audit_passes(config)


def test_a_key_in_two_topics_is_resolved_by_record_time_then_coordinates(pipeline, spark):
    import time

    a, b = f"{pipeline.topic}_a", f"{pipeline.topic}_b"
    for topic in (a, b):
        ensure_topic(pipeline.bootstrap, topic, 1)

    def send(topic: str, key: str, order_id: int, ms: int) -> None:
        producer = Producer({"bootstrap.servers": pipeline.bootstrap})
        value = json.dumps(
            {"order_id": order_id, "customer": key, "amount": 1.0, "currency": "EUR", "created_at": "2026-11-23T10:00:00Z"}
        ).encode()
        producer.produce(topic, key=key.encode(), value=value, partition=0, timestamp=ms)
        assert producer.flush(30) == 0

    base = int(time.time() * 1000) - 60_000  # recent: older records would fall to the topic's retention
    send(a, "x", 1, base + 2_000)  # newer by record time than b's record of x, which comes later
    send(b, "x", 2, base + 1_000)
    send(a, "y", 3, base + 5_000)
    send(b, "y", 4, base + 5_000)  # the same time: the greater (topic, partition, offset) wins: b
    config = pipeline.write(topic=None, topics=[a, b], sink={"mode": "upsert", "key": ["_kafka_key"]})
    run_pipeline(config, RunContext("one-batch"), lambda: spark)
    rows = _sink_by_key(config)
    assert (rows["x"]["order_id"], rows["x"]["_kafka_topic"]) == (1, a)
    assert (rows["y"]["order_id"], rows["y"]["_kafka_topic"]) == (4, b)

    send(b, "x", 5, base + 1_500)  # still older than the row (from a, at +2,000): not applied
    send(a, "y", 6, base + 4_000)  # a's own later offset, but older than the row from b: not applied
    run_pipeline(config, RunContext("older"), lambda: spark)
    rows = _sink_by_key(config)
    assert (rows["x"]["order_id"], rows["y"]["order_id"]) == (1, 4)
    send(b, "x", 7, base + 9_000)
    run_pipeline(config, RunContext("newer"), lambda: spark)
    assert _sink_by_key(config)["x"]["order_id"] == 7
    merges = [getattr(c.entry, "merge", None) for c in sink_commits(storage.table(config.layout.sink), config.name)]
    assert merges[1]["older"] == 2 and merges[2]["updated"] == 1
