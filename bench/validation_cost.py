"""What the Great Expectations gate adds to a batch: 1M-record batches with and without the suite.

    .venv/bin/python bench/validation_cost.py [--records 1000000] [--repeats 3]

Produces ``--records`` orders once (2 partitions, a private Apache Kafka broker unless
KAFKA_BOOTSTRAP_SERVERS is set), then per repeat ingests them all as ONE batch into a fresh lake twice, once with
``pipelines/orders.expectations.yaml`` (6 expectations) and once without, alternating the
order. One warm Spark session (local[2]) serves every run, after a small warm-up batch.
Prints one JSON line per run and a summary with medians: the validate step's own time, its
share of the batch, and the batch time with vs without the suite.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offsetlake.config import load_pipeline  # noqa: E402
from offsetlake.embedded.local_broker import broker_for  # noqa: E402
from offsetlake.embedded.sample_data import ensure_topic, produce_orders  # noqa: E402
from offsetlake.plan import RunContext  # noqa: E402
from offsetlake.runs import run_pipeline  # noqa: E402
from offsetlake.spark import spark_session, stop_spark  # noqa: E402


def write_pipeline(folder: Path, name: str, topic: str, bootstrap: str, lake: Path, records: int, suite: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_load((ROOT / "pipelines" / "orders.yaml").read_text().replace("${", "$${"))
    body.pop("storage", None)  # its ${AWS_...:-} defaults, escaped above, are not empty: a local lake takes none
    body.update(
        {
            "name": name,
            "topic": topic,
            "lake": str(lake),
            "max_records_per_batch": records,
            "read_timeout_seconds": 600,
            "kafka": {"bootstrap_servers": bootstrap, "options": {"client.id": "bench"}},
            "validation": {"on_failure": "fail"},
        }
    )
    shutil.copy(ROOT / "pipelines" / "orders_transform.py", folder / "orders_transform.py")
    if suite:
        shutil.copy(ROOT / "pipelines" / "orders.expectations.yaml", folder / f"{name}.expectations.yaml")
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def one_batch(work: Path, label: str, topic: str, bootstrap: str, records: int, suite: bool) -> dict:
    name = f"bench_{label}"
    lake = work / f"lake_{label}"
    shutil.rmtree(lake, ignore_errors=True)
    config = load_pipeline(str(write_pipeline(work / f"pipelines_{label}", name, topic, bootstrap, lake, records, suite)))
    started = time.monotonic()
    results = run_pipeline(config, RunContext(run_id=f"bench-{label}"), spark_session, max_batches=1, emit=lambda _: None)
    wall = time.monotonic() - started
    result = results[0]
    row = {
        "suite": suite,
        "records": result.total("records_read"),
        "rows": result.total("rows_written"),
        "wall_s": round(wall, 2),
        **{f"{k}_ms": v for k, v in result.timings_ms.items()},
    }
    shutil.rmtree(lake, ignore_errors=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="offsetlake-bench-"))
    try:
        with broker_for(work / "broker") as (bootstrap, _):
            return _measure(args, work, bootstrap)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(args: argparse.Namespace, work: Path, bootstrap: str) -> int:
    try:
        topic = f"bench_orders_{int(time.time())}"
        ensure_topic(bootstrap, topic, 2)
        t = time.monotonic()
        produce_orders(bootstrap, topic, args.records)
        print(json.dumps({"produced": args.records, "seconds": round(time.monotonic() - t, 1)}), flush=True)
        warm = f"{topic}_warmup"
        ensure_topic(bootstrap, warm, 2)
        produce_orders(bootstrap, warm, 20_000)
        one_batch(work, "warmup", warm, bootstrap, 20_000, suite=True)

        runs = []
        for i in range(args.repeats):
            for suite in (True, False) if i % 2 == 0 else (False, True):
                row = one_batch(work, f"{i}_{'suite' if suite else 'none'}", topic, bootstrap, args.records, suite)
                print(json.dumps(row), flush=True)
                runs.append(row)
        with_suite = [r for r in runs if r["suite"]]
        without = [r for r in runs if not r["suite"]]
        median = statistics.median
        summary = {
            "records_per_batch": args.records,
            "repeats": args.repeats,
            "median_batch_s_with_suite": round(median(r["total_ms"] for r in with_suite) / 1000, 2),
            "median_batch_s_without_suite": round(median(r["total_ms"] for r in without) / 1000, 2),
            "median_validate_s": round(median(r["validate_ms"] for r in with_suite) / 1000, 2),
            "median_validate_share_of_batch": round(median(r["validate_ms"] / r["total_ms"] for r in with_suite), 3),
            "median_batch_ratio_with_vs_without": round(
                median(r["total_ms"] for r in with_suite) / median(r["total_ms"] for r in without), 3
            ),
        }
        print(json.dumps({"summary": summary}), flush=True)
    finally:
        stop_spark()
    return 0


if __name__ == "__main__":
    # Spark in this process, or a server this script starts itself: never the project's own warm
    # server, which commands use by default (offsetlake.spark_server)
    os.environ.setdefault("OFFSETLAKE_SPARK_SERVER", "off")
    from offsetlake.cli import exit_now

    exit_now(main())
