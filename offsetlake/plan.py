"""What a batch is: its half-open offset ranges, its kind, who asked for it, and how it ended.

The plan is fixed before anything is read (invariant 3) and recorded in the ledger table with
status ``planned``. Ranges are half-open ``[start, end)`` in Kafka offsets (invariant 5).
This module owns the batch kinds (and the one set of kinds that move committed ends) and the
batch statuses (and the one order of how final each is); everything else imports them.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum


@dataclass(frozen=True, order=True)
class OffsetRange:
    """``[start, end)`` of one topic-partition."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        """The one text form of a range (logs, errors, Asset extras, the publish summary)."""
        return f"{self.topic}[{self.partition}] [{self.start}, {self.end})"


@dataclass(frozen=True)
class CountedRange:
    """A batch's range with what it read and wrote there (``records_read``, ``rows_written``,
    ``dead_letters``, and where they apply ``quarantined``, ``empty_as_null``; None: not known).

    ``as_dict`` is the one JSON shape of such a range: a run's summary line
    (``BatchResult.summary``) and a batch in the ledger view (``batch_view.BatchView``)."""

    range: OffsetRange
    counts: Mapping[str, int | None] = field(default_factory=dict)

    def count(self, key: str) -> int | None:
        return self.counts.get(key)

    def as_dict(self) -> dict:
        r = self.range
        return {"topic": r.topic, "partition": r.partition, "start": r.start, "end": r.end, **self.counts}

    def __str__(self) -> str:
        return str(self.range)


@dataclass(frozen=True)
class PartitionOffsets:
    """What the broker says about one partition right now."""

    topic: str
    partition: int
    log_start: int
    last_stable: int  # LSO: exclusive end of what read_committed may see


class BatchKind(StrEnum):
    """What a ledger batch (a sink commit, or a plan that never committed) does."""

    INGEST = "ingest"  # a scheduled or CLI run: reads from the committed ends, moves them
    STREAM = "stream"  # a micro-batch of `offsetlake stream`: the same as ingest
    GAP = "gap"  # lost offsets skipped under on_offsets_lost: skip; moves the ends, writes no rows
    BACKFILL = "backfill"  # replaces rows below the committed ends; never moves them (invariant 6)
    REWIND = "rewind"  # moves the committed ends back to an earlier batch's
    # an operator's `offsetlake topic reset-epoch`: a re-created or truncated topic's committed ends
    # move to its new log start, under its new topic id (invariant 16); reads and writes no rows
    EPOCH = "epoch"
    # a keyed sink written before its state had a table of its own: the state rows moved out of the
    # sink into the state table in one recorded commit (``offsetlake.write_modes.stateful``); no rows
    # change for a reader, no offsets move
    STATE_MOVE = "state_move"


# The kinds that are planned from the committed ends and move them forward: their ranges per
# partition are contiguous from the pipeline's first start, a plan of them goes stale once another
# batch moves a partition's committed end past its start, and a rewind undoes them (and the dead
# letters they wrote).
OFFSET_MOVING_KINDS = frozenset({BatchKind.INGEST, BatchKind.STREAM, BatchKind.GAP})


class BatchStatus(StrEnum):
    """A batch's state in the ledger; a later, more final event outranks an earlier one."""

    PLANNED = "planned"
    FAILED = "failed"
    SUPERSEDED = "superseded"
    COMMITTED = "committed"
    GAP = "gap"  # a committed gap batch
    # A committed batch undone by a later rewind commit: it outranks committed, because the sink
    # commit that rewound it comes after the one that committed it.
    REWOUND = "rewound"
    # A run's result only (``BatchResult.status``), never a ledger row: the sink already held the
    # plan's commit when the batch ran again (a rerun after the commit).
    ALREADY_COMMITTED = "already_committed"

    @property
    def rank(self) -> int:
        return _RANK[self]

    @property
    def committed(self) -> bool:
        """The batch's commit is in the sink (and counts, unless rewound)."""
        return self in (BatchStatus.COMMITTED, BatchStatus.GAP, BatchStatus.ALREADY_COMMITTED)


# What a batch can end as in the ledger (what the metrics count, every one even at zero).
LEDGER_OUTCOMES = (BatchStatus.COMMITTED, BatchStatus.FAILED, BatchStatus.SUPERSEDED, BatchStatus.REWOUND, BatchStatus.GAP)


_RANK = {
    BatchStatus.PLANNED: 0,
    BatchStatus.FAILED: 1,
    BatchStatus.SUPERSEDED: 2,
    BatchStatus.COMMITTED: 3,
    BatchStatus.GAP: 3,
    BatchStatus.REWOUND: 4,
    BatchStatus.ALREADY_COMMITTED: 3,
}


@dataclass(frozen=True)
class RunContext:
    """Who asked for a batch: a CLI run or an Airflow dag run / try."""

    run_id: str
    dag_id: str | None = None
    try_number: int | None = None


@dataclass(frozen=True)
class RecordTimeWindow:
    """``[from_ms, to_ms)`` of record timestamps (Kafka milliseconds): a backfill by time selects,
    within its offset ranges, only the records whose timestamp falls in it."""

    from_ms: int
    to_ms: int

    def contains(self, timestamp_ms: int | None) -> bool:
        return timestamp_ms is not None and self.from_ms <= timestamp_ms < self.to_ms

    def __str__(self) -> str:
        return f"record times [{_iso_ms(self.from_ms)}, {_iso_ms(self.to_ms)})"


def _iso_ms(ms: int) -> str:
    from datetime import timedelta

    return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class ReaderSchema:
    """The schema a batch decodes its records into, fixed when it is planned (invariant 12).

    ``source``: ``registry`` (a Schema Registry subject's version, fetched again by ``id`` on a
    rerun), ``file`` (a local ``.avsc``) or ``yaml`` (the pipeline file's JSON schema); for the
    last two ``text`` is the schema itself, so a rerun decodes with it even after the file
    changed; for a key also ``string`` or ``bytes``. ``fingerprint`` tells two schemas apart
    whatever their source. ``key``: how the batch's record keys decode (None: not kept).
    """

    source: str
    fingerprint: str
    subject: str | None = None
    version: int | None = None
    id: int | None = None
    text: str | None = None
    key: ReaderSchema | None = None  # the schema its record keys decode into (a record key's, else None)

    def describe(self) -> str:
        if self.source == "registry":
            said = f"subject {self.subject} version {self.version} (schema id {self.id})"
        elif self.source in ("string", "bytes"):  # a key kept as text or bytes
            said = self.source
        else:
            said = f"{self.source} schema {self.fingerprint[:12]}"
        return f"{said}; key {self.key.describe()}" if self.key is not None else said

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if v is not None and k != "key"}
        if self.key is not None:
            out["key"] = self.key.as_dict()
        return out

    @staticmethod
    def from_dict(data: dict | None) -> ReaderSchema | None:
        if not data:
            return None
        return ReaderSchema(
            source=str(data["source"]),
            fingerprint=str(data["fingerprint"]),
            subject=data.get("subject"),
            version=data.get("version"),
            id=data.get("id"),
            text=data.get("text"),
            key=ReaderSchema.from_dict(data.get("key")),
        )


@dataclass(frozen=True)
class BatchPlan:
    pipeline: str
    batch_id: str
    kind: BatchKind
    ranges: tuple[OffsetRange, ...]
    run: RunContext
    planned_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    window: RecordTimeWindow | None = None  # a backfill by time: only records with these timestamps
    reader_schema: ReaderSchema | None = None  # what its records decode into (None: a batch that reads nothing)
    # Kafka's topic id of each topic its offsets belong to, where the broker names one (invariant 16)
    topic_ids: dict[str, str] = field(default_factory=dict)
    # the Delta id of the sink table it was planned on (None: there was none yet); a plan never
    # applies to another table (invariant 16)
    sink_table_id: str | None = None
    # each topic's current epoch, where 1 or more (``offsetlake topic reset-epoch``): read from the
    # sink's history when the batch executes (``runs.execute_batch``), never from the ledger, and
    # written into its rows (``coordinates.TOPIC_EPOCH``); a backfill replaces only that epoch's rows
    topic_epochs: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", BatchKind(self.kind))

    @property
    def is_empty(self) -> bool:
        return all(r.size == 0 for r in self.ranges)

    @property
    def offsets(self) -> int:
        return sum(r.size for r in self.ranges)

    def describe(self) -> str:
        ranges = ", ".join(str(r) for r in self.ranges if r.size) or "nothing"
        return f"{ranges}, {self.window}" if self.window is not None else ranges


def new_batch_id(pipeline: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    return f"{pipeline}-{stamp}-{secrets.token_hex(3)}"


RangeCounts = dict[str, int]  # records_read, rows_written, dead_letters (and quarantined, empty_as_null) of one range


@dataclass
class BatchResult:
    """How a batch a run executed ended: committed, already committed, or superseded."""

    plan: BatchPlan
    status: BatchStatus  # COMMITTED | ALREADY_COMMITTED | SUPERSEDED (another batch committed these ranges)
    sink_version: int | None = None
    per_range: dict[tuple[str, int], RangeCounts] = field(default_factory=dict)
    timings_ms: dict[str, int] = field(default_factory=dict)

    def total(self, key: str) -> int:
        return sum(v.get(key, 0) for v in self.per_range.values())

    def summary(self) -> dict:
        """The JSON line a run prints per batch."""
        return {
            "pipeline": self.plan.pipeline,
            "batch_id": self.plan.batch_id,
            "kind": str(self.plan.kind),
            "status": str(self.status),
            "run_id": self.plan.run.run_id,
            "ranges": ranges_with_counts(self.plan, self.per_range),
            "records_read": self.total("records_read"),
            "rows_written": self.total("rows_written"),
            "dead_letters": self.total("dead_letters"),
            "sink_version": self.sink_version,
            "timings_ms": self.timings_ms,
        }


def ranges_with_counts(plan: BatchPlan, per_range: dict[tuple[str, int], RangeCounts]) -> list[dict]:
    """The plan's ranges as JSON objects (``CountedRange.as_dict``), each with its counts: the
    shape of a ledger entry's ``ranges`` and of a run's summary line."""
    return [CountedRange(r, per_range.get((r.topic, r.partition), {})).as_dict() for r in plan.ranges]
