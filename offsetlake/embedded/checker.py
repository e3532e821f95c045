"""An independent read_committed checker for the demo: what a consumer of offsetlake's Kafka output
sees, compared with the source topic and the Delta sink as plain clients read them.

It uses none of offsetlake's reading or committing code: a plain confluent-kafka consumer
(read_committed, up to the last stable offsets) and deltalake's own table history, so a bug in
offsetlake cannot hide itself from it.

* ``check_kafka_sink``: every valid source record's output record exactly once (kinds ingest and
  stream), every invalid one exactly once in the dead-letter topic, and the pipeline's group
  committed at the source's end;
* ``check_outbox``: the outbox topic, replayed by the rule its guide gives consumers (per source
  record, the rows of the highest sink version seen), equals the sink table at every version.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
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
    """The outbox topic replayed as its guide tells a consumer to (``outbox_replay``) equals the
    sink table (plain deltalake) at every version it has published, from the first to the last."""
    seen = list(read_committed(bootstrap, out))
    versions = {int(s.headers["offsetlake.sink_version"]) for s in seen}
    for version in range(max(versions, default=-1) + 1):
        replayed, table = outbox_replay(seen, version), sink_view(sink_path, version, storage_options)
        if replayed != table:
            missing, stale = sorted(set(table) - set(replayed))[:3], sorted(set(replayed) - set(table))[:3]
            differ = sorted(c for c in set(table) & set(replayed) if table[c] != replayed[c])[:3]
            raise CheckFailed(
                f"{out}: a consumer following the guide differs from the sink {pipeline} at version {version}: "
                f"missing {missing}, stale {stale}, differing {differ}"
            )
    return {"commits": len(versions), "records": len(seen)}


# what a published value leaves out of a row: the source coordinates (in headers) and the epoch
_NOT_PUBLISHED = ("_kafka_topic", "_kafka_partition", "_kafka_offset", "_kafka_timestamp", "_offsetlake_epoch")


def spelled(value: dict) -> str:
    """A row's value in one spelling: null fields left out at every depth (a JSON reader cannot
    tell a field added to a struct later, null in older rows, from one that is missing), timestamps
    and dates ISO 8601, NaN and infinities as the strings the outbox's guide names, sorted keys."""
    return json.dumps(_plain(value), sort_keys=True)


def _plain(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.isoformat() if hasattr(value, "isoformat") else value


def outbox_replay(seen: Iterable[Seen], upto_version: int) -> dict[tuple, list[str]]:
    """What a consumer following docs/guides/kafka-outbox.md holds after reading every record of a
    sink version up to ``upto_version``, in any order: per source record, the rows of the highest
    sink version seen (a row of the same version joins them; a delete leaves none)."""
    held: dict[tuple, tuple[int, list[str]]] = {}
    for record in seen:
        h = record.headers
        version = int(h["offsetlake.sink_version"])
        if version > upto_version:
            continue
        coordinate = (h["offsetlake.topic"], int(h["offsetlake.partition"]), int(h["offsetlake.offset"]), int(h.get("offsetlake.epoch", 0)))
        rows = [] if h["offsetlake.op"] == "delete" else [spelled(json.loads(record.value or b"null"))]
        have = held.get(coordinate)
        if have is None or version > have[0]:
            held[coordinate] = (version, rows)
        elif version == have[0]:
            have[1].extend(rows)
    return {c: sorted(rows) for c, (_, rows) in held.items() if rows}


def sink_view(sink_path: str, version: int, storage_options: dict[str, str] | None = None) -> dict[tuple, list[str]]:
    """The sink table at ``version`` (plain deltalake), per source record: its rows as the outbox spells them."""
    table = DeltaTable(sink_path, version=version, storage_options=storage_options)
    out: dict[tuple, list[str]] = {}
    for row in table.to_pyarrow_table().to_pylist():
        coordinate = (row["_kafka_topic"], row["_kafka_partition"], row["_kafka_offset"], row.get("_offsetlake_epoch") or 0)
        out.setdefault(coordinate, []).append(spelled({k: v for k, v in row.items() if k not in _NOT_PUBLISHED}))
    return {c: sorted(rows) for c, rows in out.items()}
