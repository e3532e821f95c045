"""A Delta table as a pipeline's sink: the writing half of the sink seam for Delta
(``offsetlake.sinks.writing``; docs/design.md, "The sink seam").

A batch commits ONE Delta commit: its files (none for a gap), the committed ends it moves (txn
versions, invariant 2) and its ledger entry in ``commitInfo``. The ordering rule is the Delta
snapshot: ``open`` reads the table once (its commits give the topics' epochs and what is already
committed); staging reads it again right before the commit (a keyed merge commits on the very
snapshot it read, invariant 10), and delta-rs refuses a commit that a concurrent one conflicts
with (CommitConflictError). After the commit the batch's staged dead letters are applied to the
dead-letter table (invariant 8). Backfills replace rows below the ends (``offsetlake.backfill``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from offsetlake import dead_letters, failpoints, foreign
from offsetlake.backfill import execute_backfill, refused
from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import DeltaSinkKind
from offsetlake.entry import LedgerEntry
from offsetlake.errors import OffsetlakeError
from offsetlake.history import SinkCommit, current_epochs, refuse_foreign_sink, sink_commits
from offsetlake.log_lines import log_step
from offsetlake.plan import BatchKind, BatchPlan
from offsetlake.schema_evolution import table_schema
from offsetlake.sink import WrittenFiles, check_plan_applies, commit_batch, committed_end_lookup
from offsetlake.sinks.writing import WRITER, Projection, SinkWriter
from offsetlake.storage import open_table
from offsetlake.write_modes import write_mode

if TYPE_CHECKING:
    from deltalake import DeltaTable


class DeltaSinkWriter(SinkWriter):
    """One batch into the sink table (``offsetlake.sink.commit_batch``, or a backfill's replace)."""

    _table: DeltaTable | None = None
    _commits: list[SinkCommit] | None = None

    @classmethod
    def reconcile_pipeline(cls, config: PipelineConfig, ledger: Projection) -> None:
        """Refuses another pipeline's table (invariant 16); applies dead letters a crash left
        pending after their sink commit; gives the ledger the commits it lacks and the outcomes of
        plans that can no longer apply; says the commits offsetlake did not make since its own
        last one (docs/design.md, "Foreign commits")."""
        table = open_table(config.layout.sink)
        refuse_foreign_sink(table, config.name)
        if write_mode(config).move_state_out() is not None:  # a keyed sink written with its state inside, once
            table = open_table(config.layout.sink)
        dead_letters.apply_pending(config)
        now = open_table(config.layout.sink)
        ledger.reconcile(sink_commits(now, config.name), committed_end_lookup(now, config))
        if now is not None:
            ledger.compact_if_fragmented()
        last_own = max((c.version for c in sink_commits(table, config.name)), default=-1)
        foreign.report(table, config.name, since_version=last_own)

    def open(self, plan: BatchPlan) -> BatchPlan:
        """One snapshot of the table; the plan with each topic's current epoch from its history.

        Read when the batch executes, not when it was planned: a plan recorded before an epoch
        commit no longer applies anyway (the epoch commit moved its committed ends, or, for a
        backfill, the range is no longer below them), and an epoch commit landing while the batch
        runs makes its commit fail (it moves the same txns; a backfill checks, see
        ``backfill.commit_replace``)."""
        self._table = open_table(self.config.layout.sink)
        self._commits = sink_commits(self._table, self.config.name)
        if plan.kind == BatchKind.BACKFILL and self._table is None:
            raise refused(self.config.name, f"the sink {self.config.sink_path} does not exist yet")
        return replace(plan, topic_epochs=current_epochs(self._commits))

    def commits(self) -> list[SinkCommit]:
        assert self._commits is not None, "open the sink first"
        return self._commits

    def applies(self, plan: BatchPlan) -> bool:
        return check_plan_applies(self._table, self.config, plan)

    def winner(self, plan: BatchPlan) -> str:
        """Read from the newest history: the batch that won may have committed after ``open``'s
        snapshot (a plan found held on the snapshot read again right before the commit)."""
        self._commits = sink_commits(open_table(self.config.layout.sink), self.config.name)
        return super().winner(plan)

    def reconcile(self) -> int:
        self.reconcile_pipeline(self.config, self.ledger)
        return 0

    def writes_in_read(self, plan: BatchPlan) -> bool:
        """An ingest or stream batch adds files: the read tasks may write them (the direct path);
        a backfill where its write mode says so (a merge engine the read tasks fold)."""
        return plan.kind != BatchKind.BACKFILL or write_mode(self.config).backfill_reads_in_tasks

    def observes_gate(self, plan: BatchPlan) -> bool:
        """An append sink's ingest or stream batch writes its rows in one job (``stage_files``),
        which settles the observed suite before the commit."""
        return plan.kind != BatchKind.BACKFILL and write_mode(self.config).row_per_record

    def write(
        self, plan: BatchPlan, processed: Any, spark: Any, started: float, before_commit: Callable[[], None], restore_deleted: bool
    ) -> SinkCommit | None:
        processed.stage_dead_letters(self.config, plan)
        if plan.kind == BatchKind.BACKFILL:
            version, entry = execute_backfill(self.config, plan, processed, spark, started, restore_deleted)
            return SinkCommit(version, entry)
        staged = write_mode(self.config).stage(plan, processed, spark)
        if staged is None:
            return None
        table, files, removed, merged, schema = staged.table, staged.files, staged.removed, staged.merge, staged.schema
        t = time.monotonic()
        entry = processed.entry(plan, started, merge=merged)
        before_commit()
        version = commit_batch(table, self.config, plan, files, entry, schema, removed=removed, pins=staged.pins)
        processed.timings_ms["commit"] = log_step(
            "commit",
            plan,
            t,
            sink_version=version,
            rows=files.rows,
            removed_files=len(removed) if removed else None,
            new_columns=",".join(schema.names[len(table_schema(table)) :]) if schema else None,
        )
        return SinkCommit(version, entry)

    def advance(self, plan: BatchPlan, entry: LedgerEntry, before_commit: Callable[[], None]) -> int:
        """The gap replaces the dead letters of the lost range with none: those offsets are
        recorded as never ingested, and no later batch will read (and so replace) them again."""
        table = open_table(self.config.layout.sink)
        before_commit()
        if table is None:  # nothing committed yet: a gap can only follow a committed end, so never here
            raise OffsetlakeError(f"gap batch {plan.batch_id} has no sink to commit to", pipeline=self.config.name, batch_id=plan.batch_id)
        return commit_batch(table, self.config, plan, WrittenFiles.none(), entry)

    def after_commit(self, plan: BatchPlan, processed: Any) -> None:
        """The batch's pending dead letters applied (invariant 8)."""
        if plan.kind != BatchKind.GAP:
            failpoints.failpoint("after_commit")
        dead_letters.apply_pending(self.config)


DeltaSinkKind.provides(WRITER, DeltaSinkWriter)
