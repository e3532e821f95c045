"""A Kafka topic as a pipeline's sink (``sink: {type: kafka, topic, key}``, invariant 15).

A batch is planned from the pipeline group's committed offsets and recorded in the ledger before
it reads, as for a Delta sink. Its rows then go out in ONE Kafka transaction
(``offsetlake.kafka_commit.TransactionalWriter``) together with:

* the batch's source end offsets, committed for the pipeline's group
  (``send_offsets_to_transaction``): the sink's committed ends, which only its transactions move;
* its dead letters, to the dead-letter topic, each with the reason in its headers;
* its ledger entry, to the pipeline's commit log (``offsetlake-commits-<pipeline>``): the sink's
  history, read back the way a Delta sink's commits are.

The transaction is the commit point: read_committed consumers see the rows, the dead letters, the
entry and the new ends together or nothing. The ledger row follows it; a runner that dies between
the two leaves the batch committed in Kafka, and the next run's ``reconcile`` records it from the
commit log (``Ledger.reconcile``, the same code as for a Delta sink's commits).

Every transaction starts by fencing: the writer's ``init_transactions`` (one ``transactional.id``
per pipeline) aborts whatever an earlier runner left open and makes its producer unusable, and
only then is the state read and the plan checked against it. So a second runner (a retry, an
Airflow clear, a zombie) either finds the batch in the commit log (a no-op), finds the ends moved
(superseded), or commits it once; the fenced one's commit fails and shows nothing.

A backfill re-publishes its range, marked ``backfill`` in every record's headers, and never moves
the committed ends; a Kafka log cannot have rows replaced, so consumers that keep one row per
source record replace by the coordinates. Rewinds and topic-epoch commits are refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from offsetlake import failpoints, storage
from offsetlake.config import PipelineConfig
from offsetlake.coordinates import OFFSET, PARTITION, TOPIC
from offsetlake.entry import for_plan
from offsetlake.errors import StalePlanError
from offsetlake.history import SinkCommit, covering_batch
from offsetlake.kafka import current_offsets
from offsetlake.kafka_commit import (
    NOT_IN_VALUES,
    OutputRecord,
    TransactionalWriter,
    commit_log_topic,
    ensure_topics,
    kafka_sink_commits,
    kafka_sink_ends,
    row_record,
)
from offsetlake.ledger import Ledger
from offsetlake.log_lines import log_line, log_step
from offsetlake.plan import BatchKind, BatchPlan, BatchResult, BatchStatus
from offsetlake.process import ProcessedBatch, process_ranges
from offsetlake.sink_values import value_encoder
from offsetlake.validation import load_suite

log = logging.getLogger("offsetlake.kafka_sink")

COMMIT_LOG_SETTINGS = {"cleanup.policy": "compact"}  # one key per batch: compaction keeps every entry


@dataclass(frozen=True)
class KafkaSinkState:
    """What a Kafka sink holds now: its commits (from the commit log) and its committed ends."""

    commits: list[SinkCommit]
    ends: dict[tuple[str, int], int | None]

    @classmethod
    def read(cls, config: PipelineConfig, keys: list[tuple[str, int]]) -> KafkaSinkState:
        return cls(kafka_sink_commits(config), kafka_sink_ends(config, keys))

    def commit_of(self, batch_id: str) -> SinkCommit | None:
        return next((c for c in self.commits if c.batch_id == batch_id), None)

    def end(self, topic: str, partition: int) -> int | None:
        return self.ends.get((topic, partition))


def reconcile(config: PipelineConfig, ledger: Ledger) -> int:
    """Invariant 4 for a Kafka sink: the ledger gets the commits it lacks (a runner died between
    the Kafka commit and its ledger row) and the outcomes of plans the group's ends moved past."""
    keys = sorted(current_offsets(config))
    state = KafkaSinkState.read(config, keys)
    return ledger.reconcile(state.commits, state.end)


def execute(
    config: PipelineConfig, plan: BatchPlan, ledger: Ledger, spark_factory: Callable, before_commit: Callable[[], None]
) -> BatchResult:
    """Execute exactly ``plan`` into the Kafka sink: one transaction, then its ledger row.

    A plan whose batch the commit log already holds (a rerun or clear after the commit) produces
    nothing and succeeds. Raises StalePlanError when the group's ends moved since it was planned
    (another batch committed: the plan is superseded), KafkaSinkAbortedError when the transaction
    failed and was aborted (transient: running again commits it once) and KafkaSinkFencedError
    when another runner took over mid-batch.
    """
    started = time.monotonic()
    client = config.kafka_client_config()
    assert config.sink.topic is not None  # checked with the YAML
    ensure_topics(
        client, config.name, [config.sink.topic], {commit_log_topic(config.name): COMMIT_LOG_SETTINGS, config.sink.dead_letters_to: {}}
    )
    with TransactionalWriter(client, config.name) as writer:  # fences every earlier runner first
        keys = [(r.topic, r.partition) for r in plan.ranges]
        state = KafkaSinkState.read(config, keys)
        done = state.commit_of(plan.batch_id)
        if done is not None:
            ledger.reconcile(state.commits, state.end)
            log_step("skip", plan, started, reason="already_committed")
            return BatchResult(plan, BatchStatus.ALREADY_COMMITTED, done.version, timings_ms={"total": 0})
        if plan.kind != BatchKind.BACKFILL and not _applies(config, plan, state):
            return _held_by_another(config, plan, ledger, state, started)
        processed = None
        if plan.kind != BatchKind.GAP:
            processed = process_ranges(config, plan, spark_factory(), load_suite(config))
        try:
            return _commit(config, plan, ledger, writer, processed, started, before_commit)
        finally:
            if processed is not None:
                processed.release()


def _applies(config: PipelineConfig, plan: BatchPlan, state: KafkaSinkState) -> bool:
    """Invariant 3 against the group's ends: True if the plan applies, False if another batch
    committed exactly its ranges; StalePlanError if an end moved part-way."""
    held = 0
    for r in plan.ranges:
        end = state.end(r.topic, r.partition)
        if end is None or end == r.start:
            continue
        if end >= r.end and r.size > 0:
            held += 1
            continue
        winner = covering_batch(state.commits, r.topic, r.partition, r.start) or "unknown"
        raise StalePlanError(
            f"batch {plan.batch_id} ({plan.describe()}): {r.topic}[{r.partition}] is committed up to {end} "
            f"(by batch {winner}), not {r.start} as planned; superseded, plan anew from the committed ends",
            pipeline=config.name,
            batch_id=plan.batch_id,
        )
    return held == 0


def _held_by_another(config: PipelineConfig, plan: BatchPlan, ledger: Ledger, state: KafkaSinkState, started: float) -> BatchResult:
    first = next(r for r in plan.ranges if r.size > 0)
    winner = covering_batch(state.commits, first.topic, first.partition, first.start) or "unknown"
    held = StalePlanError(f"superseded: its ranges were already committed by batch {winner}; nothing produced by this batch")
    ledger.record_outcome(plan, BatchStatus.SUPERSEDED, message=str(held))
    log_step("skip", plan, started, reason="committed_by_another_batch", winner=winner)
    return BatchResult(plan, BatchStatus.SUPERSEDED, timings_ms={"total": 0})


def _commit(
    config: PipelineConfig,
    plan: BatchPlan,
    ledger: Ledger,
    writer: TransactionalWriter,
    processed: ProcessedBatch | None,
    started: float,
    before_commit: Callable[[], None],
) -> BatchResult:
    per_range = processed.per_range if processed is not None else {}
    records = list(_output_records(config, processed))
    for record in records:
        counts = per_range.get((record.topic or "", record.partition))
        if counts is not None:
            counts["rows_written"] = counts.get("rows_written", 0) + 1
    dead = list(_dead_letter_records(config, processed, str(plan.kind))) if processed is not None else []
    if plan.kind == BatchKind.GAP:
        lost = ", ".join(str(r) for r in plan.ranges)
        entry = for_plan(plan, {}, started, message=f"{plan.offsets} offsets {lost} were lost to retention before ingestion", staged=())
    else:
        assert processed is not None
        entry = for_plan(plan, per_range, started, processed.validation, staged=(), data_path=str(processed.path.path))
    # a backfill re-publishes below the committed ends and never moves them
    ends = {} if plan.kind == BatchKind.BACKFILL else {(r.topic, r.partition): r.end for r in plan.ranges}
    t = time.monotonic()
    before_commit()
    assert config.sink.topic is not None
    log_entry = (commit_log_topic(config.name), plan.batch_id.encode(), entry.to_json().encode())
    done = writer.commit(plan.batch_id, str(plan.kind), config.sink.topic, records, ends, also=[*dead, log_entry])
    version = done.also_offsets[-1]
    timings = dict(processed.timings_ms) if processed is not None else {}
    timings["commit"] = log_step(
        "commit", plan, t, topic=config.sink.topic, records=done.records, dead_letters=len(dead), commit_log_offset=version
    )
    ledger.record_commit(SinkCommit(version, entry))
    failpoints.failpoint("after_ledger")
    if processed is not None:
        _remove_staged(config, processed)
    if plan.kind == BatchKind.GAP:
        log_line(log, "gap", plan=plan, level=logging.WARNING, lost=", ".join(str(r) for r in plan.ranges))
    timings["total"] = int((time.monotonic() - started) * 1000)
    return BatchResult(plan, BatchStatus.COMMITTED, version, per_range, timings)


def _output_records(config: PipelineConfig, processed: ProcessedBatch | None) -> Iterator[OutputRecord]:
    """The batch's rows as records, in source order (topic, partition, offset): a key's records
    keep their order in the output topic."""
    if processed is None or processed.rows is None:
        return
    rows = processed.rows.orderBy(TOPIC, PARTITION, OFFSET).toArrow()
    if rows.num_rows == 0:
        return
    columns = pa.schema([f for f in rows.schema if f.name not in NOT_IN_VALUES])
    encode = value_encoder(config, columns)  # a registry format: the schema is registered on the first row
    for batch in rows.to_batches(max_chunksize=10_000):
        for row in batch.to_pylist():
            yield row_record(row, config.sink.key, encode=encode)


def _dead_letter_records(config: PipelineConfig, processed: ProcessedBatch, kind: str) -> Iterator[tuple]:
    """The batch's dead letters (staged by ``process_ranges``) as records of the dead-letter
    topic: the original key, value and headers, with the reason and source coordinates added."""
    for staged in processed.dead_letter_files:
        fs, path = storage.filesystem(config.layout.dead_letters.child(staged.path))
        with fs.open_input_file(path) as source:
            rows = pq.read_table(source)
        for row in rows.to_pylist():
            headers = [(h["key"], h["value"]) for h in row.get("headers") or ()]
            headers += [
                ("offsetlake.reason", (row.get("reason") or "").encode()),
                ("offsetlake.reason_code", (row.get("reason_code") or "").encode()),
                ("offsetlake.topic", str(row[TOPIC]).encode()),
                ("offsetlake.partition", str(row[PARTITION]).encode()),
                ("offsetlake.offset", str(row[OFFSET]).encode()),
                ("offsetlake.batch", str(row.get("batch_id") or "").encode()),
                ("offsetlake.kind", kind.encode()),
            ]
            yield (config.sink.dead_letters_to, row.get("key"), row.get("value"), headers)


def _remove_staged(config: PipelineConfig, processed: ProcessedBatch) -> None:
    """The staged dead-letter files went out in the transaction: nothing else reads them (a batch
    that died before this leaves them to the lake's vacuum, like any staged file no commit names)."""
    for staged in processed.dead_letter_files:
        fs, path = storage.filesystem(config.layout.dead_letters.child(staged.path))
        try:
            fs.delete_file(path)
        except OSError as err:
            log.warning("pipeline=%s could not remove the staged dead letters %s: %s", config.name, path, err)
