"""``sink.mode: append``: a row per source record (row), appended (docs/design.md, "The write-mode
seam"). A backfill replaces the rows of its ranges: it rewrites the files holding them without
them, plus its new rows, and keeps a row that a commit offsetlake did not make deleted deleted
(unless ``restore_deleted``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.dataset as pads

from offsetlake import foreign, storage
from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TOPIC, TOPIC_EPOCH, Selection
from offsetlake.errors import CommitConflictError, ForeignCommitError, OffsetlakeError
from offsetlake.history import foreign_commits
from offsetlake.log_lines import log_step
from offsetlake.plan import BatchPlan
from offsetlake.processed import ProcessedBatch, stage_files
from offsetlake.schema_evolution import evolved_schema
from offsetlake.sink import check_plan_applies, ensure_table, live_files
from offsetlake.spark import dataframe_from_arrow
from offsetlake.write_modes.mode import BackfillStaging, Compaction, Replay, Staged, WriteMode, with_new_columns

if TYPE_CHECKING:
    from deltalake import DeltaTable

    from offsetlake.config import PipelineConfig


class AppendMode(WriteMode):
    """Rows appended as the batch wrote them; compaction may merge any files."""

    row_per_record = True
    replay = Replay.RECORDS

    def stage(self, plan: BatchPlan, processed: ProcessedBatch, spark: Any) -> Staged | None:
        config = self.config
        files = stage_files(config, plan, processed, processed.rows, spark)
        table = ensure_table(config, processed.rows_schema)
        if not check_plan_applies(table, config, plan):
            return None
        return Staged(table, files, [], None, evolved_schema(table, config, processed.rows_schema, plan))

    def stage_backfill(
        self, plan: BatchPlan, processed: ProcessedBatch, spark: Any, prepared: Any, restore_deleted: bool
    ) -> BackfillStaging:
        """Finds the files holding the range now, rewrites them without it plus the new rows.
        Committed on the newest snapshot if the files holding the range are still exactly the
        ones rewritten: appends (a running stream or ingest) land meanwhile and change nothing."""
        config = self.config
        table = storage.table(config.layout.sink)
        selected = Selection.of(plan)
        removed = touched_files(table, selected)
        rows = processed.rows if restore_deleted else keeping_foreign_deletes(config, table, plan, processed, selected, spark)
        kept_count = 0
        if removed:
            kept = kept_rows(table, removed, selected)
            kept_count = kept.num_rows
            if kept_count:
                # the reprocessed rows may lack columns the kept ones have, or add some: both read null
                rows = rows.unionByName(dataframe_from_arrow(spark, kept), allowMissingColumns=True)
        table = with_new_columns(config, table, rows, plan)
        files = stage_files(config, plan, processed, rows, spark)
        rewritten = files.rows - sum(v["rows_written"] for v in processed.per_range.values())
        if rewritten != kept_count:
            raise OffsetlakeError(
                f"backfill {plan.batch_id} of {plan.describe()} would rewrite {rewritten} rows "
                f"outside its ranges instead of the {kept_count} kept from {len(removed)} replaced files; nothing was committed",
                pipeline=config.name,
                batch_id=plan.batch_id,
            )

        def rebase() -> DeltaTable:
            latest = storage.table(config.layout.sink)
            if {f["path"] for f in touched_files(latest, selected)} != {f["path"] for f in removed}:
                raise CommitConflictError(
                    f"backfill {plan.batch_id} of {plan.describe()} conflicted with another writer: "
                    f"the files holding the range changed while it wrote (a compaction, rewind or another backfill)",
                    pipeline=config.name,
                    batch_id=plan.batch_id,
                )
            return latest

        message = f"replaced rows of {plan.describe()}; rewrote {len(removed)} files"
        return BackfillStaging(table, files, removed, message, rebase=rebase)

    def compact(self, table: DeltaTable, partitions: list | None) -> Compaction:
        return Compaction(table.optimize.compact(partition_filters=partitions))


def touched_files(table: DeltaTable, selected: Selection) -> list[dict[str, Any]]:
    """Live files whose statistics say they may hold selected rows (those may hold rows to replace)."""
    return [f for f in live_files(table) if selected.file_may_hold(f)]


def kept_rows(table: DeltaTable, files: list[dict[str, Any]], selected: Selection) -> pa.Table:
    """Rows of ``files`` that are not selected (with partition columns), to be rewritten.

    Raises OffsetlakeError if a file is missing from the table's dataset: rewriting without its
    kept rows would lose them.
    """
    dataset = table.to_pyarrow_dataset()
    wanted = {storage.file_path_from_log(f["path"]) for f in files}  # fragments carry real paths
    fragments = [f for f in dataset.get_fragments() if f.path in wanted]
    if len(fragments) != len(wanted):
        found = {f.path for f in fragments}
        raise OffsetlakeError(
            f"backfill: data files {sorted(wanted - found)[:5]} of the sink are not in its dataset; nothing was committed"
        )
    subset = pads.FileSystemDataset(fragments, dataset.schema, dataset.format, dataset.filesystem)
    outside = selected.outside()
    return subset.to_table(filter=outside) if outside is not None else subset.to_table()


def keeping_foreign_deletes(
    config: PipelineConfig, table: DeltaTable, plan: BatchPlan, processed: ProcessedBatch, selected: Selection, spark: Any
) -> Any:
    """``processed.rows`` without the rows that commits offsetlake did not make deleted and that
    are still absent (``foreign.still_deleted``): a user's GDPR delete stays deleted through a
    backfill of its range. Their ranges' ``rows_written`` count only what is written."""
    rows = processed.rows
    if rows is None or not foreign_commits(table, config.name):
        return rows
    where = selected.arrow()
    names = table.schema().to_arrow().names
    present = table.to_pyarrow_dataset().to_table(filter=where, columns=[c for c in foreign.IDENTITY_COLUMNS if c in names])
    epochs = {t: plan.topic_epochs.get(t, 0) for t in {r.topic for r in plan.ranges}}
    try:
        deleted = foreign.still_deleted(table, config.name, foreign.identities(present))
    except ForeignCommitError as err:
        raise ForeignCommitError(
            f"backfill {plan.batch_id}: {err.text}, so which of its rows to keep deleted cannot be told; nothing was "
            "committed. To recompute the range as Kafka has it (rows that commit deleted come back), backfill with "
            "--restore-deleted",
            pipeline=config.name,
            batch_id=plan.batch_id,
        ) from None
    gone = [
        i
        for i in deleted
        if epochs.get(i[0]) == i[4] and any(r.topic == i[0] and r.partition == i[1] and r.start <= i[2] < r.end for r in plan.ranges)
    ]
    if not gone:
        return rows
    from pyspark.sql import functions as F

    schema = f"`{TOPIC}` string, `{PARTITION}` int, `{OFFSET}` long, _identity_row int, _identity_epoch int"
    deleted = spark.createDataFrame(gone, schema)
    keyed = rows.withColumn("_identity_row", F.coalesce(F.col(ROW_INDEX), F.lit(-1)) if ROW_INDEX in rows.columns else F.lit(-1))
    keyed = keyed.withColumn("_identity_epoch", F.coalesce(F.col(TOPIC_EPOCH), F.lit(0)) if TOPIC_EPOCH in rows.columns else F.lit(0))
    on = [TOPIC, PARTITION, OFFSET, "_identity_row", "_identity_epoch"]
    dropped = {
        (r[TOPIC], r[PARTITION]): r["count"] for r in keyed.join(deleted, on, "left_semi").groupBy(TOPIC, PARTITION).count().collect()
    }
    for (topic, partition), n in dropped.items():
        processed.per_range[(topic, partition)]["rows_written"] = processed.per_range[(topic, partition)]["rows_written"] - n
    log_step("keep_foreign_deletes", plan, time.monotonic(), rows_kept_deleted=sum(dropped.values()))
    return keyed.join(deleted, on, "left_anti").drop("_identity_row", "_identity_epoch")
