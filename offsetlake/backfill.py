"""Backfill: reprocess offsets the pipeline has already passed, replacing their sink rows.

Invariant 6: every sink row carries its Kafka coordinates, so reprocessing ``[a, b)`` of a
partition removes the rows with those coordinates and adds the new ones in ONE commit; repeating
a backfill changes nothing. Of a topic re-created under the pipeline (invariant 16), only the rows
of its current epoch are replaced (``coordinates.Selection``): the old topic's rows at the same
offsets are other records, which Kafka no longer has, and stay. A backfill works only below the pipeline's committed end and never
moves the txn versions (new offsets belong to the ingest path). By-time backfills resolve to
offsets with offsets_for_times first.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads
from deltalake import DeltaTable

from offsetlake import foreign, keyed, storage
from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import Capability, sink_kind
from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TOPIC, TOPIC_EPOCH, Selection
from offsetlake.entry import LedgerEntry
from offsetlake.errors import BackfillParamsError, CommitConflictError, ForeignCommitError, OffsetlakeError, StalePlanError
from offsetlake.formats import CHANGE, resolve_reader_schema
from offsetlake.history import current_epochs, foreign_commits, refuse_foreign_sink, sink_commits
from offsetlake.kafka import check_log_start, current_offsets, offsets_for_time
from offsetlake.log_lines import log_step
from offsetlake.plan import BatchKind, BatchPlan, OffsetRange, PartitionOffsets, RecordTimeWindow, RunContext, new_batch_id
from offsetlake.process import ProcessedBatch, StagedMerge, later_records, stage_engine_merge, stage_files, stage_merge
from offsetlake.sink import (
    CommitActions,
    WrittenFiles,
    add_columns_first,
    commit_once,
    committed_end,
    evolved_schema,
    live_files,
    open_table,
    remove_actions,
    sink_columns,
)
from offsetlake.sinks.choice import open_sink
from offsetlake.spark import dataframe_from_arrow


def refused(pipeline: str, text: str, **where: Any) -> BackfillParamsError:
    """The backfill request of ``pipeline`` refused: ``text`` says what to change; ``where`` the
    topic, partition and requested offsets it is about, as the error's fields."""
    return BackfillParamsError(f"backfill: {text}", pipeline=pipeline, **where)


def _parse_time(value: str, name: str, pipeline: str) -> int:
    try:
        stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise refused(pipeline, f"{name} '{value}' is not an ISO-8601 time such as 2026-11-01T00:00:00Z") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return int(stamp.timestamp() * 1000)


def plan_backfill(
    config: PipelineConfig,
    run: RunContext,
    partitions: list[int] | None = None,
    from_offset: int | None = None,
    to_offset: int | None = None,
    from_time: str | None = None,
    to_time: str | None = None,
    topic: str | None = None,
    republish: bool = False,
) -> BatchPlan:
    """Validate the request and turn it into per-partition ranges below the committed end.

    A Kafka sink (``sink.type: kafka``) cannot have records replaced: its backfill re-publishes
    the range, marked ``backfill``, and needs ``republish`` to say so (BackfillParamsError
    otherwise); ``republish`` on a Delta sink is refused too, as it means nothing there.

    Offsets are half-open ``[from_offset, to_offset)``. Times select records by their own
    timestamps, ``[from_time, to_time)``: record timestamps need not grow with offsets (producers
    set them), so no offset bounds a time window from above. The plan reads, per partition,
    from the first offset whose timestamp is at or after ``from_time`` (offsets_for_times; every
    record before it is earlier) up to the committed end, and reprocesses — replaces — only the
    records whose timestamps fall in the window; the plan's description says so. Raises
    BackfillParamsError naming the pipeline and what to fix.
    """
    config.check_storage()
    by_time = _request_kind(config.name, from_offset, to_offset, from_time, to_time)
    _republish_agrees(config, republish)
    topic, offsets, chosen = _chosen_partitions(config, topic, partitions)
    sink = open_sink(config)
    table, found = sink.table, sink.ends([(topic, p) for p in chosen])
    ends = {p: found[(topic, p)] for p in chosen}
    window: RecordTimeWindow | None = None
    if by_time:
        assert from_time and to_time  # checked by _request_kind
        start_ms, stop_ms = _parse_time(from_time, "from_time", config.name), _parse_time(to_time, "to_time", config.name)
        if stop_ms <= start_ms:
            raise refused(config.name, f"to_time {to_time} must be after from_time {from_time}")
        window = RecordTimeWindow(start_ms, stop_ms)
        ranges = _time_ranges(config, topic, {p: offsets[p] for p in chosen}, ends, window)
    else:
        assert from_offset is not None and to_offset is not None  # checked by _request_kind
        ranges = _offset_ranges(config, topic, chosen, offsets, ends, from_offset, to_offset)
    if all(r.size == 0 for r in ranges):
        what = f"{window}" if window is not None else "the requested range"
        raise refused(config.name, f"{what} selects no committed offsets ({', '.join(map(str, ranges))})")
    return _backfill_plan(config, run, ranges, window, table)


def _republish_agrees(config: PipelineConfig, republish: bool) -> None:
    """A backfill replaces its range's rows, or with ``republish`` publishes the range again: the
    sink must be able to do the one asked (``Capability``; refused with the sink's reason)."""
    asked = Capability.REPUBLISH if republish else Capability.REPLACE
    sink_kind(config).refuse_unless(config, asked, lambda why: refused(config.name, why))


def _backfill_plan(
    config: PipelineConfig, run: RunContext, ranges: list[OffsetRange], window: RecordTimeWindow | None, table: DeltaTable | None
) -> BatchPlan:
    """The backfill batch of the non-empty ``ranges``; an old range decodes into today's reader
    schema, recorded with the plan (invariant 12)."""
    return BatchPlan(
        config.name,
        new_batch_id(config.name),
        BatchKind.BACKFILL,
        tuple(r for r in ranges if r.size),
        run,
        window=window,
        reader_schema=resolve_reader_schema(config, sink_columns(table)),
    )


def _request_kind(pipeline: str, from_offset: int | None, to_offset: int | None, from_time: str | None, to_time: str | None) -> bool:
    """True for a backfill by time, False by offsets; BackfillParamsError for a mix or half a range."""
    by_offset = from_offset is not None or to_offset is not None
    by_time = bool(from_time) or bool(to_time)
    if by_offset and by_time:
        raise refused(pipeline, "give from_offset/to_offset or from_time/to_time, not both")
    if not by_offset and not by_time:
        raise refused(pipeline, "give from_offset and to_offset, or from_time and to_time")
    if by_offset and (from_offset is None or to_offset is None):
        raise refused(pipeline, "from_offset and to_offset are both required")
    if by_time and not (from_time and to_time):
        raise refused(pipeline, "from_time and to_time are both required")
    return by_time


def _chosen_partitions(
    config: PipelineConfig, topic: str | None, partitions: list[int] | None
) -> tuple[str, dict[int, PartitionOffsets], list[int]]:
    """The topic (the only one when not given), Kafka's offsets of its partitions and the
    partitions asked for (all when none are); BackfillParamsError naming what exists otherwise."""
    every = current_offsets(config)
    topics = sorted({t for t, _ in every})
    if topic is None and len(topics) == 1:
        topic = topics[0]
    if topic is None or topic not in topics:
        said = "give the topic to backfill" if topic is None else f"topic {topic} is not one of the pipeline's"
        raise refused(config.name, f"{said} (its topics: {', '.join(topics) or 'none'})", topic=topic)
    offsets = {p: o for (t, p), o in every.items() if t == topic}
    known = sorted(offsets)
    chosen = sorted(set(partitions)) if partitions else known
    unknown = [p for p in chosen if p not in offsets]
    if unknown:
        raise refused(config.name, f"topic {topic} has no partition {', '.join(map(str, unknown))} (partitions: {known})", topic=topic)
    return topic, offsets, chosen


def _offset_ranges(
    config: PipelineConfig,
    topic: str,
    chosen: list[int],
    offsets: dict[int, PartitionOffsets],
    ends: dict[int, int | None],
    from_offset: int,
    to_offset: int,
) -> list[OffsetRange]:
    """``[from_offset, to_offset)`` of each chosen partition, refused past the last stable offset,
    past the committed end (new offsets are the ingest run's) or below the log start."""
    if to_offset <= from_offset:
        raise refused(config.name, f"to_offset {to_offset} must be greater than from_offset {from_offset}", topic=topic)
    ranges = []
    for p in chosen:
        lso, end = offsets[p].last_stable, ends[p]
        limit = end if end is not None else 0
        asked = {"topic": topic, "partition": p, "start": from_offset, "end": to_offset}
        if to_offset > lso:
            raise refused(config.name, f"to_offset {to_offset} is beyond the last stable offset {lso} of the partition", **asked)
        if to_offset > limit:
            raise refused(
                config.name,
                f"the partition is committed up to {limit}; a backfill may only reprocess offsets "
                f"below it (new offsets belong to the ingest run), so use to_offset <= {limit}",
                **asked,
            )
        check_log_start(offsets[p], from_offset, config.name)
        ranges.append(OffsetRange(topic, p, from_offset, to_offset))
    return ranges


def _time_ranges(
    config: PipelineConfig, topic: str, offsets: dict[int, PartitionOffsets], ends: dict[int, int | None], window: RecordTimeWindow
) -> list[OffsetRange]:
    """Per partition of ``topic``: from the first offset whose timestamp is at or after the
    window's start (offsets_for_times) up to the committed end; empty where nothing committed
    can fall in the window. Offsets at or above the committed end belong to the ingest path."""
    chosen = sorted(offsets)
    if window.from_ms <= 0:
        # offsets_for_times takes -1 and -2 as "latest"/"earliest", and any earlier time may
        # match from the first record on: start from the log start
        starts = {p: offsets[p].log_start for p in chosen}
    else:
        found = offsets_for_time(config.kafka_client_config(), topic, chosen, window.from_ms, config.name)
        # -1: no record at or after the window's start yet
        starts = {p: found[p] if found[p] >= 0 else offsets[p].last_stable for p in chosen}
    ranges = []
    for p in chosen:
        end = ends[p]
        stop = min(offsets[p].last_stable, end if end is not None else 0)
        start = min(starts[p], stop)
        if stop > start:
            check_log_start(offsets[p], start, config.name)
        ranges.append(OffsetRange(topic, p, start, stop))
    return ranges


def plan_interval_backfill(
    config: PipelineConfig, run: RunContext, start: datetime, end: datetime, republish: bool = False
) -> BatchPlan | None:
    """The plan of an Airflow backfill run of ``<pipeline>_ingest`` (its data interval ``[start,
    end)``): every topic and partition of the pipeline, replacing the records whose timestamps
    fall in the interval, resolved exactly like a by-time backfill (``plan_backfill``). Returns
    None when the interval selects no committed offset (nothing ingested falls in it, or nothing
    is ingested yet): the run is a no-op. Never reaches the committed ends (invariant 6). A Kafka
    sink's needs ``republish`` (the run's conf ``{"republish": true}``), as ``plan_backfill``'s."""
    config.check_storage()
    _republish_agrees(config, republish)
    window = RecordTimeWindow(int(start.timestamp() * 1000), int(end.timestamp() * 1000))
    sink = open_sink(config)
    every = current_offsets(config)
    found = sink.ends(list(every))
    if not any(end is not None for end in found.values()):
        return None  # nothing ingested yet
    ranges = []
    for topic in sorted({t for t, _ in every}):
        offsets = {p: o for (t, p), o in every.items() if t == topic}
        ranges += _time_ranges(config, topic, offsets, {p: found[(topic, p)] for p in offsets}, window)
    if all(r.size == 0 for r in ranges):
        return None
    return _backfill_plan(config, run, ranges, window, sink.table)


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


def _keeping_foreign_deletes(
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


def _add_new_columns(config: PipelineConfig, table: DeltaTable, rows: Any, plan: BatchPlan) -> DeltaTable:
    """A backfill whose rows have columns the sink lacks adds them (nullable) in a metadata-only
    commit first (``sink.add_columns_first``); a column whose type changed is refused
    (SchemaChangeError) before anything is written."""
    from pyspark.sql.pandas.types import to_arrow_schema

    written = to_arrow_schema(rows.drop(CHANGE).schema, timezone="UTC", prefers_large_types=False)
    if config.sink.mode == "upsert":  # the merge writes hidden state rows too
        written = keyed.with_hidden_column(written)
    schema = evolved_schema(table, config, written, plan)
    return table if schema is None else add_columns_first(table, config, schema, plan)


def commit_replace(
    table: DeltaTable, config: PipelineConfig, plan: BatchPlan, new_files: WrittenFiles, removed: list[dict], entry: LedgerEntry
) -> int:
    """ONE commit: remove the touched files, add the rewritten + new ones, no txn change.

    Committed with no retries, so any commit since ``table``'s version makes it fail. delta-rs
    does not flag a commit whose removes were already removed by a concurrent compaction (seen
    here: the removes became no-ops, the compacted file kept the old rows of the range, and the
    range was in the sink twice); rebasing onto a newer version is therefore never safe here.
    Raises SinkOwnedError, committing nothing, when the table belongs to another pipeline
    (invariant 16: a backfill's replace would cut into that pipeline's rows), and StalePlanError
    when a topic of the plan started a new epoch since the batch read its epochs: its rows would
    carry the old epoch's number and its offsets name the old topic's records.
    """
    refuse_foreign_sink(table, config.name)
    now = current_epochs(sink_commits(table, config.name))
    moved = sorted({r.topic for r in plan.ranges if now.get(r.topic, 0) != plan.topic_epochs.get(r.topic, 0)})
    if moved:
        raise StalePlanError(
            f"backfill {plan.batch_id} of {plan.describe()}: topic {moved[0]} started a new epoch "
            f"(`offsetlake topic reset-epoch`) while the backfill ran; its offsets name other records now, so nothing "
            "was committed; plan the backfill anew against the current topic",
            pipeline=config.name,
            batch_id=plan.batch_id,
            topic=moved[0],
        )
    actions = CommitActions(files=[*remove_actions(removed, config.sink.partition_by), *new_files.actions])
    lost = (
        f"backfill {plan.batch_id} of {plan.describe()} conflicted with another writer "
        "that committed meanwhile; nothing was committed, run the backfill again"
    )
    return commit_once(table, config, actions, entry, conflict=lost)


COMMIT_ATTEMPTS = 3  # full attempts: find the files, rewrite them, commit
QUICK_COMMIT_ATTEMPTS = 10  # commits of one rewrite, each on the newest snapshot


def execute_backfill(
    config: PipelineConfig, plan: BatchPlan, processed: ProcessedBatch, spark: Any, started: float, restore_deleted: bool = False
) -> tuple[int, LedgerEntry]:
    """Replace the sink rows of ``plan``'s ranges with ``processed`` (read, decoded and validated
    by ``runs.execute_batch``; dead letters likewise) in one commit.

    In an append sink, a row that a commit offsetlake did not make deleted, and that is still
    absent, is not written again (``restore_deleted`` writes it: docs/design.md, "Foreign commits").

    Returns (sink version, ledger entry). A commit conflict (a compaction or another backfill
    replaced one of the same files meanwhile) is retried on the new snapshot, up to
    ``COMMIT_ATTEMPTS`` times, re-reading which files hold the range; appends by a running stream
    or ingest do not conflict. Raises CommitConflictError when every attempt lost; running the
    same backfill again is always safe because it replaces, never appends.
    """
    later = None
    if config.sink.mode == "upsert":  # a record a later one of its key replaced is never restored
        table = open_table(config.layout.sink)
        ends = {(r.topic, r.partition): committed_end(table, config, r.topic, r.partition) for r in plan.ranges}
        later = later_records(config, plan, spark, ends)
    attempt = 1
    while True:
        try:
            if config.sink.engine is not None:
                return _engine_merge_once(config, plan, processed, spark, started)
            if config.sink.mode == "upsert":
                return _merge_once(config, plan, processed, spark, started, later)
            return _replace_once(config, plan, processed, spark, started, restore_deleted)
        except CommitConflictError as err:
            if attempt == COMMIT_ATTEMPTS:
                raise
            log_step("retry_commit", plan, time.monotonic(), attempt=attempt, reason=str(err))
            attempt += 1


def _merge_once(
    config: PipelineConfig, plan: BatchPlan, processed: ProcessedBatch, spark: Any, started: float, later: Any
) -> tuple[int, LedgerEntry]:
    """One attempt of a keyed backfill: merge its records (those no later record of their key
    replaced) into the files holding their keys, by the ordering rule (``offsetlake.keyed``: a
    row is replaced only by a record at least as new as its own), in one commit without txns.
    Raises CommitConflictError if another writer committed meanwhile."""
    table = _add_new_columns(config, storage.table(config.layout.sink), processed.rows, plan)
    merge = stage_merge(config, plan, processed, spark, table, later)
    c = merge.counts
    said = f"{c.inserted} inserted, {c.updated} updated, {c.deleted} deleted, {c.older} older than the rows kept"
    return _commit_merge(config, plan, processed, started, table, merge, f"merged records of {plan.describe()}: {said}")


def _engine_merge_once(
    config: PipelineConfig, plan: BatchPlan, processed: ProcessedBatch, spark: Any, started: float
) -> tuple[int, LedgerEntry]:
    """One attempt of a merge engine's backfill (``offsetlake.engines``): the contributions of the
    records it reprocesses replaced by theirs, every group either touched folded again from its
    contributions, in one commit without txns. Raises CommitConflictError if another writer
    committed meanwhile."""
    table = storage.table(config.layout.sink)
    merge = stage_engine_merge(config, plan, processed, spark, table, Selection.of(plan))
    schema = evolved_schema(table, config, merge.shape, plan)
    if schema is not None:
        table = add_columns_first(table, config, schema, plan)
    c = merge.counts
    said = f"{c.inserted} inserted, {c.updated} updated, {c.deleted} deleted"
    return _commit_merge(
        config, plan, processed, started, table, merge, f"merged records of {plan.describe()} into the {config.sink.mode} state: {said}"
    )


def _commit_merge(
    config: PipelineConfig, plan: BatchPlan, processed: ProcessedBatch, started: float, table: DeltaTable, merge: StagedMerge, message: str
) -> tuple[int, LedgerEntry]:
    """A keyed backfill's one commit: its staged merge with its ledger entry, no txns."""
    t = time.monotonic()
    entry = processed.entry(plan, started, message=f"{message}; rewrote {merge.counts.files_rewritten} files", merge=merge.counts.as_dict())
    version = commit_replace(table, config, plan, merge.files, merge.removed, entry)
    processed.timings_ms["commit"] = log_step("commit", plan, t, sink_version=version, removed_files=len(merge.removed))
    return version, entry


def _replace_once(
    config: PipelineConfig, plan: BatchPlan, processed: ProcessedBatch, spark: Any, started: float, restore_deleted: bool = False
) -> tuple[int, LedgerEntry]:
    """One attempt: find the files holding the range now, rewrite them without it plus the new
    rows, commit the replacement. Raises CommitConflictError if another writer got there first."""
    table = storage.table(config.layout.sink)
    selected = Selection.of(plan)
    removed = touched_files(table, selected)
    rows = processed.rows if restore_deleted else _keeping_foreign_deletes(config, table, plan, processed, selected, spark)
    kept_count = 0
    if removed:
        kept = kept_rows(table, removed, selected)
        kept_count = kept.num_rows
        if kept_count:
            # the reprocessed rows may lack columns the kept ones have, or add some: both read null
            rows = rows.unionByName(dataframe_from_arrow(spark, kept), allowMissingColumns=True)
    table = _add_new_columns(config, table, rows, plan)
    files = stage_files(config, plan, processed, rows, spark)
    rewritten = files.rows - sum(v["rows_written"] for v in processed.per_range.values())
    if rewritten != kept_count:
        raise OffsetlakeError(
            f"backfill {plan.batch_id} of {plan.describe()} would rewrite {rewritten} rows "
            f"outside its ranges instead of the {kept_count} kept from {len(removed)} replaced files; nothing was committed",
            pipeline=config.name,
            batch_id=plan.batch_id,
        )
    t = time.monotonic()
    entry = processed.entry(plan, started, message=f"replaced rows of {plan.describe()}; rewrote {len(removed)} files")
    # Commit on the newest snapshot if the files holding the range are still exactly the ones
    # rewritten: appends (a running stream or ingest) land meanwhile and change nothing here.
    for quick in range(QUICK_COMMIT_ATTEMPTS):
        latest = storage.table(config.layout.sink)
        if {f["path"] for f in touched_files(latest, selected)} != {f["path"] for f in removed}:
            raise CommitConflictError(
                f"backfill {plan.batch_id} of {plan.describe()} conflicted with another writer: "
                f"the files holding the range changed while it wrote (a compaction, rewind or another backfill)",
                pipeline=config.name,
                batch_id=plan.batch_id,
            )
        try:
            version = commit_replace(latest, config, plan, files, removed, entry)
            break
        except CommitConflictError:
            if quick == QUICK_COMMIT_ATTEMPTS - 1:
                raise
    processed.timings_ms["commit"] = log_step("commit", plan, t, sink_version=version, removed_files=len(removed))
    return version, entry
