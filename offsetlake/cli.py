"""``offsetlake`` command line: run, stream, backfill, rewind, topic reset-epoch, status, ledger, ledger rebuild, audit,
maintenance, spark-server, sql, publish.

Logs (one structured line per batch step) go to stderr; machine-readable results (one JSON
summary line per batch, ``--json`` views) go to stdout. Errors print one readable line naming
the pipeline, topic, partition and offsets, and exit non-zero; Kafka secrets are never printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from offsetlake.config import PipelineConfig, resolve_pipeline
from offsetlake.errors import OffsetlakeError, describe_unexpected
from offsetlake.log_lines import log_line
from offsetlake.plan import ReaderSchema
from offsetlake.validation import load_suite

log = logging.getLogger("offsetlake.cli")

DESCRIPTION = """\
Move exact Kafka offset ranges into Delta Lake tables, exactly once.

Each batch's data files, its Kafka offset advance (Delta txn per partition) and its ledger entry
are one Delta commit on the sink table, made only after the batch passed the pipeline's Great
Expectations suite (pipelines/<name>.expectations.yaml, if present). PIPELINE is a name under
the pipelines folder (--pipelines-dir, $OFFSETLAKE_PIPELINES_DIR, default ./pipelines) or a path
to a .yaml file.

exit status: 0 ok, 1 audit found problems, 2 error (message on stderr), 3 a batch failed
validation and nothing was committed (message lists the failed expectations and the report).
"""


def _add_pipeline(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pipeline", metavar="PIPELINE", help="pipeline name (pipelines/<name>.yaml) or a .yaml path")


def _add_spark_options(parser: argparse.ArgumentParser) -> None:
    """Where a command's Spark work runs: its own session (--master) or a warm server's (--remote)."""
    parser.add_argument("--master", help="Spark master (default: $OFFSETLAKE_SPARK_MASTER or local[2])")
    parser.add_argument(
        "--remote",
        metavar="URL",
        help="attach to this Spark Connect server instead of starting a JVM "
        "(default: $OFFSETLAKE_SPARK_REMOTE), e.g. sc://127.0.0.1:15002 from `offsetlake spark-server`",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offsetlake", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pipelines-dir", type=Path, help="folder of pipeline YAML files (default: $OFFSETLAKE_PIPELINES_DIR or ./pipelines)"
    )
    parser.add_argument(
        "--log-level", default=os.environ.get("OFFSETLAKE_LOG_LEVEL", "INFO"), help="logging level for stderr (default INFO)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # --log-level also works after the command (`offsetlake run --log-level DEBUG orders`)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, help="logging level for stderr (default INFO)")

    _add_run_command(commands, common)
    _add_stream_command(commands, common)
    _add_backfill_command(commands, common)
    _add_rewind_command(commands, common)
    _add_topic_command(commands, common)
    _add_status_command(commands, common)
    _add_ledger_command(commands, common)
    _add_audit_command(commands, common)
    _add_maintenance_command(commands, common)
    _add_spark_server_command(commands, common)
    _add_sql_command(commands, common)
    _add_publish_command(commands, common)
    return parser


def _add_publish_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    publish = commands.add_parser(
        "publish",
        parents=[common],
        help="publish the sink's committed batches to a Kafka topic, exactly once, in ledger order (an outbox)",
        description="Send every sink version not yet published that changed rows to TOPIC, one Kafka transaction per "
        "version that also holds the outbox's progress (topic offsetlake-outbox-progress, compacted, made on first use), "
        "so a publish killed anywhere sends no version twice and skips none: run it again and it goes on after the last "
        "whole one. A record is about one source record (headers offsetlake.topic, .partition, .offset): op=row carries "
        "one of its rows as JSON (without the _kafka_* columns), op=delete (null value) says it has no row any more; "
        "each also names the sink version (offsetlake.sink_version), batch and kind (ingest, stream, backfill, rewind, "
        "or foreign: a commit offsetlake did not make). A consumer that keeps, per source record, the rows of the "
        "highest sink version it has seen holds what the table holds (docs/guides/kafka-outbox.md); --check replays "
        "the topic that way and compares. Consumers must read with isolation.level=read_committed. Append sinks only. "
        "A second publisher of the same pipeline and topic fences the first. Starts no Spark.",
    )
    _add_pipeline(publish)
    publish.add_argument("--to", required=True, metavar="TOPIC", help="the topic to publish to (it must exist)")
    publish.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="COLUMN",
        help="a sink column whose value is the record key (repeat for a composite key, sent as a JSON array); default: no key",
    )
    publish.add_argument("--max-batches", type=int, metavar="N", help="publish at most N sink versions, then stop (default: all)")
    publish.add_argument("--json", action="store_true", help="print one JSON line per published version")
    publish.add_argument(
        "--check",
        action="store_true",
        help="publish nothing: replay TOPIC by the consumer's rule and compare it with the sink at the last published "
        "version; exit 1 when a consumer would hold other rows than the table",
    )


def _add_run_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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
    _add_pipeline(run)
    run.add_argument("--max-batches", type=int, help="stop after this many committed batches")
    run.add_argument("--run-id", help="run id recorded in the ledger (default: cli-<utc time>-<random>); an earlier run's id reruns it")
    _add_spark_options(run)


def _add_stream_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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
    _add_pipeline(stream)
    stream.add_argument(
        "--trigger-interval",
        type=_duration,
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
        "--max-duration", type=_duration, metavar="DURATION", help="stop cleanly after this long, e.g. 8h (default: run until stopped)"
    )
    stream.add_argument(
        "--lease-ttl",
        type=_duration,
        default=30.0,
        metavar="DURATION",
        help="how long the lease outlives a stream that stopped heartbeating (default 30s)",
    )
    stream.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # the Airflow task that started us
    stream.add_argument("--run-id", help="run id recorded in the ledger (default: stream-<utc time>-<random>)")
    stream.add_argument("--dag-id", help=argparse.SUPPRESS)
    _add_spark_options(stream)


def _add_backfill_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    backfill = commands.add_parser(
        "backfill",
        parents=[common],
        help="reprocess already-ingested offsets (or a time range), replacing their sink rows",
        description="Re-read [FROM, TO) of the chosen partitions (offsets, or record times resolved with "
        "offsets_for_times) and replace the sink rows and dead letters with those coordinates in one commit. "
        "Only offsets below the pipeline's committed end can be backfilled; txn versions never move. "
        "Running the same backfill twice leaves the table content identical.",
    )
    _add_pipeline(backfill)
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
    _add_spark_options(backfill)


def _add_rewind_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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
    _add_pipeline(rewind)
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


def _add_topic_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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
    _add_pipeline(reset)
    reset.add_argument("--topic", required=True, help="the topic that was re-created or truncated")
    reset.add_argument("--reason", help="why, recorded in the commit and the ledger (default: no reason given)")
    reset.add_argument(
        "--force",
        action="store_true",
        help="record a new epoch even though the check sees nothing wrong (a broker without topic ids "
        "cannot show a re-created topic that already holds more records than the committed end)",
    )
    reset.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _add_status_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    status = commands.add_parser(
        "status",
        parents=[common],
        help="per partition: committed end, log start, last stable offset, lag",
        description="Show, per partition, the sink's committed end (txn version), the log start offset, the "
        "last stable offset and the lag (LSO minus committed end), and which stream owns the pipeline, if any. "
        "Reads Kafka and Delta; starts no Spark.",
    )
    _add_pipeline(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_ledger_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    ledger = commands.add_parser(
        "ledger",
        parents=[common],
        help="show the offset ledger of a pipeline, or `ledger rebuild PIPELINE`",
        description="`offsetlake ledger PIPELINE` lists every batch (one line per partition) with its range, counts, "
        "sink version and status. `offsetlake ledger rebuild PIPELINE` recreates the pipeline's ledger rows from "
        "the sink table's commit history alone.",
    )
    ledger.add_argument("words", nargs="+", metavar="[rebuild] PIPELINE")
    ledger.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    ledger.add_argument("--limit", type=int, default=50, help="show the last N rows (default 50, 0 = all)")


def _add_audit_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    audit = commands.add_parser(
        "audit",
        parents=[common],
        help="check the sink is exactly once and agrees with the ledger (and Kafka) (exit 0/1)",
        description="Exit 0 only if: no record is in the sink twice (with a transform: no (record, _kafka_row) "
        "twice), in the dead letters twice, or in both; committed ranges per partition are contiguous with no "
        "overlap; every sink row and dead letter lies in a committed range; each batch's range holds the rows and dead "
        "letters its ledger entry says it wrote (append sinks); the sink's txn versions equal the "
        "ledger's last committed ends. Otherwise print a report and exit 1. Reads only Delta, unless "
        "--against-kafka.",
    )
    _add_pipeline(audit)
    audit.add_argument(
        "--against-kafka",
        action="store_true",
        help="also read the committed ranges back from Kafka (read_committed) and check that every "
        "record Kafka still holds is in exactly one of the sink, the dead letters or a recorded gap, "
        "and nothing else is; offsets past retention are reported, not checked. With a transform, "
        "records without rows are transformed again on Spark to tell filtered from lost",
    )


def _add_maintenance_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    maintenance = commands.add_parser(
        "maintenance",
        parents=[common],
        help="compact, checkpoint and vacuum the pipeline's sink, dead letters and ledger",
        description="Rewrite small files into larger ones (txn versions, rows and commit history unchanged), write a "
        "Delta checkpoint, then vacuum files no version younger than --retention-hours refers to, including files "
        "staged by attempts that died. Safe while runs are going on: a batch in flight keeps its staged files as "
        "long as the retention exceeds the longest batch; whichever of a backfill and a compaction commits second "
        "redoes its work on the new files (the backfill) or skips (the compaction). Prints file counts before and "
        "after per table. Starts no Spark.",
    )
    _add_pipeline(maintenance)
    maintenance.add_argument(
        "--retention-hours", type=int, default=168, help="keep unreferenced files younger than this (default 168 = 7 days, at least 1)"
    )
    maintenance.add_argument("--no-vacuum", action="store_true", help="compact and checkpoint only, delete nothing")
    maintenance.add_argument("--json", action="store_true", help="print one JSON line per table")


def _add_spark_server_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    server = commands.add_parser(
        "spark-server",
        parents=[common],
        help="keep a warm Spark session that runs, backfills and Airflow tasks attach to (Spark Connect)",
        description="Start a Spark session with offsetlake's settings and serve it over Spark Connect until "
        "SIGTERM or Ctrl-C. A `run`, `stream` or `backfill` given --remote (or $OFFSETLAKE_SPARK_REMOTE) and the "
        "Airflow ingest task (connection spark_connect_default) then attach to it instead of starting a JVM of "
        "their own, which is most of a small batch's time. Each attached run has its own Spark session "
        "(its cached rows and files are released when it ends); the data files are written by the server's "
        "tasks and the Delta commit stays in the run's own process, so killing a run mid-batch commits nothing, "
        "exactly as without the server. Restart it after upgrading offsetlake: its Python workers import "
        "the installed code. Prints one JSON line with the URL when it is ready.",
    )
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    server.add_argument("--port", type=int, default=15002, help="port to listen on (default 15002, Spark Connect's)")
    server.add_argument("--master", help="Spark master (default: $OFFSETLAKE_SPARK_MASTER or local[2])")


def _add_sql_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    sql = commands.add_parser(
        "sql",
        parents=[common],
        help="query the pipelines' Delta tables by name with Spark SQL (time travel included)",
        description="Open Spark with Delta Lake and name every pipeline's tables in its catalog: PIPELINE (the sink), "
        "PIPELINE_dead_letters and PIPELINE_ledger (the offset ledger of its lake, shared by the pipelines on it: "
        'filter on `pipeline`). Then run QUERY and print its rows, e.g. `offsetlake sql "SELECT status, count(*) '
        'FROM orders_ledger GROUP BY status"` or `... FROM orders VERSION AS OF 3`. Without QUERY, read '
        "statements ending in `;` from stdin, one result after another (a shell when stdin is a terminal). "
        "Registering reads only the tables' logs. Read-only by default: a statement that would change a table "
        "(DELETE, UPDATE, MERGE, INSERT, DDL, RESTORE, OPTIMIZE, ...) is refused unless --write is given.",
    )
    sql.add_argument("query", nargs="?", metavar="QUERY", help="one SQL statement (default: read statements from stdin)")
    sql.add_argument(
        "--pipeline", action="append", metavar="PIPELINE", help="register only this pipeline's tables (repeatable; default: all)"
    )
    sql.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    sql.add_argument("--limit", type=int, default=1000, help="print at most N rows per statement (default 1000, 0 = all)")
    sql.add_argument(
        "--write",
        action="store_true",
        help="let statements change the sink tables (a GDPR delete, a fix); each one's new commits are printed. Such a "
        "commit is one offsetlake did not make: runs, status and audit report it, backfills keep the rows it deleted "
        "deleted, a rewind past it is refused unless asked. Dead-letter and ledger tables stay offsetlake's alone",
    )
    _add_spark_options(sql)


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    for noisy in ("py4j", "pyspark"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _load(args: argparse.Namespace, name: str) -> PipelineConfig:
    if args.command in ("run", "stream", "backfill"):
        from offsetlake.spark import check_reachable, remote_url

        remote = remote_url(args.remote)
        if remote:
            check_reachable(remote)  # before anything is planned: a missing server is not a failed batch
    # every command: the YAML, then what an orchestrator handed over in the environment (e.g. the
    # <pipeline>_stream DAG's Kafka, storage and registry secrets) on top
    return resolve_pipeline(name, args.pipelines_dir)


def cmd_run(args: argparse.Namespace) -> int:
    from offsetlake.errors import StreamOwnsPipelineError
    from offsetlake.plan import RunContext
    from offsetlake.runs import run_pipeline
    from offsetlake.spark import spark_session, stop_spark

    config = _load(args, args.pipeline)
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
    return 0


def _duration(text: str) -> float:
    """Seconds from '5s', '500ms', '2m', '1h' or a plain number of seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    raw = text.strip().lower()
    unit = next((u for u in ("ms", "s", "m", "h") if raw.endswith(u)), "")
    try:
        value = float(raw[: len(raw) - len(unit)]) * units.get(unit, 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a duration like 5s, 500ms, 2m or 1h") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' must be more than zero")
    return value


def cmd_stream(args: argparse.Namespace) -> int:
    from offsetlake.spark import spark_session, stop_spark
    from offsetlake.stream import StopControl, StreamOptions, run_stream

    config = _load(args, args.pipeline)
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


def cmd_backfill(args: argparse.Namespace) -> int:
    from offsetlake.backfill import plan_backfill, refused
    from offsetlake.ledger import Ledger
    from offsetlake.plan import BatchKind, RunContext
    from offsetlake.runs import execute_recorded_batch, plan_or_reuse
    from offsetlake.spark import spark_session, stop_spark

    config = _load(args, args.pipeline)
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


def cmd_rewind(args: argparse.Namespace) -> int:
    from offsetlake.rewind import rewind_pipeline

    config = _load(args, args.pipeline)
    result = rewind_pipeline(config, args.to_batch, reason=args.reason, dry_run=args.dry_run, restore_deleted=args.restore_deleted)
    print(json.dumps(result.as_dict(), default=str) if args.json else result.text(), flush=True)
    return 0


def cmd_topic(args: argparse.Namespace) -> int:
    from offsetlake.topic_epochs import reset_topic_epoch

    config = _load(args, args.pipeline)
    result = reset_topic_epoch(config, args.topic, reason=args.reason, force=args.force)
    print(json.dumps(result.as_dict()) if args.json else result.text(), flush=True)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from offsetlake.lease import current_lease
    from offsetlake.ledger_view import partition_status
    from offsetlake.sinks.choice import open_sink

    config = _load(args, args.pipeline)
    rows = partition_status(config)
    lease = current_lease(config)
    foreign = open_sink(config).foreign_changes()  # commits offsetlake did not make (a Delta sink's SQL users)
    if args.json:
        print(
            json.dumps(
                {
                    "pipeline": config.name,
                    "partitions": rows,
                    "total_lag": sum(r["lag"] for r in rows),
                    "stream_lease": lease.as_dict() if lease else None,
                    "foreign_commits": foreign,
                }
            )
        )
        return 0
    print(f"pipeline {config.name}  topic {config.topic_label}  sink {config.sink_path}")
    _print_table(rows, ["topic", "partition", "committed_end", "log_start", "last_stable", "lag"])
    print(f"total lag: {sum(r['lag'] for r in rows)}")
    if lease is not None and lease.live():
        print(f"owned by a live {lease.describe()}: scheduled runs skip")
    elif lease is not None:
        print(f"no live stream (the last one, {lease.owner}, {lease.state} its lease; it ended {lease.expires_at})")
    # ``start`` applies to the pipeline's first plan only: once anything is committed, a partition
    # without a committed end begins at its log start (``planner.plan_ranges``)
    begins_at_lso = config.start == "latest" and all(r["committed_end"] is None for r in rows)
    for f in foreign:
        what = "its files are gone (vacuumed)" if f.get("files_gone") else f"{f['rows_removed']} row(s) removed, {f['rows_added']} added"
        print(f"note: sink version {f['version']} is a commit offsetlake did not make ({f['operation']} by {f['engine']}): {what}")
    for r in rows:
        if "group_offset" in r and r["group_offset"] != r["committed_end"]:
            group = r["group_offset"] if r["group_offset"] is not None else "missing"
            print(
                f"note: {r['topic']}[{r['partition']}] the group's offset is {group} (expired or deleted), "
                f"the commit log's end {r['committed_end']}: the next run restores it"
            )
        if r["lost"]:
            print(f"WARNING: {r['topic']}[{r['partition']}] offsets [{r['committed_end']}, {r['log_start']}) are gone from Kafka")
        elif r["removed_before_start"]:
            print(
                f"note: {r['topic']}[{r['partition']}] offsets [0, {r['log_start']}) were removed from Kafka before this "
                f"pipeline committed anything there; it begins at {'the LSO' if begins_at_lso else r['log_start']}"
            )
    return 0


def cmd_ledger(args: argparse.Namespace) -> int:
    from offsetlake.ledger import Ledger
    from offsetlake.ledger_view import sink_history
    from offsetlake.runs import reconcile

    words = args.words
    if len(words) == 2 and words[0] == "rebuild":
        config = _load(args, words[1])
        ledger = Ledger.of(config)
        count = ledger.rebuild(sink_history(config))
        print(f"rebuilt ledger of pipeline {config.name} from sink history: {count} rows at {config.ledger_path}")
        return 0
    if len(words) != 1:
        raise OffsetlakeError("usage: offsetlake ledger PIPELINE | offsetlake ledger rebuild PIPELINE")
    config = _load(args, words[0])
    ledger = Ledger.of(config)
    reconcile(config, ledger)
    rows = ledger.batches()
    if args.limit:
        rows = rows[-args.limit :]
    if args.json:
        for row in rows:
            print(json.dumps(row, default=str))
        return 0
    print(f"ledger of pipeline {config.name} ({config.ledger_path})")
    for row in rows:  # the validation summary and reader schema are JSON; the table shows their gist
        row["validation"] = json.loads(row["validation"])["outcome"] if row.get("validation") else None
        schema = ReaderSchema.from_dict(json.loads(row["reader_schema"])) if row.get("reader_schema") else None
        row["reader_schema"] = schema.describe() if schema is not None else None
    _print_table(
        rows,
        [
            "batch_id",
            "kind",
            "status",
            "topic",
            "partition",
            "start_offset",
            "end_offset",
            "records_read",
            "rows_written",
            "dead_letters",
            "validation",
            "reader_schema",
            "sink_version",
            "run_id",
        ],
    )
    reports = {r["batch_id"]: r["validation_report"] for r in rows if r.get("validation_report") and r["status"] == "failed"}
    for batch_id, report in reports.items():
        print(f"failed validation: {batch_id}: {report}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from offsetlake.audit import audit_pipeline

    config = _load(args, args.pipeline)
    try:
        report = audit_pipeline(config, against_kafka=args.against_kafka)
    finally:
        if args.against_kafka and config.transform:
            from offsetlake.spark import stop_spark

            stop_spark()
    print(report.text())
    return 0 if report.ok else 1


def cmd_maintenance(args: argparse.Namespace) -> int:
    from offsetlake.maintenance import maintain

    config = _load(args, args.pipeline)
    reports = [r.as_dict() for r in maintain(config, args.retention_hours, vacuum=not args.no_vacuum)]
    if args.json:
        for report in reports:
            print(json.dumps({"pipeline": config.name, **report}))
        return 0
    print(f"maintenance of pipeline {config.name} (retention {args.retention_hours} h{', no vacuum' if args.no_vacuum else ''})")
    _print_table(
        reports,
        [
            "table",
            "files_before",
            "files_after",
            "compacted_from",
            "compacted_into",
            "checkpoint_version",
            "vacuumed",
            "duration_ms",
            "skipped",
        ],
    )
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    from offsetlake.outbox import check_outbox, publish

    config = _load(args, args.pipeline)
    if args.check:
        check = check_outbox(config, args.to)
        print(check.text())
        return 0 if check.ok else 1
    if args.max_batches is not None and args.max_batches < 1:
        raise OffsetlakeError("--max-batches must be at least 1", pipeline=config.name, field="--max-batches")
    published = [p.as_dict() for p in publish(config, args.to, args.key, args.max_batches)]
    if args.json:
        for row in published:
            print(json.dumps({"pipeline": config.name, "topic": args.to, **row}))
        return 0
    print(f"published {len(published)} sink versions of pipeline {config.name} to {args.to}")
    if published:
        _print_table(published, ["batch_id", "kind", "sink_version", "records"])
    return 0


def _print_table(rows: list[dict], columns: list[str]) -> None:
    if not rows:
        print("(no rows)")
        return
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def cmd_spark_server(args: argparse.Namespace) -> int:
    import signal
    import threading

    from offsetlake.spark import serve_connect, stop_spark

    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    url = serve_connect(args.host, args.port, args.master)
    log_line(log, "spark_server", url=url, pid=os.getpid())
    print(json.dumps({"spark_server": url, "pid": os.getpid()}), flush=True)
    try:
        stopped.wait()
    finally:
        stop_spark()
    log_line(log, "spark_server_stopped", url=url)
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from offsetlake.catalog import changes_since, refuse_write, register, table_versions, writes
    from offsetlake.config import all_pipeline_files
    from offsetlake.spark import spark_session, stop_spark

    names = args.pipeline or [p.stem for p in all_pipeline_files(args.pipelines_dir)]
    if not names:
        raise OffsetlakeError(f"no pipelines in {args.pipelines_dir or 'the pipelines folder'}: nothing to query")
    configs = [resolve_pipeline(name, args.pipelines_dir) for name in names]
    spark = spark_session(args.master, "offsetlake-sql", args.remote)
    try:
        registered, skipped = register(spark, configs)
        log_line(log, "tables", registered=",".join(t.name for t in registered) or "none", no_commit_yet=",".join(t.name for t in skipped))
        statements = [args.query] if args.query else _statements(sys.stdin)
        for number, statement in enumerate(statements, start=1):
            writing = _parsed(writes, spark, statement, number, registered)
            if writing:
                refuse_write(statement, number, args.write, registered)
                before = table_versions(registered)
            frame = _query(spark, statement, number, [t.name for t in registered])
            rows = [r.asDict(recursive=True) for r in (frame.limit(args.limit) if args.limit else frame).collect()]
            if writing:
                changed = [f"statement {number} changed {line}" for line in changes_since(registered, before)]
                print("\n".join(changed) or f"statement {number} changed no table", file=sys.stderr)
            if args.json:
                for row in rows:
                    print(json.dumps(row, default=str))
            else:
                _print_table(rows, frame.columns)
    finally:
        stop_spark()
    return 0


def _parsed(check: Callable[[Any, str], bool], spark: Any, statement: str, number: int, tables: list[Any]) -> bool:
    """``check(spark, statement)`` (which parses it), a statement Spark cannot parse refused like ``_query`` does."""
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import ParseException

    try:
        return check(spark, statement)
    except (ParseException, Py4JJavaError) as err:
        text = str(err.java_exception) if isinstance(err, Py4JJavaError) else str(err)
        first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        raise OffsetlakeError(f"statement {number}: {first} (tables here: {', '.join(t.name for t in tables) or 'none'})") from None


def _query(spark: Any, statement: str, number: int, tables: list[str]) -> Any:
    """``statement`` as a DataFrame; Spark's refusal (a parse or analysis error: a typo, a table
    that is not there) as one line naming the statement and the tables there are."""
    from pyspark.errors import AnalysisException, ParseException

    try:
        return spark.sql(statement)
    except (AnalysisException, ParseException) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OffsetlakeError(f"statement {number}: {first} (tables here: {', '.join(tables) or 'none'})") from None


def _statements(lines: Any) -> Iterator[str]:
    """SQL statements from ``lines``, each ending in ``;`` (a last one without it counts too)."""
    interactive = lines.isatty()
    pending: list[str] = []
    while True:
        if interactive:
            print("offsetlake-sql> " if not pending else "             -> ", end="", file=sys.stderr, flush=True)
        line = lines.readline()
        if not line:
            break
        pending.append(line.rstrip("\n"))
        text = "\n".join(pending).strip()
        if text.endswith(";"):
            pending = []
            if text.rstrip(";").strip():
                yield text.rstrip(";")
    rest = "\n".join(pending).strip()
    if rest:
        yield rest


COMMANDS = {
    "backfill": cmd_backfill,
    "rewind": cmd_rewind,
    "run": cmd_run,
    "stream": cmd_stream,
    "status": cmd_status,
    "ledger": cmd_ledger,
    "topic": cmd_topic,
    "audit": cmd_audit,
    "maintenance": cmd_maintenance,
    "spark-server": cmd_spark_server,
    "sql": cmd_sql,
    "publish": cmd_publish,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level)
    try:
        return COMMANDS[args.command](args)
    except OffsetlakeError as err:
        print(f"offsetlake {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except Exception as err:
        log.debug("traceback of the unexpected error", exc_info=True)
        print(f"offsetlake {args.command}: error: {describe_unexpected(err)}", file=sys.stderr)
        return 2


def entrypoint() -> None:
    """Console-script entry: run, flush, and leave without interpreter teardown.

    Seen here: at interpreter exit the native runtimes (delta-rs, Arrow, librdkafka threads)
    occasionally abort ("terminate called without an active exception", exit -6) after the
    command had finished and printed its result. Everything we write is synchronous and done
    by now, so skipping teardown loses nothing and keeps exit codes truthful.
    """
    code = main()
    exit_now(code)


def exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entrypoint()
