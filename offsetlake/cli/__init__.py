"""``offsetlake`` command line: run, stream, backfill, rewind, topic reset-epoch, status, ledger, ledger rebuild, audit,
maintenance, spark-server, sql, publish.

Logs (one structured line per batch step) go to stderr; machine-readable results (one JSON
summary line per batch, ``--json`` views) go to stdout. Errors print one readable line naming
the pipeline, topic, partition and offsets, and exit non-zero; Kafka secrets are never printed.

One module per command family: ``batches`` (run, stream, backfill, rewind, topic), ``views``
(status, ledger, audit), ``operations`` (maintenance, publish, spark-server, sql), over ``common``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from offsetlake.cli.batches import (
    add_backfill_command,
    add_rewind_command,
    add_run_command,
    add_stream_command,
    add_topic_command,
    cmd_backfill,
    cmd_rewind,
    cmd_run,
    cmd_stream,
    cmd_topic,
)
from offsetlake.cli.common import configure_logging
from offsetlake.cli.operations import (
    add_catalog_command,
    add_maintenance_command,
    add_publish_command,
    add_spark_server_command,
    add_sql_command,
    cmd_catalog,
    cmd_maintenance,
    cmd_publish,
    cmd_spark_server,
    cmd_sql,
)
from offsetlake.cli.views import add_audit_command, add_ledger_command, add_status_command, cmd_audit, cmd_ledger, cmd_status
from offsetlake.errors import OffsetlakeError, describe_unexpected

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

    add_run_command(commands, common)
    add_stream_command(commands, common)
    add_backfill_command(commands, common)
    add_rewind_command(commands, common)
    add_topic_command(commands, common)
    add_status_command(commands, common)
    add_ledger_command(commands, common)
    add_audit_command(commands, common)
    add_maintenance_command(commands, common)
    add_spark_server_command(commands, common)
    add_sql_command(commands, common)
    add_catalog_command(commands, common)
    add_publish_command(commands, common)
    return parser


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
    "catalog": cmd_catalog,
    "publish": cmd_publish,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
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
