"""``offsetlake stream``: one long-lived driver, one warm Spark session, micro-batches forever.

Each turn is a batch of kind ``stream`` that flows through the same plan → read → transform →
validate → commit → record as a scheduled run, driven by the same loop (``runs.BatchLoop``) under
the stream's policy, so every invariant holds unchanged: the plan is in the ledger before it
reads, its offsets advance only in its one sink commit, a commit lost to another writer re-plans
(without a cap: see ``loop_policy.LoopPolicy``). A turn that finds nothing new plans from Kafka and
Delta metadata only and runs no Spark job. The stream holds the pipeline's lease (``offsetlake.lease``) so
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from offsetlake.config import PipelineConfig
from offsetlake.errors import LeaseLostError, StreamAbandoned
from offsetlake.kafka import commit_group_offsets
from offsetlake.lease import DEFAULT_TTL_SECONDS, StreamLease, default_owner
from offsetlake.ledger import Ledger
from offsetlake.log_lines import log_line
from offsetlake.loop_policy import Backoff, CaughtUp, LoopPolicy, OffsetLimit
from offsetlake.plan import BatchKind, BatchPlan, BatchResult, BatchStatus, RunContext
from offsetlake.runs import BatchLoop, reconcile
from offsetlake.spark import cancel_tagged, keep_alive, tag_jobs, untag_jobs
from offsetlake.validation import load_suite

log = logging.getLogger("offsetlake.stream")


# An outage (``errors.is_transient``: the broker, a slow read, the registry) is waited out
# (``loop_policy.Backoff``): the batch is recorded failed, the stream sleeps 1, 2, 4 … 30 s and plans
# again from the committed ends. Any other error stops the stream.
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


class _StreamLoop(BatchLoop):
    """One stream's micro-batches: the one ``BatchLoop`` under the stream's policy, plus what only
    a stream has — its lease (checked before every turn and right before every commit), stop
    requests (polled before every turn, the pauses cut short), the warm session kept alive when
    idle, and the batch in flight's Spark jobs tagged so that a second stop request cancels them
    and gives the batch up (``StreamAbandoned``)."""

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
        self.options, self.report, self.lease, self.stop, self.spark, self.emit_summary = options, report, lease, stop, spark, emit
        self.tag: str | None = None  # the batch whose Spark jobs a second signal cancels
        policy = LoopPolicy(
            kind=BatchKind.STREAM,
            offset_limit=OffsetLimit.NONE,
            resume_unfinished=False,  # what a batch left unfinished, the next plan reads again from the committed ends
            max_conflict_replans=None,  # see LoopPolicy: every superseded batch is another writer's progress
            backoff=Backoff(max_retries=MAX_TRANSIENT_RETRIES),
            when_caught_up=CaughtUp.WAIT,
            trigger_interval=options.trigger_interval,
            before_commit=self._before_commit,
            emit=self._after_commit,
        )
        ledger = Ledger.of(config)
        super().__init__(config, run, ledger, lambda: spark, policy)
        stop.on_abandon = lambda: threading.Thread(target=self._cancel_in_flight, daemon=True).start()
        reconcile(config, ledger)
        log_line(
            log,
            "stream_start",
            pipeline=config.name,
            run_id=run.run_id,
            owner=report.owner,
            trigger_s=options.trigger_interval,
            max_records_per_batch=config.max_records_per_batch,
        )

    def keep_going(self) -> bool:
        if self.stop.poll():
            return False
        self.lease.check()
        return True

    def pause(self, seconds: float) -> None:
        self.stop.sleep(seconds)

    def idle(self) -> None:
        keep_alive(self.spark)

    @contextmanager
    def executing(self, plan: BatchPlan) -> Iterator[None]:
        self.tag = f"offsetlake-{plan.batch_id}"
        tag_jobs(self.spark, self.tag)
        try:
            yield
        finally:
            untag_jobs(self.spark, self.tag)
            self.tag = None

    def given_up(self, plan: BatchPlan, err: Exception) -> StreamAbandoned | None:
        """A second stop request abandoned the batch in flight (a lost lease is recorded as itself)."""
        if not self.stop.abandon.is_set() or isinstance(err, LeaseLostError):
            return None
        self.report.abandoned.append(plan.batch_id)
        log_line(log, "abandoned", plan=plan, level=logging.WARNING)
        why = f"the stream was stopped ({self.stop.reason}) before this batch committed; nothing was committed"
        return StreamAbandoned(f"{why}, the next run reads these offsets again")

    def _before_commit(self) -> None:
        if self.stop.abandon.is_set():
            raise StreamAbandoned("the stream stopped before the commit", pipeline=self.config.name)
        self.lease.check()

    def _cancel_in_flight(self) -> None:
        tag = self.tag
        if tag is not None:
            cancel_tagged(self.spark, tag)

    def _after_commit(self, result: BatchResult) -> None:
        self.report.batches += 1
        self.report.records_read += result.total("records_read")
        self.report.rows_written += result.total("rows_written")
        self.emit_summary(result.summary())
        if result.status == BatchStatus.COMMITTED:
            ends = {(r.topic, r.partition): r.end for r in result.plan.ranges}
            try:  # informational (lag tools); the txn versions are the truth
                commit_group_offsets(self.config.kafka_client_config(), self.config.name, ends)
            except Exception as err:
                log_line(log, "group_offsets", "not published", level=logging.WARNING, pipeline=self.config.name, reason=str(err))
