"""One batch end to end, and a run of batches until caught up.

A batch flows once through plan → read → transform → commit → record; each step logs one
structured line with pipeline, batch id, ranges, counts and duration. Spark starts only when a
plan has records to read, so a run with nothing new costs a few Kafka and Delta round trips.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc

from offsetlake import failpoints
from offsetlake.config import PipelineConfig
from offsetlake.dead_letters import DEAD_LETTER_SCHEMA, replace_dead_letters
from offsetlake.errors import CommitConflictError, OffsetlakeError, StalePlanError
from offsetlake.kafka import check_log_start, describe_topic, partition_offsets
from offsetlake.lease import refuse_if_stream_owns
from offsetlake.ledger import COMMITTED, FAILED, SUPERSEDED, Ledger, SinkCommit, covering_batch, rewound_batches
from offsetlake.plan import BatchPlan, OffsetRange, RunContext, new_batch_id, plan_ranges
from offsetlake.sink import (
    WrittenFiles,
    check_plan_applies,
    collect_written_files,
    commit_batch,
    committed_ends,
    ensure_table,
    open_table,
    sink_commits,
    staging_dir,
)
from offsetlake.spark import release_memory
from offsetlake.validation import load_suite

log = logging.getLogger("offsetlake.batch")
MAX_CONFLICT_REPLANS = 5


@dataclass
class BatchResult:
    plan: BatchPlan
    status: str  # committed | already_committed | superseded (another batch committed these ranges)
    sink_version: int | None = None
    per_range: dict[tuple[str, int], dict[str, int]] = field(default_factory=dict)
    timings_ms: dict[str, int] = field(default_factory=dict)

    def total(self, key: str) -> int:
        return sum(v.get(key, 0) for v in self.per_range.values())

    def summary(self) -> dict:
        return {
            "pipeline": self.plan.pipeline,
            "batch_id": self.plan.batch_id,
            "kind": self.plan.kind,
            "status": self.status,
            "run_id": self.plan.run.run_id,
            "ranges": [
                {"topic": r.topic, "partition": r.partition, "start": r.start, "end": r.end,
                 **self.per_range.get((r.topic, r.partition), {})}
                for r in self.plan.ranges
            ],
            "records_read": self.total("records_read"),
            "rows_written": self.total("rows_written"),
            "dead_letters": self.total("dead_letters"),
            "sink_version": self.sink_version,
            "timings_ms": self.timings_ms,
        }


def log_step(step: str, plan: BatchPlan | None, started: float, **fields: object) -> int:
    elapsed = int((time.monotonic() - started) * 1000)
    parts = [f"step={step}"]
    if plan is not None:
        parts += [f"pipeline={plan.pipeline}", f"batch={plan.batch_id}", f"ranges=\"{plan.describe()}\""]
    parts += [f"{k}={v}" for k, v in fields.items()]
    parts.append(f"duration_ms={elapsed}")
    log.info(" ".join(parts))
    return elapsed


# ---- planning -------------------------------------------------------------------------------
def current_offsets(config: PipelineConfig):
    client = config.kafka_client_config()
    partitions = describe_topic(client, config.topic, config.name)
    return partition_offsets(client, config.topic, partitions, config.name)


def plan_next_batch(
    config: PipelineConfig,
    run: RunContext,
    ledger: Ledger,
    end_limit: dict[int, int] | None = None,
    kind: str = "ingest",
) -> BatchPlan | None:
    """Plan the next ingest batch from the sink's committed ends; None when caught up.

    Checks invariant 7 first: a committed end below the log start fails (or, under
    ``on_offsets_lost: skip``, commits a recorded gap). Ends are capped by the LSO and by
    ``end_limit`` (the LSO seen when the run started).
    """
    offsets = current_offsets(config)
    table = open_table(config.sink_path)
    ends = committed_ends(table, config, config.topic, sorted(offsets))
    for p, committed in ends.items():
        if committed is not None and committed < offsets[p].log_start:
            if config.on_offsets_lost == "skip":
                record_gap(config, run, ledger, OffsetRange(config.topic, p, committed, offsets[p].log_start))
                return plan_next_batch(config, run, ledger, end_limit, kind)
            check_log_start(offsets[p], committed, config.name)
    if end_limit:
        offsets = {
            p: type(o)(o.topic, o.partition, o.log_start, min(o.last_stable, end_limit.get(p, o.last_stable)))
            for p, o in offsets.items()
        }
    ranges = plan_ranges(config.topic, ends, offsets, config.start, config.max_records_per_batch)
    anchors = [r for r in ranges if ends[r.partition] is None and config.start == "latest"]
    if all(r.size == 0 for r in ranges) and not anchors:
        return None
    return BatchPlan(config.name, new_batch_id(config.name), kind, tuple(ranges), run)


def record_gap(config: PipelineConfig, run: RunContext, ledger: Ledger, lost: OffsetRange) -> None:
    """Skip lost offsets by committing the advance with a ``gap`` entry (explicit policy only).

    Dead letters a crashed batch left in the lost range are removed first: those offsets are now
    recorded as never ingested, and no later batch will read (and so replace) them again.
    """
    plan = BatchPlan(config.name, new_batch_id(config.name), "gap", (lost,), run)
    replace_dead_letters(config, [lost], DEAD_LETTER_SCHEMA.empty_table())
    table = open_table(config.sink_path)
    entry = _entry(plan, {}, time.monotonic())
    entry["message"] = f"{lost.end - lost.start} offsets {lost} were lost to retention before ingestion"
    version = commit_batch(table, config, plan, _no_files(), entry)
    ledger.record_commit(SinkCommit(version, entry))
    log.warning("step=gap pipeline=%s batch=%s lost=\"%s\" sink_version=%d", config.name, plan.batch_id, lost, version)


def _no_files() -> WrittenFiles:
    return WrittenFiles(actions=[], rows=0, schema=pa.schema([]))


def _entry(plan: BatchPlan, per_range: dict, started: float, validation: dict | None = None) -> dict:
    entry = {
        "pipeline": plan.pipeline,
        "batch_id": plan.batch_id,
        "kind": plan.kind,
        "run_id": plan.run.run_id,
        "dag_id": plan.run.dag_id,
        "try_number": plan.run.try_number,
        "planned_at": plan.planned_at.isoformat(),
        "committed_at": datetime.now(UTC).isoformat(),
        "duration_ms": int((time.monotonic() - started) * 1000),
        "ranges": [
            {"topic": r.topic, "partition": r.partition, "start": r.start, "end": r.end,
             **per_range.get((r.topic, r.partition), {})}
            for r in plan.ranges
        ],
    }
    if validation is not None:
        entry["validation"] = validation
    return entry


# ---- executing ------------------------------------------------------------------------------
@dataclass
class ProcessedRanges:
    """A batch after read → parse → transform → validate → dead letters: rows ready to be written."""

    rows: object  # pyspark DataFrame of sink rows
    cached: list  # persisted DataFrames; ``release`` when the batch is done
    per_range: dict[tuple[str, int], dict[str, int]]
    timings_ms: dict[str, int]
    validation: dict | None = None  # the Great Expectations summary, None without a suite

    def release(self) -> None:
        for frame in self.cached:
            frame.unpersist()
        self.cached.clear()


def process_ranges(config: PipelineConfig, plan: BatchPlan, spark, suite=None) -> ProcessedRanges:
    """Read the plan's ranges once, count them, transform, validate (invariant 9), then replace
    their dead letters (parse failures and quarantined records) in one write.

    Raises ValidationFailedError when the batch must not commit; nothing was written then.
    """
    from pyspark.sql import functions as F

    from offsetlake.reader import read_ranges
    from offsetlake.transform import REASON, apply_transform, dead_letter_rows, good_rows, parse_json, parsed_struct_type

    timings: dict[str, int] = {}
    per_range: dict[tuple[str, int], dict[str, int]] = {
        (r.topic, r.partition): {"records_read": 0, "dead_letters": 0, "rows_written": 0} for r in plan.ranges
    }
    sized = [r for r in plan.ranges if r.size > 0]
    if config.transform:
        spark.sparkContext.addPyFile(str(config.transform_dir / f"{config.transform.split(':')[0]}.py"))

    t = time.monotonic()
    raw = read_ranges(spark, sized, config.kafka_client_config(), config.name, config.read_timeout_seconds,
                      parsed_struct_type(config))
    parsed = parse_json(raw, config)
    if suite is None or config.validation.on_failure != "quarantine":
        # only dead letters and quarantined records need the original bytes: a cache without
        # them for good rows cost the JVM a fifth less per batch (bench, 1M records)
        good = F.col(REASON).isNull()
        for column in ("key", "value", "headers"):
            parsed = parsed.withColumn(column, F.when(good, F.lit(None)).otherwise(F.col(column)))
    parsed = parsed.persist()
    processed = ProcessedRanges(None, [parsed], per_range, timings)
    counts = (
        parsed.groupBy("topic", "partition")
        .agg(F.count("*").alias("records_read"), F.sum(F.col(REASON).isNotNull().cast("long")).alias("dead_letters"))
        .collect()
    )
    for row in counts:
        per_range[(row["topic"], row["partition"])].update(
            records_read=int(row["records_read"]), dead_letters=int(row["dead_letters"] or 0)
        )
    records = sum(v["records_read"] for v in per_range.values())
    timings["read"] = log_step("read", plan, t, records=records)
    failpoints.failpoint("after_read")

    rows = apply_transform(good_rows(parsed, config), config)
    dead = dead_letter_rows(parsed, config, plan.batch_id) if any(v["dead_letters"] for v in per_range.values()) else None
    try:
        if suite is not None and records:
            rows, quarantined = _validate(config, plan, suite, rows, parsed, processed)
            dead = quarantined if dead is None else (dead if quarantined is None else dead.unionByName(quarantined))
    except Exception:
        processed.release()
        raise

    t = time.monotonic()
    table = dead.toArrow() if dead is not None else DEAD_LETTER_SCHEMA.empty_table()
    replace_dead_letters(config, sized, table)
    timings["dead_letters"] = log_step("dead_letters", plan, t, dead_letters=table.num_rows)
    processed.rows = rows
    return processed


def _validate(config: PipelineConfig, plan: BatchPlan, suite, rows, parsed, processed: ProcessedRanges):
    """Gate the batch with its suite; returns (rows to write, quarantined dead letters or None)."""
    from offsetlake.validation import apply_quarantine, validate_rows, write_report

    t = time.monotonic()
    rows = rows.persist()
    processed.cached.append(rows)
    try:
        validation = validate_rows(rows, suite, config, plan)
    except Exception as err:
        summary = getattr(err, "summary", None)
        log_step("validate", plan, t, outcome="failed", failed=len(summary["failed"]) if summary else "error",
                 report=summary.get("report") if summary else None)
        raise
    quarantined = None
    if validation.quarantine:
        rows, quarantined, per_partition, bad = apply_quarantine(rows, parsed, validation, config, plan.batch_id)
        processed.cached.append(bad)
        for key, count in per_partition.items():
            processed.per_range[key]["dead_letters"] += count
            processed.per_range[key]["quarantined"] = count
    validation.summary["report"] = write_report(config, plan, validation.summary)
    processed.validation = validation.summary
    processed.timings_ms["validate"] = log_step(
        "validate", plan, t, outcome=validation.summary["outcome"], failed=len(validation.summary["failed"]),
        quarantined=validation.summary.get("quarantined_records", 0), report=validation.summary["report"],
    )
    return rows, quarantined


def write_rows(config: PipelineConfig, plan: BatchPlan, processed: ProcessedRanges, rows, spark) -> WrittenFiles:
    """Spark writes ``rows`` as parquet into a fresh folder inside the table; counts rows per range."""
    from pyspark.sql import functions as F

    t = time.monotonic()
    folder = staging_dir(config, plan.batch_id)
    rows.write.mode("errorifexists").partitionBy(*config.sink.partition_by).parquet(folder)
    files = collect_written_files(config.sink_path, folder)
    if files.rows:
        written = spark.read.parquet(folder)
        in_plan = None
        for r in plan.ranges:
            term = (
                (F.col("_kafka_topic") == r.topic) & (F.col("_kafka_partition") == r.partition)
                & (F.col("_kafka_offset") >= r.start) & (F.col("_kafka_offset") < r.end)
            )
            in_plan = term if in_plan is None else in_plan | term
        for row in written.where(in_plan).groupBy("_kafka_topic", "_kafka_partition").count().collect():
            processed.per_range[(row["_kafka_topic"], row["_kafka_partition"])]["rows_written"] = int(row["count"])
    processed.timings_ms["write"] = log_step("write", plan, t, files=len(files.actions), rows=files.rows)
    failpoints.failpoint("after_files_written")
    return files


def execute_batch(
    config: PipelineConfig, plan: BatchPlan, ledger: Ledger, spark_factory: Callable,
    before_commit: Callable[[], None] = lambda: None,
) -> BatchResult:
    """Read, transform and commit exactly ``plan``'s ranges; never anything else.

    If the sink already holds the plan (a rerun after a commit) this is a no-op that succeeds.
    Raises StalePlanError if another batch moved a partition part-way, and CommitConflictError
    if another writer won the commit race (invariant 10); nothing is committed then.
    Backfill plans go to ``offsetlake.backfill`` (replace, no txn change). Errors raised
    inside Spark tasks (a range no longer readable, a read timeout) surface as themselves.
    ``before_commit`` runs right before the sink commit; raising there commits nothing (a stream
    checks its lease there).
    """
    from offsetlake.reader import errors_from_spark_tasks

    with errors_from_spark_tasks():
        return _execute_batch(config, plan, ledger, spark_factory, before_commit)


def _execute_batch(
    config: PipelineConfig, plan: BatchPlan, ledger: Ledger, spark_factory: Callable, before_commit: Callable[[], None],
) -> BatchResult:
    if plan.kind == "backfill":
        return execute_backfill_batch(config, plan, ledger, spark_factory)
    started = time.monotonic()
    if not check_plan_applies(open_table(config.sink_path), config, plan):
        return _plan_already_held(config, plan, ledger, started, {"total": 0})
    suite = load_suite(config)  # a typo in the suite fails here, before Spark starts or anything is read
    spark = spark_factory()
    processed = process_ranges(config, plan, spark, suite)
    files = write_rows(config, plan, processed, processed.rows, spark)

    t = time.monotonic()
    from pyspark.sql.pandas.types import to_arrow_schema

    table = ensure_table(config, to_arrow_schema(processed.rows.schema, timezone="UTC", prefers_large_types=False))
    if not check_plan_applies(table, config, plan):
        processed.release()
        return _plan_already_held(config, plan, ledger, started, processed.timings_ms)
    entry = _entry(plan, processed.per_range, started, processed.validation)
    try:
        before_commit()
    except BaseException:
        processed.release()
        raise
    version = commit_batch(table, config, plan, files, entry)
    processed.timings_ms["commit"] = log_step("commit", plan, t, sink_version=version, rows=files.rows)
    processed.release()
    failpoints.failpoint("after_commit")

    ledger.record_commit(SinkCommit(version, entry))
    failpoints.failpoint("after_ledger")
    processed.timings_ms["total"] = int((time.monotonic() - started) * 1000)
    return BatchResult(plan, COMMITTED, version, processed.per_range, processed.timings_ms)


def execute_backfill_batch(config: PipelineConfig, plan: BatchPlan, ledger: Ledger, spark_factory: Callable) -> BatchResult:
    """Run a recorded backfill plan; a rerun after its commit writes nothing and succeeds."""
    from offsetlake.backfill import execute_backfill

    started = time.monotonic()
    done = {c.batch_id: c for c in sink_commits(open_table(config.sink_path), config.name)}
    if plan.batch_id in done:
        _record_existing_commit(config, plan, ledger)
        log_step("skip", plan, started, reason="already_committed")
        return BatchResult(plan, "already_committed", done[plan.batch_id].version, timings_ms={"total": 0})
    version, entry, processed = execute_backfill(config, plan, spark_factory)
    failpoints.failpoint("after_commit")
    ledger.record_commit(SinkCommit(version, entry))
    failpoints.failpoint("after_ledger")
    processed.timings_ms["total"] = int((time.monotonic() - started) * 1000)
    return BatchResult(plan, COMMITTED, version, processed.per_range, processed.timings_ms)


def _plan_already_held(
    config: PipelineConfig, plan: BatchPlan, ledger: Ledger, started: float, timings_ms: dict[str, int]
) -> BatchResult:
    """The sink holds every range of ``plan`` (txn version ≥ end): a no-op that succeeds.

    Either this batch committed them (a rerun after the commit) or another batch committed the
    very same ranges first, e.g. a CLI run that planned from the same committed ends; then this
    plan is recorded as ``superseded`` by that batch and nothing is written.
    """
    table = open_table(config.sink_path)
    commits = sink_commits(table, config.name)
    mine = [c for c in commits if c.batch_id == plan.batch_id]
    if mine:
        _record_existing_commit(config, plan, ledger)
        log_step("skip", plan, started, reason="already_committed")
        return BatchResult(plan, "already_committed", mine[0].version, timings_ms=timings_ms)
    first = next(r for r in plan.ranges if r.size > 0)  # there is one: check_plan_applies said held
    winner = covering_batch(commits, first.topic, first.partition, first.start) or "unknown"
    ledger.record_outcome(plan, SUPERSEDED, message=(
        f"superseded: its ranges were already committed by batch {winner}; nothing written by this batch"
    ))
    log_step("skip", plan, started, reason="committed_by_another_batch", winner=winner)
    return BatchResult(plan, SUPERSEDED, timings_ms=timings_ms)


def _record_existing_commit(config: PipelineConfig, plan: BatchPlan, ledger: Ledger) -> None:
    table = open_table(config.sink_path)
    ledger.reconcile(sink_commits(table, config.name), committed_end_of(table, config))


def committed_end_of(table, config: PipelineConfig) -> Callable[[str, int], int | None]:
    """The sink's committed end (txn version) of a topic-partition, None if never committed."""
    return lambda topic, partition: table.transaction_version(config.app_id(topic, partition)) if table is not None else None


def reconcile_ledger(config: PipelineConfig, ledger: Ledger) -> int:
    """Invariant 4: bring the ledger projection in line with the sink's history."""
    table = open_table(config.sink_path)
    added = ledger.reconcile(sink_commits(table, config.name), committed_end_of(table, config))
    if table is not None:
        ledger.compact_if_fragmented()
    return added


# ---- a run ----------------------------------------------------------------------------------
def run_pipeline(
    config: PipelineConfig,
    run: RunContext,
    spark_factory: Callable,
    max_batches: int | None = None,
    emit: Callable[[dict], None] = lambda summary: print(json.dumps(summary), flush=True),
) -> list[BatchResult]:
    """Run batches until caught up with the LSO seen at the start (or ``max_batches``).

    Raises StreamOwnsPipelineError (before anything is planned) while a live stream owns the
    pipeline. Each batch's plan is in the ledger before it reads. A commit lost to a concurrent writer is
    recorded as ``superseded`` and the run re-plans from the new committed ends. A run id that
    left a batch unfinished (failed, e.g. by validation) re-executes that batch's plan first.
    """
    ledger = Ledger(config.ledger_path, config.name)
    started = time.monotonic()
    refuse_if_stream_owns(config)
    reconcile_ledger(config, ledger)
    limit = {p: o.last_stable for p, o in current_offsets(config).items()}
    log_step("start", None, started, pipeline=config.name, run_id=run.run_id, lso=json.dumps(limit, separators=(",", ":")))
    results: list[BatchResult] = []
    conflicts = 0
    # Rerunning a run (same run id) first re-executes the batch it left unfinished, e.g. one that
    # failed validation, with exactly its recorded ranges (invariant 3).
    resume = ledger.unfinished_plan(run.run_id, run.dag_id)
    while max_batches is None or len(results) < max_batches:
        t = time.monotonic()
        if resume is not None:
            plan, resume = resume, None
            log_step("plan", plan, t, reused="true", offsets=plan.offsets)
        else:
            plan = plan_next_batch(config, run, ledger, limit)
            if plan is None:
                log_step("caught_up", None, t, pipeline=config.name, run_id=run.run_id)
                break
            ledger.record_plan(plan)
            log_step("plan", plan, t, offsets=plan.offsets)
        failpoints.failpoint("after_plan")
        try:
            result = execute_batch(config, plan, ledger, spark_factory)
        except (CommitConflictError, StalePlanError) as err:
            conflicts += 1
            ledger.record_outcome(plan, SUPERSEDED, message=str(err))
            log.warning("step=replan pipeline=%s batch=%s reason=\"%s\"", config.name, plan.batch_id, err)
            if conflicts > MAX_CONFLICT_REPLANS:
                raise
            continue
        except Exception as err:
            record_failure(ledger, plan, err)
            raise
        results.append(result)
        emit(result.summary())
        release_memory()
    reconcile_ledger(config, ledger)
    return results


def publishable_batch(config: PipelineConfig, batch_id: str) -> dict:
    """The summary of a batch whose ranges the sink holds, for the Airflow publish task.

    The batch either committed them itself, or was superseded by a batch that committed the very
    same ranges first (invariant 3: then this run is a no-op that succeeds, and the summary says
    which batch committed them). Anything else raises, naming the batch's state and why. The
    summary's ``_ends`` are the committed ends of the batch's partitions (the group offsets).
    """
    ledger = Ledger(config.ledger_path, config.name)
    reconcile_ledger(config, ledger)
    rows = ledger.batches(pc.field("batch_id") == batch_id)
    table = open_table(config.sink_path)
    end_of = committed_end_of(table, config)
    ends = {(r["topic"], r["partition"]): end_of(r["topic"], r["partition"]) for r in rows}
    held = all((ends[(r["topic"], r["partition"])] or 0) >= r["end_offset"] for r in rows)
    status = rows[0]["status"] if rows else "unknown"
    if not rows or not (all(r["status"] == COMMITTED for r in rows) or (status == SUPERSEDED and held)):
        states = ", ".join(sorted({r["status"] for r in rows})) or "not in the ledger"
        why = next((f" ({r['message']})" for r in rows if r.get("message")), "")
        raise OffsetlakeError(f"pipeline {config.name}: batch {batch_id} is {states}, not committed; nothing published{why}")
    if status == SUPERSEDED:
        log.info("pipeline=%s batch=%s %s", config.name, batch_id, rows[0]["message"])
    return {
        "pipeline": config.name, "batch_id": batch_id, "kind": rows[0]["kind"], "status": status,
        "sink_version": rows[0]["sink_version"],
        "records_read": sum(r["records_read"] or 0 for r in rows),
        "rows_written": sum(r["rows_written"] or 0 for r in rows),
        "dead_letters": sum(r["dead_letters"] or 0 for r in rows),
        "ranges": [f"{r['topic']}[{r['partition']}] [{r['start_offset']}, {r['end_offset']})" for r in rows],
        "group_offsets": {f"{t}[{p}]": o for (t, p), o in ends.items()} if rows[0]["kind"] == "ingest" else {},
        "validation": json.loads(rows[0]["validation"])["outcome"] if rows[0].get("validation") else "no suite",
        "validation_report": rows[0].get("validation_report"),
        "message": rows[0].get("message"),
        "_ends": {k: v for k, v in ends.items() if v is not None},
    }


# ---- orchestrated runs (Airflow: plan task, then a spark-submit job for exactly that plan) ----
def plan_for_dag_run(config: PipelineConfig, run: RunContext) -> BatchPlan | None:
    """The ingest plan of one dag run: the recorded one if this run planned before, else a new one.

    Invariant 3: a retry or a UI rerun of the same dag run gets exactly the same ranges. Returns
    None when nothing is new (the caller short-circuits, so no Spark starts). A new plan is
    refused with StreamOwnsPipelineError while a live stream owns the pipeline.
    """
    ledger = Ledger(config.ledger_path, config.name)
    started = time.monotonic()
    reconcile_ledger(config, ledger)
    existing = ledger.plan_for_run(run.dag_id, run.run_id, "ingest")
    if existing is not None:
        log_step("plan", existing, started, reused="true", offsets=existing.offsets)
        return existing
    refuse_if_stream_owns(config)  # a retry above still finishes its recorded plan
    plan = plan_next_batch(config, run, ledger)
    if plan is None:
        log_step("caught_up", None, started, pipeline=config.name, run_id=run.run_id)
        return None
    ledger.record_plan(plan)
    log_step("plan", plan, started, offsets=plan.offsets)
    failpoints.failpoint("after_plan")
    return plan


def execute_recorded_batch(config: PipelineConfig, batch_id: str, spark_factory: Callable) -> BatchResult:
    """Execute the plan recorded for ``batch_id``; a failure is recorded on the ledger and re-raised."""
    ledger = Ledger(config.ledger_path, config.name)
    plan = ledger.plan_by_batch_id(batch_id)
    if plan is None:
        raise OffsetlakeError(f"pipeline {config.name}: no planned batch {batch_id} in the ledger at {config.ledger_path}")
    try:
        _refuse_rewound(config, plan)
        return execute_batch(config, plan, ledger, spark_factory)
    except (CommitConflictError, StalePlanError) as err:
        # Never applicable again: a rerun of the dag run plans anew from the committed ends.
        ledger.record_outcome(plan, SUPERSEDED, message=str(err)[:4000])
        raise
    except Exception as err:
        record_failure(ledger, plan, err)
        raise


def _refuse_rewound(config: PipelineConfig, plan: BatchPlan) -> None:
    """A recorded plan (an Airflow retry or clear) whose batch a rewind undid never applies again.

    Checked here, where old plans come back, not per batch of a run: a run's plans are new.
    """
    rewind = rewound_batches(sink_commits(open_table(config.sink_path), config.name)).get(plan.batch_id)
    if rewind is not None:
        raise StalePlanError(
            f"pipeline {config.name}: batch {plan.batch_id} was rewound by {rewind.batch_id} (sink version "
            f"{rewind.version}); its plan is stale and was not applied again, plan anew from the committed ends"
        )


def record_failure(ledger: Ledger, plan: BatchPlan, err: Exception) -> None:
    """A batch that raised gets a ``failed`` ledger row saying why (our errors verbatim), with the
    validation summary and report when its expectations failed."""
    message = str(err) if isinstance(err, OffsetlakeError) else f"{type(err).__name__}: {err}"
    ledger.record_outcome(plan, FAILED, message=message[:4000], validation=getattr(err, "summary", None))
