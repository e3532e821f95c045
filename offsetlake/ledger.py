"""The offset ledger table ``<lake>/_offset_ledger``: a Delta projection of every batch.

Invariant 4: the sink commits are the source of truth. Each sink commit carries its ledger
entry in ``commitInfo.userMetadata`` (``offsetlake.history``); this table only projects them
(plus ``planned`` rows written before a batch reads anything, invariant 3, and outcomes of
batches that never committed). ``reconcile`` repairs the projection from sink history at the
start and end of every run, and ``rebuild`` recreates it from sink history alone. Rows are only
ever appended (so concurrent writers never conflict), except by ``rebuild``. A batch's rows are
shown to people through one view, ``offsetlake.batch_view.BatchView``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from offsetlake import storage
from offsetlake.config import PipelineConfig
from offsetlake.entry import RewindEntry, for_plan
from offsetlake.history import SinkCommit, covering_batch, rewound_batches, sink_commits
from offsetlake.plan import (
    OFFSET_MOVING_KINDS,
    BatchKind,
    BatchPlan,
    BatchStatus,
    OffsetRange,
    ReaderSchema,
    RecordTimeWindow,
    RunContext,
)
from offsetlake.sink import committed_end_lookup

log = logging.getLogger("offsetlake.ledger")

PLANNED, FAILED, SUPERSEDED = BatchStatus.PLANNED, BatchStatus.FAILED, BatchStatus.SUPERSEDED
COMMITTED, GAP, REWOUND = BatchStatus.COMMITTED, BatchStatus.GAP, BatchStatus.REWOUND
COMPACT_AFTER_FILES = 32  # per pipeline; see Ledger.compact_if_fragmented
ABANDON_AFTER_S = 3600.0  # a planned backfill with no outcome this long after its plan: its process died

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
        # a backfill by time: the record timestamps it selects within its ranges, [from, to) in ms
        ("record_time_from_ms", pa.int64()),
        ("record_time_to_ms", pa.int64()),
        # the reader schema its records decode into (JSON of ``offsetlake.plan.ReaderSchema``)
        ("reader_schema", pa.string()),
        # Kafka's id of the row's topic when the batch was planned (invariant 16), where known
        ("topic_id", pa.string()),
        # the Delta id of the sink table the batch was planned on, where there was one (invariant 16)
        ("sink_table_id", pa.string()),
    ]
)


class Ledger:
    """One pipeline's rows of the ledger table."""

    def __init__(self, path: storage.Where, pipeline: str) -> None:
        self.path = path
        self.pipeline = pipeline
        self._schema_current = False

    @classmethod
    def of(cls, config: PipelineConfig) -> Ledger:
        return cls(config.layout.ledger, config.name)

    # ---- writing -------------------------------------------------------------------------
    def _append(self, rows: list[dict]) -> None:
        if not rows:
            return
        table = pa.Table.from_pylist(rows, schema=LEDGER_SCHEMA)
        # Ledgers written before a column existed gain it once (a metadata change); every other
        # append stays a plain append so concurrent writers never conflict on metadata.
        merge = False
        if not self._schema_current:
            try:
                have = set(storage.table(self.path).schema().to_arrow().names)
            except TableNotFoundError:
                have = set(LEDGER_SCHEMA.names)
            merge = bool(set(LEDGER_SCHEMA.names) - have)
        if merge:
            storage.append(self.path, table, partition_by=["pipeline"], schema_mode="merge")
        else:
            storage.append(self.path, table, partition_by=["pipeline"])
        self._schema_current = True

    def record_plan(self, plan: BatchPlan) -> None:
        """Invariant 3: the plan is in the ledger before anything is read."""
        self._append(for_plan(plan).ledger_rows(PLANNED, duration_ms=None))

    def record_outcome(
        self,
        plan: BatchPlan,
        status: BatchStatus,
        message: str | None = None,
        duration_ms: int | None = None,
        validation: dict | None = None,
    ) -> None:
        """A batch that did not commit: ``failed`` (why, and its validation summary) or ``superseded``.
        Called only by ``runs.record_outcome``, which decides the status from the error."""
        self._append(for_plan(plan, validation=validation).ledger_rows(status, duration_ms=duration_ms, message=message))

    def record_commit(self, commit: SinkCommit) -> None:
        self._append(rows_for_commit(commit))

    def _own_files(self) -> list[tuple[str, str, str]]:
        """delta-rs's file pruning to this pipeline's partition of the table."""
        return [("pipeline", "=", self.pipeline)]

    # ---- reading -------------------------------------------------------------------------
    # Every read filters in Arrow before anything becomes Python rows: a plan reads this
    # table several times, and the table grows by a few rows per partition and batch forever.
    def rows(self, where: pc.Expression | None = None) -> pa.Table:
        """This pipeline's ledger rows matching ``where`` (all events, oldest first)."""
        table = storage.open_table(self.path)
        if table is None:
            return LEDGER_SCHEMA.empty_table()
        mine = pc.field("pipeline") == self.pipeline
        # Only this pipeline's files: the table is partitioned by pipeline, and building a dataset
        # costs per file (about 3 ms each in delta-rs), so a lake of many pipelines would pay for
        # every other pipeline's files on each read. The row filter stays: pruning is per file.
        dataset = table.to_pyarrow_dataset(file_pruning_predicate=self._own_files())
        data = dataset.to_table(filter=mine if where is None else mine & where)
        return data.sort_by([("recorded_at", "ascending")])

    def committed_batches(self, kinds: Iterable[BatchKind]) -> set[str]:
        """The batch ids of ``kinds`` the ledger recorded ``committed`` (and no rewind undid):
        what a sink's history must hold (a Kafka sink's commit log, ``kafka_sink.read_state``)."""
        kind_names = pa.array(sorted(str(k) for k in kinds))
        rows = self.rows(pc.field("kind").isin(kind_names) & pc.field("status").isin(pa.array([str(COMMITTED), str(REWOUND)])))
        rewound = set(pc.unique(rows.filter(pc.equal(rows["status"], str(REWOUND)))["batch_id"]).to_pylist())
        return set(pc.unique(rows["batch_id"]).to_pylist()) - rewound

    def batches(self, where: pc.Expression | None = None) -> list[dict]:
        """One row per (batch, topic, partition): the batch's most final outcome.

        ``where`` must select whole batches (e.g. by batch id or run id), never single events.
        """
        return _best_outcomes(self.rows(where).to_pylist())

    def batches_as_reconciled(self, sink_commits: list[SinkCommit]) -> list[dict]:
        """``batches()`` as they will be once ``reconcile`` has recorded what the sink's history
        holds (a commit whose ledger write a crash prevented, a rewind's ``rewound`` batches),
        without writing anything: what read-only views and the audit show."""
        rows = self.batches()
        final = {r["batch_id"] for r in rows if BatchStatus(r["status"]).committed or r["status"] == REWOUND}
        rewound = {r["batch_id"] for r in rows if r["status"] == REWOUND}
        missing = [row for c in sink_commits if c.batch_id not in final for row in rows_for_commit(c)]
        missing += [row for row in rewound_rows(sink_commits) if row["batch_id"] not in rewound]
        if not missing:
            return rows
        replaced = {(r["batch_id"], r["topic"], r["partition"]) for r in missing}
        return _best_outcomes([r for r in rows if (r["batch_id"], r["topic"], r["partition"]) not in replaced] + missing)

    def run_plan(self, run: RunContext, kind: BatchKind) -> tuple[BatchPlan, BatchStatus] | None:
        """The latest plan this run recorded that can still apply, with the batch's status: what a
        rerun of the run executes again (invariant 3) — an Airflow retry or clear of the dag run,
        or ``offsetlake run --run-id``. A superseded plan (another batch moved the committed end
        past its start) or a rewound batch can never apply again, so it is not returned: rerunning
        that run plans anew. The one home of "reuse this run's recorded plan".
        """
        events = self.rows(_run_filter(run.dag_id, run.run_id) & (pc.field("kind") == str(kind))).to_pylist()
        final: dict[str, list[BatchStatus]] = {}
        for row in _best_outcomes(events):
            final.setdefault(row["batch_id"], []).append(BatchStatus(row["status"]))
        usable = {b for b, states in final.items() if not any(s in (SUPERSEDED, REWOUND) for s in states)}
        planned = [r for r in events if r["status"] == PLANNED and r["batch_id"] in usable]
        if not planned:
            return None
        latest = max(planned, key=lambda r: (r["planned_at"], r["batch_id"]))["batch_id"]
        status = min(final[latest], key=lambda s: s.rank)
        return _plan_from_rows([r for r in planned if r["batch_id"] == latest], self.pipeline), status

    def plan_by_batch_id(self, batch_id: str) -> BatchPlan | None:
        """The recorded plan of ``batch_id`` (what a spark-submit job is asked to execute)."""
        rows = self.rows((pc.field("batch_id") == batch_id) & (pc.field("status") == str(PLANNED))).to_pylist()
        return _plan_from_rows(rows, self.pipeline) if rows else None

    # ---- reconciliation ------------------------------------------------------------------
    def reconcile(
        self, sink_commits: list[SinkCommit], committed_end: Callable[[str, int], int | None], abandon_after_s: float = ABANDON_AFTER_S
    ) -> int:
        """Make the ledger agree with the sink; returns the number of rows appended.

        Adds ``committed`` rows for sink commits the ledger lacks (a crash after the commit
        but before the ledger write), ``rewound`` rows for batches a later rewind commit lists
        (so re-reading history never resurrects them as committed), ``superseded`` rows for
        planned batches that can no longer apply because a partition's committed end moved past
        their start, and ``failed`` rows for other planned batches (backfills) left without any
        outcome for ``abandon_after_s``: their process died. A backfill still running past that
        time is only shown failed until it commits (committed outranks failed), and a failed
        plan can still be run again (an Airflow clear).
        """
        events = self.rows()
        status = events["status"]
        # batches whose every (topic, partition) has a committed or gap event (the top rank)
        flagged = events.select(["batch_id", "topic", "partition"]).append_column(
            "done", pc.is_in(status, pa.array([str(COMMITTED), str(GAP)]))
        )
        per_tp = flagged.group_by(["batch_id", "topic", "partition"]).aggregate([("done", "max")])
        per_batch = per_tp.group_by("batch_id").aggregate([("done_max", "min")])
        complete = set(per_batch.filter(per_batch["done_max_min"])["batch_id"].to_pylist())
        rows: list[dict] = []
        for commit in sink_commits:
            if commit.batch_id not in complete:
                rows.extend(rows_for_commit(commit))
        marked = set(pc.unique(events.filter(pc.equal(status, str(REWOUND)))["batch_id"]).to_pylist())
        rows.extend(row for row in rewound_rows(sink_commits) if row["batch_id"] not in marked)
        # batches planned from the committed ends with only `planned` events, not in the sink
        # (backfills start below the committed end by design: never "moved past")
        decided = set(pc.unique(events.filter(pc.not_equal(status, str(PLANNED)))["batch_id"]).to_pylist())
        in_sink = {c.batch_id for c in sink_commits}
        open_plans: dict[str, dict[tuple[str, int], dict]] = {}
        forward = pc.is_in(events["kind"], pa.array(sorted(str(k) for k in OFFSET_MOVING_KINDS)))
        for r in events.filter(pc.and_(pc.equal(status, str(PLANNED)), forward)).to_pylist():
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
                rows.extend({**r, "status": str(SUPERSEDED), "message": message, "recorded_at": now} for r in mine)
        rows.extend(self._abandoned(events, decided | in_sink, abandon_after_s))
        self._append(rows)
        if rows:
            log.info("ledger reconciled pipeline=%s rows_added=%d", self.pipeline, len(rows))
        return len(rows)

    def _abandoned(self, events: pa.Table, decided: set[str], abandon_after_s: float) -> list[dict]:
        """``failed`` rows for planned batches not planned from the committed ends (backfills)
        that have no outcome and were planned more than ``abandon_after_s`` ago."""
        now = datetime.now(UTC)
        forward = {str(k) for k in OFFSET_MOVING_KINDS}
        planned = [
            r
            for r in events.filter(pc.equal(events["status"], str(PLANNED))).to_pylist()
            if r["batch_id"] not in decided and r["kind"] not in forward
        ]
        stale = [r for r in planned if r["planned_at"] is None or (now - r["planned_at"]).total_seconds() >= abandon_after_s]
        message = (
            "failed: no outcome was recorded and nothing of it was committed; the process running it stopped "
            "(killed?) before its commit. Run it again (Airflow: clear the dag run) if it is still wanted"
        )
        return [{**r, "status": str(FAILED), "message": message, "recorded_at": now} for r in stale]

    def compact_if_fragmented(self, max_files: int = COMPACT_AFTER_FILES) -> bool:
        """Rewrite this pipeline's ledger files into one once there are more than ``max_files``.

        Every append adds a small file, and reading thousands of them made each plan slower
        than the last (2.8 s to read 774 files after 1,298 campaign steps). Compaction is a
        dataChange=false commit, so concurrent appends are unaffected; losing a race with another
        compaction only means someone else did it. The replaced files stay on disk until
        ``vacuum``.
        """
        table = storage.open_table(self.path)
        if table is None:
            return False
        mine = self._own_files()
        files = len(table.file_uris(file_pruning_predicate=mine))
        if files <= max_files:
            return False
        try:
            metrics = table.optimize.compact(partition_filters=mine)
        except (CommitFailedError, DeltaError) as err:
            log.info('ledger compaction skipped pipeline=%s reason="%s"', self.pipeline, str(err).splitlines()[0])
            return False
        log.info(
            "ledger compacted pipeline=%s files_removed=%s files_added=%s",
            self.pipeline,
            metrics.get("numFilesRemoved"),
            metrics.get("numFilesAdded"),
        )
        return True

    def rebuild(self, sink_commits: list[SinkCommit]) -> int:
        """Recreate this pipeline's rows from sink history alone (invariant 4), rewound batches
        included as ``rewound``."""
        rows = [row for commit in sink_commits for row in rows_for_commit(commit)] + rewound_rows(sink_commits)
        if storage.is_table(self.path):
            table = storage.table(self.path)
            table.delete(f"pipeline = '{self.pipeline}'")
        self._append(rows)
        return len(rows)


def reconcile_ledger(config: PipelineConfig, ledger: Ledger | None = None, abandon_after_s: float = ABANDON_AFTER_S) -> int:
    """Invariant 4: bring the pipeline's ledger projection in line with the sink's history."""
    ledger = ledger or Ledger.of(config)
    table = storage.open_table(config.layout.sink)
    added = ledger.reconcile(sink_commits(table, config.name), committed_end_lookup(table, config), abandon_after_s)
    if table is not None:
        ledger.compact_if_fragmented()
    return added


def _run_filter(dag_id: str | None, run_id: str) -> pc.Expression:
    same_dag = pc.field("dag_id").is_null() if dag_id is None else pc.field("dag_id") == dag_id
    return (pc.field("run_id") == run_id) & same_dag


def _plan_from_rows(rows: list[dict], pipeline: str) -> BatchPlan:
    """The plan that ``planned`` rows recorded (the earliest batch among them)."""
    first_batch = min(rows, key=lambda r: r["planned_at"])["batch_id"]
    mine = [r for r in rows if r["batch_id"] == first_batch]
    time_from, time_to = mine[0].get("record_time_from_ms"), mine[0].get("record_time_to_ms")
    return BatchPlan(
        pipeline=pipeline,
        batch_id=first_batch,
        kind=BatchKind(mine[0]["kind"]),
        ranges=tuple(sorted(OffsetRange(r["topic"], r["partition"], r["start_offset"], r["end_offset"]) for r in mine)),
        run=RunContext(run_id=mine[0]["run_id"], dag_id=mine[0]["dag_id"], try_number=mine[0]["try_number"]),
        planned_at=mine[0]["planned_at"],
        window=RecordTimeWindow(time_from, time_to) if time_from is not None and time_to is not None else None,
        reader_schema=ReaderSchema.from_dict(json.loads(mine[0]["reader_schema"]) if mine[0].get("reader_schema") else None),
        topic_ids={r["topic"]: r["topic_id"] for r in mine if r.get("topic_id")},
        sink_table_id=mine[0].get("sink_table_id"),
    )


def _best_outcomes(events: list[dict]) -> list[dict]:
    """One row per (batch, topic, partition) out of its events: the most final outcome, with the
    plan's planned_at unless it committed."""
    best: dict[tuple, dict] = {}
    for row in events:
        key = (row["batch_id"], row["topic"], row["partition"])
        seen = best.get(key)
        if seen is None or BatchStatus(row["status"]).rank >= BatchStatus(seen["status"]).rank:
            merged = dict(row)
            if seen is not None and row["status"] != COMMITTED:
                merged["planned_at"] = seen["planned_at"]
            best[key] = merged
    return sorted(best.values(), key=lambda r: (r["planned_at"], r["batch_id"], r["topic"], r["partition"]))


# ---- ledger entries -> rows (``LedgerEntry.ledger_rows``) ---------------------------------------
def rows_for_commit(commit: SinkCommit) -> list[dict]:
    """The ledger rows a sink commit stands for: ``gap`` for a gap batch, else ``committed``."""
    status = GAP if commit.kind == BatchKind.GAP else COMMITTED
    return commit.entry.ledger_rows(status, commit.version, recorded_at=commit.entry.committed_time)


def rewound_rows(commits: list[SinkCommit]) -> list[dict]:
    """``rewound`` ledger rows (one per range) for every batch a rewind commit undid."""
    by_id = {c.batch_id: c for c in commits}
    rows = []
    for batch_id, rewind in rewound_batches(commits).items():
        if batch_id not in by_id:
            continue
        entry = rewind.entry
        assert isinstance(entry, RewindEntry)  # rewound_batches names rewind commits only
        message = (
            f"rewound by {entry.batch_id} (sink version {rewind.version}) to batch {entry.to_batch}: {entry.reason or 'no reason given'}"
        )
        commit = by_id[batch_id]
        rows.extend(commit.entry.ledger_rows(REWOUND, commit.version, recorded_at=entry.committed_time, message=message))
    return rows
