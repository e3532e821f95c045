"""The offset ledger table ``<lake>/_offset_ledger``: a Delta projection of every batch.

Invariant 4: the sink commits are the source of truth. Each sink commit carries its ledger
entry in ``commitInfo.userMetadata``; this table only projects them (plus ``planned`` rows
written before a batch reads anything, and outcomes of batches that never committed).
``reconcile`` repairs the projection from sink history at the start and end of every run, and
``rebuild`` recreates it from sink history alone. Rows are only ever appended (so concurrent
writers never conflict), except by ``rebuild``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from offsetlake.plan import BatchPlan, OffsetRange

log = logging.getLogger("offsetlake.ledger")

PLANNED, COMMITTED, FAILED, SUPERSEDED, GAP = "planned", "committed", "failed", "superseded", "gap"
# A committed batch undone by a later rewind commit (``offsetlake.rewind``): it outranks committed,
# because the sink commit that rewound it comes after the one that committed it.
REWOUND = "rewound"
REWIND = "rewind"  # the kind of a rewind commit's ledger entry
_OUTCOME_RANK = {PLANNED: 0, FAILED: 1, SUPERSEDED: 2, COMMITTED: 3, GAP: 3, REWOUND: 4}
COMPACT_AFTER_FILES = 32  # per pipeline; see Ledger.compact_if_fragmented

LEDGER_SCHEMA = pa.schema(
    [
        ("pipeline", pa.string()),
        ("batch_id", pa.string()),
        ("kind", pa.string()),
        ("status", pa.string()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("start_offset", pa.int64()),
        ("end_offset", pa.int64()),
        ("records_read", pa.int64()),
        ("rows_written", pa.int64()),
        ("dead_letters", pa.int64()),
        ("sink_version", pa.int64()),
        ("run_id", pa.string()),
        ("dag_id", pa.string()),
        ("try_number", pa.int32()),
        ("planned_at", pa.timestamp("us", tz="UTC")),
        ("recorded_at", pa.timestamp("us", tz="UTC")),
        ("duration_ms", pa.int64()),
        ("message", pa.string()),
        # the Great Expectations summary (JSON) of the batch's last validation, and its report
        ("validation", pa.string()),
        ("validation_report", pa.string()),
    ]
)


@dataclass(frozen=True)
class RangeOutcome:
    """Per-range counts of a committed (or failed) batch."""

    range: OffsetRange
    records_read: int | None = None
    rows_written: int | None = None
    dead_letters: int | None = None


@dataclass(frozen=True)
class SinkCommit:
    """One offsetlake commit found in the sink table's history."""

    version: int
    entry: dict  # the ledger entry stored as userMetadata

    @property
    def batch_id(self) -> str:
        return self.entry["batch_id"]


class Ledger:
    def __init__(self, path: str, pipeline: str) -> None:
        self.path = path
        self.pipeline = pipeline
        self._schema_current = False

    # ---- writing -------------------------------------------------------------------------
    def _append(self, rows: list[dict]) -> None:
        if not rows:
            return
        table = pa.Table.from_pylist(rows, schema=LEDGER_SCHEMA)
        # Ledgers written before a column existed gain it once (a metadata change); every other
        # append stays a plain append so concurrent writers never conflict on metadata.
        merge = None
        if not self._schema_current:
            try:
                have = set(DeltaTable(self.path).schema().to_arrow().names)
            except TableNotFoundError:
                have = set(LEDGER_SCHEMA.names)
            merge = "merge" if set(LEDGER_SCHEMA.names) - have else None
        write_deltalake(self.path, table, mode="append", partition_by=["pipeline"], schema_mode=merge)
        self._schema_current = True

    def _row(self, plan_fields: dict, r: OffsetRange, status: str, **extra: object) -> dict:
        return {
            **plan_fields,
            "status": status,
            "topic": r.topic,
            "partition": r.partition,
            "start_offset": r.start,
            "end_offset": r.end,
            "recorded_at": datetime.now(UTC),
            **extra,
        }

    @staticmethod
    def _plan_fields(plan: BatchPlan) -> dict:
        return {
            "pipeline": plan.pipeline,
            "batch_id": plan.batch_id,
            "kind": plan.kind,
            "run_id": plan.run.run_id,
            "dag_id": plan.run.dag_id,
            "try_number": plan.run.try_number,
            "planned_at": plan.planned_at,
        }

    def record_plan(self, plan: BatchPlan) -> None:
        """Invariant 3: the plan is in the ledger before anything is read."""
        fields = self._plan_fields(plan)
        self._append([self._row(fields, r, PLANNED) for r in plan.ranges])

    def record_outcome(
        self, plan: BatchPlan, status: str, message: str | None = None, duration_ms: int | None = None,
        validation: dict | None = None,
    ) -> None:
        fields = self._plan_fields(plan)
        extra = _validation_columns(validation)
        self._append(
            [self._row(fields, r, status, message=message, duration_ms=duration_ms, **extra) for r in plan.ranges]
        )

    def record_commit(self, commit: SinkCommit) -> None:
        self._append(rows_for_commit(commit))

    # ---- reading -------------------------------------------------------------------------
    # Every read filters in Arrow before anything becomes Python rows: a plan reads this
    # table several times, and the table grows by a few rows per partition and batch forever.
    def rows(self, where: pc.Expression | None = None) -> pa.Table:
        """This pipeline's ledger rows matching ``where`` (all events, oldest first)."""
        try:
            table = DeltaTable(self.path)
        except TableNotFoundError:
            return LEDGER_SCHEMA.empty_table()
        mine = pc.field("pipeline") == self.pipeline
        data = table.to_pyarrow_dataset().to_table(filter=mine if where is None else mine & where)
        return data.sort_by([("recorded_at", "ascending")])

    def batches(self, where: pc.Expression | None = None) -> list[dict]:
        """One row per (batch, topic, partition): the batch's most final outcome.

        ``where`` must select whole batches (e.g. by batch id or run id), never single events.
        """
        return _best_outcomes(self.rows(where).to_pylist())

    def plan_for_run(self, dag_id: str | None, run_id: str, kind: str) -> BatchPlan | None:
        """The plan already recorded for this dag run, so a retry re-executes the same ranges.

        A superseded plan (another batch moved the committed end past its start) or a rewound
        batch can never apply again, so it is not returned: rerunning that dag run plans anew.
        """
        mine = self.rows(_run_filter(dag_id, run_id) & (pc.field("kind") == kind)).to_pylist()
        superseded = {r["batch_id"] for r in mine if r["status"] in (SUPERSEDED, REWOUND)}
        rows = [r for r in mine if r["status"] == PLANNED and r["batch_id"] not in superseded]
        if not rows:
            return None
        return self._plan_from_rows(rows, kind)

    def unfinished_plan(self, run_id: str, dag_id: str | None = None, kind: str = "ingest") -> BatchPlan | None:
        """The run's latest batch that was planned but neither committed nor superseded (e.g. it
        failed validation), so rerunning the run re-executes exactly those ranges first."""
        events = self.rows(_run_filter(dag_id, run_id) & (pc.field("kind") == kind)).to_pylist()
        batches: dict[str, list[dict]] = {}
        for row in _best_outcomes(events):
            batches.setdefault(row["batch_id"], []).append(row)
        open_ids = [b for b, rows in batches.items() if all(r["status"] in (PLANNED, FAILED) for r in rows)]
        if not open_ids:
            return None
        planned = [r for r in events if r["status"] == PLANNED and r["batch_id"] in open_ids]
        latest = max(planned, key=lambda r: r["planned_at"])["batch_id"]
        return self._plan_from_rows([r for r in planned if r["batch_id"] == latest], kind)

    def plan_by_batch_id(self, batch_id: str) -> BatchPlan | None:
        """The recorded plan of ``batch_id`` (what a spark-submit job is asked to execute)."""
        rows = self.rows((pc.field("batch_id") == batch_id) & (pc.field("status") == PLANNED)).to_pylist()
        return self._plan_from_rows(rows, rows[0]["kind"]) if rows else None

    def _plan_from_rows(self, rows: list[dict], kind: str) -> BatchPlan:
        from offsetlake.plan import RunContext

        first_batch = min(rows, key=lambda r: r["planned_at"])["batch_id"]
        mine = [r for r in rows if r["batch_id"] == first_batch]
        return BatchPlan(
            pipeline=self.pipeline,
            batch_id=first_batch,
            kind=kind,
            ranges=tuple(sorted(OffsetRange(r["topic"], r["partition"], r["start_offset"], r["end_offset"]) for r in mine)),
            run=RunContext(run_id=mine[0]["run_id"], dag_id=mine[0]["dag_id"], try_number=mine[0]["try_number"]),
            planned_at=mine[0]["planned_at"],
        )

    # ---- reconciliation ------------------------------------------------------------------
    def reconcile(self, sink_commits: list[SinkCommit], committed_end: Callable[[str, int], int | None]) -> int:
        """Make the ledger agree with the sink; returns the number of rows appended.

        Adds ``committed`` rows for sink commits the ledger lacks (a crash after the commit
        but before the ledger write), ``rewound`` rows for batches a later rewind commit lists
        (so re-reading history never resurrects them as committed), and ``superseded`` rows for
        planned batches that can no longer apply because a partition's committed end moved past
        their start.
        """
        events = self.rows()
        status = events["status"]
        # batches whose every (topic, partition) has a committed or gap event (the top rank)
        flagged = events.select(["batch_id", "topic", "partition"]).append_column(
            "done", pc.is_in(status, pa.array([COMMITTED, GAP])))
        per_tp = flagged.group_by(["batch_id", "topic", "partition"]).aggregate([("done", "max")])
        per_batch = per_tp.group_by("batch_id").aggregate([("done_max", "min")])
        complete = set(per_batch.filter(per_batch["done_max_min"])["batch_id"].to_pylist())
        rows: list[dict] = []
        for commit in sink_commits:
            if commit.batch_id not in complete:
                rows.extend(rows_for_commit(commit))
        marked = set(pc.unique(events.filter(pc.equal(status, REWOUND))["batch_id"]).to_pylist())
        rows.extend(row for row in rewound_rows(sink_commits) if row["batch_id"] not in marked)
        # ingest and stream batches with only `planned` events (backfills start below the committed end by
        # design: never "moved past"), not in the sink
        decided = set(pc.unique(events.filter(pc.not_equal(status, PLANNED))["batch_id"]).to_pylist())
        in_sink = {c.batch_id for c in sink_commits}
        open_plans: dict[str, dict[tuple[str, int], dict]] = {}
        txn_kinds = pc.is_in(events["kind"], pa.array(["ingest", "stream"]))
        for r in events.filter(pc.and_(pc.equal(status, PLANNED), txn_kinds)).to_pylist():
            if r["batch_id"] not in decided and r["batch_id"] not in in_sink:
                open_plans.setdefault(r["batch_id"], {})[(r["topic"], r["partition"])] = r
        for by_tp in open_plans.values():
            mine = sorted(by_tp.values(), key=lambda r: (r["topic"], r["partition"]))
            moved = [r for r in mine if (committed_end(r["topic"], r["partition"]) or -1) > r["start_offset"]]
            if moved:
                winner = covering_batch(sink_commits, moved[0]["topic"], moved[0]["partition"], moved[0]["start_offset"])
                message = (
                    f"superseded: {moved[0]['topic']}[{moved[0]['partition']}] was committed from "
                    f"{moved[0]['start_offset']} by batch {winner or 'unknown'}; this plan never committed"
                )
                now = datetime.now(UTC)
                rows.extend({**r, "status": SUPERSEDED, "message": message, "recorded_at": now} for r in mine)
        self._append(rows)
        if rows:
            log.info("ledger reconciled pipeline=%s rows_added=%d", self.pipeline, len(rows))
        return len(rows)

    def compact_if_fragmented(self, max_files: int = COMPACT_AFTER_FILES) -> bool:
        """Rewrite this pipeline's ledger files into one once there are more than ``max_files``.

        Every append adds a small file, and reading thousands of them made each plan slower
        than the last (2.8 s to read 774 files after 1,298 campaign steps). Compaction is a
        dataChange=false commit, so concurrent appends are unaffected; losing a race with another
        compaction only means someone else did it. The replaced files stay on disk until
        ``vacuum``.
        """
        try:
            table = DeltaTable(self.path)
        except TableNotFoundError:
            return False
        mine = [("pipeline", "=", self.pipeline)]
        files = len(table.file_uris(file_pruning_predicate=mine))
        if files <= max_files:
            return False
        try:
            metrics = table.optimize.compact(partition_filters=mine)
        except (CommitFailedError, DeltaError) as err:
            log.info("ledger compaction skipped pipeline=%s reason=\"%s\"", self.pipeline, str(err).splitlines()[0])
            return False
        log.info("ledger compacted pipeline=%s files_removed=%s files_added=%s", self.pipeline,
                 metrics.get("numFilesRemoved"), metrics.get("numFilesAdded"))
        return True

    def rebuild(self, sink_commits: list[SinkCommit]) -> int:
        """Recreate this pipeline's rows from sink history alone (invariant 4), rewound batches
        included as ``rewound``."""
        rows = [row for commit in sink_commits for row in rows_for_commit(commit)] + rewound_rows(sink_commits)
        if DeltaTable.is_deltatable(self.path):
            table = DeltaTable(self.path)
            table.delete(f"pipeline = '{self.pipeline}'")
        self._append(rows)
        return len(rows)


def _run_filter(dag_id: str | None, run_id: str) -> pc.Expression:
    same_dag = pc.field("dag_id").is_null() if dag_id is None else pc.field("dag_id") == dag_id
    return (pc.field("run_id") == run_id) & same_dag


def _best_outcomes(events: list[dict]) -> list[dict]:
    """One row per (batch, topic, partition) out of its events: the most final outcome, with the
    plan's planned_at unless it committed."""
    best: dict[tuple, dict] = {}
    for row in events:
        key = (row["batch_id"], row["topic"], row["partition"])
        seen = best.get(key)
        if seen is None or _OUTCOME_RANK[row["status"]] >= _OUTCOME_RANK[seen["status"]]:
            merged = dict(row)
            if seen is not None and row["status"] != COMMITTED:
                merged["planned_at"] = seen["planned_at"]
            best[key] = merged
    return sorted(best.values(), key=lambda r: (r["planned_at"], r["batch_id"], r["topic"], r["partition"]))


def covering_batch(commits: Iterable[SinkCommit], topic: str, partition: int, offset: int) -> str | None:
    """The first commit whose ranges hold ``offset`` (rewound batches skipped: a rewind commit
    covering it is named instead)."""
    commits = list(commits)
    rewound = rewound_batches(commits)
    for commit in commits:
        if commit.batch_id in rewound:
            continue
        for r in commit.entry.get("ranges", []):
            if r["topic"] == topic and r["partition"] == partition and r["start"] <= offset < r["end"]:
                return commit.batch_id
    return None


def rewound_batches(commits: Iterable[SinkCommit]) -> dict[str, SinkCommit]:
    """Batch id → the rewind commit that undid it, from the ``rewound`` list every rewind commit
    carries in its ledger entry. Sink history is the truth (invariant 4): this is how the ledger
    learns which committed batches no longer count."""
    undone: dict[str, SinkCommit] = {}
    for commit in sorted(commits, key=lambda c: c.version):
        if commit.entry.get("kind") == REWIND:
            for batch_id in commit.entry.get("rewound", []):
                undone.setdefault(batch_id, commit)
    return undone


def rewound_rows(commits: Iterable[SinkCommit]) -> list[dict]:
    """``rewound`` ledger rows (one per range) for every batch a rewind commit undid."""
    commits = list(commits)
    by_id = {c.batch_id: c for c in commits}
    rows = []
    for batch_id, rewind in rewound_batches(commits).items():
        if batch_id not in by_id:
            continue
        entry = rewind.entry
        message = (f"rewound by {entry['batch_id']} (sink version {rewind.version}) to batch {entry.get('to_batch')}: "
                   f"{entry.get('reason') or 'no reason given'}")
        recorded = _ts(entry.get("committed_at")) or datetime.now(UTC)
        rows.extend({**row, "status": REWOUND, "message": message, "recorded_at": recorded}
                    for row in rows_for_commit(by_id[batch_id]))
    return rows


def _ts(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def rows_for_commit(commit: SinkCommit) -> list[dict]:
    entry = commit.entry
    status = GAP if entry.get("kind") == "gap" else COMMITTED
    return [
        {
            "pipeline": entry["pipeline"],
            "batch_id": entry["batch_id"],
            "kind": entry.get("kind", "ingest"),
            "status": status,
            "topic": r["topic"],
            "partition": r["partition"],
            "start_offset": r["start"],
            "end_offset": r["end"],
            "records_read": r.get("records_read"),
            "rows_written": r.get("rows_written"),
            "dead_letters": r.get("dead_letters"),
            "sink_version": commit.version,
            "run_id": entry.get("run_id"),
            "dag_id": entry.get("dag_id"),
            "try_number": entry.get("try_number"),
            "planned_at": _ts(entry.get("planned_at")),
            "recorded_at": _ts(entry.get("committed_at")) or datetime.now(UTC),
            "duration_ms": entry.get("duration_ms"),
            "message": entry.get("message"),
            **_validation_columns(entry.get("validation")),
        }
        for r in entry.get("ranges", [])
    ]


def _validation_columns(summary: dict | None) -> dict:
    if not summary:
        return {}
    return {"validation": json.dumps(summary, separators=(",", ":"), default=str), "validation_report": summary.get("report")}


def ledger_entry_json(entry: dict) -> str:
    return json.dumps(entry, separators=(",", ":"), sort_keys=True)
