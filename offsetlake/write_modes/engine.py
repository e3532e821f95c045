"""The merge engines' write mode (``sink.mode``: ``aggregate``, ``first_row``, ``partial_update``;
``offsetlake.engines`` holds each engine's fold, ``offsetlake.engine_merge`` the merge). A batch
folds the groups it touches with its records' contributions; a backfill replaces the
contributions of the records it reprocesses and folds every group either touched again."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from offsetlake import engine_merge, engines, keyed, storage
from offsetlake.coordinates import Selection
from offsetlake.keyed import HIDDEN
from offsetlake.log_lines import log_step
from offsetlake.plan import BatchPlan
from offsetlake.processed import ProcessedBatch, stage_files
from offsetlake.schema_evolution import evolved_schema
from offsetlake.sink import add_columns_first, check_plan_applies, ensure_table, open_table
from offsetlake.write_modes.mode import BackfillStaging, Compaction, Replay, Staged, StagedMerge, WriteMode

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import SparkSession

    from offsetlake.config import PipelineConfig


class EngineMode(WriteMode):
    """A merge engine's batches: visible rows per group, and a contribution row per record."""

    hidden_rows = True
    replay = Replay.FOLD

    def stage(self, plan: BatchPlan, processed: ProcessedBatch, spark: Any) -> Staged | None:
        """The table is made from the engine's row shape, which the batch's records give."""
        config = self.config
        table = open_table(config.layout.sink)
        if table is not None and not check_plan_applies(table, config, plan):
            return None
        merge = stage_engine_merge(config, plan, processed, spark, table)
        shape = merge.shape
        if table is None:
            table = ensure_table(config, shape)
            if not check_plan_applies(table, config, plan):
                return None
        schema = evolved_schema(table, config, shape, plan)
        if schema is not None and merge.removed:
            table = add_columns_first(table, config, schema, plan)  # a commit cannot both
            schema = None
        return table, merge.files, merge.removed, merge.counts.as_dict(), schema

    def stage_backfill(
        self, plan: BatchPlan, processed: ProcessedBatch, spark: Any, prepared: Any, restore_deleted: bool
    ) -> BackfillStaging:
        """The contributions of the records it reprocesses replaced by theirs, every group either
        touched folded again from its contributions."""
        config = self.config
        table = storage.table(config.layout.sink)
        merge = stage_engine_merge(config, plan, processed, spark, table, Selection.of(plan))
        schema = evolved_schema(table, config, merge.shape, plan)
        if schema is not None:
            table = add_columns_first(table, config, schema, plan)
        c = merge.counts
        said = f"{c.inserted} inserted, {c.updated} updated, {c.deleted} deleted"
        message = f"merged records of {plan.describe()} into the {self.name} state: {said}; rewrote {c.files_rewritten} files"
        return BackfillStaging(table, merge.files, merge.removed, message, merge=c.as_dict())

    def compact(self, table: DeltaTable, partitions: list | None) -> Compaction:
        """Skipped: delta-rs's compaction would put contribution rows and visible rows in one
        file, and a merge tells them apart by file (``offsetlake.engines``): its merges rewrite
        the visible files; its contribution files are left as the batches wrote them."""
        skipped = f"mode {self.name}: its merges keep its files; compaction would mix state and rows"
        return Compaction({"numFilesRemoved": 0, "numFilesAdded": 0}, skipped)

    def counted(self, sink: DeltaTable, rows: int) -> tuple[int, int, str]:
        """``rows`` counts the contributions (a row per record and window)."""
        visible = keyed.current_rows(sink, [HIDDEN]).num_rows
        return visible, sink.to_pyarrow_dataset().count_rows() - visible, f"the {self.name} state: a contribution per record and window"


def stage_engine_merge(
    config: PipelineConfig, plan: BatchPlan, processed: ProcessedBatch, spark: SparkSession, table: Any, replaced: Selection | None = None
) -> StagedMerge:
    """A merge engine's batch (``offsetlake.engines``): the visible rows of the files holding its
    keys, folded with its records' contributions, rewritten sorted by (window, key); its
    contributions in files of their own. ``replaced``: the records a backfill reprocesses."""
    from pyspark.sql import functions as F

    t = time.monotonic()
    merge = engine_merge.merged(spark, config, table, processed.rows, replaced)
    processed.cached.extend(merge.cached)
    group = engines.group_columns(config)
    window_first = [*group[len(config.sink.key) :], *config.sink.key]
    ordered = merge.visible.repartitionByRange(keyed.file_count(merge.visible_rows, config), *[F.col(f"`{c}`") for c in window_first])
    processed.timings_ms["merge"] = log_step(
        "merge", plan, t, engine=str(config.sink.engine), files_read=len(merge.removed), **merge.counts.as_dict()
    )
    files = stage_files(config, plan, processed, ordered, spark, sort_by=tuple(window_first), beside=merge.contributions)
    return StagedMerge(files, merge.removed, merge.counts, engines.arrow_schema_of(merge.visible))
