"""An independent check that the sink is exactly once and agrees with its ledger — and with Kafka.

``audit_pipeline`` reads only Delta (sink, dead letters, ledger) through delta-rs and pyarrow,
so it is a quick check on a laptop. Exactly once is checked per source record and per row: a
record is a sink row (or, with a transform, rows — each ``(record, _kafka_row)`` once) or a
dead letter, never both, never twice; committed ranges are contiguous; every row and dead letter
lies in a committed range; each batch's range holds the rows and dead letters its entry says it
wrote (append sinks); the sink's txn versions equal the ledger's ends. Dead-letter changes a
crash left pending after their sink commit are counted as the next run will apply them.

``against_kafka=True`` also reads the committed ranges back from Kafka with its own
read_committed consumer and checks that every committed record Kafka still holds is in exactly
one of the sink, the dead letters or a recorded gap, and that nothing else is: a row or dead
letter at an offset Kafka does not serve (an aborted record, a transaction marker) is a problem,
and so is a record in neither table. Offsets past retention are reported, not checked. With a
transform, a record without rows may have been filtered on purpose: those records (only those)
are decoded and transformed again on Spark, and the ones that do give rows are lost.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from offsetlake import dead_letters, foreign
from offsetlake.config import PipelineConfig
from offsetlake.config.models import duration_seconds
from offsetlake.config.sink_kinds import sink_kind
from offsetlake.coordinates import OFFSET, PARTITION, RECORD_KEY, ROW_INDEX, TIMESTAMP, TOPIC, TOPIC_EPOCH
from offsetlake.engine_replay import replay
from offsetlake.engines import CONTRIBUTION, WINDOW_START, group_columns
from offsetlake.errors import ForeignCommitError
from offsetlake.history import SinkCommit, epoch_at, epoch_starts, refuse_foreign_sink, rewound_batches, sink_commits
from offsetlake.kafka import current_offsets, read_range
from offsetlake.kafka_commit import commit_log_ends, group_offsets, kafka_sink_commits, read_committed_headers
from offsetlake.keyed import DELETED, HIDDEN, current_rows
from offsetlake.ledger import Ledger
from offsetlake.plan import OFFSET_MOVING_KINDS, BatchKind, BatchStatus
from offsetlake.sink import committed_end, open_table, sink_columns, table_schema
from offsetlake.topic_epochs import check_pipeline_identity

if TYPE_CHECKING:
    from deltalake import DeltaTable

_COORDS = list(RECORD_KEY)
EPOCH_OF = "_topic_epoch"  # the audit's own column: which epoch of its topic a row's record belongs to
_KEY = [*_COORDS, EPOCH_OF]
_SHOW = 10


@dataclass
class AuditReport:
    pipeline: str
    rows: int = 0  # rows readers see (an upsert sink's hidden state rows are not among them)
    dead_letters: int = 0
    hidden_rows: int = 0  # an upsert sink's delete markers and superseded records (``keyed.HIDDEN``)
    hidden_kind: str = "delete markers, superseded records"  # what the hidden rows are, for the text
    problems: list[str] = field(default_factory=list)
    committed: dict[tuple[str, int], int] = field(default_factory=dict)
    against_kafka: dict | None = None  # what the Kafka check read and found
    sink_topic: str | None = None  # a Kafka sink: what was read back (``audit_kafka_sink``)
    notes: list[str] = field(default_factory=list)  # found and said, but nothing is wrong (a group offset restored next run)

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        head = (
            f"audit of pipeline {self.pipeline}: {self.rows} sink rows, {self.dead_letters} dead letters, "
            f"{len(self.committed)} partitions committed"
        ) + (f"; {self.hidden_rows} hidden state rows ({self.hidden_kind})" if self.hidden_rows else "")
        kafka = ""
        if self.against_kafka is not None:
            k = self.against_kafka
            kafka = (
                (
                    f"\nagainst Kafka: {k['records']} committed records read back and replayed by key: {k['keys']} keys "
                    f"with a row ({k['rows_checked']} rows compared with their key's newest record), {k['deleted_keys']} deleted; "
                    f"{k['past_retention']} committed offsets are past retention (not checked)"
                )
                if "keys" in k
                else (
                    f"\nagainst Kafka: {k['records']} committed records read back, {k['in_sink']} in the sink, "
                    f"{k['dead_letters']} dead letters, {k['in_gaps']} in recorded gaps, {k['filtered']} filtered by "
                    f"the transform, {k.get('deleted_by_others', 0)} deleted by commits offsetlake did not make; "
                    f"{k['past_retention']} committed offsets are past retention (not checked)"
                )
            )
            if "groups" in k:
                kafka += (
                    "; the merge engine's rows not compared with a replay (records past retention or of an earlier epoch)"
                    if k.get("groups_skipped")
                    else f"; {k['groups_checked']} of {k['groups']} groups compared with the record-by-record replay of their records"
                )
            if k.get("earlier_epochs"):
                kafka += (
                    f"; {k['earlier_epochs']} committed offsets belong to earlier epochs of a re-created topic "
                    "(their records are gone from Kafka: not checked)"
                )
        if self.ok and self.sink_topic is not None:
            ends = ", ".join(f"{t}[{p}]→{e}" for (t, p), e in sorted(self.committed.items()))
            return (
                f"audit of pipeline {self.pipeline}: {self.rows} records in {self.sink_topic}, {self.dead_letters} dead letters, "
                f"read back read_committed\nOK: the commit log's ranges follow each other, every record "
                f"belongs to a committed batch with the counts its entry gives, no source record in two batches, the ledger "
                f"holds every commit\ncommitted ends (commit log): {ends}{self._notes()}"
            )
        if self.ok:
            ends = ", ".join(f"{t}[{p}]→{e}" for (t, p), e in sorted(self.committed.items()))
            return (
                f"{head}\nOK: no duplicates, ranges contiguous, every row inside a committed range, "
                f"txn versions match the ledger{kafka}\ncommitted ends: {ends}{self._notes()}"
            )
        failed = f"{head}\nFAILED ({len(self.problems)} problems):\n" + "\n".join(f"  - {p}" for p in self.problems)
        return failed + kafka + self._notes()

    def _notes(self) -> str:
        return "".join(f"\nnote: {n}" for n in self.notes)


def _sink_keys(config: PipelineConfig) -> pa.Table:
    """Coordinates (and ``_kafka_row`` where the sink has it, -1 for rows without one) of every row,
    with the epoch of its topic its record belongs to (``EPOCH_OF``): the row's own
    ``coordinates.TOPIC_EPOCH`` (null or absent: epoch 0), which compaction and rewrites keep, so
    rows of a re-created topic's old records never stand for its new ones (invariant 16)."""
    table = open_table(config.layout.sink)
    if table is None:
        return pa.table(
            {
                TOPIC: pa.array([], pa.string()),
                PARTITION: pa.array([], pa.int32()),
                OFFSET: pa.array([], pa.int64()),
                EPOCH_OF: pa.array([], pa.int32()),
                ROW_INDEX: pa.array([], pa.int32()),
            }
        )
    names = table_schema(table).names
    extra = [c for c in (ROW_INDEX, TOPIC_EPOCH) if c in names]
    engine = config.sink.engine is not None and HIDDEN in names
    if engine:  # an engine sink's records are its contribution rows (one per window)
        extra += [c for c in (WINDOW_START,) if c in names]
    only = pc.field(HIDDEN) == CONTRIBUTION if engine else None
    data = table.to_pyarrow_dataset().to_table(columns=[*_COORDS, *extra], filter=only)
    index = pc.fill_null(data[ROW_INDEX], -1) if ROW_INDEX in names else pa.array(np.full(data.num_rows, -1), pa.int32())
    epochs = pc.fill_null(data[TOPIC_EPOCH], 0) if TOPIC_EPOCH in names else pa.array(np.zeros(data.num_rows, np.int32), pa.int32())
    keys = data.select(_COORDS).append_column(EPOCH_OF, epochs.cast(pa.int32())).append_column(ROW_INDEX, index.cast(pa.int32()))
    return keys.append_column(WINDOW_START, data[WINDOW_START]) if engine and WINDOW_START in names else keys


def _with_epochs(table: pa.Table, starts: dict[str, list[int]], commits: list) -> pa.Table:
    """Dead letters (with ``batch_id``) with the epoch column: the epoch of the commit of the batch
    that wrote each (``offsetlake.history.epoch_at``), without ``batch_id``."""
    epochs = np.zeros(table.num_rows, np.int32)
    if starts:
        version_of = {c.batch_id: c.version for c in commits}
        for i, (topic, batch) in enumerate(zip(table[TOPIC].to_pylist(), table["batch_id"].to_pylist(), strict=True)):
            if topic in starts:
                epochs[i] = epoch_at(starts[topic], version_of.get(batch, -1))
    return table.drop_columns(["batch_id"]).append_column(EPOCH_OF, pa.array(epochs, pa.int32()))


def _current_epoch_only(table: pa.Table, starts: dict[str, list[int]]) -> pa.Table:
    """The rows of ``table`` whose record belongs to its topic's current epoch, without the epoch column."""
    current = pa.array([len(starts.get(t, [])) for t in table[TOPIC].to_pylist()], pa.int32())
    return table.filter(pc.equal(table[EPOCH_OF], current)).drop_columns([EPOCH_OF])


def _duplicates(keys: pa.Table, columns: list[str]) -> pa.Table:
    counted = keys.group_by(columns).aggregate([([], "count_all")])
    return counted.filter(pc.field("count_all") > 1)


def audit_pipeline(config: PipelineConfig, against_kafka: bool = False) -> AuditReport:
    """The independent check (``offsetlake audit``): reads the sink, its history, the dead letters
    and the ledger (and Kafka with ``against_kafka``) and reports every problem it finds; it
    changes nothing. Each kind of sink has its audit: a Delta table's (``audit_delta_sink``), a
    Kafka topic read back from its topics (``audit_kafka_sink``)."""
    return _AUDITS[sink_kind(config).name](config, against_kafka)


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
    if config.sink.mode == "upsert" and sink is not None:
        report.hidden_rows = rows.num_rows - current_rows(sink, [TOPIC]).num_rows
        report.rows -= report.hidden_rows
    if config.sink.engine is not None and sink is not None:  # rows counts the contributions
        report.rows = current_rows(sink, [HIDDEN]).num_rows
        report.hidden_rows = sink.to_pyarrow_dataset().count_rows() - report.rows
        report.hidden_kind = f"the {config.sink.mode} state: a contribution per record and window"
    records = _check_once(config, rows, dead, report)
    rewound = rewound_batches(commits)
    ranges = _committed_ranges(commits, rewound, starts, report)
    _check_inside_ranges(records, dead, ranges.covered, report)
    _check_txn_versions(config, sink, commits, starts, set(ranges.by_tp), report)
    outside = _foreign_commits(config, sink, rows, report)
    if config.sink.mode == "append":
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
    if config.sink.mode == "upsert":
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
    if config.sink.mode == "upsert":
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
        if config.sink.engine is not None:
            _check_engine_against_kafka(config, report, current, starts)
    report.against_kafka = {**(report.against_kafka or {}), "earlier_epochs": earlier}


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


# ---- keyed sinks --------------------------------------------------------------------------------
def _check_keys_once(config: PipelineConfig, report: AuditReport) -> None:
    """A keyed sink shows each key at most once, and holds at most one state row (visible or
    hidden, ``offsetlake.keyed``) per key and topic-partition."""
    table = open_table(config.layout.sink)
    if table is None:
        return
    key = config.sink.key
    checks = [(current_rows(table, key), key, "rows in the keyed sink")]
    if HIDDEN in table_schema(table).names:
        checks.append(
            (
                table.to_pyarrow_dataset().to_table(columns=[*key, TOPIC, PARTITION]),
                [*key, TOPIC, PARTITION],
                "state rows in the keyed sink",
            )
        )
    for keys, columns, what in checks:
        dupes = _duplicates(keys, columns)
        for d in dupes.slice(0, _SHOW).to_pylist():
            shown = ", ".join(f"{c}={d[c]!r}" for c in key)
            where = f" from {d[TOPIC]}[{d[PARTITION]}]" if TOPIC in columns else ""
            report.problems.append(f"key {shown} has {d['count_all']} {what}{where}")
        if dupes.num_rows > _SHOW:
            report.problems.append(f"... {dupes.num_rows - _SHOW} more keys with several {what}")


def _check_keyed_against_kafka(
    config: PipelineConfig,
    report: AuditReport,
    covered: dict[tuple[str, int], list[tuple[int, int]]],
    earlier_epochs: int = 0,
    starts: dict[str, list[int]] | None = None,
) -> None:
    """Each key's row is the newest record of that key up to the committed ends, and a key whose
    newest record is a delete has no row: the committed records are read back with a plain
    consumer, decoded as the pipeline decodes them, and replayed here by the ordering rule
    (``offsetlake.keyed``), written out again on purpose rather than reusing the merge's code.
    Records of a re-created topic's earlier epochs are gone from Kafka: the sink's state rows of
    those epochs (visible or hidden; a ``deleted`` one is a delete) are their only witness, so
    they join the replay as the key's last records of their topic-partition in that epoch."""
    found = {"records": 0, "keys": 0, "rows_checked": 0, "deleted_keys": 0, "past_retention": 0}
    report.against_kafka = found
    chunks, unreadable = _read_committed(config, covered, found, report)
    sink = open_table(config.layout.sink)
    actual: dict[tuple, list[dict]] = {}
    for r in current_rows(sink).to_pylist() if sink is not None else []:
        actual.setdefault(_key_of(r, config.sink.key), []).append(r)
    expected = _replayed(config, sink, chunks, unreadable, {t: len(v) for t, v in (starts or {}).items()}) if chunks else {}
    deleted = {k for k, r in expected.items() if r is None}
    found["deleted_keys"] = len(deleted)
    found["keys"] = len(expected) - len(deleted)
    wrong = [problem for key, row in expected.items() for problem in _key_problems(config, key, row, actual.get(key), found)]
    # with records past retention or of a topic's earlier epoch, a row's record may be gone from Kafka
    if not found["past_retention"] and not earlier_epochs:
        for key in actual:
            if key not in expected:
                wrong.append(f"key {_shown(config, key)} has a row but no committed record of it is in Kafka")
    report.problems.extend(wrong[:_SHOW])
    if len(wrong) > _SHOW:
        report.problems.append(f"... {len(wrong) - _SHOW} more keys whose row is not their newest record")


def _check_engine_against_kafka(
    config: PipelineConfig,
    report: AuditReport,
    covered: dict[tuple[str, int], list[tuple[int, int]]],
    starts: dict[str, list[int]],
) -> None:
    """Every visible row of a merge engine's sink equals the replay, record by record, of the
    committed records read back from Kafka, decoded and transformed as the pipeline does
    (``offsetlake.engine_replay``, which shares no code with the merge): every group, every
    output column. Only while every committed record is still in Kafka and the topics were never
    re-created: otherwise the groups cannot be recomputed from Kafka, and the check says so."""
    read = {"records": 0, "past_retention": 0}
    found = {"groups": 0, "groups_checked": 0}
    if report.against_kafka is not None:
        report.against_kafka.update(found)
        found = report.against_kafka
    chunks, unreadable = _read_committed(config, covered, read, report)
    if unreadable or any(starts.values()):  # records gone from Kafka (retention, an earlier epoch of a topic)
        found["groups_skipped"] = 1
        return
    sink = open_table(config.layout.sink)
    current = {t: len(v) for t, v in starts.items()}
    rows = [r for r in _decoded_rows(config, sink, chunks, current) if _engine_takes(config, r)] if chunks else []
    expected = replay(config, rows)
    group = group_columns(config)
    actual = {tuple(r[c] for c in group): r for r in current_rows(sink).to_pylist()} if sink is not None else {}
    found["groups"] = len(expected)
    outputs = [m.name for m in config.sink.aggregates()] if config.sink.mode == "aggregate" else None
    wrong = []
    for key in sorted(set(expected) | set(actual), key=repr):
        want, got = expected.get(key), actual.get(key)
        if want is None or got is None:
            wrong.append(f"group {key!r}: {'no visible row' if got is None else 'a visible row no committed record makes'}")
            continue
        found["groups_checked"] += 1
        for column in outputs or list(want):
            if not _close(want.get(column), got.get(column)):
                wrong.append(f"group {key!r}: {column} is {got.get(column)!r}, the replay of its records gives {want.get(column)!r}")
                break
    report.problems.extend(wrong[:_SHOW])
    if len(wrong) > _SHOW:
        report.problems.append(f"... {len(wrong) - _SHOW} more groups that differ from the replay")


def _engine_takes(config: PipelineConfig, row: dict) -> bool:
    """Whether a decoded row reaches the engine (not a dead letter for its key or window)."""
    from datetime import datetime

    if any(row.get(c) is None for c in config.sink.key):
        return False
    window = config.sink.window
    if window is None:
        return True
    at = row.get(window.on)
    if at is None:
        return False
    if config.sink.allowed_lateness is not None and isinstance(row.get(TIMESTAMP), datetime):
        return (row[TIMESTAMP] - at).total_seconds() <= duration_seconds(config.sink.allowed_lateness)
    return True


def _close(want: object, got: object) -> bool:
    """Equal, floats within the rounding a different summation order gives."""
    import math

    if isinstance(want, float) and isinstance(got, float):
        return math.isclose(want, got, rel_tol=1e-9, abs_tol=1e-9) or _same(want, got)
    return want == got


def _read_committed(
    config: PipelineConfig, covered: dict[tuple[str, int], list[tuple[int, int]]], found: dict[str, int], report: AuditReport
) -> tuple[list[tuple[str, int, list]], dict[tuple[str, int], int]]:
    """The committed records Kafka still holds, in chunks per topic-partition, and the log start
    of each topic-partition where committed offsets lie below it (retention took them)."""
    offsets = current_offsets(config)
    client = config.kafka_client_config()
    chunks: list[tuple[str, int, list]] = []
    unreadable: dict[tuple[str, int], int] = {}
    for (topic, partition), spans in sorted(covered.items()):
        if (topic, partition) not in offsets:
            report.problems.append(f"{topic}[{partition}] has committed ranges but is not a partition of {config.topic_label} any more")
            continue
        log_start = offsets[(topic, partition)].log_start
        if spans and min(start for start, _ in spans) < log_start:
            unreadable[(topic, partition)] = log_start
        for start, end in _retained(spans, log_start, found):
            for chunk in read_range(client, config.name, topic, partition, start, end, config.read_timeout_seconds):
                chunks.append((topic, partition, list(chunk)))
                found["records"] += len(chunk)
    return chunks, unreadable


def _replayed(
    config: PipelineConfig,
    sink: DeltaTable | None,
    chunks: list[tuple[str, int, list]],
    unreadable: dict[tuple[str, int], int],
    current: dict[str, int],
) -> dict[tuple, dict | None]:
    """Each key's newest record (None: a delete), from the records read back, decoded and
    transformed as the pipeline does, plus the sink's state where Kafka no longer has the records."""
    from offsetlake.formats import CHANGE, DELETE

    readable = _decoded_rows(config, sink, chunks, current)
    readable += _unreadable_state(sink, config.sink.key, readable, unreadable, CHANGE, DELETE, current)
    return _newest_by_key(readable + _earlier_epoch_states(sink, current), config.sink.key, CHANGE, DELETE)


def _decoded_rows(
    config: PipelineConfig, sink: DeltaTable | None, chunks: list[tuple[str, int, list]], current: dict[str, int]
) -> list[dict]:
    """The rows of the records read back, decoded and transformed as the pipeline does (a delete
    with ``CHANGE``), each with its topic's current epoch."""
    from pyspark.sql import functions as F

    from offsetlake.formats import REASON, decoder_for, good_rows
    from offsetlake.keyed import mark_tombstones
    from offsetlake.reader import raw_dataframe
    from offsetlake.spark import spark_session
    from offsetlake.transform import apply_transform, number_rows_per_record

    decoder = decoder_for(config, sink_columns=sink_columns(sink))
    decoded = decoder.decode_in_spark(raw_dataframe(spark_session(), chunks, decoder, max_record_bytes=config.max_record_bytes))
    decoded = decoded.withColumn(REASON, F.coalesce(F.col("read_problem"), F.col(REASON)))
    if config.sink.deletes:
        decoded = mark_tombstones(decoded)
    rows = apply_transform(good_rows(decoded, decoder), config)
    if config.transform and config.sink.engine is not None:
        rows = number_rows_per_record(rows)
    return [{**r, TOPIC_EPOCH: current.get(r[TOPIC], 0)} for r in rows.toArrow().to_pylist()]


def _shown(config: PipelineConfig, key: tuple) -> str:
    return ", ".join(f"{c}={v!r}" for c, v in zip(config.sink.key, key, strict=True))


def _key_problems(config: PipelineConfig, key: tuple, row: dict | None, have_rows: list[dict] | None, found: dict[str, int]) -> list[str]:
    """What is wrong with one key's rows (``have_rows``) given its newest record (``row``; None:
    deleted)."""
    from offsetlake.formats import CHANGE

    shown = _shown(config, key)
    if row is None:
        return [
            f"key {shown} was deleted by its newest record but has a row (from {have[TOPIC]}[{have[PARTITION]}] offset {have[OFFSET]})"
            for have in have_rows or []
        ]
    if not have_rows:
        return [f"key {shown} has no row; its newest record is {row[TOPIC]}[{row[PARTITION]}] offset {row[OFFSET]}"]
    problems = []
    for have in have_rows:
        found["rows_checked"] += 1
        # a row written before a column was added reads null there: only values it holds compare
        differs = [c for c in row if c in have and c not in (CHANGE, HIDDEN, TOPIC_EPOCH) and not _holds(have[c], row[c])]
        if _record_of(have) != _record_of(row):
            differs.insert(0, "its record")
        if differs:
            problems.append(
                f"key {shown}: a row differs from its newest record {row[TOPIC]}[{row[PARTITION]}] offset "
                f"{row[OFFSET]} in {', '.join(differs[:5])} (row from {have[TOPIC]}[{have[PARTITION]}] offset "
                f"{have[OFFSET]})"
            )
    return problems


def _unreadable_state(
    sink: DeltaTable | None,
    key: list[str],
    readable: list[dict],
    unreadable: dict[tuple[str, int], int],
    change: str,
    delete: str,
    current: dict[str, int],
) -> list[dict]:
    """The sink's state rows (``offsetlake.keyed``: a key's last record per topic-partition,
    delete markers included) that Kafka can no longer show: in a topic-partition whose committed
    offsets start below its log start, for a key with no record read back from it, at an offset
    below the log start. A key's newest record may be one retention took (a record of another
    topic-partition it wins over by time is still in Kafka); its state row is then the only
    account of it, so the replay takes it as it is — unchecked, like the offsets past retention —
    rather than call the key's row wrong. A state row at or past the log start has its record in
    Kafka and is never taken on trust. Only rows of their topic's ``current`` epoch: those of an
    earlier epoch are replayed by ``_earlier_epoch_states``."""
    if sink is None or not unreadable:
        return []
    seen = {(_key_of(r, key), r[TOPIC], r[PARTITION]) for r in readable}
    state = []
    below = None  # only rows under some topic-partition's log start are read into Python
    for (topic, partition), log_start in unreadable.items():
        term = (pc.field(TOPIC) == topic) & (pc.field(PARTITION) == partition) & (pc.field(OFFSET) < log_start)
        below = term if below is None else below | term
    for r in sink.to_pyarrow_dataset().to_table(filter=below).to_pylist():
        tp = (r[TOPIC], r[PARTITION])
        if (r.get(TOPIC_EPOCH) or 0) != current.get(r[TOPIC], 0):
            continue
        if tp in unreadable and r[OFFSET] < unreadable[tp] and (_key_of(r, key), *tp) not in seen:
            hidden = r.pop(HIDDEN, None)
            state.append({**r, change: delete if hidden == DELETED else None})
    return state


def _earlier_epoch_states(sink: DeltaTable | None, current: dict[str, int]) -> list[dict]:
    """The sink's state rows (hidden ones too) of topic epochs before their topic's current one,
    as replayed records: a ``deleted`` state row as a delete (``CHANGE``), every other as an upsert."""
    from offsetlake.formats import CHANGE, DELETE, UPSERT

    if sink is None or not current or TOPIC_EPOCH not in table_schema(sink).names:
        return []
    older = None
    for topic, epoch in current.items():
        term = (pc.field(TOPIC) == topic) & (pc.coalesce(pc.field(TOPIC_EPOCH), pa.scalar(0, pa.int32())) < epoch)
        older = term if older is None else older | term
    rows = sink.to_pyarrow_dataset().to_table(filter=older).to_pylist()
    return [{**r, TOPIC_EPOCH: r[TOPIC_EPOCH] or 0, CHANGE: DELETE if r.get(HIDDEN) == DELETED else UPSERT} for r in rows]


def _record_of(row: dict) -> tuple:
    """Which record a row is: its coordinates and its topic epoch (null: 0)."""
    return row[TOPIC], row[PARTITION], row.get(TOPIC_EPOCH) or 0, row[OFFSET]


def _holds(stored: object, decoded: object) -> bool:
    """Whether a sink value agrees with today's decoding of its record: null in the sink (written
    before the column or nested field was added), or equal, where structs compare only the fields
    both have (a nested field today's schema dropped stays in the sink, invariant 12) and arrays
    and maps (lists of key/value pairs) compare item by item."""
    if stored is None:
        return True
    if isinstance(stored, dict) and isinstance(decoded, dict):
        return all(_holds(stored[name], decoded[name]) for name in stored.keys() & decoded.keys())
    if isinstance(stored, list | tuple) and isinstance(decoded, list | tuple):
        return len(stored) == len(decoded) and all(_holds(a, b) for a, b in zip(stored, decoded, strict=True))
    return _same(stored, decoded)


def _newest_by_key(rows: list[dict], key: list[str], change: str, delete: str) -> dict[tuple, dict | None]:
    """Each key's newest row (None: its newest record deletes it): the last per topic-partition
    by (topic epoch, offset, row index), then across topic-partitions by (timestamp, topic,
    partition, epoch, offset)."""
    last: dict[tuple, dict] = {}
    for r in rows:
        k = _key_of(r, key)
        if any(v is None for v in k):
            continue
        at = (k, r[TOPIC], r[PARTITION])
        seen = last.get(at)
        if seen is None or (
            (r.get(TOPIC_EPOCH) or 0, r[OFFSET], r.get(ROW_INDEX) or 0)
            > (seen.get(TOPIC_EPOCH) or 0, seen[OFFSET], seen.get(ROW_INDEX) or 0)
        ):
            last[at] = r
    newest: dict[tuple, dict] = {}
    for (k, _, _), r in last.items():
        seen = newest.get(k)
        if seen is None or _order(r) > _order(seen):
            newest[k] = r
    return {k: (None if r.get(change) == delete else r) for k, r in newest.items()}


class _NaN:
    """The one stand-in for a NaN key value: NaN != NaN, so a dict keyed by it finds nothing
    (issue 35, finding 10), while Spark's joins and groupings, and so the merge, take NaNs as equal."""

    def __repr__(self) -> str:
        return "nan"


_NAN = _NaN()


def _key_of(row: dict, key: list[str]) -> tuple:
    """A row's key as a dict key: NaN values as ``_NAN``."""
    return tuple(_NAN if isinstance(v, float) and v != v else v for v in (row[c] for c in key))


def _same(a: object, b: object) -> bool:
    """Equal values, a NaN equal to a NaN."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def _order(row: dict) -> tuple:
    from datetime import datetime

    stamp = row.get("_kafka_timestamp")
    return (
        stamp.timestamp() if isinstance(stamp, datetime) else float("-inf"),
        row[TOPIC],
        row[PARTITION],
        row.get(TOPIC_EPOCH) or 0,
        row[OFFSET],
    )


# ---- against Kafka ----------------------------------------------------------------------------
def _check_against_kafka(
    config: PipelineConfig,
    report: AuditReport,
    records: pa.Table,
    dead: pa.Table,
    covered: dict[tuple[str, int], list[tuple[int, int]]],
    gaps: dict[tuple[str, int], list[tuple[int, int]]],
    deleted: dict[tuple[str, int], set[int]],
) -> None:
    """Every committed record Kafka still holds is in exactly one of sink, dead letters or a gap,
    or its rows were deleted by a commit offsetlake did not make (``deleted``: counted, not lost)."""
    found = {"records": 0, "in_sink": 0, "dead_letters": 0, "in_gaps": 0, "filtered": 0, "past_retention": 0, "deleted_by_others": 0}
    report.against_kafka = found
    offsets = current_offsets(config)
    in_sink = _group_offsets(records)
    in_dead = _group_offsets(dead)
    unaccounted: list[tuple[str, int, list]] = []  # (topic, partition, raw messages) of records in neither table
    client = config.kafka_client_config()
    for (topic, partition), spans in sorted(covered.items()):
        if (topic, partition) not in offsets:
            report.problems.append(f"{topic}[{partition}] has committed ranges but is not a partition of {config.topic_label} any more")
            continue
        log_start = offsets[(topic, partition)].log_start
        sink_set = set(in_sink.get((topic, partition), np.array([], np.int64)).tolist())
        dead_set = set(in_dead.get((topic, partition), np.array([], np.int64)).tolist())
        served: set[int] = set()
        missing: list = []
        # one read per run of adjacent ranges: a read that ends on a transaction marker waits
        # for the consumer's poll timeout, so reading range by range got slower with every batch
        for start, end in _retained(spans, log_start, found):
            for chunk in read_range(client, config.name, topic, partition, start, end, config.read_timeout_seconds):
                for message in chunk:
                    offset = int(message.offset() or 0)  # always set on a consumed record
                    served.add(offset)
                    as_row, as_dead = offset in sink_set, offset in dead_set
                    if as_row:
                        found["in_sink"] += 1
                    if as_dead:
                        found["dead_letters"] += 1
                    if not as_row and not as_dead:
                        if offset in deleted.get((topic, partition), ()):
                            found["deleted_by_others"] += 1
                        else:
                            missing.append(message)
        found["records"] += len(served)
        retained = [(max(s, log_start), e) for s, e in _merged(spans) if e > log_start]
        phantoms = sorted(o for o in sink_set | dead_set if _inside(o, retained) and o not in served)
        if phantoms:
            report.problems.append(
                f"{len(phantoms)} rows or dead letters of {topic}[{partition}] are at offsets Kafka does not serve to "
                f"read_committed (aborted records or transaction markers), e.g. {phantoms[:5]}"
            )
        for start, end in gaps.get((topic, partition), []):
            found["in_gaps"] += max(0, end - max(start, log_start)) if end > log_start else 0
        if missing:
            unaccounted.append((topic, partition, missing))
    lost = _lost_records(config, unaccounted, found)
    for topic, partition, offsets_lost in lost:
        report.problems.append(
            f"{len(offsets_lost)} committed records of {topic}[{partition}] that Kafka holds are in neither the sink "
            f"nor the dead letters nor a recorded gap, e.g. offsets {offsets_lost[:5]}"
        )


def _lost_records(config: PipelineConfig, unaccounted: list[tuple[str, int, list]], found: dict) -> list[tuple[str, int, list[int]]]:
    """The records of ``unaccounted`` that should have become rows or dead letters: all of them
    without a transform; with one, those its decode + transform still turn into rows or dead letters."""
    if not unaccounted:
        return []
    if not config.transform:
        return [(t, p, sorted(m.offset() for m in messages)) for t, p, messages in unaccounted]
    from pyspark.sql import functions as F

    from offsetlake.formats import REASON, decoder_for, good_rows
    from offsetlake.reader import raw_dataframe
    from offsetlake.spark import spark_session
    from offsetlake.transform import apply_transform

    spark = spark_session()
    decoder = decoder_for(config, sink_columns=sink_columns(open_table(config.layout.sink)))
    decoded = decoder.decode_in_spark(raw_dataframe(spark, unaccounted, decoder, max_record_bytes=config.max_record_bytes))
    decoded = decoded.withColumn(REASON, F.coalesce(F.col("read_problem"), F.col(REASON))).persist()
    should_be_dead = {
        (r["topic"], r["partition"], r["offset"])
        for r in decoded.where(F.col(REASON).isNotNull()).select("topic", "partition", "offset").collect()
    }
    with_rows = {
        (r[TOPIC], r[PARTITION], r[OFFSET])
        for r in apply_transform(good_rows(decoded, decoder), config).select(TOPIC, PARTITION, OFFSET).distinct().collect()
    }
    decoded.unpersist()
    lost = []
    for topic, partition, messages in unaccounted:
        offsets = sorted(m.offset() for m in messages if (topic, partition, m.offset()) in should_be_dead | with_rows)
        found["filtered"] += len(messages) - len(offsets)
        if offsets:
            lost.append((topic, partition, offsets))
    return lost


def _retained(spans: list[tuple[int, int]], log_start: int, found: dict) -> list[tuple[int, int]]:
    """``spans`` merged (one read per run of adjacent ranges) and cut at the log start; the offsets
    cut off are counted in ``found["past_retention"]`` (reported, not checked)."""
    out = []
    for start, end in _merged(spans):
        if end <= log_start:
            found["past_retention"] += end - start
            continue
        if start < log_start:
            found["past_retention"] += log_start - start
            start = log_start
        out.append((start, end))
    return out


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges with adjacent or overlapping ones joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _inside(offset: int, spans: list[tuple[int, int]]) -> bool:
    return any(s <= offset < e for s, e in spans)


def _outside(offsets: np.ndarray, spans: list[tuple[int, int]]) -> list[int]:
    if not spans:
        return offsets.tolist()
    spans = sorted(spans)
    starts = np.array([s for s, _ in spans])
    ends = np.array([e for _, e in spans])
    index = np.searchsorted(starts, offsets, side="right") - 1
    inside = (index >= 0) & (offsets < ends[np.clip(index, 0, None)])
    return offsets[~inside].tolist()


def _group_offsets(table: pa.Table, more: list[str] | None = None) -> dict[tuple, np.ndarray]:
    """Offsets of ``table`` per (topic, partition, *more)."""
    if table.num_rows == 0:
        return {}
    columns = [TOPIC, PARTITION, *(more or [])]
    out: dict[tuple, np.ndarray] = {}
    for key in table.group_by(columns).aggregate([]).to_pylist():
        mask = pc.and_(pc.equal(table[TOPIC], key[TOPIC]), pc.equal(table[PARTITION], key[PARTITION]))
        for column in more or []:
            mask = pc.and_(mask, pc.equal(table[column], key[column]))
        out[tuple(key[c] for c in columns)] = table.filter(mask)[OFFSET].to_numpy()
    return out


def audit_kafka_sink(config: PipelineConfig, against_kafka: bool = True) -> AuditReport:
    """A Kafka sink read back as its consumers read it (read_committed), against its commit log,
    its group's offsets and the ledger: the commit log's ranges follow each other from the start
    to the committed ends (nothing skipped or read twice); every visible record belongs to a
    committed batch (an aborted one shows nothing), each batch shows exactly the rows and dead
    letters its entry counts, and no source record is in two forward batches; the ledger holds
    every commit. It always reads Kafka: ``against_kafka`` is the Delta audit's choice."""
    report = AuditReport(config.name, sink_topic=config.sink.topic)
    commits = kafka_sink_commits(config)
    keys = sorted(current_offsets(config))
    ends = commit_log_ends(commits, keys)
    report.committed = {k: v for k, v in ends.items() if v is not None}
    report.problems += _commit_log_coverage(commits)
    expected = {c.batch_id: c for c in commits}
    seen_rows: dict[str, int] = {}
    seen_dead: dict[str, int] = {}
    owner: dict[tuple[str, int, int], str] = {}
    client = config.kafka_client_config()
    assert config.sink.topic is not None
    for topic, counts in ((config.sink.topic, seen_rows), (config.sink.dead_letters_to, seen_dead)):
        for headers in read_committed_headers(client, topic, config.name):
            batch = headers.get("offsetlake.batch", b"").decode()
            counts[batch] = counts.get(batch, 0) + 1
            if batch not in expected:
                report.problems.append(f"{topic}: a record of batch {batch or '(none)'}, which the commit log does not hold")
                continue
            if expected[batch].kind in OFFSET_MOVING_KINDS and "offsetlake.topic" in headers:
                at = (headers["offsetlake.topic"].decode(), int(headers["offsetlake.partition"]), int(headers["offsetlake.offset"]))
                if owner.setdefault(at, batch) != batch:
                    report.problems.append(f"{at[0]}[{at[1]}] offset {at[2]}: produced by batch {owner[at]} and again by batch {batch}")
    for batch_id, c in expected.items():
        rows = sum(r.count("rows_written") or 0 for r in c.entry.ranges)
        dead = sum(r.count("dead_letters") or 0 for r in c.entry.ranges)
        if (seen_rows.get(batch_id, 0), seen_dead.get(batch_id, 0)) != (rows, dead):
            report.problems.append(
                f"batch {batch_id}: its entry counts {rows} rows and {dead} dead letters, the topics show "
                f"{seen_rows.get(batch_id, 0)} and {seen_dead.get(batch_id, 0)}"
            )
    report.rows, report.dead_letters = sum(seen_rows.values()), sum(seen_dead.values())
    _group_against_the_commit_log(config, report, keys, ends)
    recorded = {r["batch_id"] for r in Ledger.of(config).batches() if BatchStatus(r["status"]).committed}
    for batch_id in sorted(set(expected) - recorded):
        report.problems.append(f"batch {batch_id} is in the commit log but not committed in the ledger (the next run reconciles it)")
    return report


def _group_against_the_commit_log(
    config: PipelineConfig, report: AuditReport, keys: list[tuple[str, int]], ends: Mapping[tuple[str, int], int | None]
) -> None:
    """The group's offsets are Kafka's copy of the commit log's ends: past them is a problem (the
    next run refuses), behind or missing (expired, deleted) a note (the next run restores them)."""
    group = group_offsets(config.kafka_client_config(), config.name, keys)
    for (topic, partition), offset in sorted(group.items()):
        logged = ends.get((topic, partition))
        if offset is not None and offset > (logged or 0):
            report.problems.append(
                f"{topic}[{partition}]: the group's committed offset {offset} is past the commit log's end {logged} (the next run refuses)"
            )
        elif logged is not None and (offset is None or offset < logged):
            report.notes.append(
                f"{topic}[{partition}]: the group's committed offset is {offset if offset is not None else 'missing'} "
                f"(expired or deleted), the commit log's end {logged}: the next run restores it; planning reads the commit log"
            )


def _commit_log_coverage(commits: list[SinkCommit]) -> list[str]:
    """Per partition, the forward commits' ranges must follow each other from the first."""
    by_partition: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for c in commits:
        if c.kind in OFFSET_MOVING_KINDS:
            for r in c.entry.offset_ranges:
                if r.size:
                    by_partition.setdefault((r.topic, r.partition), []).append((r.start, r.end, c.batch_id))
    problems = []
    for key, spans in sorted(by_partition.items()):
        spans.sort()
        for (_, end, first), (start, _, then) in itertools.pairwise(spans):
            if start != end:
                what = "overlaps" if start < end else "leaves a hole after"
                problems.append(f"{key[0]}[{key[1]}]: batch {then} starts at {start}, which {what} batch {first}'s end {end}")
    return problems


# each kind of sink's audit (``offsetlake.config.sink_kinds``); a Kafka sink is always read back from Kafka
_AUDITS: dict[str, Callable[[PipelineConfig, bool], AuditReport]] = {"delta": audit_delta_sink, "kafka": audit_kafka_sink}
