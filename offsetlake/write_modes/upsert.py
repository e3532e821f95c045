"""``sink.mode: upsert``: one row per key, the newest record's (invariant 13; ``offsetlake.keyed``
holds the rule and its hidden state rows, which live in the state table: the sink holds each
live key's row only, ``offsetlake.write_modes.stateful``). A batch merges into the state files
holding its keys, on the state the sink snapshot it read pins (invariant 10); a backfill merges
its records, except those a later record of their key replaced, without bringing a key back to a
record before its range."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from offsetlake import keyed
from offsetlake.coordinates import PARTITION, TOPIC, Selection
from offsetlake.formats import REASON, decoder_for, good_rows
from offsetlake.keyed import HIDDEN
from offsetlake.log_lines import log_step
from offsetlake.plan import BatchPlan
from offsetlake.processed import ProcessedBatch, stage_files
from offsetlake.sink import committed_end, open_table
from offsetlake.transform import apply_transform
from offsetlake.write_modes.mode import Compaction, Replay, StagedMerge
from offsetlake.write_modes.stateful import MergeStep, StatefulMode

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import DataFrame, SparkSession

    from offsetlake.config import PipelineConfig


class UpsertMode(StatefulMode):
    """A merge per batch into the state table; the sink holds each live key's row."""

    replay = Replay.NEWEST_PER_KEY
    state_kind = "delete markers, superseded records"

    @property
    def group(self) -> list[str]:
        return list(self.config.sink.key)

    def merge(self, step: MergeStep) -> StagedMerge:
        merge = stage_merge(step.config, step.plan, step.processed, step.spark, step.state, step.prepared)
        merge.shape = keyed.with_hidden_column(step.processed.rows_schema)  # the merge writes hidden state rows
        return merge

    @property
    def private_columns(self) -> set[str]:
        """A key's row is its state row readers see (no delete marker, no superseded record)."""
        return {HIDDEN}

    def prepare_backfill(self, plan: BatchPlan, spark: Any) -> Any:
        """A record a later one of its key replaced is never restored: the later records, read once."""
        table = open_table(self.config.layout.sink)
        ends = {(r.topic, r.partition): committed_end(table, self.config, r.topic, r.partition) for r in plan.ranges}
        return later_records(self.config, plan, spark, ends)

    def backfill_message(self, plan: BatchPlan, counts: Any) -> str:
        said = f"{counts.inserted} inserted, {counts.updated} updated, {counts.deleted} deleted, {counts.older} older than the rows kept"
        return f"merged records of {plan.describe()}: {said}; rewrote {counts.files_rewritten} state files"

    def compact(self, table: DeltaTable, partitions: list | None) -> Compaction:
        """A keyed sink's merges prune files by their key ranges: compaction sorts by the key
        (z-order over one column is a sort), so files keep narrow, disjoint ranges. The sink
        holds only rows; the delete markers that keep a deleted key from coming back are in the
        state table, never dropped: nothing bounds when a record of its key may still arrive from
        another partition."""
        return Compaction(table.optimize.z_order(self.config.sink.key))


def stage_merge(
    config: PipelineConfig, plan: BatchPlan, processed: ProcessedBatch, spark: SparkSession, table: Any, later: DataFrame | None = None
) -> StagedMerge:
    """An upsert batch (``offsetlake.keyed``): the last record per key and topic-partition (minus
    those a ``later`` record of their key replaced, for a backfill), the live files of ``table``
    that may hold those keys, and new files holding those files' rows with the batch applied,
    sorted by key. Raises BackfillParamsError when a backfill would have to bring a key back to a
    record before its range (``keyed.refuse_lost_state``)."""
    t = time.monotonic()
    key = config.sink.key
    states = keyed.last_per_partition(processed.rows, key)
    if later is not None:
        states = keyed.mark_later_records(states, later, key)
    states = states.persist()
    processed.cached.append(states)
    keys = states.select(*[f"`{c}`" for c in key]).distinct().toArrow()
    removed = keyed.files_holding(table, keys, config) if table is not None else []
    merged = keyed.merged_rows(spark, config, table, states, removed, Selection.of(plan))
    processed.cached.extend(merged.cached)
    if merged.lost_state:  # only a backfill reprocesses records whose state rows are stored
        from offsetlake.kafka import current_offsets

        keyed.refuse_lost_state(config, plan, merged.lost_state, current_offsets(config))
    from pyspark.sql import functions as F

    ordered = merged.rows.repartitionByRange(
        keyed.file_count(merged.rows_written, config), *[F.col(f"`{c}`") for c in [*config.sink.partition_by, *key]]
    )
    processed.timings_ms["merge"] = log_step(
        "merge",
        plan,
        t,
        keys=keys.num_rows,
        files_read=len(removed),
        **{k: v for k, v in merged.counts.as_dict().items() if k != "files_rewritten"},
    )
    files = stage_files(config, plan, processed, ordered, spark, sort_by=tuple(key))
    touched = states.select(*[F.col(f"`{c}`") for c in key]).unionByName(merged.rows.select(*[F.col(f"`{c}`") for c in key]))
    return StagedMerge(files, removed, merged.counts, changed=merged.rows, touched=touched)


def later_records(
    config: PipelineConfig, plan: BatchPlan, spark: SparkSession, ends: dict[tuple[str, int], int | None]
) -> DataFrame | None:
    """For a keyed backfill: the key columns and coordinates of the records after the plan's up
    to the committed ``ends`` (from each range's end; from its start for a backfill by time, whose
    window leaves later records inside the range), read and decoded as the batch's are. A
    candidate whose key has one of these at a higher offset of its partition is not applied
    (``keyed.mark_later_records``). None when there is nothing after."""
    from pyspark.sql import functions as F

    from offsetlake.coordinates import OFFSET
    from offsetlake.plan import OffsetRange
    from offsetlake.reader import read_ranges

    ranges = []
    for r in plan.ranges:
        end = ends.get((r.topic, r.partition)) or 0
        start = r.start if plan.window is not None else r.end
        if end > start:
            ranges.append(OffsetRange(r.topic, r.partition, start, end))
    if not ranges:
        return None
    t = time.monotonic()
    decoder = decoder_for(config, plan.reader_schema)
    raw = read_ranges(
        spark,
        ranges,
        config.kafka_client_config(),
        config.name,
        config.read_timeout_seconds,
        decoder,
        max_record_bytes=config.max_record_bytes,
    )
    decoded = decoder.decode_in_spark(raw).withColumn(REASON, F.coalesce(F.col("read_problem"), F.col(REASON)))
    if config.sink.delete_on_tombstone:
        decoded = keyed.mark_tombstones(decoded)
    rows = apply_transform(good_rows(decoded, decoder), config)
    later = rows.select(*[F.col(f"`{c}`") for c in config.sink.key], TOPIC, PARTITION, OFFSET)
    log_step("later_records", plan, t, ranges=";".join(str(r) for r in ranges))
    return later
