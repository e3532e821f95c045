"""The next plan of a pipeline, computed from the sink's committed ends and the broker's offsets.

Planning only reads (Kafka offsets, the sink's txn versions) and decides; it never commits.
Offsets lost to retention below a committed end (invariant 7) fail the plan, or under
``on_offsets_lost: skip`` become a plan of kind ``gap`` that the run commits like any batch.
A run that is rerun gets its recorded plan back from ``offsetlake.ledger.Ledger.run_plan``.
"""

from __future__ import annotations

from offsetlake.config import PipelineConfig
from offsetlake.formats import resolve_reader_schema
from offsetlake.kafka import check_log_start, current_offsets
from offsetlake.plan import BatchKind, BatchPlan, OffsetRange, PartitionOffsets, RunContext, new_batch_id
from offsetlake.sink import committed_ends, open_table, sink_columns


def share_fairly(pending: dict[int, int], budget: int) -> dict[int, int]:
    """Split ``budget`` offsets across partitions: equal shares, unused shares go to the rest.

    Water-filling, so a nearly caught-up partition never starves a lagging one and no partition
    gets more than it has pending. Deterministic: leftover units go to the lowest partition ids.
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


def plan_ranges(
    topic: str,
    committed_ends: dict[int, int | None],
    offsets: dict[int, PartitionOffsets],
    start_policy: str,
    max_records: int,
) -> list[OffsetRange]:
    """Ranges for the next batch; empty ranges mean the partition is caught up.

    A partition with no committed end (new pipeline, or a partition added to the topic later)
    starts at its log start (``earliest``) or its LSO (``latest``). The caller checks the log
    start offset for loss (invariant 7) before calling.
    """
    starts: dict[int, int] = {}
    for p, info in offsets.items():
        committed = committed_ends.get(p)
        if committed is None:
            committed = info.log_start if start_policy == "earliest" else info.last_stable
        starts[p] = committed
    pending = {p: max(0, offsets[p].last_stable - starts[p]) for p in offsets}
    grant = share_fairly(pending, max_records)
    return [OffsetRange(topic, p, starts[p], starts[p] + grant[p]) for p in sorted(offsets)]


def plan_next_batch(
    config: PipelineConfig,
    run: RunContext,
    end_limit: dict[int, int] | None = None,
    kind: BatchKind = BatchKind.INGEST,
) -> BatchPlan | None:
    """The next batch from the sink's committed ends; None when caught up. Writes nothing.

    Checks invariant 7 first: a committed end below the log start raises OffsetsLostError, or,
    under ``on_offsets_lost: skip``, returns a ``gap`` plan covering the lost offsets (the run
    commits it, then plans again). Ends are capped by the LSO and by ``end_limit`` (the LSO seen
    when the run started).
    """
    offsets = current_offsets(config)
    table = open_table(config.sink_path)
    ends = committed_ends(table, config, config.topic, sorted(offsets))
    lost = []
    for p, committed in ends.items():
        if committed is not None and committed < offsets[p].log_start:
            if config.on_offsets_lost != "skip":
                check_log_start(offsets[p], committed, config.name)
            lost.append(OffsetRange(config.topic, p, committed, offsets[p].log_start))
    if lost:
        return BatchPlan(config.name, new_batch_id(config.name), BatchKind.GAP, tuple(lost), run)
    if end_limit:
        offsets = {
            p: PartitionOffsets(o.topic, o.partition, o.log_start, min(o.last_stable, end_limit.get(p, o.last_stable)))
            for p, o in offsets.items()
        }
    ranges = plan_ranges(config.topic, ends, offsets, config.start, config.max_records_per_batch)
    anchors = [r for r in ranges if ends[r.partition] is None and config.start == "latest"]
    if all(r.size == 0 for r in ranges) and not anchors:
        return None
    # the reader schema is fixed here, with the ranges (invariant 12)
    return BatchPlan(config.name, new_batch_id(config.name), kind, tuple(ranges), run,
                     reader_schema=resolve_reader_schema(config, sink_columns(table)))
