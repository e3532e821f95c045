"""Independent views of both sides, for assertions: a plain consumer and plain delta-rs.

Neither uses offsetlake's reader, planner or audit, so a bug there cannot hide itself.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow.compute as pc
from confluent_kafka import Consumer, IsolationLevel, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from offsetlake import storage  # only for the lake's storage options: DeltaTable as delta-rs opens it
from offsetlake.embedded.checker import check_outbox, outbox_replay, read_committed, sink_view


@dataclass(frozen=True)
class TopicTruth:
    good: dict[tuple[int, int], int]  # (partition, offset) -> order_id, for parseable records
    bad: set[tuple[int, int]]  # (partition, offset) of values that are not parseable orders
    lso: dict[int, int]


def last_stable_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    parts = admin.list_topics(topic=topic, timeout=10).topics[topic].partitions
    futures = admin.list_offsets(
        {TopicPartition(topic, p): OffsetSpec.latest() for p in parts}, isolation_level=IsolationLevel.READ_COMMITTED
    )
    return {tp.partition: f.result().offset for tp, f in futures.items()}


def _json_order_id(value: bytes) -> int:
    return int(json.loads(value)["order_id"])


def read_topic(
    bootstrap: str,
    topic: str,
    until: dict[int, int] | None = None,
    timeout_s: float = 60,
    order_id: Callable[[bytes], int] = _json_order_id,
) -> TopicTruth:
    """Every committed record up to the LSO (or ``until``), read with a plain consumer; ``order_id``
    decodes a value's order id (raising for a record that must be a dead letter)."""
    lso = until or last_stable_offsets(bootstrap, topic)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"truth-{time.time_ns()}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "receive.message.max.bytes": 200_000_000,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in lso])
    good: dict[tuple[int, int], int] = {}
    bad: set[tuple[int, int]] = set()
    done = {p for p, end in lso.items() if end == 0}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(lso):
        assert time.monotonic() < deadline, f"independent read of {topic} did not finish: done {done} of {lso}"
        for m in consumer.consume(1000, 0.5):
            if m.error():
                if m.error().code() == KafkaError._PARTITION_EOF and m.offset() >= lso[m.partition()]:
                    done.add(m.partition())
                continue
            p, o = m.partition(), m.offset()
            if o >= lso[p]:
                done.add(p)
                continue
            try:
                good[(p, o)] = order_id(m.value())
            except Exception:
                bad.add((p, o))
            if o + 1 >= lso[p]:
                done.add(p)
    consumer.close()
    return TopicTruth(good, bad, lso)


def sink_coordinates(path: storage.Where) -> list[tuple[int, int, int]]:
    """(partition, offset, order_id) of every live sink row, duplicates kept."""
    data = storage.table(path).to_pyarrow_dataset().to_table(columns=["_kafka_partition", "_kafka_offset", "order_id"])
    return list(zip(data["_kafka_partition"].to_pylist(), data["_kafka_offset"].to_pylist(), data["order_id"].to_pylist(), strict=True))


def dead_letter_coordinates(path: storage.Where) -> list[tuple[int, int]]:
    if not storage.is_table(path):
        return []
    data = storage.table(path).to_pyarrow_dataset().to_table(columns=["_kafka_partition", "_kafka_offset"])
    return list(zip(data["_kafka_partition"].to_pylist(), data["_kafka_offset"].to_pylist(), strict=True))


def assert_exactly_once(config, truth: TopicTruth) -> None:
    """Every good record of the topic (up to ``truth.lso``) in the sink once; bad ones as dead letters once."""
    rows = sink_coordinates(config.layout.sink)
    coords = [(p, o) for p, o, _ in rows]
    assert len(coords) == len(set(coords)), f"duplicate sink rows: {len(coords) - len(set(coords))}"
    in_scope = {(p, o): oid for (p, o), oid in truth.good.items() if o < truth.lso[p]}
    got = {(p, o): oid for p, o, oid in rows}
    missing = sorted(set(in_scope) - set(got))[:10]
    extra = sorted(set(got) - set(in_scope))[:10]
    assert not missing, f"{len(set(in_scope) - set(got))} records missing from the sink, e.g. {missing}"
    assert not extra, f"{len(set(got) - set(in_scope))} sink rows not among the topic's committed records, e.g. {extra}"
    assert got == in_scope, "sink rows carry different order ids than the topic records at their coordinates"
    dead = dead_letter_coordinates(config.layout.dead_letters)
    assert len(dead) == len(set(dead)), "duplicate dead letters"
    assert set(dead) == {c for c in truth.bad if c[1] < truth.lso[c[0]]}


def ledger_rows(config) -> list[dict]:
    table = storage.table(config.layout.ledger).to_pyarrow_dataset().to_table(filter=pc.field("pipeline") == config.name)
    return table.to_pylist()


def wait_until_committed(config, truth: TopicTruth, timeout_s: float = 120) -> None:
    """Until the sink's committed end of every partition reaches the LSO ``truth`` read (a stream
    running in another process commits on its own time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        table = storage.table(config.layout.sink)
        if all((table.transaction_version(config.app_id(config.topic, p)) or 0) >= end for p, end in truth.lso.items()):
            return
        time.sleep(0.5)


@dataclass(frozen=True)
class Record:
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


def read_records(bootstrap: str, topic: str, timeout_s: float = 60) -> list[Record]:
    """Every committed record up to the LSO, in (partition, offset) order, with a plain consumer."""
    lso = last_stable_offsets(bootstrap, topic)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"truth-{time.time_ns()}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "receive.message.max.bytes": 200_000_000,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in lso])
    out: list[Record] = []
    done = {p for p, end in lso.items() if end == 0}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(lso):
        assert time.monotonic() < deadline, f"independent read of {topic} did not finish: done {done} of {lso}"
        for m in consumer.consume(1000, 0.5):
            if m.error():
                if m.error().code() == KafkaError._PARTITION_EOF and m.offset() >= lso[m.partition()]:
                    done.add(m.partition())
                continue
            if m.offset() < lso[m.partition()]:
                out.append(Record(m.partition(), m.offset(), m.timestamp()[1], m.key(), m.value(), tuple(m.headers() or ())))
            if m.offset() + 1 >= lso[m.partition()]:
                done.add(m.partition())
    consumer.close()
    return sorted(out, key=lambda r: (r.partition, r.offset))


def replay_by_key(
    records: list[Record], key_of: Callable[[Record], object | None], row_of: Callable[[Record], dict | None]
) -> dict[object, dict]:
    """The table a keyed sink must hold: each key's newest record (keys stay in one partition
    here, so by offset), applied in order; ``row_of`` returns None for a delete. Records whose key
    is None are skipped."""
    table: dict[object, dict] = {}
    for r in records:
        key = key_of(r)
        if key is None:
            continue
        row = row_of(r)
        if row is None:
            table.pop(key, None)
        else:
            table[key] = row
    return table


def newest_by_key(
    records: list[Record], key_of: Callable[[Record], object | None], row_of: Callable[[Record], dict | None]
) -> dict[object, dict]:
    """The table a keyed sink must hold by the ordering rule (docs/design.md), for keys that may live in
    several partitions: each key's last record per partition (by offset), then the newest of
    those by (timestamp, partition, offset); ``row_of`` returns None for a delete, and a key whose
    newest record is a delete has no row. Records whose key is None are skipped. One topic only."""
    last: dict[tuple[object, int], Record] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        key = key_of(r)
        if key is not None:
            last[(key, r.partition)] = r
    newest: dict[object, Record] = {}
    for (key, _), r in last.items():
        seen = newest.get(key)
        if seen is None or (r.timestamp_ms, r.partition, r.offset) > (seen.timestamp_ms, seen.partition, seen.offset):
            newest[key] = r
    table = {key: row_of(r) for key, r in newest.items()}
    return {key: row for key, row in table.items() if row is not None}


PRIVATE_COLUMNS = ("_offsetlake_hidden", "_offsetlake_state")  # what a keyed sink once kept beside its rows


def keyed_sink_rows(path: storage.Where) -> list[dict]:
    """The rows a plain ``deltalake`` reader of a keyed sink sees, with no filter: the sink holds
    only what a reader should see (its state lives in the state table), so a private column is a
    failure here, not something to filter on."""
    table = storage.table(path).to_pyarrow_table()
    private = [c for c in table.column_names if c in PRIVATE_COLUMNS]
    assert not private, f"the sink {path} has offsetlake-private columns {private} a plain reader sees"
    return table.to_pylist()


def delete_topic(bootstrap: str, topic: str, timeout_s: float = 30) -> None:
    """Delete ``topic`` and wait until the broker no longer lists it (a topic re-created before
    that would be the old one)."""
    import time

    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic])[topic].result(15)
    deadline = time.monotonic() + timeout_s
    while topic in admin.list_topics(timeout=10).topics:
        assert time.monotonic() < deadline, f"{topic} still listed {timeout_s} s after its deletion"
        time.sleep(0.2)


# ---- a Kafka sink (sink.type: kafka), read back as its consumers read it --------------------------
def source_orders(bootstrap: str, topic: str) -> dict[tuple[int, int], dict | None]:
    """Every committed source record by (partition, offset): its JSON object, or None when it is
    malformed (not JSON, not an object, or no integer order_id)."""
    out: dict[tuple[int, int], dict | None] = {}
    for record in read_records(bootstrap, topic):
        try:
            body = json.loads(record.value or b"")
        except ValueError:
            body = None
        out[(record.partition, record.offset)] = body if isinstance(body, dict) and isinstance(body.get("order_id"), int) else None
    return out


def by_source(bootstrap: str, topic: str, kinds: tuple[str, ...] = ("ingest", "stream")) -> Counter:
    """How many times each source (partition, offset) appears among the committed records of ``kinds``."""
    return _sources(read_records(bootstrap, topic), kinds)


def _sources(records: list[Record], kinds: tuple[str, ...] = ("ingest", "stream")) -> Counter:
    seen: Counter = Counter()
    for record in records:
        h = dict(record.headers)
        if h["offsetlake.kind"].decode() in kinds:
            seen[(int(h["offsetlake.partition"]), int(h["offsetlake.offset"]))] += 1
    return seen


def group_offsets(bootstrap: str, group: str, topic: str, partitions: list[int]) -> dict[int, int | None]:
    """The group's committed offsets, asked as a read_committed consumer (a pending transactional
    commit is waited out)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "isolation.level": "read_committed"})
    try:
        found = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=60)
    finally:
        consumer.close()
    return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in found}


def check_kafka_sink(bootstrap: str, source_topic: str, config, wait_s: float = 30, decode=json.loads) -> None:
    """``_check_kafka_sink``, again for up to ``wait_s`` while it fails: a committed transaction's
    markers reach its partitions just after ``commit_transaction`` returns, and until then a
    read_committed consumer stops before its records."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _check_kafka_sink(bootstrap, source_topic, config, decode)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _check_kafka_sink(bootstrap: str, source_topic: str, config, decode) -> None:
    """A Kafka sink's independent check: each valid source record's row exactly once in the output
    topic (keyed by its customer, its value its fields as ``decode`` reads them), each malformed
    one exactly once in the dead-letter topic with a reason, and the group's committed offsets at
    the source's end."""
    out, dead_topic = config.sink.topic, config.sink.dead_letters_to
    source = source_orders(bootstrap, source_topic)
    valid = {k for k, v in source.items() if v is not None}
    written = read_records(bootstrap, out)  # each topic read once: its counts and its records' contents
    seen = _sources(written)
    assert set(seen) == valid, f"missing {sorted(valid - set(seen))[:5]}, extra {sorted(set(seen) - valid)[:5]}"
    assert not seen or max(seen.values()) == 1, [k for k, n in seen.items() if n > 1][:5]
    for record in written:
        h = dict(record.headers)
        if h["offsetlake.kind"].decode() not in ("ingest", "stream"):
            continue
        expected = source[(int(h["offsetlake.partition"]), int(h["offsetlake.offset"]))]
        value = decode(record.value or b"")
        assert expected is not None and value["order_id"] == expected["order_id"] and value["customer"] == expected["customer"]
        assert record.key == (expected["customer"] or "").encode() or (record.key is None and expected["customer"] is None)
    dead_letters = read_records(bootstrap, dead_topic)
    dead = _sources(dead_letters)
    assert all(dict(r.headers)["offsetlake.reason"] for r in dead_letters)
    assert set(dead) == set(source) - valid and (not dead or max(dead.values()) == 1)
    partitions = sorted({p for p, _ in source})
    per_partition = Counter(p for p, _ in source)
    assert group_offsets(bootstrap, f"offsetlake-{config.name}", source_topic, partitions) == {p: per_partition[p] for p in partitions}


# ---- an outbox (offsetlake publish), replayed as its guide tells a consumer to -------------------
def check_outbox_replay(bootstrap: str, topic: str, sink: storage.Where) -> int:
    """An outbox topic replayed by a consumer equals the sink table at every version it has
    published, from the first to the last (versions no record names, like compactions, too);
    returns the last version checked (-1: nothing published). The demo's independent checker
    (``offsetlake.embedded.checker``: plain confluent-kafka and deltalake) does the replay."""
    where = sink if isinstance(sink, storage.Location) else storage.Location.of(str(sink))
    check_outbox(bootstrap, topic, where.path, "?", dict(where.options) if where.options else None)
    records = list(read_committed(bootstrap, topic))
    return max((int(r.headers["offsetlake.sink_version"]) for r in records), default=-1)


def outbox_view(bootstrap: str, topic: str, upto_version: int) -> dict[tuple, list[str]]:
    return outbox_replay(read_committed(bootstrap, topic), upto_version)


def sink_rows_view(sink: storage.Where, version: int) -> dict[tuple, list[str]]:
    where = sink if isinstance(sink, storage.Location) else storage.Location.of(str(sink))
    return sink_view(where.path, version, dict(where.options) if where.options else None)
