"""What every command shares: the pipeline and Spark options, logging, loading a pipeline, durations, tables."""

from __future__ import annotations

import argparse
import logging
import sys

from offsetlake.config import PipelineConfig, resolve_pipeline


def add_pipeline(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "pipeline",
        metavar="PIPELINE",
        help="pipeline name (pipelines/<name>.yaml; <name>_<table> for one table of a file with routes:) or a .yaml path",
    )


def add_spark_options(parser: argparse.ArgumentParser) -> None:
    """Where a command's Spark work runs: its own session (--master) or a warm server's (--remote)."""
    parser.add_argument("--master", help="Spark master (default: $OFFSETLAKE_SPARK_MASTER or local[2])")
    parser.add_argument(
        "--remote",
        metavar="URL",
        help="attach to this Spark Connect server instead of starting a JVM "
        "(default: $OFFSETLAKE_SPARK_REMOTE), e.g. sc://127.0.0.1:15002 from `offsetlake spark-server`",
    )
    parser.add_argument(
        "--no-server",
        action="store_true",
        help="start Spark in this process instead of attaching to the project's warm Spark server. By default a command "
        "given neither --remote nor --master attaches to it, and the first one starts it (loopback only, with a token; "
        "it stops after $OFFSETLAKE_SPARK_SERVER_IDLE, default 15m, unused). Same as $OFFSETLAKE_SPARK_SERVER=off",
    )


def apply_spark_options(args: argparse.Namespace) -> None:
    """--no-server: this command and anything it starts keep Spark in their own process."""
    import os

    if getattr(args, "no_server", False):
        os.environ["OFFSETLAKE_SPARK_SERVER"] = "off"


def configure_logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    for noisy in ("py4j", "pyspark"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def load_config(args: argparse.Namespace, name: str) -> PipelineConfig:
    if args.command in ("run", "stream", "backfill"):
        from offsetlake.spark import check_reachable, remote_url

        apply_spark_options(args)

        remote = remote_url(args.remote)
        if remote:
            check_reachable(remote)  # before anything is planned: a missing server is not a failed batch
    # every command: the YAML, then what an orchestrator handed over in the environment (e.g. the
    # <pipeline>_stream DAG's Kafka, storage and registry secrets) on top
    return resolve_pipeline(name, args.pipelines_dir)


def duration(text: str) -> float:
    """Seconds from '5s', '500ms', '2m', '1h' or a plain number of seconds (an argparse type)."""
    from offsetlake.durations import seconds

    try:
        return seconds(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def print_table(rows: list[dict], columns: list[str]) -> None:
    if not rows:
        print("(no rows)")
        return
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
