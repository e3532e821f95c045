"""A batch as people see it: one typed view built from its ledger rows, and every form it is shown in.

The ledger table holds one row per (batch, topic, partition) (``offsetlake.ledger``); people and
Airflow want one thing per batch. ``BatchView.from_rows`` is the one place that turns a batch's
rows into that (status = its least final partition's, totals, validation, reader schema), and
the forms it is shown in are its methods, so no caller builds a batch dict by hand:

- ``to_json``: a batch in the Offset ledger view and its JSON API (``offsetlake.ledger_view``),
- ``last_batch``: the "last batch" of a pipeline in the view's headline and in the metrics,
- ``publish_summary``: what the Airflow publish task logs and returns (``runs.publishable_batch``),
- ``asset_extra``: the extra of the asset event announcing a committed batch (Airflow assets).

A range is shown as text by one formatter, ``OffsetRange.__str__`` (``topic[p] [start, end)``,
half-open, invariant 5), and as JSON by ``CountedRange.as_dict``, the same shape a run's summary
line prints (``BatchResult.summary``). Nothing here reads a table: this is arithmetic on rows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from offsetlake.plan import BatchKind, BatchStatus, CountedRange, OffsetRange, ReaderSchema

# the per-range counts a ledger row carries (None where the batch never got that far)
ROW_COUNTS = ("records_read", "rows_written", "dead_letters")
# the kinds that read records, so a validation suite could have checked them
_VALIDATED_KINDS = frozenset({BatchKind.INGEST, BatchKind.STREAM, BatchKind.BACKFILL})
# what a validation digest keeps of each failed expectation
_FAILURE_KEYS = (
    "expectation",
    "type",
    "row_level",
    "element_count",
    "unexpected_count",
    "unexpected_percent",
    "observed_value",
    "examples",
    "error",
)


@dataclass(frozen=True)
class BatchView:
    """One batch as its ledger rows describe it (one row per topic-partition, any status).

    ``status`` is the least final of its partitions' statuses (``BatchStatus.rank``), so a batch
    shows as committed only once every partition's row is; ``statuses`` keeps them all.
    ``validation`` is the digest of its stored GX summary (``validation_digest``).
    """

    batch_id: str
    kind: BatchKind
    status: BatchStatus
    statuses: frozenset[BatchStatus]
    run_id: str | None
    dag_id: str | None
    try_number: int | None
    planned_at: datetime | None
    recorded_at: datetime | None  # the latest of its rows'
    duration_ms: int | None
    sink_version: int | None  # the highest of its rows'
    ranges: tuple[CountedRange, ...]  # sorted by topic, partition
    validation: Mapping[str, Any] | None
    validation_report: str | None
    message: str | None  # the first of its rows' messages
    reader_schema: ReaderSchema | None

    @staticmethod
    def from_rows(rows: Sequence[Mapping[str, Any]]) -> BatchView:
        """The view of one batch out of its per-partition ledger rows (``Ledger.batches``, or
        ``Ledger.batches_as_reconciled`` for the sink's commits not projected yet). Raises
        ValueError for no rows: a batch the ledger does not know has no view."""
        if not rows:
            raise ValueError("a batch view needs at least one ledger row")
        rows = sorted(rows, key=lambda r: (r["topic"], r["partition"]))
        first = rows[0]
        statuses = frozenset(BatchStatus(r["status"]) for r in rows)
        versions = [r["sink_version"] for r in rows if r["sink_version"] is not None]
        schema = _first(rows, "reader_schema")
        return BatchView(
            batch_id=first["batch_id"],
            kind=BatchKind(first["kind"]),
            status=min(statuses, key=lambda s: s.rank),
            statuses=statuses,
            run_id=first["run_id"],
            dag_id=first["dag_id"],
            try_number=first["try_number"],
            planned_at=first["planned_at"],
            recorded_at=max((r["recorded_at"] for r in rows if r["recorded_at"]), default=None),
            duration_ms=first["duration_ms"],
            sink_version=max(versions) if versions else None,
            ranges=tuple(
                CountedRange(OffsetRange(r["topic"], r["partition"], r["start_offset"], r["end_offset"]), {k: r[k] for k in ROW_COUNTS})
                for r in rows
            ),
            validation=validation_digest(_first(rows, "validation")),
            validation_report=_first(rows, "validation_report"),
            message=_first(rows, "message"),
            reader_schema=ReaderSchema.from_dict(json.loads(schema)) if schema else None,
        )

    # ---- figures ------------------------------------------------------------------------
    @property
    def offsets(self) -> int:
        return sum(r.range.size for r in self.ranges)

    def total(self, key: str) -> int | None:
        """The sum of a count over the ranges; None when no range has it (a batch never read)."""
        values = [v for v in (r.count(key) for r in self.ranges) if v is not None]
        return sum(values) if values else None

    @property
    def validation_outcome(self) -> str | None:
        return (self.validation or {}).get("outcome")

    @property
    def sort_key(self) -> tuple[str, str]:
        """Newest last: by plan time (commit time when unplanned), then batch id."""
        return (iso_time(self.planned_at) or iso_time(self.recorded_at) or "", self.batch_id)

    def range_labels(self) -> list[str]:
        return [str(r) for r in self.ranges]

    # ---- forms --------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The batch in the Offset ledger view, its JSON API and ``offsetlake status`` (timestamps
        as ISO-8601 text; the view adds its links to this dict)."""
        return {
            "batch_id": self.batch_id,
            "kind": str(self.kind),
            "status": str(self.status),
            "run_id": self.run_id,
            "dag_id": self.dag_id,
            "try_number": self.try_number,
            "planned_at": iso_time(self.planned_at),
            "recorded_at": iso_time(self.recorded_at),
            "duration_ms": self.duration_ms,
            "sink_version": self.sink_version,
            "ranges": [r.as_dict() for r in self.ranges],
            "offsets": self.offsets,
            **{key: self.total(key) for key in ROW_COUNTS},
            "validation": None if self.validation is None else dict(self.validation),
            "validation_report": self.validation_report,
            "message": self.message,
            "reader_schema": _schema_digest(self.reader_schema),
        }

    def last_batch(self) -> dict[str, Any]:
        """A pipeline's latest batch in the view's headline (``/api/pipelines``) and its metrics."""
        return {
            "batch_id": self.batch_id,
            "kind": str(self.kind),
            "status": str(self.status),
            "planned_at": iso_time(self.planned_at),
            "validation": self.validation_outcome,
            "message": self.message,
            "records": self.total("records_read") or 0,
            "rows": self.total("rows_written") or 0,
            "dead_letters": self.total("dead_letters") or 0,
            "duration_ms": self.duration_ms,
        }

    def gaps(self) -> list[dict[str, Any]]:
        """The ranges of a gap batch as the view's list of recorded gaps shows them (invariant 7);
        none for another kind."""
        if self.kind != BatchKind.GAP:
            return []
        return [
            {
                "batch_id": self.batch_id,
                "topic": r.range.topic,
                "partition": r.range.partition,
                "start": r.range.start,
                "end": r.range.end,
                "recorded_at": iso_time(self.recorded_at),
                "sink_version": self.sink_version,
                "message": self.message,
            }
            for r in self.ranges
        ]

    def publish_summary(self, pipeline: str, committed_ends: Mapping[tuple[str, int], int | None]) -> dict[str, Any]:
        """What the Airflow publish task logs and returns: the batch with its ranges as text and,
        for an ingest batch, the committed ends it publishes as consumer-group offsets."""
        return {
            "pipeline": pipeline,
            "batch_id": self.batch_id,
            "kind": str(self.kind),
            "status": str(self.status),
            "sink_version": self.sink_version,
            **{key: self.total(key) or 0 for key in ROW_COUNTS},
            "ranges": self.range_labels(),
            "group_offsets": {f"{t}[{p}]": o for (t, p), o in committed_ends.items()} if self.kind == BatchKind.INGEST else {},
            "validation": self.validation_outcome or "no suite",
            "validation_report": self.validation_report,
            "message": self.message,
        }

    def asset_extra(self, pipeline: str, table: str) -> dict[str, Any]:
        """The extra of the asset event that announces this batch on the sink table (URI
        ``table``): the keys downstream DAGs read (docs/guides/airflow.md, "Downstream DAGs")."""
        return {
            "pipeline": pipeline,
            "batch_id": self.batch_id,
            "kind": str(self.kind),
            "ranges": self.range_labels(),
            "records": self.total("records_read") or 0,
            "rows": self.total("rows_written") or 0,
            "dead_letters": self.total("dead_letters") or 0,
            "sink_version": self.sink_version,
            "validation": self.validation_outcome or ("no suite" if self.kind in _VALIDATED_KINDS else "not validated"),
            "table": table,
        }


def batch_views(rows: Sequence[Mapping[str, Any]]) -> list[BatchView]:
    """Per-partition ledger rows of any number of batches grouped into one view per batch,
    newest first."""
    by_batch: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_batch.setdefault(row["batch_id"], []).append(row)
    return sorted((BatchView.from_rows(mine) for mine in by_batch.values()), key=lambda b: b.sort_key, reverse=True)


def validation_digest(raw: str | None) -> dict[str, Any] | None:
    """The parts of a stored GX summary (JSON text) that say why a batch passed, quarantined or
    failed; ``outcome: unreadable`` for text that is not JSON."""
    if not raw:
        return None
    try:
        summary = json.loads(raw)
    except ValueError:
        return {"outcome": "unreadable", "failures": []}
    return {
        "outcome": summary.get("outcome"),
        "suite": summary.get("suite"),
        "on_failure": summary.get("on_failure"),
        "rows_validated": summary.get("rows_validated"),
        "quarantined_records": summary.get("quarantined_records"),
        "failures": [{k: e.get(k) for k in _FAILURE_KEYS} for e in summary.get("expectations", []) if not e.get("success")],
    }


def _schema_digest(schema: ReaderSchema | None) -> dict[str, Any] | None:
    """The reader schema a batch decoded with, as people read it (its text left out)."""
    if schema is None:
        return None
    digest = {k: v for k, v in schema.as_dict().items() if k != "text"}
    if "key" in digest:
        digest["key"] = {k: v for k, v in digest["key"].items() if k != "text"}
    return {**digest, "description": schema.describe()}


def _first(rows: Sequence[Mapping[str, Any]], key: str) -> Any:
    """The first row's non-empty value of a column the ledger sets on some rows only."""
    return next((r.get(key) for r in rows if r.get(key)), None)


def iso_time(value: datetime | None) -> str | None:
    """A ledger timestamp as the view shows it: ISO-8601 in UTC, microseconds, so text order is time order."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat(timespec="microseconds")  # fixed width: sorts as text
