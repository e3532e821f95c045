"""The ledger entry: what each offsetlake commit on a sink records about its batch, typed and versioned.

Invariant 2: a batch's data files, its txn actions and its ledger entry are ONE Delta commit; the
entry is the JSON in that commit's ``commitInfo.userMetadata``. Invariant 4: sink history is the
source of truth, so this JSON is offsetlake's persisted contract. This module is its only home:
it builds entries (one class per batch kind), writes them (``LedgerEntry.to_json``) and reads
every shape offsetlake has written (``parse``); no other module reads an entry's fields by key.
It also derives the shapes other modules need from an entry (ledger-table rows, a range's label).

Versions (``docs/reference/ledger-entry.md``):

- **1**: entries marked only with ``"offsetlake": 1`` (main up to ``3e10e68``, issue 36). Keys were added over
  time without a version (``topic_ids``, ``sink_table_id``, ``topic_epochs``, ``reader_schema``,
  ``merge``, ...); an entry without one reads as "not known" (empty / None).
- **2**: the same keys plus an explicit ``format_version``. The ``offsetlake: 1`` marker stays, so a
  reader of version 1 still recognises (and reads) a version-2 entry.

Unknown keys are kept (``LedgerEntry.other``) and written back unchanged, so a newer writer's
additions survive. An entry whose ``format_version`` is newer than ``FORMAT_VERSION`` is refused
(``EntryFormatError``): a version bump means old readers would misread it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any, ClassVar

from offsetlake import json_text
from offsetlake.errors import EntryFormatError
from offsetlake.plan import BatchKind, BatchPlan, OffsetRange, RangeCounts, ReaderSchema, RecordTimeWindow

MARKER = "offsetlake"  # userMetadata[MARKER] == 1: the commit is offsetlake's (every version keeps it)
FORMAT_VERSION = 2  # what this code writes; it reads 1 and 2
_COUNT_KEYS = ("records_read", "rows_written", "dead_letters")


# ---- parts ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EntryRange:
    """One ``[start, end)`` of the batch (invariant 5) with what it read and wrote there."""

    topic: str
    partition: int
    start: int
    end: int
    counts: Mapping[str, int] = field(default_factory=dict)  # records_read, rows_written, dead_letters, ...

    @property
    def offsets(self) -> OffsetRange:
        return OffsetRange(self.topic, self.partition, self.start, self.end)

    def count(self, key: str) -> int | None:
        value = self.counts.get(key)
        return None if value is None else int(value)

    def label(self) -> str:
        """``topic[p] [start, end)``: how a range is shown in Asset extras and XCom."""
        return str(self.offsets)

    def as_dict(self) -> dict[str, Any]:
        return {"topic": self.topic, "partition": self.partition, "start": self.start, "end": self.end, **self.counts}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> EntryRange:
        counts = {k: int(v) for k, v in data.items() if k not in ("topic", "partition", "start", "end") and v is not None}
        return EntryRange(str(data["topic"]), int(data["partition"]), int(data["start"]), int(data["end"]), counts)


@dataclass(frozen=True)
class DeadLetterFile:
    """A dead-letter file written before the sink commit (invariant 8), relative to the dead-letter table."""

    path: str
    size: int
    rows: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, **({"rows": self.rows} if self.rows is not None else {})}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> DeadLetterFile:
        return DeadLetterFile(str(data["path"]), int(data["size"]), data.get("rows"))


@dataclass(frozen=True)
class EpochChange:
    """What an epoch commit did (``offsetlake topic reset-epoch``, invariant 16)."""

    topic: str
    previous_topic_id: str | None = None
    topic_id: str | None = None
    moves: tuple[Mapping[str, Any], ...] = ()  # {"partition", "from", "to"} per partition
    problems: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "previous_topic_id": self.previous_topic_id,
            "topic_id": self.topic_id,
            "moves": [dict(m) for m in self.moves],
            "problems": list(self.problems),
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> EpochChange:
        return EpochChange(
            str(data["topic"]),
            data.get("previous_topic_id"),
            data.get("topic_id"),
            tuple(data.get("moves") or ()),
            tuple(data.get("problems") or ()),
        )


# ---- entries ----------------------------------------------------------------------------------
# JSON key -> attribute, where they differ (the JSON names are the persisted contract)
_RENAMED = {"dead_letter_files": "staged", "dead_letter_restore": "restore_to_sink_version"}


@dataclass(frozen=True, kw_only=True)
class LedgerEntry:
    """What every batch's commit records (the fields of all kinds); a subclass per kind adds its own.

    ``planned_at`` / ``committed_at`` are ISO-8601 text as written; ``other`` holds keys this code
    does not know (a newer writer's), written back as they were.
    """

    KIND: ClassVar[BatchKind] = BatchKind.INGEST
    pipeline: str
    batch_id: str
    run_id: str | None = None
    dag_id: str | None = None
    try_number: int | None = None
    planned_at: str | None = None
    committed_at: str | None = None
    duration_ms: int | None = None
    ranges: tuple[EntryRange, ...] = ()
    message: str | None = None
    validation: Mapping[str, Any] | None = None  # the Great Expectations summary (invariant 9)
    record_time: RecordTimeWindow | None = None  # a backfill by time
    reader_schema: ReaderSchema | None = None  # invariant 12
    topic_ids: Mapping[str, str] = field(default_factory=dict)  # invariant 16; absent before topic ids
    sink_table_id: str | None = None
    topic_epochs: Mapping[str, int] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION  # 1 for an entry read that had only the marker
    other: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> BatchKind:
        return self.KIND

    @property
    def offset_ranges(self) -> tuple[OffsetRange, ...]:
        return tuple(r.offsets for r in self.ranges)

    @property
    def dead_letter_change(self) -> bool:
        """Whether the commit stands for a change of the dead-letter table (``offsetlake.dead_letters``)."""
        return False

    def topics(self) -> set[str]:
        return {r.topic for r in self.ranges}

    # ---- JSON ---------------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        """The entry as its JSON object (without the marker), version-2 keys."""
        out: dict[str, Any] = {**self.other, "kind": str(self.kind), "format_version": self.format_version}
        for f in fields(self):
            if f.name in ("format_version", "other"):
                continue
            value = _json_value(getattr(self, f.name))
            if f.name == "restore_to_sink_version" and value is not None:
                value = {"to_sink_version": value}
            if value is None or (value == {} and f.name in ("topic_ids", "topic_epochs")):
                if f.name in _ALWAYS:
                    out[_json_name(f.name)] = value
                continue
            out[_json_name(f.name)] = value
        return out

    def to_json(self) -> str:
        """The commit's ``userMetadata``: compact, sorted JSON with offsetlake's marker (a NaN or
        infinite number, say a validation's observed value, as its string: ``json_text``)."""
        return json_text.dumps({**self.as_dict(), MARKER: 1}, separators=(",", ":"), sort_keys=True, default=str)

    # ---- derived shapes -----------------------------------------------------------------
    def ledger_rows(
        self, status: str, sink_version: int | None = None, recorded_at: datetime | None = None, **columns: Any
    ) -> list[dict[str, Any]]:
        """One ledger-table row per range (``offsetlake.ledger.LEDGER_SCHEMA``) with ``status``;
        ``columns`` override what the entry says (message, duration, validation)."""
        base = {
            "pipeline": self.pipeline,
            "batch_id": self.batch_id,
            "kind": str(self.kind),
            "status": str(status),
            "sink_version": sink_version,
            "run_id": self.run_id,
            "dag_id": self.dag_id,
            "try_number": self.try_number,
            "planned_at": _ts(self.planned_at),
            "recorded_at": recorded_at or datetime.now(UTC),
            "duration_ms": self.duration_ms,
            "message": self.message,
            **_validation_columns(self.validation),
            "record_time_from_ms": self.record_time.from_ms if self.record_time else None,
            "record_time_to_ms": self.record_time.to_ms if self.record_time else None,
            "reader_schema": json.dumps(self.reader_schema.as_dict(), sort_keys=True) if self.reader_schema else None,
            **columns,
        }
        return [
            {
                **base,
                "topic": r.topic,
                "partition": r.partition,
                "start_offset": r.start,
                "end_offset": r.end,
                **{k: r.count(k) for k in _COUNT_KEYS},
                "topic_id": self.topic_ids.get(r.topic),
                "sink_table_id": self.sink_table_id,
            }
            for r in self.ranges
        ]

    @property
    def committed_time(self) -> datetime | None:
        return _ts(self.committed_at)


_ALWAYS = frozenset({"run_id", "dag_id", "try_number", "planned_at", "committed_at", "duration_ms", "ranges"})


@dataclass(frozen=True, kw_only=True)
class RowsEntry(LedgerEntry):
    """A kind that reads records and writes rows: its dead letters staged before the commit
    replace those of its ranges (invariant 8); a keyed sink's merge counts."""

    staged: tuple[DeadLetterFile, ...] | None = None  # None: an entry written before staged dead letters
    merge: Mapping[str, int] | None = None
    # the data path that wrote its rows (``offsetlake.process.DataPath``: "spark", "direct");
    # None: a gap, or an entry written before the path was recorded
    data_path: str | None = None

    @property
    def dead_letter_change(self) -> bool:
        return self.staged is not None


@dataclass(frozen=True, kw_only=True)
class IngestEntry(RowsEntry):
    KIND: ClassVar[BatchKind] = BatchKind.INGEST


@dataclass(frozen=True, kw_only=True)
class StreamEntry(RowsEntry):
    KIND: ClassVar[BatchKind] = BatchKind.STREAM


@dataclass(frozen=True, kw_only=True)
class GapEntry(RowsEntry):
    """Lost offsets skipped under ``on_offsets_lost: skip`` (invariant 7): no rows, no dead letters."""

    KIND: ClassVar[BatchKind] = BatchKind.GAP


@dataclass(frozen=True, kw_only=True)
class BackfillEntry(RowsEntry):
    KIND: ClassVar[BatchKind] = BatchKind.BACKFILL


@dataclass(frozen=True, kw_only=True)
class RewindEntry(LedgerEntry):
    """A rewind: its ranges are the offsets undone per partition ``[new end, old end)``."""

    KIND: ClassVar[BatchKind] = BatchKind.REWIND
    to_batch: str | None = None
    to_version: int | None = None
    rewound: tuple[str, ...] = ()  # the batch ids it undid
    reason: str | None = None
    requested_by: str | None = None
    files_removed: int | None = None
    files_readded: int | None = None
    kept_columns: tuple[str, ...] | None = None
    restore_to_sink_version: int | None = None  # the dead-letter table follows the sink back to it

    @property
    def dead_letter_change(self) -> bool:
        return self.restore_to_sink_version is not None


@dataclass(frozen=True, kw_only=True)
class EpochEntry(LedgerEntry):
    """``offsetlake topic reset-epoch``: committed ends moved to a re-created topic's log start."""

    KIND: ClassVar[BatchKind] = BatchKind.EPOCH
    epoch: EpochChange | None = None
    reason: str | None = None
    requested_by: str | None = None


@dataclass(frozen=True, kw_only=True)
class StateMoveEntry(LedgerEntry):
    """A keyed sink's state rows moved out of the sink into its state table (once per pipeline)."""

    KIND: ClassVar[BatchKind] = BatchKind.STATE_MOVE
    state_version: int | None = None  # the state table version the commit pins
    rows_kept: int | None = None  # the rows a reader sees, as before
    state_rows: int | None = None  # the rows that moved out (delete markers, contributions, ...)


_CLASSES: dict[BatchKind, type[LedgerEntry]] = {
    c.KIND: c for c in (IngestEntry, StreamEntry, GapEntry, BackfillEntry, RewindEntry, EpochEntry, StateMoveEntry)
}


# ---- building ---------------------------------------------------------------------------------
def for_plan(
    plan: BatchPlan,
    per_range: Mapping[tuple[str, int], RangeCounts] | None = None,
    started: float | None = None,
    validation: Mapping[str, Any] | None = None,
    **kind_fields: Any,
) -> LedgerEntry:
    """The entry of ``plan`` as its commit records it: who planned it, when, its ranges with their
    counts, its validation summary, its reader schema, topic ids, sink table id and topic epochs;
    ``kind_fields`` are those of the plan's kind (``IngestEntry.staged``, ``RewindEntry.to_batch``,
    ...; a TypeError names one the kind does not have). ``started`` is the batch's
    ``time.monotonic()`` start, for its duration."""
    counts = per_range or {}
    return _CLASSES[plan.kind](
        pipeline=plan.pipeline,
        batch_id=plan.batch_id,
        run_id=plan.run.run_id,
        dag_id=plan.run.dag_id,
        try_number=plan.run.try_number,
        planned_at=plan.planned_at.isoformat(),
        committed_at=datetime.now(UTC).isoformat(),
        duration_ms=int((time.monotonic() - started) * 1000) if started is not None else 0,
        ranges=tuple(EntryRange(r.topic, r.partition, r.start, r.end, dict(counts.get((r.topic, r.partition), {}))) for r in plan.ranges),
        validation=validation,
        record_time=plan.window,
        reader_schema=plan.reader_schema,
        topic_ids=dict(sorted(plan.topic_ids.items())),
        sink_table_id=plan.sink_table_id,
        topic_epochs=dict(sorted(plan.topic_epochs.items())),
        **kind_fields,
    )


def staged_files(files: Iterable[Mapping[str, Any]]) -> tuple[DeadLetterFile, ...]:
    """``offsetlake.dead_letters.stage``'s answer as an entry's staged files."""
    return tuple(DeadLetterFile.from_dict(f) for f in files)


# ---- reading ----------------------------------------------------------------------------------
def parse(raw: str | None) -> LedgerEntry | None:
    """The ledger entry a commit's ``userMetadata`` holds, or None if the commit is not an
    offsetlake batch commit (no metadata, not JSON, no marker, or the dead-letter table's own
    commits). Raises EntryFormatError for a marked entry this code cannot read."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get(MARKER) != 1 or data.get("kind") == AppliedChange.KIND:
        return None
    return from_dict(data)


def from_dict(data: Mapping[str, Any]) -> LedgerEntry:
    """An entry from its JSON object, any version (see the module doc)."""
    version = int(data.get("format_version", 1))
    if version > FORMAT_VERSION:
        raise EntryFormatError(
            f"batch {data.get('batch_id')}: its ledger entry has format version "
            f"{version}, this offsetlake reads up to {FORMAT_VERSION}; upgrade offsetlake to read this sink",
            pipeline=data.get("pipeline"),
            batch_id=data.get("batch_id"),
        )
    try:
        cls = _CLASSES[BatchKind(data.get("kind") or BatchKind.INGEST)]  # entries before kinds were ingest
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {"format_version": version}
        other: dict[str, Any] = {}
        for key, value in data.items():
            name = _RENAMED.get(key, key)
            if key in (MARKER, "kind", "format_version"):
                continue
            if name in known and name != "other":
                values[name] = _read_field(name, value)
            else:
                other[key] = value
        return cls(**values, other=other)
    except (KeyError, TypeError, ValueError) as err:
        raise EntryFormatError(f"an offsetlake ledger entry that cannot be read ({err!r}): {json.dumps(data)[:300]}") from None


def _read_field(name: str, value: Any) -> Any:
    if value is None:
        return None
    readers = {
        "ranges": lambda v: tuple(EntryRange.from_dict(r) for r in v),
        "record_time": lambda v: RecordTimeWindow(int(v["from_ms"]), int(v["to_ms"])),
        "reader_schema": ReaderSchema.from_dict,
        "staged": staged_files,
        "restore_to_sink_version": lambda v: int(v["to_sink_version"]),
        "epoch": EpochChange.from_dict,
        "rewound": tuple,
        "kept_columns": tuple,
        "topic_ids": dict,
        "topic_epochs": dict,
    }
    return readers[name](value) if name in readers else value


def _json_name(name: str) -> str:
    return next((k for k, v in _RENAMED.items() if v == name), name)


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, (EntryRange, DeadLetterFile, EpochChange, ReaderSchema)):
        return value.as_dict()
    if isinstance(value, RecordTimeWindow):
        return {"from_ms": value.from_ms, "to_ms": value.to_ms}
    if isinstance(value, Mapping):
        return dict(value)
    return value


def _ts(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def _validation_columns(summary: Mapping[str, Any] | None) -> dict[str, Any]:
    if not summary:
        return {}
    return {"validation": json.dumps(summary, separators=(",", ":"), default=str), "validation_report": summary.get("report")}


# ---- the dead-letter table's commits ----------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class AppliedChange:
    """The entry of a dead-letter table's commit (not a batch): the sink commit whose dead-letter
    change it applied (``sink_version`` of the sink table ``sink_table_id``; entries written before
    table ids lack it), marked like a ledger entry (``offsetlake.dead_letters``)."""

    KIND: ClassVar[str] = "dead_letters"
    pipeline: str
    batch_id: str
    sink_version: int
    sink_table_id: str | None = None

    def to_json(self) -> str:
        body = {
            "pipeline": self.pipeline,
            "batch_id": self.batch_id,
            "kind": self.KIND,
            "sink_version": self.sink_version,
            "format_version": FORMAT_VERSION,
            MARKER: 1,
        }
        if self.sink_table_id is not None:
            body["sink_table_id"] = self.sink_table_id
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    @staticmethod
    def parse(raw: str | None) -> AppliedChange | None:
        """The applied change a dead-letter commit's ``userMetadata`` names, or None if it is not one."""
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            return None
        if not isinstance(data, dict) or data.get(MARKER) != 1 or data.get("kind") != AppliedChange.KIND:
            return None
        return AppliedChange(
            pipeline=str(data.get("pipeline")),
            batch_id=str(data.get("batch_id")),
            sink_version=int(data.get("sink_version", -1)),
            sink_table_id=data.get("sink_table_id"),
        )
