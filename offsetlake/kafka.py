"""Kafka side: partition offsets for planning, and reading one exact offset range.

Ranges are half-open ``[start, end)`` (invariant 5). ``end`` comes from the Last Stable Offset
(ListOffsets with read_committed), never the high watermark, so an open transaction at the tail
neither blocks a run nor leaks into it. A range is done when the consumer position reaches
``end``; the last offsets may be transaction markers or aborted records, so we never wait for a
message at ``end - 1``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaError, KafkaException, Message, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient

from offsetlake.errors import KafkaUnavailableError, OffsetsLostError, ReadTimeoutError
from offsetlake.plan import PartitionOffsets

if TYPE_CHECKING:  # Spark's read tasks import this module: keep their imports light
    from offsetlake.config import PipelineConfig

METADATA_TIMEOUT_S = 15.0


def current_offsets(config: PipelineConfig) -> dict[tuple[str, int], PartitionOffsets]:
    """Log start and Last Stable Offset of every partition of the pipeline's topics, now, keyed
    by (topic, partition)."""
    client = config.kafka_client_config()
    # A read_committed consumer's watermark query, not AdminClient.list_offsets: seen four times
    # under heavy load, never reproduced, a SIGSEGV inside AdminClient.list_offsets
    # (RELIABILITY.md). The consumer's query is librdkafka's long-standing path to the same two
    # ListOffsets requests, with the consumer's isolation level (its high mark is the LSO).
    consumer = Consumer(_consumer_config(client, config.name))
    try:
        out: dict[tuple[str, int], PartitionOffsets] = {}
        for topic, partitions in describe_topics(client, config, consumer).items():
            for p, offsets in partition_offsets(consumer, topic, partitions, config.name, client).items():
                out[(topic, p)] = offsets
        return out
    finally:
        consumer.close()


def describe_topics(
    client_config: dict[str, str], config: PipelineConfig, client: AdminClient | Consumer | None = None
) -> dict[str, list[int]]:
    """Partition ids of each topic the pipeline reads: its ``topic``, its ``topics`` (each must
    exist: KafkaUnavailableError naming it), or every topic ``topic_pattern`` matches in full now
    (internal topics, ``__...``, never; none matching is an empty answer, not an error)."""
    servers = client_config.get("bootstrap.servers", "?")
    try:
        # all topics in one request: naming a topic makes brokers with auto.create.topics.enable create it
        metadata = (client or _admin(client_config)).list_topics(timeout=METADATA_TIMEOUT_S)
    except KafkaException as err:
        raise KafkaUnavailableError(
            f"cannot reach Kafka at {servers} to describe {config.topic_label}: {err.args[0]}", pipeline=config.name
        ) from None
    if config.topic_pattern is not None:
        pattern = re.compile(config.topic_pattern)
        names = sorted(t for t in metadata.topics if not t.startswith("__") and pattern.fullmatch(t))
    else:
        names = [config.topic] if config.topic is not None else list(config.topics or [])
    out = {}
    for topic in names:
        described = metadata.topics.get(topic)
        if described is None or described.error is not None or not described.partitions:
            reason = described.error.str() if described is not None and described.error else "unknown topic"
            raise KafkaUnavailableError(f"topic '{topic}' is not available on {servers}: {reason}", pipeline=config.name, topic=topic)
        out[topic] = sorted(described.partitions)
    return out


def topic_ids(config: PipelineConfig, topics: list[str]) -> dict[str, str | None]:
    """Kafka's id (the topic UUID, as Kafka prints it) of each of ``topics``, None where the broker
    names none: a broker before Kafka 2.8, or a Kafka-protocol broker that answers the all-zero id.

    An offset means something only for one topic id (invariant 16): a topic deleted and created
    again with the same name, or the same name on another cluster, has another id.
    Raises KafkaUnavailableError naming the topic when the broker cannot describe it.
    """
    if not topics:
        return {}
    client = config.kafka_client_config()
    servers = client.get("bootstrap.servers", "?")
    admin = _admin(client)  # kept alive until every answer is in: a collected client cancels them
    futures = admin.describe_topics(TopicCollection(sorted(topics)), request_timeout=METADATA_TIMEOUT_S)
    out: dict[str, str | None] = {}
    for topic, future in futures.items():
        try:
            described = future.result(METADATA_TIMEOUT_S)
        except (KafkaException, TimeoutError) as err:
            raise KafkaUnavailableError(
                f"cannot describe topic '{topic}' on {servers} for its topic id: {err}", pipeline=config.name, topic=topic
            ) from None
        uuid = described.topic_id
        known = uuid is not None and (uuid.get_most_significant_bits() or uuid.get_least_significant_bits())
        out[topic] = str(uuid) if known else None
    return out


def _admin(client_config: dict[str, str]) -> AdminClient:
    return AdminClient(dict(client_config))


def partition_offsets(
    consumer: Consumer, topic: str, partitions: list[int], pipeline: str, client_config: dict[str, str]
) -> dict[int, PartitionOffsets]:
    """Log start offset and Last Stable Offset of each partition, from a read_committed consumer."""
    servers = client_config.get("bootstrap.servers", "?")
    out = {}
    for p in partitions:
        try:
            start, stable = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=METADATA_TIMEOUT_S, cached=False)
        except KafkaException as err:
            raise KafkaUnavailableError(
                f"ListOffsets on {servers} failed: {err.args[0]}", pipeline=pipeline, topic=topic, partition=p
            ) from None
        out[p] = PartitionOffsets(topic, p, start, stable)
    return out


def offsets_for_time(client_config: dict[str, str], topic: str, partitions: list[int], timestamp_ms: int, pipeline: str) -> dict[int, int]:
    """Earliest offset whose timestamp is >= ``timestamp_ms`` per partition (-1 → none yet)."""
    consumer = Consumer(_consumer_config(client_config, pipeline))
    try:
        found = consumer.offsets_for_times([TopicPartition(topic, p, timestamp_ms) for p in partitions], timeout=METADATA_TIMEOUT_S)
    except KafkaException as err:
        raise KafkaUnavailableError(f"offsets_for_times on '{topic}' failed: {err.args[0]}", pipeline=pipeline, topic=topic) from None
    finally:
        consumer.close()
    return {tp.partition: tp.offset if tp.offset is not None else -1 for tp in found}


# Records per consume call, and how long one call waits for them: the wait only matters at a
# range's end (when fewer records remain than asked for) or while the broker has nothing yet.
CONSUME_BATCH = 10_000
CONSUME_WAIT_S = 0.05

# A range read needs no deep prefetch: these bound each read task's librdkafka buffers on a
# broker that honours fetch sizes, as Apache Kafka does (the pipeline's kafka options override
# them); a broker that answers a fetch with the partition's whole tail does not (BENCHMARKS.md, memory).
_READ_BUFFER_DEFAULTS = {
    "fetch.max.bytes": 16 * 1024 * 1024,
    "max.partition.fetch.bytes": 4 * 1024 * 1024,
    "queued.max.messages.kbytes": 16 * 1024,
}


def group_id(pipeline: str) -> str:
    """The pipeline's consumer group: its progress for lag tools, and a Kafka sink's committed ends."""
    return f"offsetlake-{pipeline}"


def _consumer_config(client_config: dict[str, str], pipeline: str) -> dict[str, object]:
    return {
        **_READ_BUFFER_DEFAULTS,
        **client_config,
        "group.id": group_id(pipeline),
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": "read_committed",
        "enable.partition.eof": True,
        "auto.offset.reset": "error",
        "receive.message.max.bytes": max(int(client_config.get("receive.message.max.bytes", 0) or 0), 200_000_000),
    }


def read_range(
    client_config: dict[str, str],
    pipeline: str,
    topic: str,
    partition: int,
    start: int,
    end: int,
    timeout_s: float,
) -> Iterator[list[Message]]:
    """Yield every committed record of ``[start, end)`` of one partition, in offset order, as
    chunks (one list per consume call, so callers build columns without a per-record generator).

    Done when the position reaches ``end`` (by a record at or past ``end - 1``, by the
    end-of-partition event, or by the consumer position), so trailing markers never hang.
    Raises OffsetsLostError if ``start`` is below the log start offset, and ReadTimeoutError if
    the range is not finished within ``timeout_s`` of the last progress.
    """
    if end <= start:
        return
    consumer = Consumer(_consumer_config(client_config, pipeline))
    tp = TopicPartition(topic, partition, start)
    where: dict[str, Any] = {"pipeline": pipeline, "topic": topic, "partition": partition, "start": start, "end": end}
    try:
        consumer.assign([tp])
        position = start
        last_progress = time.monotonic()
        while position < end:
            # librdkafka's batch consume returns when it holds num_messages OR at the timeout:
            # asking for more than the range still holds made every range's last call wait out
            # the whole timeout (0.5 s per split, most of a small batch's read time)
            messages = consumer.consume(num_messages=min(CONSUME_BATCH, end - position), timeout=CONSUME_WAIT_S)
            if not messages:
                position = max(position, _consumer_position(consumer, tp))
                if position >= end:
                    break
                if time.monotonic() - last_progress > timeout_s:
                    raise ReadTimeoutError(
                        f"no progress for {timeout_s:.0f}s at offset {position}; "
                        "the broker is unreachable or the range is no longer readable",
                        **where,
                    )
                continue
            last_progress = time.monotonic()
            records = [m for m in messages if m.error() is None]
            if len(records) != len(messages):
                position = _raise_or_skip_errors(messages, position, where)
            if records and _offset(records[-1]) >= end:  # offsets ascend: the range is done
                position = end
                records = [m for m in records if _offset(m) < end]
            elif records:
                position = max(position, _offset(records[-1]) + 1)
            if records:
                yield records
    finally:
        consumer.close()


def _offset(message: Message) -> int:
    """A consumed record's (or partition event's) offset; librdkafka always sets it there."""
    offset = message.offset()
    return offset if offset is not None else -1


def _raise_or_skip_errors(messages: list[Message], position: int, where: dict[str, Any]) -> int:
    """Raise for the error events of one consume call that end the read; skip the retriable
    ones; ``where`` holds the fields of the errors (pipeline, topic, partition, the range).
    Returns the position an end-of-partition event reports (or ``position``)."""
    for message in messages:
        error = message.error()
        if error is None:
            continue
        if error.code() == KafkaError._PARTITION_EOF:
            position = max(position, _offset(message))
            continue
        if error.code() in (KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET):
            raise OffsetsLostError(
                f"offsets from {position} are no longer in the log (retention or delete_records removed them): {error.str()}", **where
            )
        if error.retriable() or error.code() == KafkaError._TRANSPORT:
            continue
        raise KafkaUnavailableError(f"read failed at offset {position}: {error.str()}", **where)
    return position


def _consumer_position(consumer: Consumer, tp: TopicPartition) -> int:
    try:
        current = consumer.position([TopicPartition(tp.topic, tp.partition)])[0].offset
    except KafkaException:
        return -1
    return current if current >= 0 else -1


def check_log_start(offsets: PartitionOffsets, start: int, pipeline: str, *, added_later: bool = False) -> None:
    """Invariant 7: refuse to plan from below the log start offset (``added_later``: a partition
    added while the pipeline ran, due from offset 0, never read)."""
    if start < offsets.log_start:
        due = (
            "the partition was added after the pipeline began and never read" if added_later else f"the pipeline's committed end is {start}"
        )
        raise OffsetsLostError(
            f"these offsets are gone from Kafka (log start offset is {offsets.log_start}, {due}); "
            f"{offsets.log_start - start} offsets were removed by retention or delete_records "
            "before they were ingested. Set on_offsets_lost: skip to record a gap and continue.",
            pipeline=pipeline,
            topic=offsets.topic,
            partition=offsets.partition,
            start=start,
            end=offsets.log_start,
        )


GROUP_OFFSETS_TIMEOUT_S = 5.0


def commit_group_offsets(client_config: dict[str, str], pipeline: str, ends: dict[tuple[str, int], int]) -> None:
    """Publish committed ends as consumer-group offsets so standard lag tools see progress.

    Informational only: the Delta txn versions stay the source of truth (invariant 2). Bounded
    (``GROUP_OFFSETS_TIMEOUT_S``): a consumer's synchronous commit waits about 45 s for a group
    coordinator while the broker is down, which held a stream in an outage instead of retrying.
    """
    request = ConsumerGroupTopicPartitions(group_id(pipeline), [TopicPartition(t, p, o) for (t, p), o in sorted(ends.items())])
    admin = _admin(client_config)  # held until the answer: a dropped client never completes its futures
    futures = admin.alter_consumer_group_offsets([request], request_timeout=GROUP_OFFSETS_TIMEOUT_S)
    for future in futures.values():
        future.result(timeout=GROUP_OFFSETS_TIMEOUT_S)


# ---- record headers, read without confluent-kafka's decoder ------------------------------------
# confluent-kafka's Message.headers() decodes header keys as strict UTF-8 and, on a key that is
# not, returns its half-built list with the exception still set (its c_headers_to_py does not
# check PyUnicode_FromString). CPython then raises SystemError there or at a later, unrelated
# call, and the read task crashed (segmentation fault and stray SystemErrors, seen here). So the
# headers are read from librdkafka itself, through the rd_kafka_headers_t the Message holds, and
# Message.headers() is never called.
class _RawHeaders:
    """librdkafka's header accessors, from the library confluent-kafka loaded."""

    def __init__(self) -> None:
        import ctypes
        import glob
        import os

        import confluent_kafka

        folder = os.path.join(os.path.dirname(os.path.dirname(confluent_kafka.__file__)), "confluent_kafka.libs")
        found = glob.glob(os.path.join(folder, "librdkafka*.so*"))
        if not found:
            raise ImportError(f"no librdkafka next to confluent_kafka in {folder}")
        lib = ctypes.CDLL(found[0])
        self.count = lib.rd_kafka_header_cnt
        self.count.restype, self.count.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
        self.get_all = lib.rd_kafka_header_get_all
        self.get_all.restype = ctypes.c_int
        self.get_all.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_size_t),
        ]
        self.ctypes = ctypes
        # confluent-kafka 2.16's Message: PyObject_HEAD, then topic, value, key, headers (PyObject*),
        # then c_headers (rd_kafka_headers_t*): checked against headers() on a valid record (see verify)
        self.offset = 6 * ctypes.sizeof(ctypes.c_void_p)
        self.verified: bool | None = None

        # one set of out-parameters, reused: creating them per record cost more than the calls
        self._name, self._value, self._size = ctypes.c_char_p(), ctypes.c_void_p(), ctypes.c_size_t()
        self._refs = (ctypes.byref(self._name), ctypes.byref(self._value), ctypes.byref(self._size))
        self._address = ctypes.c_void_p.from_address
        self._string_at = ctypes.string_at

    def pointer(self, message: Message) -> int | None:
        return self._address(id(message) + self.offset).value

    def read(self, message: Message) -> list[tuple[str, bytes | None]] | None:
        """One message's headers, None when it has none."""
        pointer = self._address(id(message) + self.offset).value
        if not pointer:
            return None
        name, value, size = self._name, self._value, self._size
        get_all, refs, string_at = self.get_all, self._refs, self._string_at
        out: list[tuple[str, bytes | None]] = []
        index = 0
        while get_all(pointer, index, *refs) == 0:
            index += 1
            # a key that is not UTF-8 is kept readable, its odd bytes escaped (\xff): header keys
            # are text in the dead-letter table, and they are never part of a sink row
            key = (name.value or b"").decode("utf-8", "backslashreplace")
            out.append((key, string_at(value.value, size.value) if value.value else None))
        return out

    def verify(self, message: Message) -> bool:
        """Once per process: the raw read equals Message.headers() on a message whose keys decode."""
        raw = self.read(message)
        if raw is None or any("\\x" in key for key, _ in raw):
            return False  # decide on another message
        self.verified = [tuple(h) for h in (message.headers() or [])] == [tuple(h) for h in raw]
        return True


_RAW: _RawHeaders | None = None


def record_headers(chunk: list[Message], wanted: list[bool] | None = None) -> list:
    """Headers of each message ((key, value) pairs, or None); a key that is not UTF-8 comes back
    with its odd bytes escaped. ``wanted``: read only these messages' headers (None for the
    others): reading them costs about 3 µs a record, and a record that becomes a row does not
    keep them."""
    global _RAW
    if _RAW is None:
        _RAW = _RawHeaders()
    raw = _RAW
    headers: list = []
    for i, message in enumerate(chunk):
        if wanted is not None and not wanted[i]:
            headers.append(None)
        elif raw.verified is None and raw.pointer(message) and raw.verify(message):
            if not raw.verified:
                raise RuntimeError(
                    "confluent-kafka's Message layout is not the one offsetlake reads headers from "
                    "(its version changed?); pin confluent-kafka==2.16.1"
                )
            headers.append(message.headers())  # verify() read it already; its keys decode
        else:
            headers.append(raw.read(message))
    return headers
