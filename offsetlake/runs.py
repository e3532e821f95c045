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
from typing import Any

import pyarrow.compute as pc

from offsetlake import dead_letters, delta_sink, failpoints, kafka_sink, storage  # noqa: F401 - the sinks provide their writers
from offsetlake.batch_view import BatchView
from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import sink_kind
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
    rewound_batches,
    sink_commits,
)
from offsetlake.kafka import current_offsets
from offsetlake.lease import refuse_if_stream_owns
from offsetlake.ledger import Ledger
from offsetlake.log_lines import log_line, log_step
from offsetlake.loop_policy import CaughtUp, LoopPolicy, OffsetLimit
from offsetlake.plan import BatchKind, BatchPlan, BatchResult, BatchStatus, RunContext
from offsetlake.planner import TopicPartitionKey, plan_next_batch
from offsetlake.process import process_ranges
from offsetlake.processed import ProcessedBatch
from offsetlake.sink import (
    open_table,
)
from offsetlake.sinks.choice import open_sink
from offsetlake.sinks.writing import WRITER, SinkWriter
from offsetlake.spark import release_memory
from offsetlake.validation import Undecided, load_suite

log = logging.getLogger("offsetlake.runs")


# ---- projections of the sink's history --------------------------------------------------------
def reconcile(config: PipelineConfig, ledger: Ledger | None = None) -> None:
    """Invariant 4: bring both projections of the sink's history in line with it before a run
    reads them — the dead-letter table (a change a crash left pending after its sink commit) and
    the ledger (commits it lacks, plans that can no longer apply). First, an object store that
    cannot be used or cannot commit safely is refused (``PipelineConfig.check_storage``), and so is
    a sink table that belongs to another pipeline (invariant 16), before anything is planned."""
    config.check_storage()
    _writer_for(config).reconcile_pipeline(config, ledger or Ledger.of(config))


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

    with errors_from_spark_tasks(), storage_errors_named(config, plan), _writer_for(config)(config, ledger) as sink:
        return _lifecycle(config, plan, ledger, sink, spark_factory, before_commit, restore_deleted)


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


def _writer_for(config: PipelineConfig) -> type[SinkWriter]:
    """The writing half of the pipeline's kind of sink (``offsetlake.config.sink_kinds``), which
    ``delta_sink`` and ``kafka_sink`` provide."""
    return sink_kind(config).implementation(WRITER)


def _lifecycle(
    config: PipelineConfig,
    plan: BatchPlan,
    ledger: Ledger,
    sink: SinkWriter,
    spark_factory: Callable,
    before_commit: Callable[[], None],
    restore_deleted: bool,
) -> BatchResult:
    """The one lifecycle of a batch, whatever the sink (docs/design.md, "The sink seam"): open the
    sink for the plan → already committed? → applies? → read, decode, transform, validate → write
    (prepare, ``before_commit``, commit) → after the commit → the ledger row."""
    started = time.monotonic()
    plan = sink.open(plan)
    done = sink.committed(plan.batch_id)
    if done is not None:  # a rerun or an Airflow clear after the commit
        sink.reconcile()
        log_step("skip", plan, started, reason="already_committed")
        return BatchResult(plan, BatchStatus.ALREADY_COMMITTED, done.version, timings_ms={"total": 0})
    if plan.kind != BatchKind.BACKFILL and not sink.applies(plan):
        return _superseded(plan, ledger, sink, started, {"total": 0})
    if plan.kind == BatchKind.GAP:
        return _gap(plan, ledger, sink, started, before_commit)
    suite = load_suite(config)  # a typo in the suite fails here, before Spark starts or anything is read
    spark = spark_factory()
    observe = sink.observes_gate(plan)
    while True:
        processed = process_ranges(config, plan, spark, suite, write_in_read=sink.writes_in_read(plan), observe_gate=observe)
        try:
            commit = sink.write(plan, processed, spark, started, before_commit, restore_deleted)
            break
        except Undecided as err:  # the suite observed during the write may fail: Great Expectations decides, before the write
            log_step("revalidate", plan, started, reason=str(err))
            observe = False
        finally:
            processed.release()
    if commit is None:  # the sink, read again right before the commit, holds the plan already
        return _superseded(plan, ledger, sink, started, processed.timings_ms)
    _committed(plan, ledger, sink, commit, processed)
    processed.timings_ms["total"] = int((time.monotonic() - started) * 1000)
    return BatchResult(plan, BatchStatus.COMMITTED, commit.version, processed.per_range, processed.timings_ms)


def _committed(plan: BatchPlan, ledger: Ledger, sink: SinkWriter, commit: SinkCommit, processed: ProcessedBatch | None) -> None:
    """After a batch's sink commit: the sink's own step (a Delta sink applies the batch's dead
    letters, invariant 8), then its ledger row."""
    sink.after_commit(plan, processed)
    ledger.record_commit(commit)
    failpoints.failpoint("after_ledger")


def _gap(plan: BatchPlan, ledger: Ledger, sink: SinkWriter, started: float, before_commit: Callable[[], None]) -> BatchResult:
    """Skip lost offsets by committing the advance with a ``gap`` entry (explicit policy only)."""
    lost = ", ".join(str(r) for r in plan.ranges)
    entry = for_plan(plan, {}, started, message=f"{plan.offsets} offsets {lost} were lost to retention before ingestion", staged=())
    version = sink.advance(plan, entry, before_commit)
    _committed(plan, ledger, sink, SinkCommit(version, entry), None)
    log_line(log, "gap", plan=plan, level=logging.WARNING, lost=lost, sink_version=version)
    return BatchResult(plan, BatchStatus.COMMITTED, version, timings_ms={"total": int((time.monotonic() - started) * 1000)})


def _superseded(plan: BatchPlan, ledger: Ledger, sink: SinkWriter, started: float, timings_ms: dict[str, int]) -> BatchResult:
    """Another batch committed the very same ranges first (e.g. a CLI run that planned from the
    same committed ends): this plan is recorded ``superseded`` by that batch, nothing of it commits."""
    winner = sink.winner(plan)
    held = StalePlanError(f"superseded: its ranges were already committed by batch {winner}; nothing {sink.done} by this batch")
    record_outcome(ledger, plan, held)
    log_step("skip", plan, started, reason="committed_by_another_batch", winner=winner)
    return BatchResult(plan, BatchStatus.SUPERSEDED, timings_ms=timings_ms)


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
        release_memory(result.total("records_read"))
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
