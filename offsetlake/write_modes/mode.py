"""What a write mode is: how a batch's rows become rows of a Delta sink table (docs/design.md,
"The write-mode seam"). ``runs`` (through the Delta sink's writer), ``backfill``, ``maintenance``,
the outbox and the audit ask the pipeline's mode (``offsetlake.write_modes.write_mode``); none of
them branches on ``sink.mode``.

A mode stages; it never commits. The batch's one commit (``sink.commit_batch``, a backfill's
``backfill.commit_replace``) stays with its caller, so the ordering rules of a commit (invariant
3's "applies?", a backfill's epoch check, no retries on a replace) are kept in one place for
every mode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import pyarrow as pa

from offsetlake import keyed
from offsetlake.config import PipelineConfig
from offsetlake.errors import ConfigError
from offsetlake.formats import CHANGE
from offsetlake.plan import BatchPlan
from offsetlake.processed import ProcessedBatch
from offsetlake.schema_evolution import evolved_schema
from offsetlake.sink import WrittenFiles, add_columns_first

if TYPE_CHECKING:
    from deltalake import DeltaTable, Transaction


class Staged(NamedTuple):
    """An ingest batch staged: the snapshot to commit on, its files, the live files they replace
    (a merge), the merge's counts, the schema the commit evolves the table to (None: unchanged)
    and the txns the commit carries besides the plan's (a keyed sink's state pin)."""

    table: DeltaTable
    files: WrittenFiles
    removed: list[dict]
    merge: dict[str, int] | None
    schema: pa.Schema | None
    pins: tuple[Transaction, ...] = ()


@dataclass(frozen=True)
class BackfillStaging:
    """A backfill's replacement, staged: the files it adds and the live files it removes, what its
    entry says, and the snapshot its one commit is made on (``snapshot``)."""

    table: DeltaTable
    files: WrittenFiles
    removed: list[dict]
    message: str
    merge: dict[str, int] | None = None
    # the newest snapshot if committing on it is still right (an append sink: the files holding
    # the range are still the ones rewritten; raises CommitConflictError if not); None: only
    # ``table`` itself, the snapshot a merge read
    rebase: Callable[[], DeltaTable] | None = None
    pins: tuple[Transaction, ...] = ()  # txns the commit carries (a keyed sink's state pin)


@dataclass
class StagedMerge:
    """A keyed batch's merge, staged: the files it wrote, the live files they replace (read from
    ``table``, the snapshot the commit must be made on) and what it did to the keys."""

    files: WrittenFiles
    removed: list[dict]
    counts: keyed.MergeCounts
    shape: Any = None  # the state rows' schema (pyarrow), which makes the state table
    # every state row of the groups the merge rewrote (Spark), and the groups whose rows may have
    # changed or gone: what the sink's projection rewrites (``offsetlake.state_table.project``)
    changed: Any = None
    touched: Any = None
    folded: Any = None  # an engine's fold: the horizon the state commit raises (``engine_merge.fold``)


@dataclass(frozen=True)
class Compaction:
    """What maintenance's compaction of the sink did (delta-rs's metrics), or why it was skipped."""

    metrics: dict[str, Any]
    skipped: str | None = None


class Replay(StrEnum):
    """What the audit replays from Kafka's records to check the sink (``audit --against-kafka``)."""

    RECORDS = "records"  # a row per record (row index), as the batch wrote it
    NEWEST_PER_KEY = "newest per key"  # one row per key, its newest record's (``offsetlake.keyed``)
    FOLD = "fold"  # a contribution row per record and window, and the engine's fold per group


class WriteMode(ABC):
    """One write mode of a Delta sink (``sink.mode``): how it stages a batch and a backfill, what
    maintenance may do to its files, what the outbox can publish and what the audit counts."""

    # the mode keeps state beside the sink (``offsetlake.state_table``: upsert's state rows and
    # delete markers, an engine's folded states and contributions); the sink holds only rows
    keeps_state: ClassVar[bool] = False
    # each sink row is one source record's (row): counts per range match the entries, and the
    # outbox can publish a row per record
    row_per_record: ClassVar[bool] = False
    replay: ClassVar[Replay]

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config

    @property
    def name(self) -> str:
        return self.config.sink.mode

    @property
    def backfill_reads_in_tasks(self) -> bool:
        """Whether a backfill's read tasks may write its new rows' files themselves (the direct
        path) while its merge replaces the old ones: False, Spark writes a backfill's rows."""
        return False

    @abstractmethod
    def stage(self, plan: BatchPlan, processed: ProcessedBatch, spark: Any) -> Staged | None:
        """An ingest or stream batch's files staged for its commit (module docstring); None when
        the sink already holds the plan meanwhile (invariant 3)."""

    def refuse_backfill(self, ranges: list[Any], sink: DeltaTable | None) -> None:
        """BackfillParamsError when the mode can no longer replace the records of ``ranges`` (an
        engine's folded records); every mode but the engines replaces any committed range."""
        return None

    def prepare_backfill(self, plan: BatchPlan, spark: Any) -> Any:
        """What every attempt of a backfill needs and no retry changes (read once)."""
        return None

    @abstractmethod
    def stage_backfill(
        self, plan: BatchPlan, processed: ProcessedBatch, spark: Any, prepared: Any, restore_deleted: bool
    ) -> BackfillStaging:
        """One attempt of a backfill: the rows of ``plan``'s ranges replaced by ``processed``."""

    @abstractmethod
    def compact(self, table: DeltaTable, partitions: list | None) -> Compaction:
        """Maintenance's compaction of the sink table (``partitions``: the pipeline's own)."""

    def refuse_publish(self) -> None:
        """ConfigError unless the outbox can publish this sink's changes (a row per record)."""
        if not self.row_per_record:
            raise ConfigError(
                f"publish takes an append sink; this one is sink.mode {self.name}, whose deletes and merged rows leave "
                "no row per source record to publish",
                pipeline=self.config.name,
                field="sink.mode",
            )

    def counted(self, sink: DeltaTable, rows: int) -> tuple[int, int, str]:
        """The audit's count of ``rows`` (every row of ``sink``): (rows a reader sees, state rows
        kept beside them, what the state rows are)."""
        return rows, 0, ""

    def move_state_out(self) -> int | None:
        """A keyed sink written with its state inside moves it to the state table (once); None:
        nothing to move (every mode without state)."""
        return None

    def records_table(self, sink: DeltaTable | None) -> DeltaTable | None:
        """The table holding a row per committed record that reached the sink, with its
        coordinates (the audit's "each record once"): the sink itself, or a keyed sink's state."""
        return sink


def with_new_columns(config: PipelineConfig, table: DeltaTable, rows: Any, plan: BatchPlan) -> DeltaTable:
    """A backfill whose rows have columns the sink lacks adds them (nullable) in a metadata-only
    commit first (``sink.add_columns_first``); a column whose type changed is refused
    (SchemaChangeError) before anything is written."""
    from pyspark.sql.pandas.types import to_arrow_schema

    written = to_arrow_schema(rows.drop(CHANGE).schema, timezone="UTC", prefers_large_types=False)
    schema = evolved_schema(table, config, written, plan)
    return table if schema is None else add_columns_first(table, config, schema, plan)
