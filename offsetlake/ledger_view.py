"""What a person looking at a pipeline wants to see: lag, batches, validation, gaps.

Read-only views over state that already exists, for ``offsetlake status`` and the Airflow
"Offset ledger" view and its JSON API: the sink's txn versions (committed ends), the broker's
log start and Last Stable Offsets, and the ledger table. Nothing here writes a table.

Invariant 4 holds in the view too: the sink commits are the source of truth, so a batch that
committed but whose ledger row was never written (a crash between the two) is shown from its
commit's ``userMetadata``, exactly as the next run's reconciliation will record it.

Every function returns plain JSON-ready dicts (timestamps as ISO-8601 strings).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime

from deltalake import DeltaTable

from offsetlake.config import PipelineConfig
from offsetlake.errors import OffsetlakeError
from offsetlake.ledger import COMMITTED, FAILED, GAP, PLANNED, REWOUND, SUPERSEDED, Ledger, rows_for_commit
from offsetlake.sink import committed_ends, open_table, sink_commits

# A batch is only as final as its least final partition (its ranges are recorded together).
_FINALITY = (PLANNED, FAILED, SUPERSEDED, COMMITTED, GAP, REWOUND)
RECENT_BATCHES = 25


def partition_status(config: PipelineConfig, table: DeltaTable | None = None) -> list[dict]:
    """Per partition: committed end (sink txn version), log start, LSO and lag.

    Lag is ``last_stable - committed_end`` (from the log start when nothing was committed yet),
    never negative. ``lost`` flags a committed end below the log start: those offsets are gone
    from Kafka (invariant 7). Raises KafkaUnavailableError when the broker cannot be asked.
    """
    from offsetlake.batch import current_offsets

    offsets = current_offsets(config)
    table = table if table is not None else open_table(config.sink_path)
    ends = committed_ends(table, config, config.topic, sorted(offsets))
    rows = []
    for p, o in sorted(offsets.items()):
        committed = ends[p]
        lag = o.last_stable - (committed if committed is not None else o.log_start)
        rows.append({"topic": o.topic, "partition": p, "committed_end": committed, "log_start": o.log_start,
                     "last_stable": o.last_stable, "lag": max(lag, 0),
                     "lost": committed is not None and committed < o.log_start})
    return rows


def ledger_batch_rows(config: PipelineConfig, table: DeltaTable | None) -> list[dict]:
    """One row per (batch, topic, partition) with its most final outcome, the sink's commits
    included even where the ledger projection has not caught up with them yet."""
    rows = Ledger(config.ledger_path, config.name).batches()
    recorded = {r["batch_id"] for r in rows if r["status"] in (COMMITTED, GAP, REWOUND)}
    unrecorded = [row for c in sink_commits(table, config.name) if c.batch_id not in recorded for row in rows_for_commit(c)]
    if unrecorded:
        replaced = {(r["batch_id"], r["topic"], r["partition"]) for r in unrecorded}
        rows = [r for r in rows if (r["batch_id"], r["topic"], r["partition"]) not in replaced] + unrecorded
    return rows


def summarize_batches(rows: list[dict]) -> list[dict]:
    """Group per-partition ledger rows into one summary per batch, newest first."""
    by_batch: dict[str, list[dict]] = {}
    for row in rows:
        by_batch.setdefault(row["batch_id"], []).append(row)
    batches = [_batch_summary(mine) for mine in by_batch.values()]
    return sorted(batches, key=lambda b: (b["planned_at"] or b["recorded_at"] or "", b["batch_id"]), reverse=True)


def _batch_summary(rows: list[dict]) -> dict:
    rows = sorted(rows, key=lambda r: (r["topic"], r["partition"]))
    first = rows[0]
    status = min((r["status"] for r in rows), key=_FINALITY.index)
    versions = {r["sink_version"] for r in rows if r["sink_version"] is not None}
    return {
        "batch_id": first["batch_id"],
        "kind": first["kind"],
        "status": status,
        "run_id": first["run_id"],
        "dag_id": first["dag_id"],
        "try_number": first["try_number"],
        "planned_at": _iso(first["planned_at"]),
        "recorded_at": _iso(max((r["recorded_at"] for r in rows if r["recorded_at"]), default=None)),
        "duration_ms": first["duration_ms"],
        "sink_version": max(versions) if versions else None,
        "ranges": [
            {"topic": r["topic"], "partition": r["partition"], "start": r["start_offset"], "end": r["end_offset"],
             "records_read": r["records_read"], "rows_written": r["rows_written"], "dead_letters": r["dead_letters"]}
            for r in rows
        ],
        "offsets": sum(r["end_offset"] - r["start_offset"] for r in rows),
        "records_read": _total(rows, "records_read"),
        "rows_written": _total(rows, "rows_written"),
        "dead_letters": _total(rows, "dead_letters"),
        "validation": _validation(next((r.get("validation") for r in rows if r.get("validation")), None)),
        "validation_report": next((r.get("validation_report") for r in rows if r.get("validation_report")), None),
        "message": next((r["message"] for r in rows if r["message"]), None),
    }


def _validation(raw: str | None) -> dict | None:
    """The parts of a stored GX summary that say why a batch passed, quarantined or failed."""
    if not raw:
        return None
    try:
        summary = json.loads(raw)
    except ValueError:
        return {"outcome": "unreadable", "failures": []}
    keep = ("expectation", "type", "row_level", "element_count", "unexpected_count", "unexpected_percent",
            "observed_value", "examples", "error")
    return {
        "outcome": summary.get("outcome"),
        "suite": summary.get("suite"),
        "on_failure": summary.get("on_failure"),
        "rows_validated": summary.get("rows_validated"),
        "quarantined_records": summary.get("quarantined_records"),
        "failures": [{k: e.get(k) for k in keep} for e in summary.get("expectations", []) if not e.get("success")],
    }


def _total(rows: list[dict], key: str) -> int | None:
    values = [r[key] for r in rows if r[key] is not None]
    return sum(values) if values else None


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat(timespec="microseconds")  # fixed width: sorts as text


def _lag(config: PipelineConfig, table: DeltaTable | None) -> tuple[list[dict], int | None, str | None]:
    try:
        partitions = partition_status(config, table)
    except OffsetlakeError as err:  # the ledger is still worth showing when Kafka is down
        return [], None, str(err)
    return partitions, sum(p["lag"] for p in partitions), None


def _headline(config: PipelineConfig, batches: list[dict]) -> dict:
    committed = [b["recorded_at"] for b in batches if b["status"] in (COMMITTED, GAP) and b["recorded_at"]]
    last = batches[0] if batches else None
    return {
        "pipeline": config.name,
        "topic": config.topic,
        "last_commit_at": max(committed) if committed else None,
        "last_batch": None if last is None else {
            "batch_id": last["batch_id"], "kind": last["kind"], "status": last["status"], "planned_at": last["planned_at"],
            "validation": (last["validation"] or {}).get("outcome"), "message": last["message"],
        },
    }


def pipeline_overview(config: PipelineConfig) -> dict:
    """One line of the pipelines list: total lag, last commit time, last batch and its status."""
    table = open_table(config.sink_path)
    batches = summarize_batches(ledger_batch_rows(config, table))
    _, total_lag, kafka_error = _lag(config, table)
    return {**_headline(config, batches), "total_lag": total_lag, "kafka_error": kafka_error, "error": None}


def pipeline_detail(config: PipelineConfig, limit: int = RECENT_BATCHES) -> dict:
    """Everything the per-pipeline page shows: lag per partition, recent batches, recorded gaps."""
    table = open_table(config.sink_path)
    batches = summarize_batches(ledger_batch_rows(config, table))
    partitions, total_lag, kafka_error = _lag(config, table)
    return {
        **_headline(config, batches),
        "sink": config.sink_path,
        "sink_version": table.version() if table is not None else None,
        "total_lag": total_lag,
        "kafka_error": kafka_error,
        "partitions": partitions,
        "batch_count": len(batches),
        "batches": batches[:limit] if limit else batches,
        "gaps": [
            {"batch_id": b["batch_id"], "topic": r["topic"], "partition": r["partition"], "start": r["start"],
             "end": r["end"], "recorded_at": b["recorded_at"], "sink_version": b["sink_version"], "message": b["message"]}
            for b in batches if b["kind"] == "gap" for r in b["ranges"]
        ],
    }


def validation_report(config: PipelineConfig, batch_id: str) -> str | None:
    """URI of the batch's latest validation report (HTML), as its ledger row or commit records it."""
    rows = [r for r in ledger_batch_rows(config, open_table(config.sink_path)) if r["batch_id"] == batch_id]
    return next((r["validation_report"] for r in rows if r.get("validation_report")), None)


def pipelines_overview(names: list[str], load: Callable[[str], PipelineConfig]) -> list[dict]:
    """``pipeline_overview`` of each named pipeline; one that cannot be loaded or read shows its error."""
    overview = []
    for name in names:
        try:
            overview.append(pipeline_overview(load(name)))
        except Exception as err:  # noqa: BLE001 - one broken pipeline must not hide the others
            reason = str(err) if isinstance(err, OffsetlakeError) else f"{type(err).__name__}: {err}"
            overview.append({"pipeline": name, "topic": None, "last_commit_at": None, "last_batch": None,
                             "total_lag": None, "kafka_error": None, "error": reason})
    return overview
