"""An independent read_committed checker for the demo: what a consumer of offsetlake's Kafka output
sees, compared with the source topic and the Delta sink as plain clients read them.

It uses none of offsetlake's reading or committing code: a plain confluent-kafka consumer
(read_committed, up to the last stable offsets) and deltalake's own table history, so a bug in
offsetlake cannot hide itself from it.

* ``check_kafka_sink``: every valid source record's output record exactly once (kinds ingest and
  stream), every invalid one exactly once in the dead-letter topic, and the pipeline's group
  committed at the source's end;
* ``check_outbox``: the outbox topic holds, per sink commit, exactly the rows of that commit's
  ranges in the table at that version, each once (one record per undone batch for a rewind).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from deltalake import DeltaTable


class CheckFailed(AssertionError):
    """What the checker found wrong, in words."""


@dataclass(frozen=True)
class Seen:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, str]


def read_committed(bootstrap: str, topic: str, timeout_s: float = 120) -> Iterator[Seen]:
    """Every committed record of ``topic`` up to its last stable offsets, as a read_committed consumer sees it."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"checker-{time.time_ns()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        ends = {}
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30, cached=False)
            if high > low:
                ends[p] = high
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            for m in consumer.consume(5_000, 1.0):
                if m.error() is not None:
                    continue
                p, o = m.partition() or 0, m.offset() or 0
                headers = {str(h[0]): (h[1].decode() if isinstance(h[1], bytes) else str(h[1])) for h in (m.headers() or [])}
                yield Seen(p, o, m.key(), m.value(), headers)
            for p, end in list(ends.items()):
                if consumer.position([TopicPartition(topic, p)])[0].offset >= end:
                    ends.pop(p)
        if ends:
            raise CheckFailed(f"reading {topic} did not reach its last stable offsets within {timeout_s:.0f}s")
    finally:
        consumer.close()


def _coordinates(seen: Seen) -> tuple[int, int]:
    return int(seen.headers["offsetlake.partition"]), int(seen.headers["offsetlake.offset"])


def check_kafka_sink(
    bootstrap: str, source: str, out: str, dead_letters: str, group: str, valid: Callable[[dict], bool], key: str | None = None
) -> dict[str, int]:
    """Each source record ``valid`` accepts once in ``out`` (keyed by its ``key`` field), each other
    once in ``dead_letters``, the group at the source's end; returns what it counted."""
    source_records = {(s.partition, s.offset): s.value for s in read_committed(bootstrap, source)}
    good = set()
    for at, value in source_records.items():
        try:
            body = json.loads(value or b"")
        except ValueError:
            continue
        if isinstance(body, dict) and valid(body):
            good.add(at)
    rows: Counter = Counter()
    for seen in read_committed(bootstrap, out):
        if seen.headers.get("offsetlake.kind") not in ("ingest", "stream"):
            continue
        at = _coordinates(seen)
        rows[at] += 1
        if key is not None and at in good:
            expected = json.loads(source_records[at] or b"")[key]
            if seen.key != str(expected).encode():
                raise CheckFailed(f"{out}: the record of {source}[{at[0]}]@{at[1]} has key {seen.key!r}, its {key} is {expected!r}")
    dead = Counter(
        _coordinates(s) for s in read_committed(bootstrap, dead_letters) if s.headers.get("offsetlake.kind") in ("ingest", "stream")
    )
    for name, counted, wanted in ((out, rows, good), (dead_letters, dead, set(source_records) - good)):
        twice = sorted(at for at, n in counted.items() if n > 1)
        if twice:
            raise CheckFailed(f"{name}: {len(twice)} source records appear more than once, e.g. {source}[{twice[0][0]}]@{twice[0][1]}")
        if set(counted) != wanted:
            missing, extra = sorted(wanted - set(counted)), sorted(set(counted) - wanted)
            raise CheckFailed(
                f"{name}: {len(missing)} source records missing (e.g. {missing[:3]}), {len(extra)} unexpected (e.g. {extra[:3]})"
            )
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "isolation.level": "read_committed"})
    try:
        partitions = sorted({p for p, _ in source_records})
        committed = {tp.partition: tp.offset for tp in consumer.committed([TopicPartition(source, p) for p in partitions], timeout=60)}
    finally:
        consumer.close()
    # past each partition's last record (a transaction marker after it may take one more offset)
    last = {p: max(o for q, o in source_records if q == p) for p in partitions}
    behind = {p: committed.get(p) for p in partitions if committed.get(p, -1) <= last[p]}
    if behind:
        raise CheckFailed(f"group {group} is committed below the source's last records: {behind}")
    return {"source_records": len(source_records), "rows": sum(rows.values()), "dead_letters": sum(dead.values())}


def check_outbox(bootstrap: str, out: str, sink_path: str, pipeline: str, storage_options: dict[str, str] | None = None) -> dict[str, int]:
    """The outbox topic against the sink's history: per commit, the rows of its ranges at its version."""
    expected: Counter = Counter()
    history = DeltaTable(sink_path, storage_options=storage_options).history()
    for info in history:
        try:
            entry = json.loads(info.get("userMetadata") or "")
        except ValueError:
            continue
        if not isinstance(entry, dict) or entry.get("offsetlake") != 1 or entry.get("pipeline") != pipeline:
            continue
        version, kind = int(info["version"]), entry.get("kind", "ingest")
        if kind == "rewind":
            expected.update((version, "undone", b) for b in entry.get("rewound", ()))
            continue
        if kind not in ("ingest", "stream", "backfill"):
            continue
        spans = [(r["topic"], r["partition"], r["start"], r["end"]) for r in entry.get("ranges", ())]
        window = entry.get("record_time")
        then = DeltaTable(sink_path, version=version, storage_options=storage_options)
        columns = ["_kafka_topic", "_kafka_partition", "_kafka_offset", "_kafka_timestamp"]
        for row in then.to_pyarrow_table(columns=columns).to_pylist():
            at = (row["_kafka_topic"], row["_kafka_partition"], row["_kafka_offset"])
            if not any(t == at[0] and p == at[1] and s <= at[2] < e for t, p, s, e in spans):
                continue
            if window and not (window["from_ms"] <= int(row["_kafka_timestamp"].timestamp() * 1000) < window["to_ms"]):
                continue
            expected[(version, *at)] += 1
    published: Counter = Counter()
    for seen in read_committed(bootstrap, out):
        version = int(seen.headers["offsetlake.sink_version"])
        if seen.headers["offsetlake.kind"] == "rewind":
            published[(version, "undone", json.loads(seen.value or b"{}")["rewound_batch"])] += 1
        else:
            published[(version, seen.headers["offsetlake.topic"], *_coordinates(seen))] += 1
    if published != expected:
        missing, extra = expected - published, published - expected
        raise CheckFailed(
            f"{out}: {sum(missing.values())} records missing (e.g. {list(missing)[:3]}), "
            f"{sum(extra.values())} extra (e.g. {list(extra)[:3]})"
        )
    return {"commits": len({k[0] for k in expected}), "records": sum(published.values())}
