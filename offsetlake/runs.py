"""Runs: a batch executed by kind, a run of batches until caught up, and how each batch ended.

A batch flows once through plan -> read -> decode -> transform -> validate -> stage -> commit ->
record. ``execute_batch`` dispatches a recorded plan by its kind: ``ingest`` and ``stream``
append their files and move the committed ends (``offsetlake.sink.commit_batch``), ``gap``
moves them over lost offsets without rows, ``backfill`` replaces rows below them
(``offsetlake.backfill``). ``record_outcome`` is the one place a batch that did not commit gets
its ledger row — ``superseded`` when another writer won (invariants 3 and 10), else ``failed`` —
for the CLI, the spark-submit job, the Airflow tasks and the stream alike. Spark starts only when
a plan has records to read, so a run with nothing new costs a few Kafka and Delta round trips.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from offsetlake import dead_letters, failpoints, foreign, kafka_sink, storage
from offsetlake.backfill import execute_backfill
from offsetlake.batch_view import BatchView
from offsetlake.config import PipelineConfig
from offsetlake.entry import for_plan
from offsetlake.errors import (
    CommitConflictError,
    LeaseLostError,
    OffsetlakeError,
    StalePlanError,
    StorageError,
    StreamAbandoned,
    is_transient,
)
from offsetlake.history import (
    SinkCommit,
    covering_batch,
    current_epochs,
    refuse_foreign_sink,
    rewound_batches,
    sink_commits,
)
from offsetlake.kafka import current_offsets
from offsetlake.lease import refuse_if_stream_owns
from offsetlake.ledger import Ledger, reconcile_ledger
from offsetlake.log_lines import log_line, log_step
from offsetlake.plan import BatchKind, BatchPlan, BatchResult, BatchStatus, RunContext
from offsetlake.planner import TopicPartitionKey, plan_next_batch
from offsetlake.process import ProcessedBatch, process_ranges, stage_engine_merge, stage_files, stage_merge
from offsetlake.sink import (
    WrittenFiles,
    add_columns_first,
    check_plan_applies,
    commit_batch,
    ensure_table,
    evolved_schema,
    open_table,
    table_schema,
)
from offsetlake.sinks.choice import open_sink
from offsetlake.spark import release_memory
from offsetlake.validation import load_suite

if TYPE_CHECKING:
    from deltalake import DeltaTable

log = logging.getLogger("offsetlake.runs")


# ---- projections of the sink's history --------------------------------------------------------
def reconcile(config: PipelineConfig, ledger: Ledger | None = None) -> None:
    """Invariant 4: bring both projections of the sink's history in line with it before a run
    reads them — the dead-letter table (a change a crash left pending after its sink commit) and
    the ledger (commits it lacks, plans that can no longer apply). First, an object store that
    cannot be used or cannot commit safely is refused (``PipelineConfig.check_storage``), and so is
    a sink table that belongs to another pipeline (invariant 16), before anything is planned."""
    config.check_storage()
    if config.sink.is_kafka:  # its history is the commit log (its group's offsets are restored from it)
        kafka_sink.reconcile(config, ledger or Ledger.of(config))
        return
    table = open_table(config.layout.sink)
    refuse_foreign_sink(table, config.name)
    dead_letters.apply_pending(config)
    reconcile_ledger(config, ledger or Ledger.of(config))
    # commits offsetlake did not make since its own last one: said at every run until the next
    # batch commits after them (status and audit keep saying them): docs/design.md, "Foreign commits"
    last_own = max((c.version for c in sink_commits(table, config.name)), default=-1)
    foreign.report(table, config.name, since_version=last_own)


# ---- how a batch ended ------------------------------------------------------------------------
def record_outcome(ledger: Ledger, plan: BatchPlan, err: BaseException) -> BatchStatus:
    """Record why ``plan`` did not commit; returns the status recorded. The only caller of
    ``Ledger.record_outcome``: every batch that does not commit gets its row here, whoever ran it
    (docs/design.md, "How a batch ends").

    Another writer won (CommitConflictError, invariant 10) or moved the committed ends past the
    plan or already holds its ranges (StalePlanError, invariant 3): ``superseded`` — the plan can
    never apply again, a rerun plans anew. A stream that stopped or lost its lease before the
    commit (StreamAbandoned, LeaseLostError): ``failed``, "abandoned: <why>". Anything else:
    ``failed``, with our errors' message verbatim and, for a failed validation, its summary and
    report.
    """
    status, message, validation = _outcome_of(err)
    try:
        ledger.record_outcome(plan, status, message=message[:4000], validation=validation)
    except OSError as unrecorded:
        if not isinstance(err, StorageError):
            raise
        # The store that failed the batch cannot take its outcome either: the batch stays
        # `planned` until the next run's reconcile marks it (its plan no longer applies, or it
        # committed after all); the store's error is the one to report.
        log_line(log, "unrecorded", plan=plan, level=logging.WARNING, reason=storage.describe_store_error(unrecorded))
    return status


def _outcome_of(err: BaseException) -> tuple[BatchStatus, str, dict | None]:
    """The status, message and validation summary ``record_outcome`` records for ``err``."""
    if isinstance(err, CommitConflictError | StalePlanError):
        return BatchStatus.SUPERSEDED, str(err), None
    if isinstance(err, StreamAbandoned | LeaseLostError):
        return BatchStatus.FAILED, f"abandoned: {err}", None
    message = str(err) if isinstance(err, OffsetlakeError) else f"{type(err).__name__}: {err}"
    return BatchStatus.FAILED, message, getattr(err, "summary", None) or None


# ---- one batch --------------------------------------------------------------------------------
def execute_batch(
    config: PipelineConfig,
    plan: BatchPlan,
    ledger: Ledger,
    spark_factory: Callable,
    before_commit: Callable[[], None] = lambda: None,
    restore_deleted: bool = False,
) -> BatchResult:
    """Execute exactly ``plan``'s ranges, by the plan's kind; never anything else.

    If the sink already holds the plan (a rerun after a commit) this is a no-op that succeeds.
    Raises StalePlanError if another batch moved a partition part-way, and CommitConflictError
    if another writer won the commit race (invariant 10); nothing is committed then. Errors raised
    inside Spark tasks (a range no longer readable, a read timeout) surface as themselves. The
    rows carry each topic's current epoch (``with_current_epochs``).
    ``before_commit`` runs right before the sink commit; raising there commits nothing (a stream
    checks its lease there). ``restore_deleted``: a backfill writes again the rows commits
    offsetlake did not make deleted (``backfill.execute_backfill``).
    """
    from offsetlake.reader import errors_from_spark_tasks

    if config.sink.is_kafka:
        with errors_from_spark_tasks(), storage_errors_named(config, plan):
            return kafka_sink.execute(config, plan, ledger, spark_factory, before_commit)
    plan = with_current_epochs(config, plan)
    with errors_from_spark_tasks(), storage_errors_named(config, plan):
        if plan.kind == BatchKind.BACKFILL:
            return _execute_backfill(config, plan, ledger, spark_factory, restore_deleted)
        return _execute_forward(config, plan, ledger, spark_factory, before_commit)


def with_current_epochs(config: PipelineConfig, plan: BatchPlan) -> BatchPlan:
    """``plan`` with each topic's current epoch from the sink's history (``BatchPlan.topic_epochs``).

    Read when the batch executes, not when it was planned: a plan recorded before an epoch commit
    no longer applies anyway (the epoch commit moved its committed ends, or, for a backfill, the
    range is no longer below them), and an epoch commit landing while the batch runs makes its
    commit fail (it moves the same txns; a backfill checks, see ``backfill.commit_replace``)."""
    from dataclasses import replace

    return replace(plan, topic_epochs=current_epochs(sink_commits(open_table(config.layout.sink), config.name)))


@contextmanager
def storage_errors_named(config: PipelineConfig, plan: BatchPlan) -> Iterator[None]:
    """An object store failing under a batch (down, timing out, refusing) becomes one clear
    StorageError naming the pipeline, the batch, its offsets and the store; nothing of the batch
    is visible unless its commit landed (a Delta commit is one put-if-absent: all or nothing),
    and the next run finds out which from the sink's txns."""
    try:
        yield
    except OSError as err:
        if not storage.is_uri(config.lake_path) and not storage.is_uri(config.sink_path):
            raise
        raise StorageError(
            f"batch {plan.batch_id} ({plan.describe()}): the object store "
            f"({storage.store_name(config.layout.lake)}) failed: {storage.describe_store_error(err)}; the batch did not "
            "commit unless the ledger or `offsetlake status` shows it committed; run again once the store answers",
            pipeline=config.name,
            batch_id=plan.batch_id,
        ) from err


def _execute_forward(
    config: PipelineConfig,
    plan: BatchPlan,
    ledger: Ledger,
    spark_factory: Callable,
    before_commit: Callable[[], None],
) -> BatchResult:
    """An ingest, stream or gap batch: files (none for a gap) + committed ends moved to the plan's
    ends + its ledger entry, in one sink commit."""
    started = time.monotonic()
    if not check_plan_applies(open_table(config.layout.sink), config, plan):
        return _plan_already_held(config, plan, ledger, started, {"total": 0})
    if plan.kind == BatchKind.GAP:
        return _commit_gap(config, plan, ledger, started, before_commit)
    suite = load_suite(config)  # a typo in the suite fails here, before Spark starts or anything is read
    spark = spark_factory()
    processed = process_ranges(config, plan, spark, suite, write_in_read=True)
    try:
        staged = _stage(config, plan, processed, spark)
        if staged is None:
            return _plan_already_held(config, plan, ledger, started, processed.timings_ms)
        table, files, removed, merged, schema = staged
        t = time.monotonic()
        entry = for_plan(
            plan,
            processed.per_range,
            started,
            processed.validation,
            staged=processed.dead_letter_files,
            merge=merged,
            data_path=str(processed.path.path),
        )
        before_commit()
        version = commit_batch(table, config, plan, files, entry, schema, removed=removed)
        processed.timings_ms["commit"] = log_step(
            "commit",
            plan,
            t,
            sink_version=version,
            rows=files.rows,
            removed_files=len(removed) if removed else None,
            new_columns=",".join(schema.names[len(table_schema(table)) :]) if schema else None,
        )
    finally:
        processed.release()
    return _committed(config, ledger, plan, SinkCommit(version, entry), processed, started)


def _committed(
    config: PipelineConfig, ledger: Ledger, plan: BatchPlan, commit: SinkCommit, processed: ProcessedBatch, started: float
) -> BatchResult:
    """After a batch's sink commit: its pending dead letters applied (invariant 8), its ledger row
    written, its result."""
    failpoints.failpoint("after_commit")
    dead_letters.apply_pending(config)
    ledger.record_commit(commit)
    failpoints.failpoint("after_ledger")
    processed.timings_ms["total"] = int((time.monotonic() - started) * 1000)
    return BatchResult(plan, BatchStatus.COMMITTED, commit.version, processed.per_range, processed.timings_ms)


def _stage(
    config: PipelineConfig, plan: BatchPlan, processed: ProcessedBatch, spark: Any
) -> tuple[DeltaTable, WrittenFiles, list[dict], dict[str, int] | None, pa.Schema | None] | None:
    """The batch's files staged for its commit, with the table snapshot to commit on, the files it
    removes (a keyed merge), the merge's counts and the evolved schema; None if meanwhile the
    sink already holds the plan (invariant 3)."""
    rows_schema = processed.rows_schema
    if config.sink.engine is not None:
        return _stage_engine(config, plan, processed, spark)
    if config.sink.mode != "upsert":
        files = stage_files(config, plan, processed, processed.rows, spark)
        table = ensure_table(config, rows_schema)
        if not check_plan_applies(table, config, plan):
            return None
        return table, files, [], None, evolved_schema(table, config, rows_schema, plan)
    # the merge reads the table: the commit is made on that same snapshot (invariant 10)
    table = ensure_table(config, rows_schema)
    if not check_plan_applies(table, config, plan):
        return None
    schema = evolved_schema(table, config, rows_schema, plan)
    merge = stage_merge(config, plan, processed, spark, table)
    if schema is not None and merge.removed:
        table = add_columns_first(table, config, schema, plan)  # a commit cannot both
        schema = None
    return table, merge.files, merge.removed, merge.counts.as_dict(), schema


def _stage_engine(
    config: PipelineConfig, plan: BatchPlan, processed: ProcessedBatch, spark: Any
) -> tuple[DeltaTable, WrittenFiles, list[dict], dict[str, int] | None, pa.Schema | None] | None:
    """A merge engine's batch staged (``offsetlake.engines``): the table is made from the engine's
    row shape, which the batch's records give."""
    table = open_table(config.layout.sink)
    if table is not None and not check_plan_applies(table, config, plan):
        return None
    merge = stage_engine_merge(config, plan, processed, spark, table)
    shape = merge.shape
    if table is None:
        table = ensure_table(config, shape)
        if not check_plan_applies(table, config, plan):
            return None
    schema = evolved_schema(table, config, shape, plan)
    if schema is not None and merge.removed:
        table = add_columns_first(table, config, schema, plan)  # a commit cannot both
        schema = None
    return table, merge.files, merge.removed, merge.counts.as_dict(), schema


def _commit_gap(config: PipelineConfig, plan: BatchPlan, ledger: Ledger, started: float, before_commit: Callable[[], None]) -> BatchResult:
    """Skip lost offsets by committing the advance with a ``gap`` entry (explicit policy only).

    The gap replaces the dead letters of the lost range with none: those offsets are recorded as
    never ingested, and no later batch will read (and so replace) them again.
    """
    table = open_table(config.layout.sink)
    lost = ", ".join(str(r) for r in plan.ranges)
    entry = for_plan(plan, {}, started, message=f"{plan.offsets} offsets {lost} were lost to retention before ingestion", staged=())
    before_commit()
    if table is None:  # nothing committed yet: a gap can only follow a committed end, so never here
        raise OffsetlakeError(f"gap batch {plan.batch_id} has no sink to commit to", pipeline=config.name, batch_id=plan.batch_id)
    version = commit_batch(table, config, plan, WrittenFiles.none(), entry)
    dead_letters.apply_pending(config)
    ledger.record_commit(SinkCommit(version, entry))
    log_line(log, "gap", plan=plan, level=logging.WARNING, lost=lost, sink_version=version)
    return BatchResult(plan, BatchStatus.COMMITTED, version, timings_ms={"total": int((time.monotonic() - started) * 1000)})


def _execute_backfill(
    config: PipelineConfig, plan: BatchPlan, ledger: Ledger, spark_factory: Callable, restore_deleted: bool = False
) -> BatchResult:
    """Run a recorded backfill plan; a rerun after its commit writes nothing and succeeds."""
    started = time.monotonic()
    done = {c.batch_id: c for c in sink_commits(open_table(config.layout.sink), config.name)}
    if plan.batch_id in done:
        reconcile(config, ledger)
        log_step("skip", plan, started, reason="already_committed")
        return BatchResult(plan, BatchStatus.ALREADY_COMMITTED, done[plan.batch_id].version, timings_ms={"total": 0})
    version, entry, processed = execute_backfill(config, plan, spark_factory, restore_deleted)
    return _committed(config, ledger, plan, SinkCommit(version, entry), processed, started)


def _plan_already_held(config: PipelineConfig, plan: BatchPlan, ledger: Ledger, started: float, timings_ms: dict[str, int]) -> BatchResult:
    """The sink holds every range of ``plan`` (txn version >= end): a no-op that succeeds.

    Either this batch committed them (a rerun after the commit) or another batch committed the
    very same ranges first, e.g. a CLI run that planned from the same committed ends; then this
    plan is recorded as ``superseded`` by that batch and nothing is written.
    """
    commits = sink_commits(open_table(config.layout.sink), config.name)
    mine = [c for c in commits if c.batch_id == plan.batch_id]
    if mine:
        reconcile(config, ledger)
        log_step("skip", plan, started, reason="already_committed")
        return BatchResult(plan, BatchStatus.ALREADY_COMMITTED, mine[0].version, timings_ms=timings_ms)
    first = next(r for r in plan.ranges if r.size > 0)  # there is one: check_plan_applies said held
    winner = covering_batch(commits, first.topic, first.partition, first.start) or "unknown"
    held = StalePlanError(f"superseded: its ranges were already committed by batch {winner}; nothing written by this batch")
    record_outcome(ledger, plan, held)
    log_step("skip", plan, started, reason="committed_by_another_batch", winner=winner)
    return BatchResult(plan, BatchStatus.SUPERSEDED, timings_ms=timings_ms)


# ---- the batch loop ---------------------------------------------------------------------------
# A run re-plans a batch that lost its commit at most this many times, then fails (Airflow retries
# it): a run is bounded work and should end with an answer.
MAX_CONFLICT_REPLANS = 5


class CaughtUp(StrEnum):
    """What a loop does when planning finds nothing new."""

    STOP = "stop"  # a run: it is done
    WAIT = "wait"  # a stream: keep the session warm, sleep the trigger interval, plan again


class OffsetLimit(StrEnum):
    """How far a loop's plans may reach."""

    LSO_AT_START = "lso_at_start"  # a run: the LSO read when it starts, so it ends under steady produce
    NONE = "none"  # a stream: each plan up to the LSO of its own moment


@dataclass(frozen=True)
class Backoff:
    """How a transient error (``errors.is_transient``: the broker, a slow read, the registry) is
    waited out: the batch is recorded ``failed``, then the loop sleeps ``first_s``, doubling up to
    ``max_s``, and plans again from the committed ends; after ``max_retries`` in a row (no batch
    result or idle check in between) the error is raised."""

    max_retries: int = 8
    first_s: float = 1.0
    max_s: float = 30.0

    def pause(self, attempt: int) -> float | None:
        """Seconds to wait before retry ``attempt`` (1 for the first in a row); None once they are spent."""
        if attempt > self.max_retries:
            return None
        return min(self.max_s, self.first_s * 2.0 ** (attempt - 1))


def _nothing() -> None:
    pass


def _drop(result: BatchResult) -> None:
    pass


@dataclass(frozen=True)
class LoopPolicy:
    """Everything a ``BatchLoop`` decides, in one value: ``run_pipeline`` and the stream differ only here.

    ``max_conflict_replans``: how many superseded batches (invariants 3, 10) the loop re-plans in
    all before it raises the last one; None re-plans without a cap. A batch is superseded when
    another writer's commit landed first (delta-rs reported the conflict, or the committed ends
    moved past the plan's start) or the sink table was replaced; the next plan starts from the new
    ends, so the loop re-plans only as often as others make progress. A run caps it anyway (it is
    bounded work; Airflow retries it); the stream must not: it lives for days beside the other
    writers of its sink table, any of which may win one of its commits, and a cap would stop it
    for losing a few of those races.

    ``backoff`` None raises a transient error at once (a run: Airflow or the operator retries it);
    else it is waited out. ``before_commit`` runs right before each sink commit (raising there
    commits nothing). ``emit`` gets each batch's result (committed, or found already held).
    ``trigger_interval``: seconds from one batch's start to the next, and between checks when
    caught up under ``CaughtUp.WAIT``; 0 paces nothing.
    """

    kind: BatchKind = BatchKind.INGEST
    max_batches: int | None = None
    offset_limit: OffsetLimit = OffsetLimit.LSO_AT_START
    resume_unfinished: bool = True  # first re-execute the plan this run id left planned or failed (invariant 3)
    max_conflict_replans: int | None = MAX_CONFLICT_REPLANS
    backoff: Backoff | None = None
    when_caught_up: CaughtUp = CaughtUp.STOP
    trigger_interval: float = 0.0
    before_commit: Callable[[], None] = _nothing
    emit: Callable[[BatchResult], None] = _drop

    def may_replan(self, replans: int) -> bool:
        """Whether the loop re-plans after its ``replans``-th superseded batch."""
        return self.max_conflict_replans is None or replans <= self.max_conflict_replans


class BatchLoop:
    """The one loop of batches (``run_pipeline``, the stream): plan (or resume a run's recorded
    plan), execute, record every batch that did not commit through ``record_outcome``, emit every
    result; ``policy`` says how far, how often to re-plan, how to wait out an outage and what to
    do when caught up. Opening the pipeline (storage check, ownership, reconcile) is the driver's.

    A driver with controls of its own (the stream: stop requests, its lease, Spark job tags)
    overrides the hooks ``keep_going``, ``pause``, ``idle``, ``executing`` and ``given_up``.
    """

    def __init__(self, config: PipelineConfig, run: RunContext, ledger: Ledger, spark_factory: Callable, policy: LoopPolicy) -> None:
        self.config, self.run_context, self.ledger, self.spark_factory, self.policy = config, run, ledger, spark_factory, policy
        self.batches = 0  # results emitted
        self.replans = 0  # superseded batches re-planned, in all
        self.transient_failures = 0  # in a row
        self.stopped = False  # the driver gave a batch up: no further turn
        self.limit: dict[TopicPartitionKey, int] | None = None
        self.resume: BatchPlan | None = None

    # ---- hooks for a driver; these defaults are a run's ----
    def keep_going(self) -> bool:
        """Checked before every turn; False ends the loop, raising ends it with that error."""
        return True

    def pause(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def idle(self) -> None:
        """Caught up under ``CaughtUp.WAIT``, before the trigger interval's pause."""

    @contextmanager
    def executing(self, plan: BatchPlan) -> Iterator[None]:
        """Around one batch's execution and its outcome."""
        yield

    def given_up(self, plan: BatchPlan, err: Exception) -> OffsetlakeError | None:
        """Why the driver gave up ``plan``, in flight when it raised ``err`` (the stream: a second
        stop request), recorded as its outcome instead of ``err``; the loop then ends. None: ``err``
        is the outcome."""
        return None

    # ---- the loop ----
    def run(self) -> None:
        """Turn until caught up (``CaughtUp.STOP``), ``max_batches`` results, or the driver stops it.

        Raises the first error that is neither superseded within the re-plan cap nor transient
        within the back-off; that batch's outcome is recorded first."""
        self.limit = self._offset_limit()
        self.resume = self._unfinished_plan()
        while not self.stopped and (self.policy.max_batches is None or self.batches < self.policy.max_batches):
            if not self.keep_going() or not self._turn():
                break

    def _offset_limit(self) -> dict[TopicPartitionKey, int] | None:
        if self.policy.offset_limit == OffsetLimit.NONE:
            return None
        started = time.monotonic()
        limit = {key: o.last_stable for key, o in current_offsets(self.config).items()}
        lso = {f"{t}[{p}]": end for (t, p), end in sorted(limit.items())}
        log_step(
            "start", None, started, pipeline=self.config.name, run_id=self.run_context.run_id, lso=json.dumps(lso, separators=(",", ":"))
        )
        return limit

    def _unfinished_plan(self) -> BatchPlan | None:
        """Rerunning a run (same run id) first re-executes the batch it left unfinished, e.g. one
        that failed validation, with exactly its recorded ranges (invariant 3)."""
        if not self.policy.resume_unfinished:
            return None
        recorded = self.ledger.run_plan(self.run_context, self.policy.kind)
        return recorded[0] if recorded and recorded[1] in (BatchStatus.PLANNED, BatchStatus.FAILED) else None

    def _turn(self) -> bool:
        """One plan and its batch; False when caught up under ``CaughtUp.STOP``."""
        started = time.monotonic()
        try:
            plan = self._next_plan(started)
        except Exception as err:
            self._wait_out(err)
            return True
        if plan is None:
            return self._caught_up(started)
        failpoints.failpoint("after_plan")
        result = self._execute(plan)
        if result is None:  # superseded, an outage waited out, or given up: its outcome is recorded
            return True
        self.transient_failures = 0
        self.batches += 1
        self.policy.emit(result)
        release_memory()
        self.pause(self.policy.trigger_interval - (time.monotonic() - started))
        return True

    def _next_plan(self, started: float) -> BatchPlan | None:
        """The batch to run next, in the ledger before it reads (invariant 3); None when caught up."""
        resumed, self.resume = self.resume, None
        if resumed is not None:
            log_step("plan", resumed, started, reused="true", offsets=resumed.offsets)
            return resumed
        plan = plan_next_batch(self.config, self.run_context, self.limit, kind=self.policy.kind)
        if plan is not None:
            self.ledger.record_plan(plan)
            log_step("plan", plan, started, kind=str(plan.kind), offsets=plan.offsets)
        return plan

    def _caught_up(self, started: float) -> bool:
        if self.policy.when_caught_up == CaughtUp.STOP:
            log_step("caught_up", None, started, pipeline=self.config.name, run_id=self.run_context.run_id)
            return False
        self.transient_failures = 0
        self.idle()
        self.pause(self.policy.trigger_interval)
        return True

    def _execute(self, plan: BatchPlan) -> BatchResult | None:
        """``plan`` executed (``execute_batch``), or None once its outcome is recorded and the loop
        may go on; any other error is recorded and raised."""
        with self.executing(plan):
            try:
                return execute_batch(self.config, plan, self.ledger, self.spark_factory, self.policy.before_commit)
            except Exception as err:
                self._failed(plan, err)
                return None

    def _failed(self, plan: BatchPlan, err: Exception) -> None:
        """Record why ``plan`` did not commit; return to go on, raise ``err`` to end the loop."""
        why = self.given_up(plan, err)
        if why is not None:
            record_outcome(self.ledger, plan, why)
            self.stopped = True
            return
        if record_outcome(self.ledger, plan, err) == BatchStatus.SUPERSEDED:
            self.replans += 1
            log_line(log, "replan", plan=plan, level=logging.WARNING, reason=str(err))
            if not self.policy.may_replan(self.replans):
                raise err
            return
        self._wait_out(err)

    def _wait_out(self, err: Exception) -> None:
        """Sleep the back-off's next pause after a transient ``err``; raise ``err`` if it is not
        transient, the policy has no back-off, or its retries in a row are spent."""
        backoff = self.policy.backoff
        if backoff is None or not is_transient(err):
            raise err
        self.transient_failures += 1
        pause = backoff.pause(self.transient_failures)
        if pause is None:
            raise err
        log_line(
            log,
            "retry",
            level=logging.WARNING,
            pipeline=self.config.name,
            attempt=f"{self.transient_failures}/{backoff.max_retries}",
            in_s=f"{pause:.0f}",
            reason=str(err),
        )
        self.pause(pause)


# ---- a run ------------------------------------------------------------------------------------
def run_pipeline(
    config: PipelineConfig,
    run: RunContext,
    spark_factory: Callable,
    max_batches: int | None = None,
    emit: Callable[[dict], None] = lambda summary: print(json.dumps(summary), flush=True),
) -> list[BatchResult]:
    """Run batches until caught up with the LSO seen at the start (or ``max_batches``).

    Raises StreamOwnsPipelineError (before anything is planned) while a live stream owns the
    pipeline. Each batch's plan is in the ledger before it reads. A commit lost to a concurrent
    writer is recorded as ``superseded`` and the run re-plans from the new committed ends, at most
    ``MAX_CONFLICT_REPLANS`` times. A run id that left a batch unfinished (failed, e.g. by
    validation) re-executes that batch's plan first. Any other error is recorded and raised at
    once (``BatchLoop`` under ``LoopPolicy``'s defaults, which are this run's).
    """
    config.check_storage()  # a store that cannot work is named before Kafka or the lake is read
    ledger = Ledger.of(config)
    refuse_if_stream_owns(config)
    reconcile(config, ledger)
    results: list[BatchResult] = []

    def collect(result: BatchResult) -> None:
        results.append(result)
        emit(result.summary())

    BatchLoop(config, run, ledger, spark_factory, LoopPolicy(max_batches=max_batches, emit=collect)).run()
    reconcile(config, ledger)
    return results


# ---- orchestrated runs (Airflow: plan task, then a spark-submit job for exactly that plan) ----
def plan_or_reuse(
    ledger: Ledger, run: RunContext, kind: BatchKind, plan_new: Callable[[], BatchPlan | None]
) -> tuple[BatchPlan | None, bool]:
    """The plan of ``run`` for batches of ``kind``, and whether it was reused.

    Invariant 3: the plan this run recorded, if it can still apply (``Ledger.run_plan``), so that
    a retry, a clear or a rerun of the run executes exactly those ranges again; else
    ``plan_new()``, recorded in the ledger before anything is read. The plan is None when
    ``plan_new`` finds nothing to do. Errors of ``plan_new`` (bad parameters, a live stream owning
    the pipeline) propagate with nothing recorded. The one place a run's plan is made or found
    again, for the Airflow plan tasks (ingest, backfill, interval backfill) and ``offsetlake
    backfill``.
    """
    started = time.monotonic()
    recorded = ledger.run_plan(run, kind)
    if recorded is not None:
        log_step("plan", recorded[0], started, reused="true", offsets=recorded[0].offsets)
        return recorded[0], True
    plan = plan_new()
    if plan is not None:
        ledger.record_plan(plan)
        log_step("plan", plan, started, kind=str(plan.kind), offsets=plan.offsets)
    return plan, False


def plan_for_dag_run(config: PipelineConfig, run: RunContext) -> BatchPlan | None:
    """The ingest plan of one dag run: the recorded one if this run planned before, else a new one.

    Invariant 3: a retry or a UI rerun of the same dag run gets exactly the same ranges. Returns
    None when nothing is new (the caller short-circuits, so no Spark starts). A new plan is
    refused with StreamOwnsPipelineError while a live stream owns the pipeline. Offsets lost under
    ``on_offsets_lost: skip`` come back from planning as a gap batch, which this task commits
    right away (it needs no Spark: no rows, only the committed ends and the ledger entry) before
    it plans the run's ingest batch.
    """
    config.check_storage()
    ledger = Ledger.of(config)
    started = time.monotonic()
    reconcile(config, ledger)

    def plan_new() -> BatchPlan | None:
        refuse_if_stream_owns(config)  # a retry (a recorded plan) still finishes its batch
        return plan_next_batch(config, run)

    while True:  # a gap batch is recorded with its own kind: the next turn plans past it
        plan, reused = plan_or_reuse(ledger, run, BatchKind.INGEST, plan_new)
        if plan is None:
            log_step("caught_up", None, started, pipeline=config.name, run_id=run.run_id)
            return None
        if plan.kind != BatchKind.GAP:
            if not reused:
                failpoints.failpoint("after_plan")
            return plan
        try:
            execute_batch(config, plan, ledger, lambda: None)
        except Exception as err:
            record_outcome(ledger, plan, err)
            raise


def execute_recorded_batch(config: PipelineConfig, batch_id: str, spark_factory: Callable, restore_deleted: bool = False) -> BatchResult:
    """Execute the plan recorded for ``batch_id``; a failure is recorded on the ledger and re-raised.
    ``restore_deleted``: see ``execute_batch``."""
    config.check_storage()
    ledger = Ledger.of(config)
    dead_letters.apply_pending(config)
    plan = ledger.plan_by_batch_id(batch_id)
    if plan is None:
        raise OffsetlakeError(f"no planned batch {batch_id} in the ledger at {config.ledger_path}", pipeline=config.name, batch_id=batch_id)
    try:
        _refuse_rewound(config, plan)
        return execute_batch(config, plan, ledger, spark_factory, restore_deleted=restore_deleted)
    except Exception as err:
        record_outcome(ledger, plan, err)
        raise


def _refuse_rewound(config: PipelineConfig, plan: BatchPlan) -> None:
    """A recorded plan (an Airflow retry or clear) whose batch a rewind undid never applies again.

    Checked here, where old plans come back, not per batch of a run: a run's plans are new.
    """
    rewind = rewound_batches(sink_commits(open_table(config.layout.sink), config.name)).get(plan.batch_id)
    if rewind is not None:
        raise StalePlanError(
            f"batch {plan.batch_id} was rewound by {rewind.batch_id} (sink version "
            f"{rewind.version}); its plan is stale and was not applied again, plan anew from the committed ends",
            pipeline=config.name,
            batch_id=plan.batch_id,
        )


@dataclass(frozen=True)
class PublishableBatch:
    """A batch whose ranges the sink holds: its view, and the committed ends of its partitions
    (``committed_ends``: what the Airflow publish task commits as consumer-group offsets, for
    ingest batches). ``summary()`` is what the publish task logs and returns."""

    pipeline: str
    batch: BatchView
    committed_ends: dict[tuple[str, int], int]

    def summary(self) -> dict[str, Any]:
        return self.batch.publish_summary(self.pipeline, self.committed_ends)


def publishable_batch(config: PipelineConfig, batch_id: str) -> PublishableBatch:
    """The batch whose ranges the sink holds, for the Airflow publish task.

    The batch either committed them itself, or was superseded by a batch that committed the very
    same ranges first (invariant 3: then this run is a no-op that succeeds, and the batch's
    message says which batch committed them). Anything else raises OffsetlakeError, naming the
    batch's state and why.
    """
    ledger = Ledger.of(config)
    reconcile(config, ledger)
    rows = ledger.batches(pc.field("batch_id") == batch_id)
    if not rows:
        raise OffsetlakeError(
            f"batch {batch_id} is not in the ledger, not committed; nothing published", pipeline=config.name, batch_id=batch_id
        )
    batch = BatchView.from_rows(rows)
    ends = open_sink(config).ends([(r.range.topic, r.range.partition) for r in batch.ranges])
    held = all((ends[(r.range.topic, r.range.partition)] or 0) >= r.range.end for r in batch.ranges)
    if not (all(s.committed for s in batch.statuses) or (batch.status == BatchStatus.SUPERSEDED and held)):
        states = ", ".join(sorted(batch.statuses))
        why = f" ({batch.message})" if batch.message else ""
        raise OffsetlakeError(
            f"batch {batch_id} is {states}, not committed; nothing published{why}", pipeline=config.name, batch_id=batch_id
        )
    if batch.status == BatchStatus.SUPERSEDED:
        log.info("pipeline=%s batch=%s %s", config.name, batch_id, batch.message)
    return PublishableBatch(config.name, batch, {k: v for k, v in ends.items() if v is not None})
