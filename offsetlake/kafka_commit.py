"""A Kafka sink's commit point (invariant 15): one Kafka transaction per batch.

A Delta commit and a Kafka commit cannot be one atomic step (the two-phase API of KIP-939 is not
in a released broker), so for a Kafka sink the Kafka transaction is where a batch commits: its
output records and its source end offsets, committed for the pipeline's consumer group with
``send_offsets_to_transaction``, become visible to read_committed consumers together or not at
all. The ledger follows the transaction and is reconciled from the group's committed offsets.

Mapped onto Flink's two-phase commit (docs/design.md, "A Kafka topic as a sink"):

* pre-commit: ``begin_transaction``, produce every output record, flush (every record
  acknowledged by the broker, still invisible), then add the source ends to the transaction;
* commit: ``commit_transaction``; the broker writes the commit markers on the output partitions
  and ``__consumer_offsets`` in one step;
* abort: any failure before the commit aborts the transaction (``KafkaSinkAbortedError``); a
  process that dies leaves it open until the next producer with the same ``transactional.id``
  starts (``init_transactions`` aborts it and fences the dead one) or ``transaction.timeout.ms``;
* recovery: ``committed_ends`` reads the group's offsets with ``require_stable`` semantics (a
  read_committed consumer waits out a pending transactional offset commit), so a runner that
  died between the Kafka commit and the ledger finds the batch committed.

A ``transactional.id`` is stable per pipeline and writer slot: a second runner of the same
pipeline fences the first, whose next transactional call fails (``KafkaSinkFencedError``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from offsetlake import failpoints
from offsetlake.errors import KafkaSinkAbortedError, KafkaSinkFencedError, KafkaUnavailableError
from offsetlake.kafka import group_id

log = logging.getLogger("offsetlake.kafka_commit")

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

    def all_headers(self, batch_id: str, kind: str) -> list[tuple[str, str | bytes | None]]:
        named: list[tuple[str, str | bytes | None]] = [("offsetlake.batch", batch_id.encode()), ("offsetlake.kind", kind.encode())]
        if self.topic is not None:
            coordinates = (self.topic, str(self.partition), str(self.offset))
            named += [(name, value.encode()) for name, value in zip(SOURCE_HEADERS, coordinates, strict=True)]
        return [*named, *self.headers]


@dataclass
class CommittedTransaction:
    """What one committed transaction wrote: records per output partition and the source ends."""

    records: int
    ends: dict[tuple[str, int], int]
    output_partitions: dict[int, int] = field(default_factory=dict)


class TransactionalWriter:
    """The pipeline's transactional producer for one writer slot.

    Made once per runner: ``init_transactions`` fences every earlier producer with the same id and
    aborts the transaction it left open. ``commit`` then writes one batch per transaction.
    """

    def __init__(self, client_config: Mapping[str, str], pipeline: str, slot: int | str = 0, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.pipeline = pipeline
        self.transactional_id = transactional_id(pipeline, slot)
        self._servers = client_config.get("bootstrap.servers", "?")
        self._producer = Producer(
            {
                **client_config,
                "transactional.id": self.transactional_id,
                "enable.idempotence": True,
                "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
                "linger.ms": 20,
            }
        )
        # the consumer only names the group whose offsets the transaction commits; it never polls
        self._group = Consumer({**client_config, "group.id": group_id(pipeline), "enable.auto.commit": False})
        try:
            self._producer.init_transactions(timeout_s)
        except KafkaException as err:
            self._group.close()
            raise KafkaUnavailableError(
                f"the Kafka sink's producer ({self.transactional_id}) could not start its transactions on {self._servers} "
                f"within {timeout_s:.0f}s: {err.args[0].str()}",
                pipeline=pipeline,
            ) from None

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
        also: Iterable[tuple[str, bytes, bytes]] = (),
    ) -> CommittedTransaction:
        """Produce ``records`` to ``out_topic`` and commit them with the source ``ends`` (none: no
        offsets) and the ``also`` records (topic, key, value: e.g. an outbox's progress) in one
        transaction. On any failure before the commit the transaction is aborted and nothing of it
        is visible; a fenced producer raises ``KafkaSinkFencedError`` and must not be used again."""
        failed: list[KafkaError] = []
        per_partition: dict[int, int] = {}

        def delivered(err: KafkaError | None, message: Message) -> None:
            partition = message.partition()
            if err is not None:
                failed.append(err)
            elif partition is not None:
                per_partition[partition] = per_partition.get(partition, 0) + 1

        count = 0
        self._producer.begin_transaction()
        try:
            for record in records:
                self._produce(out_topic, record, record.all_headers(batch_id, kind), delivered)
                count += 1
            for topic, key, value in also:
                self._producer.produce(topic, value=value, key=key, on_delivery=delivered)
            failpoints.failpoint("after_produce")
            remaining = self._producer.flush(CALL_TIMEOUT_S)
            if remaining or failed:
                reason = failed[0].str() if failed else f"{remaining} records not acknowledged within {CALL_TIMEOUT_S:.0f}s"
                raise KafkaSinkAbortedError(
                    f"batch {batch_id}: producing to '{out_topic}' failed ({reason}); the transaction is aborted",
                    pipeline=self.pipeline,
                    batch_id=batch_id,
                )
            failpoints.failpoint("after_flush")
            if ends:
                offsets = [TopicPartition(topic, partition, end) for (topic, partition), end in sorted(ends.items())]
                self._producer.send_offsets_to_transaction(offsets, self._group.consumer_group_metadata(), CALL_TIMEOUT_S)
            self._producer.commit_transaction(CALL_TIMEOUT_S)
        except KafkaException as err:
            raise self._aborted(batch_id, err.args[0]) from None
        except Exception:
            self._abort(batch_id)
            raise
        failpoints.failpoint("after_kafka_commit")
        log.info("batch %s: %d records to %s committed with the source ends in %s", batch_id, count, out_topic, self.transactional_id)
        return CommittedTransaction(count, dict(ends), per_partition)

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
        if error.fatal() or error.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH):
            return KafkaSinkFencedError(
                f"batch {batch_id}: the Kafka sink's producer {self.transactional_id} was fenced by a newer one "
                f"({error.str()}): another runner of this pipeline took over; nothing of this batch is visible. "
                "Only one runner per pipeline writes a Kafka sink: let the other finish, then run again",
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

    def _abort(self, batch_id: str) -> None:
        try:
            self._producer.abort_transaction(CALL_TIMEOUT_S)
        except KafkaException as err:  # fenced or fatal: the broker aborts it when the new producer starts
            log.warning("batch %s: aborting the transaction of %s failed: %s", batch_id, self.transactional_id, err.args[0].str())


def committed_ends(
    client_config: Mapping[str, str], pipeline: str, partitions: Iterable[tuple[str, int]]
) -> dict[tuple[str, int], int | None]:
    """The group's committed offset per source partition (None: never committed): a Kafka sink's
    committed ends. A read_committed consumer asks with ``require_stable``, so an offset commit
    still inside an open transaction is waited out (until it commits or aborts), never read half-done."""
    wanted = [TopicPartition(topic, partition) for topic, partition in partitions]
    consumer = Consumer({**client_config, "group.id": group_id(pipeline), "enable.auto.commit": False, "isolation.level": "read_committed"})
    try:
        found = consumer.committed(wanted, timeout=CALL_TIMEOUT_S)
    except KafkaException as err:
        raise KafkaUnavailableError(
            f"reading the committed offsets of group {group_id(pipeline)} failed: {err.args[0].str()}", pipeline=pipeline
        ) from None
    finally:
        consumer.close()
    return {(tp.topic, tp.partition): (tp.offset if tp.offset >= 0 else None) for tp in found}
