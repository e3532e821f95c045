"""Small-file control for a pipeline's tables: compact, checkpoint, vacuum.

Every batch adds a few files to the sink and the dead-letter table, every plan and outcome a
small file to the ledger. ``maintain`` rewrites them into larger files (a dataChange=false
commit: txn versions, rows and the commit history offsetlake reads stay as they are), writes a
checkpoint so opening a table reads one parquet file instead of every commit, and vacuums files
that no version younger than the retention refers to.

Reruns stay safe: a rerun never reads old files (each attempt stages new files of its own), and
vacuum only deletes files older than the retention, so the staged files of a batch still in
flight are never touched as long as the retention exceeds the longest batch (at least
``MIN_RETENTION_HOURS``). The commit history is never cleaned up: it is the source of truth of
the ledger (invariant 4), so sink tables are created with ``delta.enableExpiredLogCleanup=false``
and ``maintain`` sets it on older ones.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError, DeltaError

from offsetlake import dead_letters, state_segments, state_table
from offsetlake.config import PipelineConfig
from offsetlake.errors import OffsetlakeError
from offsetlake.log_lines import log_line
from offsetlake.sink import KEEP_HISTORY, live_files, open_table
from offsetlake.write_modes import write_mode

log = logging.getLogger("offsetlake.maintenance")

MIN_RETENTION_HOURS = 1
DEFAULT_RETENTION_HOURS = 168


@dataclass
class TableReport:
    table: str
    path: str
    files_before: int
    files_after: int
    compacted_from: int = 0
    compacted_into: int = 0
    checkpoint_version: int | None = None
    vacuumed: int = 0
    skipped: str | None = None  # why compaction was skipped (lost a race to another writer)
    duration_ms: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def maintain(config: PipelineConfig, retention_hours: int = DEFAULT_RETENTION_HOURS, vacuum: bool = True) -> list[TableReport]:
    """Compact, checkpoint and (unless ``vacuum=False``) vacuum the sink, dead letters and ledger."""
    config.check_storage()
    if retention_hours < MIN_RETENTION_HOURS:
        raise OffsetlakeError(
            f"maintenance: retention {retention_hours} h is below {MIN_RETENTION_HOURS} h; "
            "vacuum could delete the staged files of a batch still in flight",
            pipeline=config.name,
        )
    # A dead-letter change a crash left pending names staged files vacuum would otherwise take.
    dead_letters.apply_pending(config)
    write_mode(config).move_state_out()  # compaction must not mix a sink's state rows with its rows
    state_table.heal(config)  # the state table's newest version holds the pinned state: vacuum keeps its files
    reports = []
    for label, place, mine in (
        ("sink", config.layout.sink, None),
        ("state", config.layout.state, None),
        ("dead_letters", config.layout.dead_letters, None),
        ("ledger", config.layout.ledger, [("pipeline", "=", config.name)]),
    ):
        table = open_table(place)
        if table is None:
            log_line(log, "maintenance", "no table yet", pipeline=config.name, table=label, path=place.path)
            continue
        reports.append(_maintain_table(config, label, place.path, table, mine, retention_hours, vacuum))
    return reports


def _maintain_table(
    config: PipelineConfig, label: str, path: str, table: DeltaTable, mine: list | None, retention_hours: int, vacuum: bool
) -> TableReport:
    started = time.monotonic()
    report = TableReport(label, path, files_before=len(table.file_uris(file_pruning_predicate=mine)), files_after=0)
    if label == "sink" and table.metadata().configuration.get("delta.enableExpiredLogCleanup") != "false":
        table.alter.set_table_properties(KEEP_HISTORY, raise_if_not_exists=False)
    try:
        if label == "sink":  # the mode says what compaction may do to its files (``WriteMode.compact``)
            compaction = write_mode(config).compact(table, mine)
            metrics, report.skipped = compaction.metrics, compaction.skipped
        elif label == "state":  # the next state commit sets the pinned files again: compaction would be undone
            metrics, report.skipped = {"numFilesRemoved": 0, "numFilesAdded": 0}, "the state table is kept as the batches wrote it"
        else:
            metrics = table.optimize.compact(partition_filters=mine)
        report.compacted_from, report.compacted_into = metrics["numFilesRemoved"], metrics["numFilesAdded"]
    except (CommitFailedError, DeltaError) as err:  # a concurrent backfill replaced files we were compacting
        report.skipped = str(err).splitlines()[0]
        log_line(log, "maintenance", "compaction skipped", level=logging.WARNING, pipeline=config.name, table=label, reason=report.skipped)
    table.update_incremental()
    table.create_checkpoint()
    report.checkpoint_version = table.version()
    if vacuum:
        # full: also files no commit ever referenced (staged by attempts that died), once older
        # than the retention; enforce_retention_duration=False lets a retention below the
        # table's 7-day default through (never below MIN_RETENTION_HOURS, checked above).
        report.vacuumed = len(table.vacuum(retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False, full=True))
        if label == "state":  # batch states that name a file no longer live (vacuum leaves their folder alone)
            live = state_segments.file_paths(live_files(table))
            report.vacuumed += state_segments.remove_unused(config.layout.state, live, retention_hours * 3600)
    report.files_after = len(table.file_uris(file_pruning_predicate=mine))
    report.duration_ms = int((time.monotonic() - started) * 1000)
    log_line(
        log,
        "maintenance",
        pipeline=config.name,
        table=label,
        files_before=report.files_before,
        files_after=report.files_after,
        compacted=f"{report.compacted_from}->{report.compacted_into}",
        checkpoint_version=report.checkpoint_version,
        vacuumed=report.vacuumed,
        duration_ms=report.duration_ms,
    )
    return report
