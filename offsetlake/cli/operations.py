"""The commands around the pipelines: maintenance, publish (the outbox), spark-server, sql."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from offsetlake.cli.common import add_pipeline, add_spark_options, apply_spark_options, load_config, print_table
from offsetlake.config import resolve_pipeline
from offsetlake.errors import OffsetlakeError
from offsetlake.log_lines import log_line

log = logging.getLogger("offsetlake.cli")


def add_maintenance_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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
    add_pipeline(maintenance)
    maintenance.add_argument(
        "--retention-hours", type=int, default=168, help="keep unreferenced files younger than this (default 168 = 7 days, at least 1)"
    )
    maintenance.add_argument("--no-vacuum", action="store_true", help="compact and checkpoint only, delete nothing")
    maintenance.add_argument("--json", action="store_true", help="print one JSON line per table")


def cmd_maintenance(args: argparse.Namespace) -> int:
    from offsetlake.maintenance import maintain

    config = load_config(args, args.pipeline)
    reports = [r.as_dict() for r in maintain(config, args.retention_hours, vacuum=not args.no_vacuum)]
    if args.json:
        for report in reports:
            print(json.dumps({"pipeline": config.name, **report}))
        return 0
    print(f"maintenance of pipeline {config.name} (retention {args.retention_hours} h{', no vacuum' if args.no_vacuum else ''})")
    print_table(
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


def add_publish_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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
    add_pipeline(publish)
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


def cmd_publish(args: argparse.Namespace) -> int:
    from offsetlake.outbox import check_outbox, publish

    config = load_config(args, args.pipeline)
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
        print_table(published, ["batch_id", "kind", "sink_version", "records"])
    return 0


def add_spark_server_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    server = commands.add_parser(
        "spark-server",
        parents=[common],
        help="keep a warm Spark session that runs, backfills and Airflow tasks attach to (Spark Connect); "
        "--status / --stop the project's own",
        description="By default you need not start one: a `run`, `stream`, `backfill` or `sql` given neither --remote nor "
        "--master attaches to the project's own server, which the first of them starts (loopback only, with a token, "
        "one per $OFFSETLAKE_HOME or working directory, files in .offsetlake/spark-server/) and which stops once no "
        "command has used it for $OFFSETLAKE_SPARK_SERVER_IDLE (default 15m); `--status` shows it, `--stop` stops it, "
        "--no-server or $OFFSETLAKE_SPARK_SERVER=off keeps Spark in each command's own process. "
        "Without --status/--stop, start a Spark session with offsetlake's settings and serve it over Spark Connect until "
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
    which = server.add_mutually_exclusive_group()
    which.add_argument(
        "--status",
        action="store_true",
        help="print the project's own server (the one commands start by default and share: its PID, port, start time "
        "and the commands attached to it) as one JSON line, and exit; exit code 1 when none runs",
    )
    which.add_argument(
        "--stop", action="store_true", help="stop the project's own server by its PID (its commands in flight fail and commit nothing)"
    )
    server.add_argument("--managed", metavar="DIR", help=argparse.SUPPRESS)  # started by offsetlake.spark_server


def cmd_spark_server(args: argparse.Namespace) -> int:
    import signal
    import threading
    from pathlib import Path

    from offsetlake import spark_server
    from offsetlake.spark import serve_connect, stop_spark

    if args.status or args.stop:
        running = spark_server.current()
        if args.stop:
            ended = spark_server.stop()
            print(json.dumps({"spark_server": "stopped" if ended else "none", "pid": ended.pid if ended else None}))
            return 0
        if running is None:
            print(json.dumps({"spark_server": None, "home": str(spark_server.home())}))
            return 1
        leases = sorted(p.name.split(".")[0] for p in (spark_server.state_dir() / "leases").glob(f"*.{running.pid}"))
        shown = {"spark_server": f"sc://localhost:{running.port}", "pid": running.pid, "started": running.started, "commands": leases}
        print(json.dumps(shown))
        return 0
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    url = serve_connect(args.host, args.port, args.master)
    if args.managed:  # the project's own server: name it, and stop it when it is idle or retired
        folder = Path(args.managed)
        spark_server.publish(folder, args.port)
        idle = spark_server.idle_seconds()
        threading.Thread(target=spark_server.watch, args=(folder, idle, stopped), name="idle-watch", daemon=True).start()
        log_line(log, "spark_server", url=url, pid=os.getpid(), idle_stop_s=idle, home=str(folder))
    else:
        log_line(log, "spark_server", url=url, pid=os.getpid())
        print(json.dumps({"spark_server": url, "pid": os.getpid()}), flush=True)
    try:
        stopped.wait()
    finally:
        if args.managed:
            spark_server.retire(Path(args.managed))
        stop_spark()
    log_line(log, "spark_server_stopped", url=url)
    return 0


def add_catalog_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    catalog = commands.add_parser(
        "catalog",
        parents=[common],
        help="name the pipelines' tables in a metastore any Spark session reaches: `catalog register`, `catalog settings`",
        description="Spark's Hive-compatible catalog with an embedded metastore (Derby) in .offsetlake/metastore/ under "
        "$OFFSETLAKE_HOME or the working directory. `register` names every committed table of the pipelines there "
        "(PIPELINE, PIPELINE_dead_letters, PIPELINE_ledger in the pipeline's catalog.database, `default` unless it says "
        "otherwise; external Delta tables whose location is the lake folder, so the Delta log stays the truth); "
        "`settings` prints the Spark settings a `pyspark`, `spark-sql` or "
        "`spark-submit` session needs to query them by name. Derby allows one process at a time: register while no "
        "other session has the metastore open. With --metastore thrift://HOST:PORT (or $OFFSETLAKE_METASTORE) the "
        "names go to that Hive Metastore server instead, which every session of a team reaches at once. A lake on S3 "
        "is named at s3a:// with the pipeline's storage: settings as S3A's per-bucket settings.",
    )
    actions = catalog.add_subparsers(dest="catalog_command", required=True, metavar="ACTION")
    register = actions.add_parser("register", parents=[common], help="name the pipelines' committed tables in the metastore")
    register.add_argument(
        "--pipeline", action="append", metavar="PIPELINE", help="register only this pipeline's tables (repeatable; default: all)"
    )
    shown = actions.add_parser(
        "settings",
        parents=[common],
        help="print the Spark settings of a session that sees the tables (S3 credentials as ***: they are in the conf file)",
    )
    shown.add_argument(
        "--pipeline", action="append", metavar="PIPELINE", help="only this pipeline's lake settings (repeatable; default: all)"
    )
    shown.add_argument("--json", action="store_true", help="one JSON object of settings instead of --conf arguments")
    for action in (register, shown):
        action.add_argument(
            "--metastore",
            metavar="URI",
            help="a Hive Metastore server to name the tables in, thrift://HOST:PORT (comma-separated for several); "
            "default: $OFFSETLAKE_METASTORE, else `embedded`, the project's own in .offsetlake/metastore/",
        )


def cmd_catalog(args: argparse.Namespace) -> int:
    from offsetlake import metastore
    from offsetlake.config import pipeline_names

    names = args.pipeline or pipeline_names(args.pipelines_dir)
    if args.catalog_command == "settings":
        server = metastore.server(args.metastore)
        conf = metastore.shown(
            {**metastore.settings(None, server), **metastore.object_storage([resolve_pipeline(n, args.pipelines_dir) for n in names])}
        )
        if args.json:
            print(json.dumps(conf))
            return 0
        print("# a Spark session with these settings sees the registered tables by name; `catalog register` also")
        print(f"# writes them to {metastore.conf_dir()}/spark-defaults.conf (with the S3 credentials shown here as ***),")
        print("# so this is enough:")
        print(f"#   SPARK_CONF_DIR={metastore.conf_dir()} .venv/bin/pyspark     (or spark-sql, spark-submit)")
        print("\n".join(f"--conf {key}={value}" for key, value in conf.items()))
        return 0
    if not names:
        raise OffsetlakeError(f"no pipelines in {args.pipelines_dir or 'the pipelines folder'}: nothing to register")
    configs = [resolve_pipeline(name, args.pipelines_dir) for name in names]
    server = metastore.server(args.metastore)
    registered, skipped = metastore.register(configs, metastore=server)
    log_line(
        log, "catalog_registered", tables=",".join(t.label for t in registered) or "none", no_commit_yet=",".join(t.label for t in skipped)
    )
    print(
        f"registered {len(registered)} tables in the metastore at {server or metastore.folder()}: "
        f"{', '.join(t.label for t in registered) or 'none'}"
    )
    if skipped:
        print(f"not yet (no commit): {', '.join(t.label for t in skipped)}")
    print(f"query them by name from any Spark session started with SPARK_CONF_DIR={metastore.conf_dir()} (`offsetlake catalog settings`)")
    return 0


def add_sql_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    sql = commands.add_parser(
        "sql",
        parents=[common],
        help="query the pipelines' Delta tables by name with Spark SQL (time travel included)",
        description="Open Spark with Delta Lake and name every pipeline's tables in its catalog: PIPELINE (the sink), "
        "PIPELINE_dead_letters and PIPELINE_ledger (the offset ledger of its lake, shared by the pipelines on it: "
        "filter on `pipeline`), in the pipeline's catalog.database (default: `default`; the current database when all "
        'share one, else name them DATABASE.TABLE). Then run QUERY and print its rows, e.g. `offsetlake sql "SELECT status, count(*) '
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
    add_spark_options(sql)


def cmd_sql(args: argparse.Namespace) -> int:
    from offsetlake.catalog import changes_since, current_database, refuse_write, register, table_versions, writes
    from offsetlake.config import pipeline_names
    from offsetlake.spark import spark_session, stop_spark

    names = args.pipeline or pipeline_names(args.pipelines_dir)
    if not names:
        raise OffsetlakeError(f"no pipelines in {args.pipelines_dir or 'the pipelines folder'}: nothing to query")
    configs = [resolve_pipeline(name, args.pipelines_dir) for name in names]
    apply_spark_options(args)
    spark = spark_session(args.master, "offsetlake-sql", args.remote)
    try:
        registered, skipped = register(spark, configs)
        current_database(spark, registered)
        log_line(
            log, "tables", registered=",".join(t.label for t in registered) or "none", no_commit_yet=",".join(t.label for t in skipped)
        )
        statements = [args.query] if args.query else _statements(sys.stdin)
        for number, statement in enumerate(statements, start=1):
            writing = _parsed(writes, spark, statement, number, registered)
            if writing:
                refuse_write(statement, number, args.write, registered)
                before = table_versions(registered)
            frame = _query(spark, statement, number, [t.label for t in registered])
            rows = [r.asDict(recursive=True) for r in (frame.limit(args.limit) if args.limit else frame).collect()]
            if writing:
                changed = [f"statement {number} changed {line}" for line in changes_since(registered, before)]
                print("\n".join(changed) or f"statement {number} changed no table", file=sys.stderr)
            if args.json:
                for row in rows:
                    print(json.dumps(row, default=str))
            else:
                print_table(rows, frame.columns)
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
        raise OffsetlakeError(f"statement {number}: {first} (tables here: {', '.join(t.label for t in tables) or 'none'})") from None


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
