"""The commands that read: status, ledger (and ledger rebuild), audit."""

from __future__ import annotations

import argparse
import json

from offsetlake.cli.common import add_pipeline, load_config, print_table
from offsetlake.errors import OffsetlakeError
from offsetlake.plan import ReaderSchema


def add_status_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    status = commands.add_parser(
        "status",
        parents=[common],
        help="per partition: committed end, log start, last stable offset, lag",
        description="Show, per partition, the sink's committed end (txn version), the log start offset, the "
        "last stable offset and the lag (LSO minus committed end), and which stream owns the pipeline, if any. "
        "Reads Kafka and Delta; starts no Spark.",
    )
    add_pipeline(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")


def cmd_status(args: argparse.Namespace) -> int:
    from offsetlake.lease import current_lease
    from offsetlake.ledger_view import partition_status
    from offsetlake.sinks.choice import open_sink

    config = load_config(args, args.pipeline)
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
    print_table(rows, ["topic", "partition", "committed_end", "log_start", "last_stable", "lag"])
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


def add_ledger_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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


def cmd_ledger(args: argparse.Namespace) -> int:
    from offsetlake.ledger import Ledger
    from offsetlake.ledger_view import sink_history
    from offsetlake.runs import reconcile

    words = args.words
    if len(words) == 2 and words[0] == "rebuild":
        config = load_config(args, words[1])
        ledger = Ledger.of(config)
        count = ledger.rebuild(sink_history(config))
        print(f"rebuilt ledger of pipeline {config.name} from sink history: {count} rows at {config.ledger_path}")
        return 0
    if len(words) != 1:
        raise OffsetlakeError("usage: offsetlake ledger PIPELINE | offsetlake ledger rebuild PIPELINE")
    config = load_config(args, words[0])
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
    print_table(
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


def add_audit_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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
    add_pipeline(audit)
    audit.add_argument(
        "--against-kafka",
        action="store_true",
        help="also read the committed ranges back from Kafka (read_committed) and check that every "
        "record Kafka still holds is in exactly one of the sink, the dead letters or a recorded gap, "
        "and nothing else is; offsets past retention are reported, not checked. With a transform, "
        "records without rows are transformed again on Spark to tell filtered from lost",
    )


def cmd_audit(args: argparse.Namespace) -> int:
    from offsetlake.audit import audit_pipeline

    config = load_config(args, args.pipeline)
    try:
        report = audit_pipeline(config, against_kafka=args.against_kafka)
    finally:
        if args.against_kafka and config.transform:
            from offsetlake.spark import stop_spark

            stop_spark()
    print(report.text())
    return 0 if report.ok else 1
