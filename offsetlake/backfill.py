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
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from deltalake import DeltaTable, Transaction

from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import Capability, sink_kind
from offsetlake.entry import LedgerEntry
from offsetlake.errors import BackfillParamsError, CommitConflictError, StalePlanError
from offsetlake.formats import resolve_reader_schema
from offsetlake.history import current_epochs, refuse_foreign_sink, sink_commits
from offsetlake.kafka import check_log_start, current_offsets, offsets_for_time
from offsetlake.log_lines import log_step
from offsetlake.plan import BatchKind, BatchPlan, OffsetRange, PartitionOffsets, RecordTimeWindow, RunContext, new_batch_id
from offsetlake.processed import ProcessedBatch
from offsetlake.schema_evolution import sink_columns
from offsetlake.sink import CommitActions, WrittenFiles, commit_once, remove_actions
from offsetlake.sinks.choice import open_sink
from offsetlake.write_modes import BackfillStaging, write_mode


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
    schema, recorded with the plan (invariant 12). Refused where the mode can no longer replace
    a range's records (a merge engine's folded ones)."""
    write_mode(config).refuse_backfill(ranges, table)
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


def commit_replace(
    table: DeltaTable,
    config: PipelineConfig,
    plan: BatchPlan,
    new_files: WrittenFiles,
    removed: list[dict],
    entry: LedgerEntry,
    pins: Sequence[Transaction] = (),
) -> int:
    """ONE commit: remove the touched files, add the rewritten + new ones, no txn change but a
    keyed sink's state pin (``pins``, ``offsetlake.state_table``).

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
    actions = CommitActions(files=[*remove_actions(removed, config.sink.partition_by), *new_files.actions], txns=list(pins))
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
    mode = write_mode(config)
    prepared = mode.prepare_backfill(plan, spark)
    attempt = 1
    while True:
        try:
            return _commit_staged(config, plan, processed, started, mode.stage_backfill(plan, processed, spark, prepared, restore_deleted))
        except CommitConflictError as err:
            if attempt == COMMIT_ATTEMPTS:
                raise
            log_step("retry_commit", plan, time.monotonic(), attempt=attempt, reason=str(err))
            attempt += 1


def _commit_staged(
    config: PipelineConfig, plan: BatchPlan, processed: ProcessedBatch, started: float, staged: BackfillStaging
) -> tuple[int, LedgerEntry]:
    """A backfill's one commit: its staged replacement with its ledger entry, no txns; on the
    newest snapshot where the mode says that is still right (``BackfillStaging.rebase``), retried
    there ``QUICK_COMMIT_ATTEMPTS`` times, else on the snapshot it staged from."""
    t = time.monotonic()
    entry = processed.entry(plan, started, message=staged.message, **({"merge": staged.merge} if staged.merge is not None else {}))
    for quick in range(QUICK_COMMIT_ATTEMPTS if staged.rebase is not None else 1):
        table = staged.rebase() if staged.rebase is not None else staged.table
        try:
            version = commit_replace(table, config, plan, staged.files, staged.removed, entry, staged.pins)
            break
        except CommitConflictError:
            if staged.rebase is None or quick == QUICK_COMMIT_ATTEMPTS - 1:
                raise
    processed.timings_ms["commit"] = log_step("commit", plan, t, sink_version=version, removed_files=len(staged.removed))
    return version, entry
