"""A Kafka sink's commit log (invariant 15): the history its transactions write beside its records.

For a Kafka sink the Kafka transaction is where a batch commits (``offsetlake.kafka_transactions``:
its records and its source end offsets, committed for the pipeline's group, visible together or
not at all). Each transaction also writes the batch's ledger entry to the pipeline's commit log
topic (``commit_log_topic``), so a runner that died between the Kafka commit and the ledger finds
the batch committed (``kafka_sink_commits``, read read_committed after the fence) and the
committed ends are read from it (``kafka_sink_ends``). The group's offsets (``group_offsets``,
read with ``require_stable`` semantics) are a copy for Kafka's tools, restored from the commit log
when they expired or were deleted.

Only the Kafka sink's own parts read it: its writer (``offsetlake.kafka_sink``), its reading half
(``offsetlake.sinks.kafka_reader``) and its audit (``offsetlake.audit.kafka_sink``), an
import-linter contract. The transactions themselves are shared with the outbox.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from offsetlake.config import PipelineConfig
from offsetlake.entry import parse
from offsetlake.errors import KafkaUnavailableError
from offsetlake.history import SinkCommit
from offsetlake.kafka import group_id
from offsetlake.kafka_transactions import CALL_TIMEOUT_S, read_one_partition
from offsetlake.plan import OFFSET_MOVING_KINDS

log = logging.getLogger("offsetlake.kafka_commit")


def group_offsets(
    client_config: Mapping[str, str], pipeline: str, partitions: Iterable[tuple[str, int]]
) -> dict[tuple[str, int], int | None]:
    """The group's committed offset per source partition (None: never committed): a Kafka sink's
    committed ends. A read_committed consumer asks with ``require_stable``, so an offset commit
    still inside an open transaction is waited out (until it commits or aborts), never read half-done."""
    wanted = [TopicPartition(topic, partition) for topic, partition in partitions]
    if not wanted:
        return {}
    consumer = Consumer({**client_config, "group.id": group_id(pipeline), "enable.auto.commit": False, "isolation.level": "read_committed"})
    try:
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            try:
                found = consumer.committed(wanted, timeout=CALL_TIMEOUT_S)
                break
            except KafkaException as err:
                # a coordinator still loading (right after a broker start) answers this for a while
                retriable = err.args[0].retriable() or err.args[0].code() in _COORDINATOR_NOT_READY
                if not retriable or time.monotonic() > deadline:
                    raise KafkaUnavailableError(
                        f"reading the committed offsets of group {group_id(pipeline)} failed: {err.args[0].str()}", pipeline=pipeline
                    ) from None
                time.sleep(0.5)
    finally:
        consumer.close()
    return {(tp.topic, tp.partition): (tp.offset if tp.offset >= 0 else None) for tp in found}


_COORDINATOR_NOT_READY = (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE)


# ---- the commit log: each committed transaction's ledger entry, inside the transaction ------------
def commit_log_topic(pipeline: str) -> str:
    """The compacted one-partition topic where a Kafka sink's transactions record their ledger
    entries (key: the batch id): the sink's history, as a Delta sink's is its commits."""
    return f"offsetlake-commits-{pipeline}"


def read_commit_log(client_config: Mapping[str, str], pipeline: str) -> list[tuple[int, str]]:
    """Every committed entry of the pipeline's commit log: (offset, entry JSON), in order; read by a
    read_committed consumer up to the last stable offset, so an open transaction's entry is not
    read (nor anything after it) until it commits or aborts. Empty when the topic does not exist."""
    found = read_one_partition(client_config, commit_log_topic(pipeline), f"{group_id(pipeline)}-commit-log-reader", pipeline)
    return [(offset, value.decode()) for offset, _, value in found if value]


def kafka_sink_commits(config: PipelineConfig) -> list[SinkCommit]:
    """A Kafka sink's history: each committed transaction's ledger entry, its ``version`` the
    entry's offset in the commit log (what a Delta sink's commits are to a Delta sink)."""
    out = []
    for offset, raw in read_commit_log(config.kafka_client_config(), config.name):
        entry = parse(raw)
        if entry is not None and entry.pipeline == config.name:
            out.append(SinkCommit(offset, entry))
    return out


def kafka_sink_ends(config: PipelineConfig, keys: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
    """A Kafka sink's committed end per source partition (None: never committed), from its commit
    log: the sink's history, as a Delta sink's txn versions are its ends (invariant 15).

    The pipeline group's offsets, which the same transactions commit, are a copy for Kafka's own
    tools (lag monitors, ``kafka-consumer-groups``), never the record of progress: a group that
    has no members has its offsets expired ``offsets.retention.minutes`` after its last commit (7
    days by default), and an operator may delete it; planning from them then restarted from the
    log start and published every record again (issue 48, finding 2)."""
    return commit_log_ends(kafka_sink_commits(config), keys)


def commit_log_ends(commits: Iterable[SinkCommit], keys: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
    """Per source partition, the end of the last offset-moving commit (ingest, stream, gap) of a
    Kafka sink's commit log (None: none committed it). Backfills never move an end."""
    ends: dict[tuple[str, int], int | None] = dict.fromkeys(keys)
    for commit in commits:
        if commit.kind not in OFFSET_MOVING_KINDS:
            continue
        for r in commit.entry.ranges:
            key = (r.topic, r.partition)
            if key in ends:
                ends[key] = max(r.end, ends[key] or 0)
    return ends
