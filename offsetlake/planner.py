"""The next plan of a pipeline, computed from the sink's committed ends and the broker's offsets.

Planning only reads (Kafka offsets, the sink's txn versions) and decides; it never commits.
Offsets lost to retention below a committed end (invariant 7) fail the plan, or under
``on_offsets_lost: skip`` become a plan of kind ``gap`` that the run commits like any batch.
A run that is rerun gets its recorded plan back from ``offsetlake.ledger.Ledger.run_plan``.
"""

from __future__ import annotations

import re

from offsetlake.config import PipelineConfig
from offsetlake.errors import KafkaUnavailableError
from offsetlake.formats import resolve_reader_schema
from offsetlake.history import SinkCommit
from offsetlake.kafka import check_log_start, current_offsets, topic_ids
from offsetlake.plan import OFFSET_MOVING_KINDS, BatchKind, BatchPlan, OffsetRange, PartitionOffsets, RunContext, new_batch_id
from offsetlake.schema_evolution import sink_columns
from offsetlake.sink import table_id
from offsetlake.sinks.choice import open_sink
from offsetlake.topic_epochs import check_topic_identity


def share_fairly(pending: dict, budget: int) -> dict:
    """Split ``budget`` offsets across partitions (keys: (topic, partition)): equal shares,
    unused shares go to the rest.

    Water-filling, so a nearly caught-up partition never starves a lagging one and no partition
    gets more than it has pending. Deterministic: leftover units go to the lowest keys.
    """
    grant = {p: 0 for p in pending}
    open_parts = sorted(p for p, n in pending.items() if n > 0)
    remaining = budget
    while open_parts and remaining > 0:
        share, extra = divmod(remaining, len(open_parts))
        still_open = []
        for index, p in enumerate(open_parts):
            want = pending[p] - grant[p]
            give = min(want, share + (1 if index < extra else 0))
            grant[p] += give
            remaining -= give
            if grant[p] < pending[p]:
                still_open.append(p)
        if len(still_open) == len(open_parts) and share == 0 and extra == 0:
            break
        open_parts = still_open
    return grant


TopicPartitionKey = tuple[str, int]


def plan_ranges(
    committed_ends: dict[TopicPartitionKey, int | None],
    offsets: dict[TopicPartitionKey, PartitionOffsets],
    start_policy: str,
    max_records: int,
    *,
    pipeline_begun: bool = False,
) -> list[OffsetRange]:
    """Ranges for the next batch over every topic-partition; empty ranges mean caught up.

    A partition with no committed end starts where ``start_policy`` says (its log start for
    ``earliest``, its LSO for ``latest``) only in the pipeline's first plan; once the pipeline
    has begun (``pipeline_begun``, see ``pipeline_has_begun``) a partition added later, or a topic
    that started matching ``topic_pattern``, starts at its log start: every record it holds was
    written while the pipeline was running, and ``latest`` would skip them unseen (invariant 7).
    The caller checks the log start offset for loss (invariant 7) first.
    """
    starts: dict[TopicPartitionKey, int] = {}
    for key, info in offsets.items():
        committed = committed_ends.get(key)
        if committed is None:
            at_lso = start_policy == "latest" and not pipeline_begun
            committed = info.last_stable if at_lso else info.log_start
        starts[key] = committed
    pending = {key: max(0, offsets[key].last_stable - starts[key]) for key in offsets}
    grant = share_fairly(pending, max_records)
    return [OffsetRange(t, p, starts[(t, p)], starts[(t, p)] + grant[(t, p)]) for t, p in sorted(offsets)]


def pipeline_has_begun(commits: list[SinkCommit], ends: dict[TopicPartitionKey, int | None]) -> bool:
    """True once the sink holds a commit of the pipeline that moved committed ends (an ingest,
    stream or gap batch, also the anchoring first batch of ``start: latest``) or any committed
    end: from then on ``start`` no longer applies (``plan_ranges``). A plan that never committed
    does not count, so a first run that failed plans its first batch again."""
    return any(end is not None for end in ends.values()) or any(c.kind in OFFSET_MOVING_KINDS for c in commits)


def due_from(commits: list[SinkCommit], ends: dict[TopicPartitionKey, int | None], begun: bool) -> dict[TopicPartitionKey, int]:
    """Per partition, the offset from which every record is due (invariant 7's loss check): its
    committed end; for a partition without one, of a topic the pipeline has committed ranges of,
    once it has begun, offset 0: it was added while the pipeline ran, so every record it ever
    held was due, and records deleted before its first read are lost, not unseen (RELIABILITY
    rounds 7 and 11). A topic the pipeline has no range of (one just listed or just matching
    ``topic_pattern``) may hold older records: it starts at its log start with nothing lost."""
    known = {t for c in commits for t in c.entry.topics()} if begun else set()
    due = {key: end for key, end in ends.items() if end is not None}
    due.update({key: 0 for key, end in ends.items() if end is None and key[0] in known})
    return due


def check_no_topic_gone(config: PipelineConfig, commits: list[SinkCommit], present: set[str]) -> None:
    """A topic the pattern matches whose records the sink holds must still exist: one deleted
    (or unreadable) fails the plan, naming it; its committed ranges stay in the sink's history.
    (A listed topic that is missing already failed when the topics were described.)"""
    if config.topic_pattern is None:
        return
    pattern = re.compile(config.topic_pattern)
    committed = {t for c in commits for t in c.entry.topics()}
    gone = sorted(t for t in committed - present if pattern.fullmatch(t))
    if gone:
        raise KafkaUnavailableError(
            f"topic {gone[0]} matches topic_pattern {config.topic_pattern} and has committed "
            f"ranges in the sink, but Kafka does not list it any more{f' ({len(gone) - 1} more)' if len(gone) > 1 else ''}. "
            "Its committed rows and ranges stay in the sink and its history. If it was retired on purpose, narrow "
            "topic_pattern so it no longer matches it; if it should exist, restore it",
            pipeline=config.name,
        )


def plan_next_batch(
    config: PipelineConfig,
    run: RunContext,
    end_limit: dict[TopicPartitionKey, int] | None = None,
    kind: BatchKind = BatchKind.INGEST,
) -> BatchPlan | None:
    """The next batch from the sink's committed ends; None when caught up. Writes nothing.

    Checks invariant 16 first: a committed end past its partition's log end, or a topic whose Kafka
    id changed, raises TopicIdentityError (``offsetlake.topic_epochs``); the plan records the topic
    ids it was made for. Then invariant 7: a committed end below the log start raises OffsetsLostError, or,
    under ``on_offsets_lost: skip``, returns a ``gap`` plan covering the lost offsets (the run
    commits it, then plans again). Ends are capped by the LSO and by ``end_limit`` (the LSO seen
    when the run started).
    """
    offsets = current_offsets(config)
    sink = open_sink(config)  # a Delta table's commits and txns, or a Kafka sink's commit log (invariant 15)
    table, commits, ends = sink.table, sink.commits(), sink.ends(sorted(offsets))
    check_no_topic_gone(config, commits, {t for t, _ in offsets})
    current_ids = topic_ids(config, sorted({t for t, _ in offsets}))
    check_topic_identity(config, commits, ends, offsets, current_ids)  # invariant 16, before anything else
    identity = {t: i for t, i in current_ids.items() if i is not None}
    begun = pipeline_has_begun(commits, ends)
    lost = []
    for key, committed in due_from(commits, ends, begun).items():
        if committed < offsets[key].log_start:
            if config.on_offsets_lost != "skip":
                check_log_start(offsets[key], committed, config.name, added_later=ends[key] is None)
            lost.append(OffsetRange(key[0], key[1], committed, offsets[key].log_start))
    if lost:
        return BatchPlan(
            config.name, new_batch_id(config.name), BatchKind.GAP, tuple(lost), run, topic_ids=identity, sink_table_id=table_id(table)
        )
    if end_limit:
        offsets = {
            key: PartitionOffsets(o.topic, o.partition, o.log_start, min(o.last_stable, end_limit.get(key, o.last_stable)))
            for key, o in offsets.items()
        }
    ranges = plan_ranges(ends, offsets, config.start, config.max_records_per_batch, pipeline_begun=begun)
    anchors = [r for r in ranges if ends[(r.topic, r.partition)] is None and config.start == "latest" and not begun]
    if all(r.size == 0 for r in ranges) and not anchors:
        return None
    # the reader schema is fixed here, with the ranges (invariant 12)
    return BatchPlan(
        config.name,
        new_batch_id(config.name),
        kind,
        tuple(ranges),
        run,
        reader_schema=resolve_reader_schema(config, sink_columns(table)),
        topic_ids=identity,
        sink_table_id=table_id(table),
    )
