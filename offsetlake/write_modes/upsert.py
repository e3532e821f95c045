"""``sink.mode: upsert``: one row per key, the newest record's (invariant 13; ``offsetlake.keyed``
holds the rule and its hidden rows). A batch merges into the files holding its keys, on the very
snapshot it read (invariant 10); a backfill merges its records, except those a later record of
their key replaced, without bringing a key back to a record before its range."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from offsetlake import keyed, storage
from offsetlake.coordinates import PARTITION, TOPIC, Selection
from offsetlake.formats import REASON, decoder_for, good_rows
from offsetlake.log_lines import log_step
from offsetlake.plan import BatchPlan
from offsetlake.processed import ProcessedBatch, stage_files
from offsetlake.schema_evolution import evolved_schema
from offsetlake.sink import add_columns_first, check_plan_applies, committed_end, ensure_table, open_table
from offsetlake.transform import apply_transform
from offsetlake.write_modes.mode import BackfillStaging, Compaction, Replay, Staged, StagedMerge, WriteMode, with_new_columns

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import DataFrame, SparkSession

    from offsetlake.config import PipelineConfig


class UpsertMode(WriteMode):
    """A merge per batch; compaction sorts by the key and keeps every row, hidden ones too."""

    hidden_rows = True
    replay = Replay.NEWEST_PER_KEY

    def stage(self, plan: BatchPlan, processed: ProcessedBatch, spark: Any) -> Staged | None:
        """The merge reads the table: the commit is made on that same snapshot (invariant 10)."""
        config = self.config
        written = keyed.with_hidden_column(processed.rows_schema)  # the merge writes hidden state rows
        table = ensure_table(config, written)
        if not check_plan_applies(table, config, plan):
            return None
        schema = evolved_schema(table, config, written, plan)
        merge = stage_merge(config, plan, processed, spark, table)
        if schema is not None and merge.removed:
            table = add_columns_first(table, config, schema, plan)  # a commit cannot both
            schema = None
        return table, merge.files, merge.removed, merge.counts.as_dict(), schema

    def prepare_backfill(self, plan: BatchPlan, spark: Any) -> Any:
        """A record a later one of its key replaced is never restored: the later records, read once."""
        table = open_table(self.config.layout.sink)
        ends = {(r.topic, r.partition): committed_end(table, self.config, r.topic, r.partition) for r in plan.ranges}
        return later_records(self.config, plan, spark, ends)

    def stage_backfill(
        self, plan: BatchPlan, processed: ProcessedBatch, spark: Any, prepared: Any, restore_deleted: bool
    ) -> BackfillStaging:
        """Merges the backfill's records (those no ``prepared`` later record of their key replaced)
        into the files holding their keys, by the ordering rule (``offsetlake.keyed``: a row is
        replaced only by a record at least as new as its own)."""
        table = with_new_columns(self.config, storage.table(self.config.layout.sink), processed.rows, plan, hidden=True)
        merge = stage_merge(self.config, plan, processed, spark, table, prepared)
        c = merge.counts
        said = f"{c.inserted} inserted, {c.updated} updated, {c.deleted} deleted, {c.older} older than the rows kept"
        message = f"merged records of {plan.describe()}: {said}; rewrote {c.files_rewritten} files"
        return BackfillStaging(table, merge.files, merge.removed, message, merge=c.as_dict())

    def compact(self, table: DeltaTable, partitions: list | None) -> Compaction:
        """A keyed sink's merges prune files by their key ranges: compaction sorts by the key
        (z-order over one column is a sort), so files keep narrow, disjoint ranges; it keeps
        every row as it is, hidden state rows too: a delete marker is what keeps a deleted key
        from coming back (``offsetlake.keyed``), and nothing bounds when a record of its key may
        still arrive from another partition, so no marker is ever dropped."""
        return Compaction(table.optimize.z_order(self.config.sink.key))

    def counted(self, sink: DeltaTable, rows: int) -> tuple[int, int, str]:
        hidden = rows - keyed.current_rows(sink, [TOPIC]).num_rows
        return rows - hidden, hidden, "delete markers, superseded records"


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
    return StagedMerge(files, removed, merged.counts)


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
