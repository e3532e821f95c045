"""The commands that commit batches: run, stream, backfill, rewind, topic reset-epoch."""

from __future__ import annotations

import argparse
import json
import logging
import os
import uuid
from datetime import UTC, datetime
from typing import Any

from offsetlake.cli.common import add_pipeline, add_spark_options, duration, load_config
from offsetlake.log_lines import log_line
from offsetlake.validation import load_suite

log = logging.getLogger("offsetlake.cli")


def add_run_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    run = commands.add_parser(
        "run",
        parents=[common],
        help="ingest batches until caught up with the last stable offset seen at start",
        description="Plan, read, transform and commit batches until every partition reaches the last stable "
        "offset (LSO) seen when the run started. Prints one JSON summary line per batch on stdout. "
        "A concurrent writer that wins a commit makes this run re-plan; nothing is committed twice. "
        "Giving the --run-id of an earlier run re-executes the batch it left unfinished (for example one that "
        "failed validation) with exactly the same offset ranges, then goes on.",
    )
    add_pipeline(run)
    run.add_argument("--max-batches", type=int, help="stop after this many committed batches")
    run.add_argument("--run-id", help="run id recorded in the ledger (default: cli-<utc time>-<random>); an earlier run's id reruns it")
    add_spark_options(run)


def cmd_run(args: argparse.Namespace) -> int:
    from offsetlake.errors import StreamOwnsPipelineError
    from offsetlake.plan import RunContext
    from offsetlake.runs import run_pipeline
    from offsetlake.spark import spark_session, stop_spark

    config = load_config(args, args.pipeline)
    load_suite(config)  # a broken suite fails before anything is planned or read
    run_id = args.run_id or f"cli-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    try:
        results = run_pipeline(config, RunContext(run_id=run_id), lambda: spark_session(args.master, remote=args.remote), args.max_batches)
    except StreamOwnsPipelineError as err:
        log_line(log, "skip", str(err), level=logging.WARNING, pipeline=config.name, run_id=run_id)
        return 0
    finally:
        stop_spark()
    log_line(log, "done", pipeline=config.name, run_id=run_id, batches=len(results))
    _follow_catalog(config, args.pipeline, args.pipelines_dir)
    return 0


def _follow_catalog(config: Any, source: str, pipelines_dir: Any) -> None:
    """The pipeline's tables that are new since the last ``catalog register`` get their names
    (``metastore.follow``); a failure there is a warning, the run's commits stand."""
    from offsetlake import metastore

    problem = metastore.follow(config, source, pipelines_dir)
    if problem:
        log_line(log, "catalog_not_followed", f"{problem}; run `offsetlake catalog register`", level=logging.WARNING, pipeline=config.name)


def add_stream_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    stream = commands.add_parser(
        "stream",
        parents=[common],
        help="ingest continuously: one warm Spark session, a micro-batch every trigger interval",
        description="Run until stopped: every --trigger-interval, plan the offsets that are new since the sink's "
        "committed ends (up to the last stable offset, at most --max-records-per-batch), then read, transform, "
        "validate and commit them as one ledger batch of kind `stream`, exactly like a batch run. A loop with "
        "nothing new runs no Spark job. The stream holds the pipeline's lease (owner, heartbeat, expiry) while it "
        "runs: scheduled `<pipeline>_ingest` runs and `offsetlake run` skip meanwhile, backfills still work. "
        "A second stream of the same pipeline waits up to one lease TTL for the lease, then fails naming the owner. "
        "SIGTERM or Ctrl-C: the batch in flight finishes, the lease is released, exit 0; a second signal abandons "
        "the batch in flight (nothing of it is committed). After a crash, the lease expires after --lease-ttl and "
        "the next stream or scheduled run continues from the last commit.",
    )
    add_pipeline(stream)
    stream.add_argument(
        "--trigger-interval",
        type=duration,
        default=5.0,
        metavar="DURATION",
        help="time from one micro-batch's start to the next, e.g. 5s, 500ms, 1m (default 5s)",
    )
    stream.add_argument(
        "--max-records-per-batch",
        type=int,
        metavar="N",
        help="offsets per micro-batch, all partitions together (default: the pipeline's max_records_per_batch)",
    )
    stream.add_argument(
        "--max-duration", type=duration, metavar="DURATION", help="stop cleanly after this long, e.g. 8h (default: run until stopped)"
    )
    stream.add_argument(
        "--lease-ttl",
        type=duration,
        default=30.0,
        metavar="DURATION",
        help="how long the lease outlives a stream that stopped heartbeating (default 30s)",
    )
    stream.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # the Airflow task that started us
    stream.add_argument("--run-id", help="run id recorded in the ledger (default: stream-<utc time>-<random>)")
    stream.add_argument("--dag-id", help=argparse.SUPPRESS)
    add_spark_options(stream)


def cmd_stream(args: argparse.Namespace) -> int:
    from offsetlake.spark import spark_session, stop_spark
    from offsetlake.stream import StopControl, StreamOptions, run_stream

    config = load_config(args, args.pipeline)
    options = StreamOptions(
        trigger_interval=args.trigger_interval,
        max_records_per_batch=args.max_records_per_batch,
        max_duration=args.max_duration,
        lease_ttl=args.lease_ttl,
        parent_pid=args.parent_pid,
        run_id=args.run_id,
        dag_id=args.dag_id,
        label=f"{args.dag_id} (Airflow)" if args.dag_id else f"offsetlake stream on {os.uname().nodename}",
    )
    stop = StopControl(args.max_duration, args.parent_pid)
    stop.install_signal_handlers()
    try:
        report = run_stream(config, options, lambda: spark_session(args.master, remote=args.remote), stop)
    finally:
        stop_spark()
    print(json.dumps({"stream": report.as_dict()}), flush=True)
    return 0


def add_backfill_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    backfill = commands.add_parser(
        "backfill",
        parents=[common],
        help="reprocess already-ingested offsets (or a time range), replacing their sink rows",
        description="Re-read [FROM, TO) of the chosen partitions (offsets, or record times resolved with "
        "offsets_for_times) and replace the sink rows and dead letters with those coordinates in one commit. "
        "Only offsets below the pipeline's committed end can be backfilled; txn versions never move. "
        "Running the same backfill twice leaves the table content identical.",
    )
    add_pipeline(backfill)
    backfill.add_argument("--topic", help="the topic to backfill (needed when the pipeline reads several)")
    backfill.add_argument("--partitions", help="comma-separated partition ids (default: all)")
    backfill.add_argument("--from-offset", type=int, help="first offset to reprocess (inclusive)")
    backfill.add_argument("--to-offset", type=int, help="end offset (exclusive), at most the committed end")
    backfill.add_argument("--from-time", help="ISO-8601 start time, e.g. 2026-11-01T00:00:00Z (inclusive)")
    backfill.add_argument("--to-time", help="ISO-8601 end time (exclusive)")
    backfill.add_argument(
        "--republish",
        action="store_true",
        help="a Kafka sink only (sink.type: kafka): publish the range again, each record marked offsetlake.kind=backfill in "
        "its headers, beside the records consumers already read; the committed ends do not move. Required there, "
        "refused for a Delta sink",
    )
    backfill.add_argument(
        "--restore-deleted",
        action="store_true",
        help="also write the rows of the range that a commit offsetlake did not make deleted (a GDPR delete from Spark, "
        "`offsetlake sql --write`); by default they stay deleted",
    )
    backfill.add_argument("--run-id", help="run id recorded in the ledger")
    add_spark_options(backfill)


def cmd_backfill(args: argparse.Namespace) -> int:
    from offsetlake.backfill import plan_backfill, refused
    from offsetlake.ledger import Ledger
    from offsetlake.plan import BatchKind, RunContext
    from offsetlake.runs import execute_recorded_batch, plan_or_reuse
    from offsetlake.spark import spark_session, stop_spark

    config = load_config(args, args.pipeline)
    load_suite(config)
    try:
        partitions = [int(p) for p in args.partitions.split(",")] if args.partitions else None
    except ValueError:
        raise refused(config.name, f"--partitions '{args.partitions}' is not a list like 0,2") from None
    run_id = args.run_id or f"cli-backfill-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run = RunContext(run_id=run_id)
    plan, _ = plan_or_reuse(
        Ledger.of(config),
        run,
        BatchKind.BACKFILL,
        lambda: plan_backfill(
            config,
            run,
            partitions,
            args.from_offset,
            args.to_offset,
            args.from_time,
            args.to_time,
            topic=args.topic,
            republish=args.republish,
        ),
    )
    assert plan is not None  # plan_backfill plans or raises
    try:
        result = execute_recorded_batch(
            config, plan.batch_id, lambda: spark_session(args.master, remote=args.remote), restore_deleted=args.restore_deleted
        )
    finally:
        stop_spark()
    print(json.dumps(result.summary()), flush=True)
    return 0


def add_rewind_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    rewind = commands.add_parser(
        "rewind",
        parents=[common],
        help="restore the sink to its state right after an earlier batch, to reprocess from there",
        description="Restore the sink to its state right after batch ID in ONE Delta commit: data files added "
        "later are removed and files that version had are re-added (the rows equal time travel to that "
        "version), each partition's committed end (txn version) goes back to that batch's end, and the "
        "commit's userMetadata lists the rewound batches, the reason and who asked. Later batches become "
        "`rewound` in the ledger and their dead letters are deleted; the next `offsetlake run` reprocesses "
        "everything after batch ID. Partitions with no committed end at batch ID go back to the first offset "
        "the pipeline ever read from them. Fails without writing anything if the batch is unknown, never "
        "committed, was rewound itself, or if files of that version were vacuumed. Run it while no ingest "
        "or backfill of the pipeline is running.",
    )
    add_pipeline(rewind)
    rewind.add_argument(
        "--to-batch", required=True, metavar="ID", help="batch id to rewind to (see `offsetlake ledger PIPELINE`); it stays, later ones go"
    )
    rewind.add_argument("--reason", help="why, recorded in the rewind commit and the ledger (default: no reason given)")
    rewind.add_argument(
        "--dry-run", action="store_true", help="print the batches, files, txn versions and dead letters that would change; write nothing"
    )
    rewind.add_argument(
        "--restore-deleted",
        action="store_true",
        help="rewind even where commits offsetlake did not make deleted rows after the target batch: those rows come "
        "back (refused by default)",
    )
    rewind.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def cmd_rewind(args: argparse.Namespace) -> int:
    from offsetlake.rewind import rewind_pipeline

    config = load_config(args, args.pipeline)
    result = rewind_pipeline(config, args.to_batch, reason=args.reason, dry_run=args.dry_run, restore_deleted=args.restore_deleted)
    print(json.dumps(result.as_dict(), default=str) if args.json else result.text(), flush=True)
    return 0


def add_topic_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    topic = commands.add_parser(
        "topic",
        parents=[common],
        help="operator actions on one topic of a pipeline: `topic reset-epoch`",
        description="`offsetlake topic reset-epoch PIPELINE --topic T --reason WHY`: after topic T was deleted and "
        "created again (or the cluster changed, or an unclean leader election truncated its log), runs refuse "
        "because the pipeline's committed ends no longer belong to the topic Kafka has. This records it: ONE sink "
        "commit moves T's committed ends to its new log start, with a ledger entry naming the old and new topic id, "
        "every move, who asked and why. The rows already in the sink stay. Refused (nothing written) when T looks "
        "unchanged, unless --force.",
    )
    topic_actions = topic.add_subparsers(dest="topic_action", required=True, metavar="ACTION")
    reset = topic_actions.add_parser(
        "reset-epoch", parents=[common], help="start a new epoch of a re-created or truncated topic (one recorded commit)"
    )
    add_pipeline(reset)
    reset.add_argument("--topic", required=True, help="the topic that was re-created or truncated")
    reset.add_argument("--reason", help="why, recorded in the commit and the ledger (default: no reason given)")
    reset.add_argument(
        "--force",
        action="store_true",
        help="record a new epoch even though the check sees nothing wrong (a broker without topic ids "
        "cannot show a re-created topic that already holds more records than the committed end)",
    )
    reset.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def cmd_topic(args: argparse.Namespace) -> int:
    from offsetlake.topic_epochs import reset_topic_epoch

    config = load_config(args, args.pipeline)
    result = reset_topic_epoch(config, args.topic, reason=args.reason, force=args.force)
    print(json.dumps(result.as_dict()) if args.json else result.text(), flush=True)
    return 0
