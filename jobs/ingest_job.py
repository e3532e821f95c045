"""spark-submit entry point: execute exactly one planned batch of a pipeline.

    spark-submit jobs/ingest_job.py --pipeline orders --batch-id orders-20261122T...-ab12cd

The plan (ranges) comes from the ledger, never from "the latest offsets", so a retry of the
Airflow task re-executes the same ranges or, if the commit already happened, succeeds without
writing.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ingest_job", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", required=True, help="pipeline name or .yaml path")
    parser.add_argument("--batch-id", required=True, help="the planned batch to execute (from the plan task)")
    parser.add_argument("--pipelines-dir", type=Path, help="folder of pipeline YAML files")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")

    from offsetlake.config import resolve_pipeline
    from offsetlake.errors import OffsetlakeError, describe_unexpected
    from offsetlake.runs import execute_recorded_batch
    from offsetlake.spark import spark_session, stop_spark

    try:
        config = resolve_pipeline(args.pipeline, args.pipelines_dir)
        result = execute_recorded_batch(config, args.batch_id, spark_session)
    except OffsetlakeError as err:
        print(f"ingest_job: error: {err}", file=sys.stderr)
        return err.exit_code
    except Exception as err:
        logging.getLogger("offsetlake.job").info("details of the error below", exc_info=True)
        print(f"ingest_job: error: {describe_unexpected(err)}", file=sys.stderr)
        return 2
    finally:
        stop_spark()
    print(json.dumps(result.summary()), flush=True)
    from offsetlake import metastore

    problem = metastore.follow(
        config, args.pipeline, args.pipelines_dir
    )  # the batch's new tables by name, if the project keeps a metastore
    if problem:
        print(f"ingest_job: warning: {problem}; run `offsetlake catalog register`", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from offsetlake.cli import exit_now

    exit_now(main())
