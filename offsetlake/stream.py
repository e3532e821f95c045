"""``offsetlake stream``: one long-lived driver, one warm Spark session, micro-batches forever.

Each loop is a batch of kind ``stream`` that flows through the same plan → read → transform →
validate → commit → record as a scheduled run, so every invariant holds unchanged: the plan is
in the ledger before it reads, its offsets advance only in its one sink commit, a commit lost
to another writer re-plans. A loop that finds nothing new plans from Kafka and Delta metadata
only and runs no Spark job. The stream holds the pipeline's lease (``offsetlake.lease``) so
scheduled ingest runs skip while it lives.

Stopping: the first SIGTERM/SIGINT lets the batch in flight finish (its commit, or its
abandonment if it fails), then the lease is released and the process exits 0. A second signal
abandons the batch in flight at once: its Spark jobs are cancelled and, if its commit has not
started, it commits nothing (recorded ``failed``, reason "abandoned"); the next run re-reads
those offsets. Either way no batch the stream planned is left without an outcome (docs/design.md,
"How a batch ends"); only a killed stream leaves one, for the next run's reconcile.

A broker that is unreachable or stops serving a range (KafkaUnavailableError, ReadTimeoutError),
or any other transient error (``errors.is_transient``), is waited out: the batch in flight is
recorded ``failed``, the stream backs off (1 s doubling to 30 s, up to 8 times in a row) and
plans again from the committed ends. Any other batch error
(validation, lost offsets, a transform bug) stops the stream with that error.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from offsetlake.config import PipelineConfig
from offsetlake.errors import LeaseLostError, StreamAbandoned, is_transient
from offsetlake.kafka import commit_group_offsets
from offsetlake.lease import DEFAULT_TTL_SECONDS, StreamLease, default_owner
from offsetlake.ledger import Ledger
from offsetlake.log_lines import log_line, log_step
from offsetlake.plan import BatchKind, BatchPlan, BatchResult, BatchStatus, RunContext
from offsetlake.planner import plan_next_batch
from offsetlake.runs import execute_batch, reconcile, record_outcome
from offsetlake.spark import cancel_tagged, keep_alive, release_memory, tag_jobs, untag_jobs
from offsetlake.validation import load_suite

log = logging.getLogger("offsetlake.stream")


# An outage (``errors.is_transient``: the broker, a slow read, the registry) is waited out: the
# batch is recorded failed, the stream sleeps 1, 2, 4 … 30 s and plans again from the committed
# ends. Any other error stops the stream.
MAX_TRANSIENT_RETRIES = 8


@dataclass
class StreamOptions:
    trigger_interval: float = 5.0  # seconds from one micro-batch's start to the next (idle: between checks)
    max_records_per_batch: int | None = None  # default: the pipeline's max_records_per_batch
    max_duration: float | None = None  # seconds; then stop cleanly, as on SIGTERM
    lease_ttl: float = DEFAULT_TTL_SECONDS
    lease_wait: float | None = None  # default: one TTL + 5 s
    parent_pid: int | None = None  # stop when this process is gone (the Airflow task that started us)
    run_id: str | None = None
    dag_id: str | None = None
    label: str = "offsetlake stream"


@dataclass
class StreamReport:
    pipeline: str
    run_id: str
    owner: str
    batches: int = 0
    records_read: int = 0
    rows_written: int = 0
    stop_reason: str = ""
    abandoned: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "pipeline": self.pipeline,
            "run_id": self.run_id,
            "owner": self.owner,
            "batches": self.batches,
            "records_read": self.records_read,
            "rows_written": self.rows_written,
            "stop_reason": self.stop_reason,
            "abandoned_batches": self.abandoned,
        }


class StopControl:
    """What asks the stream to stop: signals, a deadline, the parent process going away."""

    def __init__(self, max_duration: float | None = None, parent_pid: int | None = None):
        self.requested = threading.Event()
        self.abandon = threading.Event()
        self.reason = ""
        self.deadline = time.monotonic() + max_duration if max_duration else None
        self.parent_pid = parent_pid
        self.on_abandon: Callable[[], None] = lambda: None
        self.handles_signals = False

    def request(self, reason: str) -> None:
        if self.requested.is_set():
            if not self.abandon.is_set():
                log_line(log, "stop", f"{reason} again: abandoning the batch in flight", level=logging.WARNING)
                self.abandon.set()
                self.on_abandon()
            return
        self.reason = reason
        log_line(log, "stop", f"{reason}: finishing the batch in flight, then releasing the lease")
        self.requested.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT ask the stream to stop (main thread only, as Python requires)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self.request(f"received {signal.Signals(signum).name}"))
        self.handles_signals = True

    def reclaim_signals(self) -> None:
        """Install the handlers again if they were installed: a SparkContext starting in the main
        thread replaces the SIGINT handler by its own (cancel every job, raise KeyboardInterrupt),
        which would stop a batch between its plan and its outcome and leave it ``planned``
        (docs/design.md, "How a batch ends"). Called once Spark has started."""
        if self.handles_signals:
            self.install_signal_handlers()

    def poll(self) -> bool:
        """True once a stop was asked for (checks the deadline and the parent too)."""
        if not self.requested.is_set():
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self.request("maximum duration reached")
            elif self.parent_pid is not None and os.getppid() != self.parent_pid:
                self.request(f"parent process {self.parent_pid} is gone")
        return self.requested.is_set()

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.poll() and (left := end - time.monotonic()) > 0:
            self.requested.wait(min(left, 0.5))


def run_stream(
    config: PipelineConfig,
    options: StreamOptions,
    spark_factory: Callable,
    stop: StopControl,
    emit: Callable[[dict], None] = lambda summary: print(json.dumps(summary), flush=True),
) -> StreamReport:
    """Loop micro-batches until ``stop`` says so; returns what was done and why it stopped.

    Raises LeaseHeldError if another live stream owns the pipeline, LeaseLostError if the lease
    was lost while running (nothing is committed after that), and any batch error (recorded as
    ``failed`` in the ledger, as for a batch run).
    """
    if options.max_records_per_batch:
        config = config.model_copy(update={"max_records_per_batch": options.max_records_per_batch})
    load_suite(config)  # a broken suite fails before the lease is taken or anything is read
    config.check_storage()  # so does a store that cannot work or cannot commit safely
    owner = default_owner()
    run = RunContext(run_id=options.run_id or f"stream-{datetime.now(UTC):%Y%m%dT%H%M%S}-{owner.rsplit(':', 1)[-1]}", dag_id=options.dag_id)
    report = StreamReport(config.name, run.run_id, owner)
    lease = StreamLease(config, owner, f"{options.label}, run {run.run_id}", options.lease_ttl)
    lease.acquire(options.lease_wait)
    lease.start_heartbeats()
    try:
        spark = spark_factory()  # warm for the whole stream; idle loops run no job on it
        stop.reclaim_signals()
        _StreamLoop(config, options, run, report, lease, stop, spark, emit).run()
        report.stop_reason = stop.reason or "stopped"
        return report
    finally:
        lease.release()
        log_line(
            log,
            "stream_stop",
            pipeline=config.name,
            run_id=run.run_id,
            batches=report.batches,
            records=report.records_read,
            reason=stop.reason or "error",
        )


class _StreamLoop:
    """One stream's micro-batch loop under its lease: plan, execute, record every outcome
    (``runs.record_outcome``), back off on a transient error, stop when asked."""

    def __init__(
        self,
        config: PipelineConfig,
        options: StreamOptions,
        run: RunContext,
        report: StreamReport,
        lease: StreamLease,
        stop: StopControl,
        spark: Any,
        emit: Callable[[dict], None],
    ) -> None:
        self.config, self.options, self.run_context, self.report = config, options, run, report
        self.lease, self.stop, self.spark, self.emit = lease, stop, spark, emit
        self.retries = 0
        self.abandoned = False
        self.tag: str | None = None  # the batch whose Spark jobs a second signal cancels
        stop.on_abandon = lambda: threading.Thread(target=self._cancel_in_flight, daemon=True).start()
        self.ledger = Ledger.of(config)
        reconcile(config, self.ledger)
        log_line(
            log,
            "stream_start",
            pipeline=config.name,
            run_id=run.run_id,
            owner=report.owner,
            trigger_s=options.trigger_interval,
            max_records_per_batch=config.max_records_per_batch,
        )

    def run(self) -> None:
        while not self.stop.poll():
            if not self._step():
                break

    def _step(self) -> bool:
        """One turn of the loop; False when the stream stops (its batch in flight abandoned)."""
        started = time.monotonic()
        self.lease.check()
        try:
            plan = plan_next_batch(self.config, self.run_context, kind=BatchKind.STREAM)
        except Exception as err:
            if not is_transient(err):
                raise
            self._wait_out(err)
            return True
        if plan is None:
            self.retries = 0
            keep_alive(self.spark)
            self.stop.sleep(self.options.trigger_interval)
            return True
        self.ledger.record_plan(plan)
        log_step("plan", plan, started, kind=str(plan.kind), offsets=plan.offsets)
        result = self._execute(plan)
        if result is None:
            return not self.abandoned
        self.retries = 0
        _after_commit(self.config, result, self.report, self.emit)
        self.stop.sleep(self.options.trigger_interval - (time.monotonic() - started))
        return True

    def _execute(self, plan: BatchPlan) -> BatchResult | None:
        """The batch executed and committed, or None once its outcome is recorded: superseded
        (the next turn plans anew), a transient failure waited out, or abandoned by a second stop
        request (``self.abandoned``). Any other error is recorded and raised."""
        self.tag = f"offsetlake-{plan.batch_id}"
        tag_jobs(self.spark, self.tag)
        try:
            return execute_batch(self.config, plan, self.ledger, lambda: self.spark, self._before_commit)
        except LeaseLostError as err:
            record_outcome(self.ledger, plan, err)
            raise
        except Exception as err:
            if self.stop.abandon.is_set():
                why = f"the stream was stopped ({self.stop.reason}) before this batch committed; nothing was committed"
                record_outcome(self.ledger, plan, StreamAbandoned(f"{why}, the next run reads these offsets again"))
                self.report.abandoned.append(plan.batch_id)
                log_line(log, "abandoned", plan=plan, level=logging.WARNING)
                self.abandoned = True
                return None
            if record_outcome(self.ledger, plan, err) == BatchStatus.SUPERSEDED:
                log_line(log, "replan", plan=plan, level=logging.WARNING, reason=str(err))
                return None
            if is_transient(err):
                self._wait_out(err)
                return None
            raise
        finally:
            untag_jobs(self.spark, self.tag)
            self.tag = None

    def _before_commit(self) -> None:
        if self.stop.abandon.is_set():
            raise StreamAbandoned(f"pipeline {self.config.name}: stream stopped before the commit")
        self.lease.check()

    def _cancel_in_flight(self) -> None:
        tag = self.tag
        if tag is not None:
            cancel_tagged(self.spark, tag)

    def _wait_out(self, err: Exception) -> None:
        """Back off after a transient error (1, 2, 4 ... 30 s); raise it after
        ``MAX_TRANSIENT_RETRIES`` in a row."""
        self.retries += 1
        if self.retries > MAX_TRANSIENT_RETRIES:
            raise err
        pause = min(30.0, 2.0 ** (self.retries - 1))
        log_line(
            log,
            "retry",
            level=logging.WARNING,
            pipeline=self.config.name,
            attempt=f"{self.retries}/{MAX_TRANSIENT_RETRIES}",
            in_s=f"{pause:.0f}",
            reason=str(err),
        )
        self.stop.sleep(pause)


def _after_commit(config: PipelineConfig, result: BatchResult, report: StreamReport, emit: Callable) -> None:
    report.batches += 1
    report.records_read += result.total("records_read")
    report.rows_written += result.total("rows_written")
    emit(result.summary())
    if result.status == BatchStatus.COMMITTED:
        ends = {(r.topic, r.partition): r.end for r in result.plan.ranges}
        try:  # informational (lag tools); the txn versions are the truth
            commit_group_offsets(config.kafka_client_config(), config.name, ends)
        except Exception as err:
            log_line(log, "group_offsets", "not published", level=logging.WARNING, pipeline=config.name, reason=str(err))
    release_memory()
