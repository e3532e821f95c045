"""A batch after read -> decode -> transform -> validate -> dead letters (``ProcessedBatch``), the
data path it took (``DataPath``, ``PathChoice``), the files its read tasks wrote
(``WrittenInRead``), and ``stage_files``, which writes its rows as the files a commit adds.
``offsetlake.process`` makes one; the write modes (``offsetlake.write_modes``) stage it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from offsetlake import dead_letters, direct, failpoints, keyed, staging, storage
from offsetlake.config import PipelineConfig
from offsetlake.coordinates import Selection
from offsetlake.entry import DeadLetterFile, LedgerEntry, for_plan
from offsetlake.log_lines import log_step
from offsetlake.plan import BatchKind, BatchPlan, RangeCounts
from offsetlake.sink import StagedFile, WrittenFiles, add_actions_for, staging_dir

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession


class DataPath(StrEnum):
    """How a batch's records become its staged files (the pipeline's ``data_path`` picks among
    them, or ``auto``); the value is what the log and the ledger entry say."""

    SPARK = "spark"  # the read tasks hand every record to Spark, which writes the rows
    DIRECT = "direct"  # the read tasks write the rows of the records they decide (``offsetlake.direct``)
    JVM = "jvm"  # Spark's Kafka source reads and Spark decodes: no record crosses Python (``offsetlake.kafka_source``)


@dataclass(frozen=True)
class PathChoice:
    """The data path a batch takes and why, decided before anything is read."""

    path: DataPath
    reason: str
    rows_schema: Any = None  # the direct path: pyarrow schema of the rows the read tasks write
    engine: Any = None  # the direct path of a merge engine: how the read tasks fold (``engine_arrow.ArrowEngine``)


@dataclass
class WrittenInRead:
    """The files a batch's read tasks wrote (the direct path; none on the Spark path): its rows'
    files in the staging ``folder``, and the files of the records they left to the Spark steps,
    removed once those are decided (a crash leaves them, uncommitted and inert, for vacuum)."""

    folder: str | None = None
    files: list[StagedFile] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)  # paths under ``table_root``
    table_root: storage.Location | None = None
    # a merge engine's partial states of the groups of each read task (``offsetlake.engine_arrow``),
    # paths under ``table_root``: the merge reads them, and they go with the undecided files
    partials: list[str] = field(default_factory=list)
    partial_rows: int = 0  # the rows of those files

    def remove_undecided(self) -> None:
        if (self.undecided or self.partials) and self.table_root is not None:
            direct.remove_undecided(self.table_root, [*self.undecided, *self.partials])
        self.undecided, self.partials = [], []


@dataclass
class ProcessedBatch:
    """A batch after read -> decode -> transform -> validate -> dead letters: ``stage_files``
    writes ``rows`` next to the files the read tasks already wrote."""

    path: PathChoice
    per_range: dict[tuple[str, int], RangeCounts]
    timings_ms: dict[str, int] = field(default_factory=dict)
    # pyspark DataFrame of the sink rows Spark writes: every row on the Spark path, the rows of the
    # records the read tasks left undecided on the direct path; None when there are none
    rows: Any = None
    rows_schema: Any = None  # pyarrow schema of the batch's sink rows, whoever writes them
    written: WrittenInRead = field(default_factory=WrittenInRead)
    cached: list[Any] = field(default_factory=list)  # persisted DataFrames; ``release`` when the batch is done
    validation: dict | None = None  # the Great Expectations summary, None without a suite
    observe_gate: bool = False  # whether the suite may be observed during the write (``process_ranges``)
    gate: Any = None  # that suite, observed by ``stage_files`` and settled after its write (``validation.ObservedGate``)
    # the batch's dead letters (``dead_letters.DEAD_LETTER_SCHEMA``), None for none: a Delta sink
    # stages them as a file its commit's entry lists (``stage_dead_letters``, invariant 8), a
    # Kafka sink produces them in its transaction
    dead_letters: Any = None
    dead_letter_files: tuple[DeadLetterFile, ...] = ()  # staged; the sink commit's entry lists them

    def entry(self, plan: BatchPlan, started: float, **kind_fields: Any) -> LedgerEntry:
        """The ledger entry of ``plan`` with this batch's counts, validation, data path and staged
        dead letters (``kind_fields`` may say otherwise: a Kafka sink stages none it keeps)."""
        fields = {"staged": self.dead_letter_files, "data_path": str(self.path.path), **kind_fields}
        return for_plan(plan, self.per_range, started, self.validation, **fields)

    def stage_dead_letters(self, config: PipelineConfig, plan: BatchPlan) -> None:
        """The batch's dead letters written as a staged file under the dead-letter table, inert
        until the sink commit's entry names it (``dead_letters.stage``; a Delta sink, invariant 8)."""
        if self.dead_letters is None:
            return
        t = time.monotonic()
        self.dead_letter_files = dead_letters.stage(config, plan.batch_id, self.dead_letters)
        self.timings_ms["stage_dead_letters"] = log_step("stage_dead_letters", plan, t, dead_letters=self.dead_letters.num_rows)

    def release(self) -> None:
        for frame in self.cached:
            frame.unpersist()
        self.cached.clear()
        self.written.remove_undecided()


def settle_gate(config: PipelineConfig, plan: BatchPlan, processed: ProcessedBatch, staged: list[StagedFile]) -> None:
    """The suite observed during the write decides the batch (``validation.ObservedGate``): a
    pass is recorded as a suite run before the write would be (summary, report, ``validate``
    step); anything else removes the batch's staged files and raises ``validation.Undecided``."""
    from offsetlake.validation import Undecided, write_report

    t = time.monotonic()
    gate, processed.gate = processed.gate, None
    try:
        validation = gate.settle()
    except Undecided:  # inert, as no commit names them: the batch's files and its dead letters' (staged again by its rerun)
        direct.remove_undecided(config.layout.sink, [f.path for f in staged])
        direct.remove_undecided(config.layout.dead_letters, [f.path for f in processed.dead_letter_files])
        processed.dead_letter_files = ()
        raise
    validation.summary["report"] = write_report(config, plan, validation.summary)
    processed.validation = validation.summary
    processed.timings_ms["validate"] = log_step(
        "validate", plan, t, outcome="passed", observed=True, failed=0, quarantined=0, report=validation.summary["report"]
    )


def stage_files(
    config: PipelineConfig,
    plan: BatchPlan,
    processed: ProcessedBatch,
    rows: DataFrame | None,
    spark: SparkSession,
    sort_by: tuple[str, ...] = (),
    beside: DataFrame | None = None,
    held: pa.Table | None = None,
    held_beside: pa.Table | None = None,
) -> WrittenFiles:
    """The Spark tasks write ``rows`` as parquet into a fresh folder inside the table with pyarrow
    (``offsetlake.staging``: inert until a commit names them, on a local folder or object
    storage alike); counts the rows written per range of the plan. When the read tasks wrote
    files (``processed.written``, the direct path), ``rows`` are those of the records they left
    to Spark (None: none), written next to theirs. ``beside``: more rows written to files of
    their own (a merge engine's contribution rows, never in a file with visible rows). ``held``:
    rows the driver holds (a merge engine's groups, ``engine_merge.merged_on_driver``), written
    from the driver sorted by ``sort_by`` in files of ``sink.file_rows``; ``held_beside``: rows of
    ``beside``'s kind the driver holds (a backfill's contributions, ``engine_merge.backfill_in_arrow``)."""
    t = time.monotonic()
    written = processed.written
    folder = written.folder or staging_dir(config, plan.batch_id)
    staged = list(written.files)
    if rows is not None:
        written_rows = processed.gate.observed(rows) if processed.gate is not None else rows
        staged += staging.write_rows(written_rows, config.layout.sink, folder, config.sink.partition_by, Selection.of(plan), sort_by)
    if processed.gate is not None:
        settle_gate(config, plan, processed, staged)
    if held is not None:
        runs = keyed.file_count(held.num_rows, config)
        staged += staging.write_table(held, config.layout.sink, folder, config.sink.partition_by, Selection.of(plan), sort_by, runs)
    if beside is not None:
        staged += staging.write_rows(beside, config.layout.sink, folder, config.sink.partition_by, Selection.of(plan))
    if held_beside is not None:
        runs = keyed.file_count(held_beside.num_rows, config)
        staged += staging.write_table(held_beside, config.layout.sink, folder, config.sink.partition_by, Selection.of(plan), (), runs)
    if plan.kind != BatchKind.BACKFILL:  # a backfill stages again after a commit conflict, from them: ``release`` removes them
        written.remove_undecided()
    files = add_actions_for(config.layout.sink, staged)
    for counts in processed.per_range.values():  # this attempt's files only: a retried backfill stages again
        counts["rows_written"] = 0
        counts.pop("empty_as_null", None)
    for staged_file in staged:
        for key, count in staged_file.counts.items():
            if key in processed.per_range:
                processed.per_range[key]["rows_written"] += count
                if staged_file.empty_as_null:  # a file of "" partition values: every row of it is one
                    counts = processed.per_range[key]
                    counts["empty_as_null"] = counts.get("empty_as_null", 0) + count
    processed.timings_ms["write"] = log_step("write", plan, t, files=len(files.actions), rows=files.rows)
    failpoints.failpoint("after_files_written")
    return files
