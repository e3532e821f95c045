"""The audit of a Delta sink: its rows and dead letters against its history, its entries' counts, its
txn versions and the ledger (``audit_delta_sink``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from offsetlake import dead_letters, foreign, state_table
from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import DeltaSinkKind
from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TOPIC, TOPIC_EPOCH
from offsetlake.engines import WINDOW_START
from offsetlake.errors import ForeignCommitError
from offsetlake.history import SinkCommit, epoch_at, epoch_starts, refuse_foreign_sink, rewound_batches, sink_commits
from offsetlake.kafka import current_offsets
from offsetlake.ledger import Ledger
from offsetlake.plan import OFFSET_MOVING_KINDS, BatchKind, BatchStatus
from offsetlake.sink import committed_end, open_table
from offsetlake.topic_epochs import check_pipeline_identity
from offsetlake.write_modes import Replay, write_mode

if TYPE_CHECKING:
    from deltalake import DeltaTable
from offsetlake.audit.against_kafka import _check_against_kafka, _group_offsets, _outside
from offsetlake.audit.batch_states import check_batch_states
from offsetlake.audit.keyed import _check_engine_against_kafka, _check_keyed_against_kafka, _check_keys_once
from offsetlake.audit.report import (
    _COORDS,
    _KEY,
    _SHOW,
    AUDIT,
    EPOCH_OF,
    AuditReport,
    SinkAudit,
    _current_epoch_only,
    _duplicates,
    _sink_keys,
    _with_epochs,
)


def audit_delta_sink(config: PipelineConfig, against_kafka: bool = False) -> AuditReport:
    """The audit of a Delta sink: its rows against its history, the dead letters and the ledger
    (and against Kafka's records with ``against_kafka``)."""
    config.check_storage()
    report = AuditReport(config.name)
    sink = open_table(config.layout.sink)
    refuse_foreign_sink(sink, config.name)  # another pipeline's table: say so, as a run does, not "rows outside every range"
    commits = sink_commits(sink, config.name)
    starts = epoch_starts(commits)  # a topic re-created under the pipeline: its epochs are kept apart
    rows = _sink_keys(config)
    dead = _with_epochs(dead_letters.coordinates_applied(config, [*_COORDS, "batch_id"]), starts, commits)
    report.rows, report.dead_letters = rows.num_rows, dead.num_rows
    mode = write_mode(config)
    if sink is not None:
        report.rows, report.hidden_rows, report.hidden_kind = mode.counted(sink, rows.num_rows)
    records = _check_once(config, rows, dead, report)
    rewound = rewound_batches(commits)
    ranges = _committed_ranges(commits, rewound, starts, report)
    _check_inside_ranges(records, dead, ranges.covered, report)
    _check_txn_versions(config, sink, commits, starts, set(ranges.by_tp), report)
    outside = _foreign_commits(config, sink, rows, report)
    if mode.replay is Replay.FOLD:
        check_batch_states(config, sink, report)
    if mode.row_per_record:
        _check_counts_match_entries(commits, rewound, starts, rows, dead, report, outside)
    if against_kafka:
        _check_kafka(config, sink, starts, records, dead, ranges, report, outside)
    return report


@dataclass(frozen=True)
class _ForeignRows:
    """What commits offsetlake did not make changed, per (topic, partition, epoch): (offset, sink
    version) of each row they deleted that is still absent, and of each row they added."""

    removed: dict[tuple[str, int, int], list[tuple[int, int]]] = field(default_factory=dict)
    added: dict[tuple[str, int, int], list[tuple[int, int]]] = field(default_factory=dict)

    def count(self, which: str, key: tuple[str, int, int], start: int, end: int, after_version: int) -> int:
        """Rows in ``[start, end)`` that foreign commits after ``after_version`` deleted or added
        (a batch committed after a foreign delete counted only what it wrote)."""
        return sum(1 for o, v in getattr(self, which).get(key, ()) if start <= o < end and v > after_version)


def _foreign_commits(config: PipelineConfig, sink: DeltaTable | None, rows: pa.Table, report: AuditReport) -> _ForeignRows:
    """Commits offsetlake did not make (docs/design.md, "Foreign commits"): each is said in a note
    with what it changed, and the rows it deleted or added explain the counts and the check
    against Kafka instead of showing as lost or stray. One whose files are gone is a note too."""
    out = _ForeignRows()
    try:
        changes = foreign.foreign_changes(sink, config.name)
    except ForeignCommitError as err:
        report.notes.append(f"{err.text}; the counts of the ranges it touched cannot be explained")
        return out
    keys = rows.select([TOPIC, PARTITION, OFFSET, *[c for c in (ROW_INDEX, EPOCH_OF) if c in rows.column_names]])
    present = foreign.identities(keys.rename_columns([TOPIC_EPOCH if c == EPOCH_OF else c for c in keys.column_names]))
    for change in changes:
        report.notes.append(f"sink {change.describe()}: a commit offsetlake did not make")
        for (topic, partition, offset, _, epoch), n in change.removed.items():
            if (topic, partition, offset, _, epoch) not in present:
                out.removed.setdefault((topic, partition, epoch), []).extend([(offset, change.commit.version)] * n)
        for (topic, partition, offset, _, epoch), n in change.added.items():
            out.added.setdefault((topic, partition, epoch), []).extend([(offset, change.commit.version)] * n)
    return out


def _check_once(config: PipelineConfig, rows: pa.Table, dead: pa.Table, report: AuditReport) -> pa.Table:
    """Check 1: each (record, row index) at most once in the sink, each record at most once in
    the dead letters, no record in both (and, keyed, each key once). Returns the sink's records."""
    per_window = [WINDOW_START] if WINDOW_START in rows.column_names else []  # a record counts in each of its windows
    for label, table, columns in (("sink", rows, [*_KEY, ROW_INDEX, *per_window]), ("dead letters", dead, _KEY)):
        dupes = _duplicates(table, columns)
        for d in dupes.slice(0, _SHOW).to_pylist():
            which = f" row {d[ROW_INDEX]}" if d.get(ROW_INDEX, -1) >= 0 else ""
            report.problems.append(
                f"duplicate in {label}: {d[TOPIC]}[{d[PARTITION]}] offset {d[OFFSET]}{which} appears {d['count_all']} times"
            )
        if dupes.num_rows > _SHOW:
            report.problems.append(f"... {dupes.num_rows - _SHOW} more duplicated coordinates in {label}")
    if write_mode(config).replay is Replay.NEWEST_PER_KEY:
        _check_keys_once(config, report)
    records = rows.select(_KEY).group_by(_KEY).aggregate([])
    both = records.join(dead.select(_KEY).cast(records.schema), _KEY, join_type="inner")
    for d in both.slice(0, _SHOW).to_pylist():
        report.problems.append(f"{d[TOPIC]}[{d[PARTITION]}] offset {d[OFFSET]} is both a sink row and a dead letter")
    return records


_Span = tuple[int, int]
_TopicPartitionEpoch = tuple[str, int, int]


@dataclass
class _CommittedRanges:
    """The committed ranges per (topic, partition, epoch of the topic): every batch's, the
    covered (non-gap) spans and the recorded gaps."""

    by_tp: dict[_TopicPartitionEpoch, list[tuple[int, int, str, str]]] = field(default_factory=dict)
    covered: dict[_TopicPartitionEpoch, list[_Span]] = field(default_factory=dict)
    gaps: dict[_TopicPartitionEpoch, list[_Span]] = field(default_factory=dict)

    def current(self, spans: dict[_TopicPartitionEpoch, list[_Span]], starts: dict[str, list[int]]) -> dict[tuple[str, int], list[_Span]]:
        """``spans`` of each topic's current epoch, by (topic, partition)."""
        return {(t, p): g for (t, p, e), g in spans.items() if e == len(starts.get(t, []))}


def _committed_ranges(
    commits: list[SinkCommit], rewound: Mapping[str, SinkCommit], starts: dict[str, list[int]], report: AuditReport
) -> _CommittedRanges:
    """Check 2: committed ranges per partition (and epoch of its topic) are contiguous with no
    overlap (ingest, stream and gap batches, from the epoch commit that opened the epoch if any;
    batches a later rewind commit undid no longer count: their offsets are read again)."""
    ranges = _CommittedRanges()
    for c in commits:
        if (c.kind not in OFFSET_MOVING_KINDS and c.kind != BatchKind.EPOCH) or c.batch_id in rewound:
            continue
        for r in c.entry.ranges:
            epoch = epoch_at(starts.get(r.topic, []), c.version)
            ranges.by_tp.setdefault((r.topic, r.partition, epoch), []).append((r.start, r.end, c.batch_id, c.kind))
    for tp, spans in ranges.by_tp.items():
        spans.sort()
        previous = None
        for start, end, batch, kind in spans:
            if previous is not None and start != previous[1]:
                word = "overlap" if start < previous[1] else "gap"
                which = f" (epoch {tp[2]} of the topic)" if tp[2] else ""
                report.problems.append(
                    f"{word} in committed ranges of {tp[0]}[{tp[1]}]{which}: batch {previous[2]} ends "
                    f"at {previous[1]}, batch {batch} starts at {start}"
                )
            (ranges.gaps if kind == BatchKind.GAP else ranges.covered).setdefault(tp, []).append((start, end))
            previous = (start, end, batch)
    return ranges


def _check_inside_ranges(records: pa.Table, dead: pa.Table, covered: dict[_TopicPartitionEpoch, list[_Span]], report: AuditReport) -> None:
    """Check 3: every sink row and dead letter lies inside a committed (non-gap) range."""
    for label, table in (("sink row", records), ("dead letter", dead)):
        for (topic, partition, epoch), group in _group_offsets(table, [EPOCH_OF]).items():
            stray = _outside(group, covered.get((topic, partition, epoch), []))
            if stray:
                report.problems.append(
                    f"{len(stray)} {label}(s) of {topic}[{partition}] outside every committed range, "
                    f"e.g. offsets {', '.join(map(str, stray[:5]))}"
                )


def _check_txn_versions(
    config: PipelineConfig,
    sink: DeltaTable | None,
    commits: list[SinkCommit],
    starts: dict[str, list[int]],
    committed: set[_TopicPartitionEpoch],
    report: AuditReport,
) -> None:
    """Check 4: txn versions equal the ledger's last committed ends (of each topic's current epoch).
    The batches of an earlier sink table (a new sink.table, a sink re-created) stay in the ledger
    as history; only this table's count (invariant 16)."""
    ledger_ends: dict[tuple[str, int], int] = {}
    in_table = {c.batch_id for c in commits}
    for row in Ledger.of(config).batches_as_reconciled(commits):  # a ledger write a crash left out is not a problem
        if not BatchStatus(row["status"]).committed or (row["kind"] not in OFFSET_MOVING_KINDS and row["kind"] != BatchKind.EPOCH):
            continue
        if row["batch_id"] not in in_table:
            continue
        topic_starts = starts.get(row["topic"], [])
        if epoch_at(topic_starts, row["sink_version"] if row["sink_version"] is not None else -1) == len(topic_starts):
            key = (row["topic"], row["partition"])
            ledger_ends[key] = max(ledger_ends.get(key, -1), row["end_offset"])
    for key in sorted({(t, p) for t, p, _ in committed} | set(ledger_ends)):
        txn = committed_end(sink, config, *key)
        if txn is not None:
            report.committed[key] = txn
        if txn != ledger_ends.get(key):
            report.problems.append(
                f"{key[0]}[{key[1]}]: sink txn version is {txn} but the ledger's last committed end is "
                f"{ledger_ends.get(key)} (run `offsetlake ledger rebuild {config.name}` if the ledger was lost)"
            )


def _check_kafka(
    config: PipelineConfig,
    sink: DeltaTable | None,
    starts: dict[str, list[int]],
    records: pa.Table,
    dead: pa.Table,
    ranges: _CommittedRanges,
    report: AuditReport,
    outside: _ForeignRows,
) -> None:
    """``--against-kafka``: the current epoch's committed ranges read back from Kafka. Offsets are
    compared with records only where they mean the same records (invariant 16)."""
    check_pipeline_identity(config, sink, current_offsets(config))
    current = ranges.current(ranges.covered, starts)
    earlier = sum(e - s for (t, _, epoch), spans in ranges.covered.items() if epoch < len(starts.get(t, [])) for s, e in spans)
    replay = write_mode(config).replay
    folded = 0
    if replay is Replay.FOLD:  # folded records have no row of their own: the engine check replays them
        current, folded = _above_horizon(config, sink, current, starts)
    if replay is Replay.NEWEST_PER_KEY:
        _check_keyed_against_kafka(config, report, current, earlier, starts)
    else:
        _check_against_kafka(
            config,
            report,
            _current_epoch_only(records, starts),
            _current_epoch_only(dead, starts),
            current,
            ranges.current(ranges.gaps, starts),
            {(t, p): {o for o, _ in deleted} for (t, p, epoch), deleted in outside.removed.items() if epoch == len(starts.get(t, []))},
        )
        if replay is Replay.FOLD:
            _check_engine_against_kafka(config, report, ranges.current(ranges.covered, starts), starts)
    report.against_kafka = {**(report.against_kafka or {}), "earlier_epochs": earlier, **({"folded": folded} if folded else {})}


def _above_horizon(
    config: PipelineConfig,
    sink: DeltaTable | None,
    covered: dict[tuple[str, int], list[_Span]],
    starts: dict[str, list[int]],
) -> tuple[dict[tuple[str, int], list[_Span]], int]:
    """The committed spans of a merge engine's records that keep a contribution of their own:
    above the pinned state's horizon (``state_table.FOLDED_BELOW``). The records below it are
    counted as ``folded``; the engine check compares their groups with the replay."""
    horizon = state_table.folded_below(state_table.pinned(config, sink))
    kept: dict[tuple[str, int], list[_Span]] = {}
    folded = 0
    for (t, p), spans in covered.items():
        below = horizon.get((t, len(starts.get(t, [])), p), 0)
        folded += sum(min(e, below) - s for s, e in spans if s < below)
        kept[(t, p)] = [(max(s, below), e) for s, e in spans if e > below]
    return kept, folded


# ---- counts against the entries --------------------------------------------------------------
_WRITING_KINDS = frozenset({BatchKind.INGEST, BatchKind.STREAM, BatchKind.BACKFILL})


def _check_counts_match_entries(
    commits: list, rewound: dict, starts: dict[str, list[int]], rows: pa.Table, dead: pa.Table, report: AuditReport, outside: _ForeignRows
) -> None:
    """Per batch and range, the sink rows and dead letters a scan finds equal the ``rows_written``
    and ``dead_letters`` its entry recorded — for every range no later commit replaced in part
    (a backfill replaces its range; a backfill by record time only the rows in its window, so a
    range it touched is not checked, nor is that backfill's). This is how a committed file that
    lost rows after its task counted them shows without Kafka (issue 35, finding 1). Rows are
    counted in the topic epoch of the commit (``offsetlake.topic_epochs``). Rows a commit offsetlake
    did not make deleted or added (``outside``) are counted back: a GDPR delete is explained, not lost."""
    writes = [c for c in sorted(commits, key=lambda c: c.version) if c.kind in _WRITING_KINDS and c.batch_id not in rewound]
    seen = {label: _group_offsets(table, [EPOCH_OF]) for label, table in (("rows_written", rows), ("dead_letters", dead))}
    for i, commit in enumerate(writes):
        later = [(r.topic, r.partition, r.start, r.end) for c in writes[i + 1 :] if c.kind == BatchKind.BACKFILL for r in c.entry.ranges]
        if commit.entry.record_time is not None:
            continue
        for r in commit.entry.ranges:
            tp = (r.topic, r.partition)
            if any((t, p) == tp and s < r.end and e > r.start for t, p, s, e in later):
                continue
            epoch = epoch_at(starts.get(tp[0], []), commit.version)
            for label, counted in seen.items():
                said = r.count(label)
                if said is None:
                    continue
                offsets = np.sort(counted.get((*tp, epoch), np.array([], np.int64)))
                found = int(np.searchsorted(offsets, r.end) - np.searchsorted(offsets, r.start))
                if label == "rows_written":
                    key = (*tp, epoch)
                    found += outside.count("removed", key, r.start, r.end, commit.version)
                    found -= outside.count("added", key, r.start, r.end, commit.version)
                if found != said:
                    what = "sink rows" if label == "rows_written" else "dead letters"
                    report.problems.append(
                        f"{tp[0]}[{tp[1]}] [{r.start}, {r.end}) of batch {commit.batch_id}: the ledger says "
                        f"{said} {what} were written, the {'sink' if label == 'rows_written' else 'dead-letter table'} "
                        f"holds {found}"
                    )


class DeltaSinkAudit(SinkAudit):
    @classmethod
    def run(cls, config: PipelineConfig, against_kafka: bool) -> AuditReport:
        return audit_delta_sink(config, against_kafka)


DeltaSinkKind.provides(AUDIT, DeltaSinkAudit)
