"""What upsert and the merge engines share: their state lives in the state table
(``offsetlake.state_table``) and the sink holds what a reader sees. A batch or a backfill merges
into the state the sink pins, commits that state, then rewrites the sink's rows of the groups
it touched; its one sink commit carries the pin of the new state (docs/design.md, "State beside
the sink")."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from offsetlake import failpoints, state_table, storage
from offsetlake.coordinates import Selection
from offsetlake.keyed import HIDDEN
from offsetlake.plan import BatchPlan
from offsetlake.processed import ProcessedBatch
from offsetlake.schema_evolution import evolved_schema
from offsetlake.sink import add_columns_first, check_plan_applies, ensure_table, open_table
from offsetlake.write_modes.mode import BackfillStaging, Staged, StagedMerge, WriteMode

if TYPE_CHECKING:
    from deltalake import DeltaTable

    from offsetlake.config import PipelineConfig


class MergeStep(NamedTuple):
    """What a keyed mode's merge is given: ``config`` is the pipeline with the state table in the
    sink's place (``state_table.as_table``), ``state`` the pinned state table (None: empty),
    ``replaced`` the records a backfill reprocesses, ``prepared`` what ``prepare_backfill`` read."""

    config: PipelineConfig
    plan: BatchPlan
    processed: ProcessedBatch
    spark: Any
    state: Any
    replaced: Selection | None
    prepared: Any


@dataclass
class _Both:
    merge: StagedMerge
    projection: state_table.Projection
    state_version: int


class StatefulMode(WriteMode):
    """A keyed write mode: ``merge`` stages the state, ``output`` says what a reader sees of it."""

    keeps_state: ClassVar[bool] = True
    state_kind: ClassVar[str]  # what the state rows are, for the audit's text

    @abstractmethod
    def merge(self, step: MergeStep) -> StagedMerge:
        """The batch merged into ``step.state``: the state files it writes and removes, with
        ``changed`` and ``touched`` set."""

    def output(self, rows: Any) -> Any:
        """The rows a reader sees of these state rows (a DataFrame, or a pyarrow table the driver
        holds): those not hidden, without the private columns."""
        import pyarrow as pa
        import pyarrow.compute as pc
        from pyspark.sql import functions as F

        if isinstance(rows, pa.Table):
            return rows.filter(pc.field(HIDDEN).is_null()).select([c for c in rows.column_names if c not in self.private_columns])

        kept = [F.col(f"`{c}`") for c in rows.columns if c not in self.private_columns]
        return rows.where(F.col(HIDDEN).isNull()).select(*kept)

    @property
    @abstractmethod
    def group(self) -> list[str]:
        """The columns naming one row of the sink (the key; and the window)."""

    @property
    @abstractmethod
    def private_columns(self) -> set[str]:
        """The state rows' columns a reader's row does not have."""

    @property
    def prune(self) -> list[str]:
        """The columns whose statistics find the sink files that may hold a group."""
        return self.group

    @property
    def sort_order(self) -> list[str]:
        """The order of the sink's rows in its files (a group's file found by its statistics)."""
        return self.group

    def stage(self, plan: BatchPlan, processed: ProcessedBatch, spark: Any) -> Staged | None:
        """The merge reads the state the sink pins on the sink snapshot whose txns it checked;
        the sink commit is made on that same snapshot (invariant 10)."""
        config = self.config
        sink = open_table(config.layout.sink)
        if sink is not None and not check_plan_applies(sink, config, plan):
            return None
        both = self._staged(plan, processed, spark, sink, None, None)
        shape = both.projection.shape
        if sink is None:
            sink = ensure_table(config, shape)
            if not check_plan_applies(sink, config, plan):
                return None
        schema = evolved_schema(sink, config, shape, plan)
        if schema is not None and both.projection.removed:
            sink = add_columns_first(sink, config, schema, plan)  # a commit cannot both
            schema = None
        counts = both.merge.counts.as_dict()
        return Staged(sink, both.projection.files, both.projection.removed, counts, schema, (state_table.pin(both.state_version),))

    def stage_backfill(
        self, plan: BatchPlan, processed: ProcessedBatch, spark: Any, prepared: Any, restore_deleted: bool
    ) -> BackfillStaging:
        config = self.config
        sink = storage.table(config.layout.sink)
        both = self._staged(plan, processed, spark, sink, Selection.of(plan), prepared)
        schema = evolved_schema(sink, config, both.projection.shape, plan)
        if schema is not None:
            sink = add_columns_first(sink, config, schema, plan)
        c = both.merge.counts
        return BackfillStaging(
            sink,
            both.projection.files,
            both.projection.removed,
            self.backfill_message(plan, c),
            merge=c.as_dict(),
            pins=(state_table.pin(both.state_version),),
        )

    def backfill_message(self, plan: BatchPlan, counts: Any) -> str:
        said = f"{counts.inserted} inserted, {counts.updated} updated, {counts.deleted} deleted"
        return f"merged records of {plan.describe()}: {said}; rewrote {counts.files_rewritten} state files"

    def _staged(
        self, plan: BatchPlan, processed: ProcessedBatch, spark: Any, sink: DeltaTable | None, replaced: Selection | None, prepared: Any
    ) -> _Both:
        """The state merged and committed (unpinned until the sink commit), then the sink's rows
        of the touched groups staged."""
        config = self.config
        state = state_table.pinned(config, sink)
        merge = self.merge(MergeStep(state_table.as_table(config), plan, processed, spark, state, replaced, prepared))
        version = state_table.commit(config, plan.batch_id, state, merge.files, merge.removed, merge.shape, merge.folded)
        projection = state_table.project(
            config, plan, spark, sink, merge.changed, merge.touched, self.group, self.prune, self.output, Selection.of(plan)
        )
        failpoints.failpoint("after_state_commit")  # the state committed, no sink commit pins it yet
        return _Both(merge, projection, version)

    def move_state_out(self) -> int | None:
        """A sink written before the state had a table of its own (its state rows hidden in it,
        no pin) gets one, in one recorded operation (docs/design.md, "State beside the sink"):
        the sink's live files are copied into the state table as they are, then ONE sink commit
        replaces the sink's files with the rows a reader saw (the private columns gone from its
        schema), pins that state and records a ``state_move`` entry. Dying in between leaves the
        sink as it was and an unpinned state commit, which the next attempt replaces; once the
        pin is there, nothing is moved again. Returns the sink version, None when there was
        nothing to move."""
        import pyarrow.compute as pc
        from deltalake import CommitProperties, write_deltalake

        from offsetlake.entry import for_plan
        from offsetlake.history import refuse_foreign_sink
        from offsetlake.plan import BatchKind, RunContext, new_batch_id
        from offsetlake.schema_evolution import table_schema
        from offsetlake.sink import commit_version

        config = self.config
        sink = open_table(config.layout.sink)
        if sink is None or state_table.pinned_version(sink) is not None or HIDDEN not in table_schema(sink).names:
            return None
        refuse_foreign_sink(sink, config.name)
        batch_id = new_batch_id(config.name)
        moved = state_table.copied_into_state(config, sink)
        version = state_table.commit(config, batch_id, None, moved, [], table_schema(sink))
        failpoints.failpoint("after_state_commit")
        total = sink.to_pyarrow_dataset().count_rows()
        rows = sink.to_pyarrow_dataset().to_table(filter=pc.field(HIDDEN).is_null())
        rows = rows.drop_columns([c for c in rows.column_names if c in self.private_columns])
        rows = rows.sort_by([(c, "ascending") for c in self.sort_order])
        plan = BatchPlan(config.name, batch_id, BatchKind.STATE_MOVE, (), RunContext(run_id=f"state-move-{batch_id}"))
        entry = for_plan(
            plan,
            state_version=version,
            rows_kept=rows.num_rows,
            state_rows=total - rows.num_rows,
            message=f"moved the {self.name} sink's {total - rows.num_rows} state rows ({self.state_kind}) into the state "
            f"table {state_table.location(config)}; its {rows.num_rows} rows stay as a reader saw them",
        )
        write_deltalake(
            sink,
            rows,
            mode="overwrite",
            schema_mode="overwrite",
            partition_by=config.sink.partition_by or None,
            commit_properties=CommitProperties(
                custom_metadata={"userMetadata": entry.to_json()}, app_transactions=[state_table.pin(version)], max_commit_retries=0
            ),
        )
        return commit_version(config.layout.sink, batch_id)

    def records_table(self, sink: DeltaTable | None) -> DeltaTable | None:
        """The pinned state; a sink not moved yet (``move_state_out``) holds its state itself."""
        from offsetlake.schema_evolution import table_schema

        if sink is not None and state_table.pinned_version(sink) is None and HIDDEN in table_schema(sink).names:
            return sink
        return state_table.pinned(self.config, sink)

    def counted(self, sink: DeltaTable, rows: int) -> tuple[int, int, str]:
        """Every sink row is one a reader sees; the state rows beside them that are not."""
        import pyarrow.compute as pc

        state = state_table.pinned(self.config, sink)
        hidden = state.to_pyarrow_dataset().count_rows(filter=pc.field(HIDDEN).is_valid()) if state is not None else 0
        return sink.to_pyarrow_dataset().count_rows(), hidden, f"{self.state_kind}, in the state table {state_table.location(self.config)}"
