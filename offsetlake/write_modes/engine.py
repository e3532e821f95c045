"""The merge engines' write mode (``sink.mode``: ``aggregate``, ``first_row``, ``partial_update``;
``offsetlake.engines`` holds each engine's fold, ``offsetlake.engine_merge`` the merge). A batch
folds the groups it touches with its records' contributions; a backfill replaces the
contributions of the records it reprocesses and folds every group either touched again. The
folded states and the contributions live in the state table; the sink holds one row per group
(and window): its columns and outputs (``offsetlake.write_modes.stateful``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from offsetlake import engine_merge, engines, keyed, state_segments, state_table
from offsetlake.coordinates import ROW_INDEX, OffsetRange, Selection
from offsetlake.engines import COORDINATES, STATE, WINDOW_START
from offsetlake.keyed import HIDDEN
from offsetlake.log_lines import log_step
from offsetlake.plan import BatchPlan
from offsetlake.processed import ProcessedBatch, stage_files
from offsetlake.sink import open_table
from offsetlake.write_modes.mode import BackfillStaging, Compaction, Replay, StagedMerge
from offsetlake.write_modes.stateful import MergeStep, StatefulMode

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import SparkSession

    from offsetlake.config import PipelineConfig


class EngineMode(StatefulMode):
    """A merge engine's batches: a row per group in the sink; folded states and a contribution
    per record in the state table."""

    replay = Replay.FOLD
    state_kind = "folded states and a contribution per record and window"

    @property
    def group(self) -> list[str]:
        return engines.group_columns(self.config)

    @property
    def prune(self) -> list[str]:
        """By the key's and the window start's statistics: files are sorted by (window, key)."""
        return [*self.config.sink.key, *([WINDOW_START] if self.config.sink.window is not None else [])]

    @property
    def backfill_reads_in_tasks(self) -> bool:
        """An engine the read tasks fold: they write a backfill's contributions and fold its
        groups' partial states as an ingest's (``engine_merge.backfill_in_arrow`` folds from
        those), and the merge writes only the replaced files' kept contributions."""
        return self.config.sink.folds_in_read

    def merge(self, step: MergeStep) -> StagedMerge:
        return stage_engine_merge(step.config, step.plan, step.processed, step.spark, step.state, step.replaced)

    @property
    def private_columns(self) -> set[str]:
        """A group's row has its columns and outputs: no state, no coordinates of one record (a
        partial_update key whose newest record deletes it has no row: it is hidden)."""
        return {HIDDEN, STATE, *COORDINATES, ROW_INDEX}

    @property
    def sort_order(self) -> list[str]:
        return [*self.group[len(self.config.sink.key) :], *self.config.sink.key]

    def refuse_backfill(self, ranges: list[OffsetRange], sink: DeltaTable | None) -> None:
        """A backfill may replace only records above the pinned state's horizon (``engine_merge.fold``);
        the sink's history (for the topics' epochs) is read only when something is folded."""
        state = state_table.pinned(self.config, sink)
        if sink is None or not state_table.folded_below(state):
            return
        from offsetlake.history import current_epochs, sink_commits

        state_table.refuse_folded(self.config, state, ranges, current_epochs(sink_commits(sink, self.config.name)))

    def stage_backfill(
        self, plan: BatchPlan, processed: ProcessedBatch, spark: Any, prepared: Any, restore_deleted: bool
    ) -> BackfillStaging:
        """Checked again on the snapshot it merges on: a fold may have run since the plan was made."""
        sink = open_table(self.config.layout.sink)
        state_table.refuse_folded(self.config, state_table.pinned(self.config, sink), plan.ranges, plan.topic_epochs)
        return super().stage_backfill(plan, processed, spark, prepared, restore_deleted)

    def backfill_message(self, plan: BatchPlan, counts: Any) -> str:
        said = f"{counts.inserted} inserted, {counts.updated} updated, {counts.deleted} deleted"
        return f"merged records of {plan.describe()} into the {self.name} state: {said}; rewrote {counts.files_rewritten} state files"

    def compact(self, table: DeltaTable, partitions: list | None) -> Compaction:
        """The sink holds one row per group: sorted by (window, key) like the files a merge
        writes, so merges keep finding a group's file by its statistics. The state table is left
        as the batches wrote it (its visible and contribution files must not mix)."""
        return Compaction(table.optimize.z_order(self.prune, partition_filters=partitions))


def stage_engine_merge(
    config: PipelineConfig, plan: BatchPlan, processed: ProcessedBatch, spark: SparkSession, table: Any, replaced: Selection | None = None
) -> StagedMerge:
    """A merge engine's batch (``offsetlake.engines``), ``config`` the pipeline with the state
    table in the sink's place: the visible rows of the files holding its keys, folded with its
    records' contributions, rewritten sorted by (window, key); its contributions in files of
    their own. ``replaced``: the records a backfill reprocesses."""
    from pyspark.sql import functions as F

    t = time.monotonic()
    group = engines.group_columns(config)
    window_first = [*group[len(config.sink.key) :], *config.sink.key]
    batch = engine_merge.batch_contributions(spark, config, processed.rows, processed.path.engine, processed.written)
    held = None
    if engine_merge.on_driver(config, replaced):
        held = engine_merge.merged_in_arrow(spark, config, table, batch) or engine_merge.merged_on_driver(spark, config, table, batch)
    elif replaced is not None and config.sink.folds_in_read:
        held = engine_merge.backfill_in_arrow(spark, config, table, batch, replaced)
    if batch.held is not None and processed.written.files:
        # the fold of the read tasks' contribution files (an ingest's or a backfill's), kept for backfills (``state_segments``)
        state_segments.write(config.layout.sink, plan.batch_id, batch.held, [f.path for f in processed.written.files])
    if held is not None:
        merge = held
        processed.cached.extend(merge.cached)
        segments = {"segments": merge.segments} if replaced is not None else {}
        processed.timings_ms["merge"] = log_step(
            "merge",
            plan,
            t,
            engine=str(config.sink.engine),
            on=merge.on,
            files_read=len(merge.removed),
            **segments,
            **merge.counts.as_dict(),
        )
        files = stage_files(
            config,
            plan,
            processed,
            None,
            spark,
            sort_by=tuple(window_first),
            beside=merge.contributions,
            held=merge.visible,
            held_beside=merge.held_contributions,
        )
        return StagedMerge(files, merge.removed, merge.counts, merge.visible.schema, merge.visible, merge.keys, merge.folded)
    merge = engine_merge.merged(spark, config, table, batch, replaced)
    processed.cached.extend(merge.cached)
    ordered = merge.visible.repartitionByRange(keyed.file_count(merge.visible_rows, config), *[F.col(f"`{c}`") for c in window_first])
    processed.timings_ms["merge"] = log_step(
        "merge", plan, t, engine=str(config.sink.engine), on=merge.on, files_read=len(merge.removed), **merge.counts.as_dict()
    )
    files = stage_files(config, plan, processed, ordered, spark, sort_by=tuple(window_first), beside=merge.contributions)
    touched = merge.keys.unionByName(merge.visible.select(*[F.col(f"`{c}`") for c in group]))
    return StagedMerge(files, merge.removed, merge.counts, engines.arrow_schema_of(merge.visible), merge.visible, touched, merge.folded)
