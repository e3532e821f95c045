"""Kafka transactions as offsetlake writes them (invariant 15): ``TransactionalWriter`` produces a
batch's records and commits its source ends for the pipeline's group in ONE transaction, and the
read_committed readers read what such transactions made visible. The Kafka sink's commit point
(``offsetlake.kafka_commit``, ``offsetlake.kafka_sink``) and the outbox's publication
(``offsetlake.outbox``) are both built from these.

Mapped onto Flink's two-phase commit (docs/design.md, "A Kafka topic as a sink"):

* pre-commit: ``begin_transaction``, produce every output record, flush (every record
  acknowledged by the broker, still invisible), then add the source ends to the transaction;
* commit: ``commit_transaction``; the broker writes the commit markers on the output partitions
  and ``__consumer_offsets`` in one step;
* abort: any failure before the commit aborts the transaction (``KafkaSinkAbortedError``); a
  process that dies leaves it open until the next producer with the same ``transactional.id``
  starts (``init_transactions`` aborts it and fences the dead one) or ``transaction.timeout.ms``.

A ``transactional.id`` is stable per pipeline and writer slot: a second runner of the same
pipeline fences the first, whose next transactional call fails (``KafkaSinkFencedError``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from offsetlake import failpoints
from offsetlake.coordinates import COORDINATE_COLUMNS, OFFSET, PARTITION, TOPIC, TOPIC_EPOCH
from offsetlake.errors import ConfigError, KafkaSinkAbortedError, KafkaSinkFencedError, KafkaUnavailableError
from offsetlake.kafka import group_id
from offsetlake.sink_values import Encode, encode_json, json_value, json_values

log = logging.getLogger("offsetlake.kafka_transactions")


TRANSACTION_TIMEOUT_MS = 60_000  # a dead runner's open transaction blocks read_committed consumers at most this long


CALL_TIMEOUT_S = 60.0


# Headers of every output record: the batch that wrote it and its kind (offsetlake.batch,
# offsetlake.kind), and the source record it came from, when one did (these three).
SOURCE_HEADERS = ("offsetlake.topic", "offsetlake.partition", "offsetlake.offset")


def transactional_id(pipeline: str, slot: int | str = 0) -> str:
    """The pipeline's ``transactional.id`` for one writer slot: stable, so a restart fences its zombie."""
    return f"offsetlake-{pipeline}-{slot}"


@dataclass(frozen=True)
class OutputRecord:
    """One record to produce: the output topic's key and value, with the source coordinates."""

    key: bytes | None
    value: bytes | None
    topic: str | None  # the source record's coordinates; None for a record no source record made
    partition: int = -1
    offset: int = -1
    headers: tuple[tuple[str, bytes], ...] = ()
    to: str | None = None  # the output topic, when not the transaction's own (a Kafka sink's routes)

    def all_headers(self, batch_id: str, kind: str) -> list[tuple[str, str | bytes | None]]:
        return _Marks(batch_id, kind).of(self)


class _Marks:
    """The headers of a transaction's records: its batch and kind, then the source coordinates
    (their topic and partition encoded once per partition, not once per record), then the
    record's own."""

    def __init__(self, batch_id: str, kind: str) -> None:
        self.batch = (("offsetlake.batch", batch_id.encode()), ("offsetlake.kind", kind.encode()))
        self.places: dict[tuple[str, int], tuple[tuple[str, bytes], ...]] = {}

    def of(self, record: OutputRecord) -> list[tuple[str, str | bytes | None]]:
        if record.topic is None:
            return [*self.batch, *record.headers]
        place = self.places.get((record.topic, record.partition))
        if place is None:
            named = zip(SOURCE_HEADERS[:2], (record.topic.encode(), str(record.partition).encode()), strict=True)
            place = self.places[record.topic, record.partition] = tuple(named)
        return [*self.batch, *place, (SOURCE_HEADERS[2], str(record.offset).encode()), *record.headers]


@dataclass
class CommittedTransaction:
    """What one committed transaction wrote: records per output partition, the source ends, and
    the offset each ``also`` record got (in the order given)."""

    records: int
    ends: dict[tuple[str, int], int]
    output_partitions: dict[int, int] = field(default_factory=dict)
    also_offsets: list[int] = field(default_factory=list)


@dataclass
class _Deliveries:
    """The delivery reports of one transaction: what failed, how many records each output
    partition took, and where each ``also`` record landed (by its index)."""

    failed: list[KafkaError] = field(default_factory=list)
    per_partition: dict[int, int] = field(default_factory=dict)
    also_offsets: dict[int, int] = field(default_factory=dict)

    def record(self, err: KafkaError | None, message: Message) -> None:
        partition = message.partition()
        if err is not None:
            self.failed.append(err)
        elif partition is not None:
            self.per_partition[partition] = self.per_partition.get(partition, 0) + 1

    def also(self, index: int) -> Callable[[KafkaError | None, Message], None]:
        def answer(err: KafkaError | None, message: Message) -> None:
            if err is not None:
                self.failed.append(err)
            else:
                self.also_offsets[index] = message.offset() or 0

        return answer


class TransactionalWriter:
    """The pipeline's transactional producer for one writer slot.

    Made once per runner: ``init_transactions`` fences every earlier producer with the same id and
    aborts the transaction it left open. ``commit`` then writes one batch per transaction.
    """

    def __init__(
        self,
        client_config: Mapping[str, str],
        pipeline: str,
        slot: int | str = 0,
        timeout_s: float = CALL_TIMEOUT_S,
        transaction_timeout_ms: int = TRANSACTION_TIMEOUT_MS,
    ) -> None:
        self.pipeline = pipeline
        self.transactional_id = transactional_id(pipeline, slot)
        self._servers = client_config.get("bootstrap.servers", "?")
        self._transaction_timeout_ms = transaction_timeout_ms
        self._producer_config = {
            **client_config,
            "transactional.id": self.transactional_id,
            "enable.idempotence": True,
            "transaction.timeout.ms": transaction_timeout_ms,
            "linger.ms": 20,
            "error_cb": self._on_error,
        }
        self._fatal: KafkaError | None = None
        # the consumer only names the group whose offsets the transaction commits; it never polls
        self._group = Consumer({**client_config, "group.id": group_id(pipeline), "enable.auto.commit": False})
        self._needs_restart = False  # an abort failed: the producer is unusable, its successor aborts its transaction
        try:
            self._producer = self._started(timeout_s)
        except KafkaUnavailableError:
            self._group.close()
            raise

    def _check_delivered(self, batch_id: str, out_topic: str, remaining: int, failed: list[KafkaError]) -> None:
        """After the flush: every record acknowledged, or the reason the transaction must abort."""
        if (fatal := self._fatal_among(failed)) is not None:  # fenced while producing: deliveries fail fatally
            raise self._aborted(batch_id, fatal)
        if remaining or failed:
            reason = failed[0].str() if failed else f"{remaining} records not acknowledged within {CALL_TIMEOUT_S:.0f}s"
            raise KafkaSinkAbortedError(
                f"batch {batch_id}: producing to '{out_topic}' failed ({reason}); the transaction is aborted",
                pipeline=self.pipeline,
                batch_id=batch_id,
            )

    def _fatal_among(self, failed: list[KafkaError]) -> KafkaError | None:
        """The fatal error (fenced) this producer met, from its error callback or a delivery report."""
        return self._fatal or next((e for e in failed if e.fatal() or e.code() in _FENCED), None)

    def _on_error(self, error: KafkaError) -> None:
        """librdkafka's error callback: a fatal error (fenced) is kept, since a call that meets it
        inside a delivery callback (``flush``) can surface as a bare SystemError."""
        if error.fatal():
            self._fatal = error

    def _started(self, timeout_s: float) -> Producer:
        """A producer with the pipeline's transactional id: ``init_transactions`` fences every
        earlier one and aborts the transaction it left open."""
        producer = Producer(self._producer_config)
        try:
            producer.init_transactions(timeout_s)
        except KafkaException as err:
            raise KafkaUnavailableError(
                f"the Kafka sink's producer ({self.transactional_id}) could not start its transactions on {self._servers} "
                f"within {timeout_s:.0f}s: {err.args[0].str()}",
                pipeline=self.pipeline,
            ) from None
        return producer

    def close(self) -> None:
        self._group.close()

    def __enter__(self) -> TransactionalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def commit(
        self,
        batch_id: str,
        kind: str,
        out_topic: str,
        records: Iterable[OutputRecord],
        ends: Mapping[tuple[str, int], int],
        also: Iterable[tuple] = (),
    ) -> CommittedTransaction:
        """Produce ``records`` to ``out_topic`` (a record's ``to``, when it names one) and commit them
        with the source ``ends`` (none: no offsets) and the ``also`` records (topic, key, value: e.g.
        an outbox's progress) in one transaction. On any failure before the commit the transaction is aborted and nothing of it
        is visible; a fenced producer raises ``KafkaSinkFencedError`` and must not be used again."""
        reports = _Deliveries()
        failed, per_partition, also_offsets = reports.failed, reports.per_partition, reports.also_offsets
        delivered, also_delivered = reports.record, reports.also
        count = 0
        if self._needs_restart:
            self._producer = self._started(CALL_TIMEOUT_S)
            self._needs_restart, self._fatal = False, None
        self._producer.begin_transaction()
        try:
            marks = _Marks(batch_id, kind)
            for record in records:
                self._produce(record.to or out_topic, record, marks.of(record), delivered)
                count += 1
            for index, (topic, key, value, *headers) in enumerate(also):
                extra = OutputRecord(key, value, None, headers=tuple(headers[0]) if headers else ())
                self._produce(topic, extra, list(extra.headers), also_delivered(index))
            failpoints.failpoint("after_produce")
            remaining = self._producer.flush(CALL_TIMEOUT_S)
            self._check_delivered(batch_id, out_topic, remaining, failed)
            failpoints.failpoint("after_flush")
            if ends:
                offsets = [TopicPartition(topic, partition, end) for (topic, partition), end in sorted(ends.items())]
                self._producer.send_offsets_to_transaction(offsets, self._group.consumer_group_metadata(), CALL_TIMEOUT_S)
            self._producer.commit_transaction(CALL_TIMEOUT_S)
        except KafkaException as err:
            raise self._aborted(batch_id, err.args[0]) from None
        except Exception as err:
            # fenced while flushing: the fatal error can come out of a delivery callback as a bare
            # SystemError, before the error callback has told it (seen under load); asked to abort,
            # a fenced producer says so
            fatal = self._fatal_among(failed) or _kafka_error_in(err)
            if fatal is None:
                met = self._abort(batch_id)
                if met is not None and not _fenced(met):
                    # librdkafka (issue 4849) can fail an abort right after a produce with
                    # INVALID_TXN_STATE and make the producer fatal: not a fence. The transaction
                    # stays uncommitted, the next commit starts a new producer whose
                    # init_transactions aborts it, and the error to report is the batch's own.
                    log.warning("batch %s: %s (%s); the next batch restarts the producer", batch_id, met.str(), met.name())
                    self._fatal = None
                fatal = self._fatal or (met if met is not None and _fenced(met) else None)
            log.warning("batch %s: %s while in its transaction (fatal: %s)", batch_id, type(err).__name__, fatal.str() if fatal else None)
            if fatal is not None:
                raise self._aborted(batch_id, fatal) from None
            raise
        failpoints.failpoint("after_kafka_commit")
        log.info("batch %s: %d records to %s committed with the source ends in %s", batch_id, count, out_topic, self.transactional_id)
        return CommittedTransaction(count, dict(ends), per_partition, [also_offsets[i] for i in sorted(also_offsets)])

    def _produce(
        self,
        topic: str,
        record: OutputRecord,
        headers: list[tuple[str, str | bytes | None]],
        delivered: Callable[[KafkaError | None, Message], None],
    ) -> None:
        while True:
            try:
                self._producer.produce(topic, value=record.value, key=record.key, headers=headers, on_delivery=delivered)
                return
            except BufferError:  # the local queue is full: let deliveries drain it
                self._producer.poll(0.5)

    def _aborted(self, batch_id: str, error: KafkaError) -> Exception:
        if error.fatal() or error.code() in _FENCED:
            return KafkaSinkFencedError(
                f"batch {batch_id}: the Kafka sink's producer {self.transactional_id} was fenced ({error.str()}): either "
                "another runner of this pipeline started (a newer producer with the same transactional.id) or this "
                f"transaction stayed open longer than transaction.timeout.ms ({self._transaction_timeout_ms} ms) and the broker "
                "aborted it. Nothing of this batch is visible. Only one runner per pipeline writes a Kafka sink: let the "
                "other finish, then run again",
                pipeline=self.pipeline,
                batch_id=batch_id,
            )
        self._abort(batch_id)
        return KafkaSinkAbortedError(
            f"batch {batch_id}: the transaction on {self._servers} failed ({error.str()}) and was aborted; "
            "none of its records or offsets are visible, and running again commits it once",
            pipeline=self.pipeline,
            batch_id=batch_id,
        )

    def _abort(self, batch_id: str) -> KafkaError | None:
        """Abort the open transaction; returns the error the abort met (None: aborted)."""
        try:
            self._producer.abort_transaction(CALL_TIMEOUT_S)
        except KafkaException as err:  # fenced or fatal: the broker aborts it when the next producer starts
            self._needs_restart = True
            log.warning("batch %s: aborting the transaction of %s failed: %s", batch_id, self.transactional_id, err.args[0].str())
            return err.args[0]
        return None


def _fenced(error: KafkaError) -> bool:
    """The producer was fenced (a newer one with its transactional.id, or its transaction timed
    out): a fence code, or any fatal error but the INVALID_TXN_STATE of a failed abort."""
    return error.code() in _FENCED or (error.fatal() and error.code() != KafkaError.INVALID_TXN_STATE)


def _kafka_error_in(err: BaseException) -> KafkaError | None:
    """The KafkaError an exception was raised over (a SystemError out of a callback carries the
    KafkaException that was pending as its cause or context)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, KafkaException) and isinstance(seen.args[0], KafkaError):
            return seen.args[0]
        seen = seen.__cause__ or seen.__context__
    return None


_FENCED = (KafkaError._FENCED, KafkaError._FATAL, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)


def read_one_partition(
    client_config: Mapping[str, str], topic: str, group: str, pipeline: str
) -> list[tuple[int, bytes | None, bytes | None]]:
    """(offset, key, value) of every committed record of partition 0 of ``topic``, in order, read
    by a read_committed consumer to the last stable offset: a commit log, an outbox's progress.
    Empty when the topic does not exist."""
    consumer = Consumer(
        {**client_config, "group.id": group, "isolation.level": "read_committed", "enable.auto.commit": False, "enable.partition.eof": True}
    )
    out: list[tuple[int, bytes | None, bytes | None]] = []
    try:
        if topic not in consumer.list_topics(timeout=CALL_TIMEOUT_S).topics:
            return out
        start, end = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=CALL_TIMEOUT_S, cached=False)
        if end <= start:
            return out
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    return out
                raise KafkaUnavailableError(f"reading '{topic}' failed: {error.str()}", pipeline=pipeline)
            out.append((message.offset() or 0, message.key(), message.value()))
        raise KafkaUnavailableError(f"reading '{topic}' did not reach its end within {CALL_TIMEOUT_S:.0f}s", pipeline=pipeline)
    except KafkaException as err:
        raise KafkaUnavailableError(f"reading '{topic}' failed: {err.args[0].str()}", pipeline=pipeline) from None
    finally:
        consumer.close()


def read_committed_headers(client_config: Mapping[str, str], topic: str, pipeline: str) -> Iterator[dict[str, bytes]]:
    """The headers of every committed record of ``topic`` (every partition, up to its last stable
    offset), read by a read_committed consumer: what a Kafka sink's audit counts."""
    for _, _, headers in read_committed_records(client_config, topic, pipeline, f"{group_id(pipeline)}-audit"):
        yield headers


def read_committed_records(
    client_config: Mapping[str, str], topic: str, pipeline: str, group: str
) -> Iterator[tuple[bytes | None, bytes | None, dict[str, bytes]]]:
    """(key, value, headers) of every committed record of ``topic`` (every partition, up to its
    last stable offset), read by a read_committed consumer in group ``group`` (which commits
    nothing); nothing when the topic does not exist."""
    consumer = Consumer({**client_config, "group.id": group, "isolation.level": "read_committed", "enable.auto.commit": False})
    try:
        metadata = consumer.list_topics(topic, timeout=CALL_TIMEOUT_S).topics.get(topic)
        if metadata is None or metadata.error is not None:
            return
        ends = {}
        for partition in metadata.partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=CALL_TIMEOUT_S, cached=False)
            if high > low:
                ends[partition] = high  # a read_committed consumer's high watermark is the last stable offset
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        deadline = time.monotonic() + 10 * CALL_TIMEOUT_S
        while ends:
            if time.monotonic() > deadline:
                raise KafkaUnavailableError(f"reading '{topic}' to its last stable offsets did not finish", pipeline=pipeline)
            for message in consumer.consume(10_000, 1.0):
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaUnavailableError(f"reading '{topic}' failed: {error.str()}", pipeline=pipeline)
                partition, offset = message.partition() or 0, message.offset() or 0
                headers: dict[str, bytes] = {}
                for header in message.headers() or []:
                    value = header[1]
                    headers[str(header[0])] = value.encode() if isinstance(value, str) else (value or b"")
                yield message.key(), message.value(), headers
                if offset + 1 >= ends.get(partition, 0):
                    ends.pop(partition, None)
            for partition, end in list(ends.items()):  # transaction markers end a partition without a record
                position = consumer.position([TopicPartition(topic, partition)])[0].offset
                if position >= end:
                    ends.pop(partition)
    except KafkaException as err:
        raise KafkaUnavailableError(f"reading '{topic}' failed: {err.args[0].str()}", pipeline=pipeline) from None
    finally:
        consumer.close()


def ensure_topics(client_config: Mapping[str, str], pipeline: str, needed: Iterable[str], made: Mapping[str, dict[str, str]]) -> None:
    """Each topic of ``needed`` must exist (its partitions are the user's to choose: a clear error
    names it); each of ``made`` (name -> config) is created once, with one partition, if missing."""
    admin = AdminClient(dict(client_config))
    try:
        topics = admin.list_topics(timeout=CALL_TIMEOUT_S).topics
    except KafkaException as err:
        raise KafkaUnavailableError(f"listing topics failed: {err.args[0].str()}", pipeline=pipeline) from None
    for topic in needed:
        if topic not in topics:
            raise ConfigError(
                f"topic '{topic}' does not exist: create it first (its partitions and retention are yours to choose)",
                pipeline=pipeline,
                topic=topic,
            )
    missing = [NewTopic(name, num_partitions=1, config=dict(settings)) for name, settings in made.items() if name not in topics]
    for name, future in admin.create_topics(missing).items() if missing else ():
        try:
            future.result(CALL_TIMEOUT_S)
        except KafkaException as err:
            if err.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise KafkaUnavailableError(f"creating topic '{name}' failed: {err.args[0].str()}", pipeline=pipeline) from None


# ---- rows as records ------------------------------------------------------------------------------
def record_key(row: Mapping[str, Any], key_columns: Sequence[str]) -> bytes | None:
    """One column: its value as text (bytes as they are); several: a JSON array; none: no key."""
    if not key_columns:
        return None
    if len(key_columns) > 1:
        return json.dumps([row[c] for c in key_columns], default=json_value).encode()
    value = row[key_columns[0]]
    if value is None or isinstance(value, bytes):
        return value
    return (value if isinstance(value, str) else str(json_value(value))).encode()


def row_record(
    row: Mapping[str, Any], key_columns: Sequence[str], headers: tuple[tuple[str, bytes], ...] = (), encode: Encode = encode_json
) -> OutputRecord:
    """A sink row as a record: its key columns' key, its columns without the record coordinates
    as the value (``encode``: a JSON object unless the sink's format says otherwise), and the
    source record's coordinates."""
    value = {k: v for k, v in row.items() if k not in NOT_IN_VALUES}
    return OutputRecord(record_key(row, key_columns), encode(value), row[TOPIC], row[PARTITION], row[OFFSET], headers)


NOT_IN_VALUES = frozenset({*COORDINATE_COLUMNS, TOPIC_EPOCH})


def table_records(
    rows: pa.Table, key_columns: Sequence[str], encode: Encode = encode_json, to: Sequence[str | None] | None = None
) -> Iterator[OutputRecord]:
    """``row_record`` of every row of ``rows``, in their order, a column at a time: the keys and
    JSON values are made from Arrow columns (``record_keys``, ``sink_values.json_values``), so a
    row is never a dict of Python objects on the way. Another ``encode`` (a registry format), or a
    column JSON values cannot prepare, encodes row by row as ``row_record`` does. ``to``: each
    row's output topic (a Kafka sink's routes), in the rows' order."""
    values = rows.select([c for c in rows.column_names if c not in NOT_IN_VALUES])
    encoded = json_values(values) if encode is encode_json else None
    if encoded is None:
        encoded = [encode(row) for batch in values.to_batches(max_chunksize=10_000) for row in batch.to_pylist()]
    coordinates = zip(rows.column(TOPIC).to_pylist(), rows.column(PARTITION).to_pylist(), rows.column(OFFSET).to_pylist(), strict=True)
    targets = to if to is not None else [None] * rows.num_rows
    for key, value, (topic, partition, offset), target in zip(record_keys(rows, key_columns), encoded, coordinates, targets, strict=True):
        yield OutputRecord(key, value, topic, partition, offset, to=target)


def record_keys(rows: pa.Table, key_columns: Sequence[str]) -> list[bytes | None]:
    """``record_key`` of every row: one text, integer or binary column is cast in Arrow (a
    string's UTF-8 bytes, an integer's digits), anything else goes row by row."""
    if not key_columns:
        return [None] * rows.num_rows
    if len(key_columns) == 1:
        column, t = rows.column(key_columns[0]), rows.schema.field(key_columns[0]).type
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return column.cast(pa.binary()).to_pylist()
        if pa.types.is_integer(t):
            return column.cast(pa.string()).cast(pa.binary()).to_pylist()
    keys = rows.select(list(key_columns)).to_pylist()
    return [record_key(row, key_columns) for row in keys]
