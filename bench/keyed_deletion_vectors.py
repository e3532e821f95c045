"""A keyed sink's merges with and without Delta deletion vectors (issue 37's keyed row).

    .venv/bin/python bench/keyed_deletion_vectors.py [--records 2000000] [--keys 100000]
                                                     [--batch 200000] [--out bench-keyed-dv.json]

1. Produces ``--records`` orders over 6 partitions whose order_id is drawn (seeded) from
   ``--keys`` keys, on a private Apache Kafka broker (or $KAFKA_BOOTSTRAP_SERVERS).
2. offsetlake: a keyed sink (``sink.mode: upsert``, key order_id) fed in batches of
   ``--batch`` records by one warm ``run_pipeline``: delta-rs copy-on-write merges, no deletion
   vectors. Per batch from its ledger entry: files rewritten and the batch's whole time
   (``duration_ms``: read, decode, merge, commit).
3. delta-spark: the very same batches (each ledger entry's ranges read again with Spark's Kafka
   source, decoded with ``from_json``, newest record per key), each cached and counted first,
   then ``MERGE INTO`` alone is timed into two delta-spark tables, one created with
   ``delta.enableDeletionVectors`` and one without, the two taking turns going first. Per
   batch from ``DESCRIBE HISTORY``'s operation metrics: files removed and added, deletion
   vectors added, rows copied unchanged.

The offsetlake and delta-spark times measure different scopes (a whole batch vs the MERGE
alone); the files-rewritten columns compare directly. Prints one JSON line per batch and a
summary of medians; writes every figure to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from offsetlake_bench import produce_order_ids, write_pipeline  # noqa: E402

from offsetlake.config import load_pipeline  # noqa: E402
from offsetlake.embedded.local_broker import broker_for  # noqa: E402
from offsetlake.embedded.sample_data import ensure_topic  # noqa: E402
from offsetlake.history import sink_commits  # noqa: E402
from offsetlake.plan import RunContext  # noqa: E402
from offsetlake.runs import run_pipeline  # noqa: E402
from offsetlake.spark import spark_session, stop_spark  # noqa: E402
from offsetlake.storage import table as open_delta  # noqa: E402

log = logging.getLogger("keyed_deletion_vectors")
SCHEMA = "order_id BIGINT, customer STRING, amount DOUBLE, currency STRING, created_at TIMESTAMP"
TOPIC = "bench_keyed_dv"


def offsetlake_merges(work: Path, bootstrap: str, batch: int) -> list[dict[str, Any]]:
    """Drain the topic into a keyed sink in batches of ``batch``; per batch its entry's figures."""
    sink = work / "offsetlake_sink"
    config = load_pipeline(
        str(
            write_pipeline(
                work / "p",
                "bench_keyed_dv",
                TOPIC,
                bootstrap,
                work / "lake",
                key_format="none",
                max_records_per_batch=batch,
                sink={"table": str(sink), "mode": "upsert", "key": ["order_id"]},
            )
        )
    )
    run_pipeline(config, RunContext("keyed-dv"), spark_session, emit=lambda _: None)
    rows = []
    for commit in sink_commits(open_delta(str(sink)), config.name):
        entry = commit.entry
        rows.append(
            {
                "ranges": [(r.partition, r.start, r.end) for r in entry.ranges],
                "records": sum(r.end - r.start for r in entry.ranges),
                "batch_s": round((entry.duration_ms or 0) / 1000, 2),
                "files_rewritten": entry.merge["files_rewritten"],
                "rows_rewritten": entry.merge["rows_rewritten"],
                "updated": entry.merge["updated"],
                "inserted": entry.merge["inserted"],
            }
        )
    return rows


def batch_frame(spark: Any, bootstrap: str, ranges: list[tuple[int, int, int]]) -> Any:
    """One batch's records as rows, newest per key, cached and counted."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    frame = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("assign", json.dumps({TOPIC: [p for p, _, _ in ranges]}))
        .option("startingOffsets", json.dumps({TOPIC: {str(p): s for p, s, _ in ranges}}))
        .option("endingOffsets", json.dumps({TOPIC: {str(p): e for p, _, e in ranges}}))
        .load()
        .select(F.from_json(F.col("value").cast("string"), SCHEMA).alias("v"), "partition", "offset")
        .select("v.*", F.col("partition").alias("_kafka_partition"), F.col("offset").alias("_kafka_offset"))
    )
    # a key's records share a partition (the producer keys them): its newest is its highest offset
    newest = Window.partitionBy("order_id").orderBy(F.col("_kafka_offset").desc())
    frame = frame.withColumn("_n", F.row_number().over(newest)).where("_n = 1").drop("_n").cache()
    frame.count()
    return frame


def spark_merge(spark: Any, path: str, frame: Any) -> dict[str, Any]:
    """``MERGE INTO`` ``path`` from ``frame``, timed; its operation metrics."""
    frame.createOrReplaceTempView("bench_batch")
    t = time.monotonic()
    spark.sql(
        f"MERGE INTO delta.`{path}` t USING bench_batch s ON t.order_id = s.order_id "
        "WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *"
    )
    elapsed = time.monotonic() - t
    [last] = spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1").collect()
    metrics = last["operationMetrics"]
    return {
        "merge_s": round(elapsed, 2),
        "files_removed": int(metrics.get("numTargetFilesRemoved", 0)),
        "files_added": int(metrics.get("numTargetFilesAdded", 0)),
        "deletion_vectors_added": int(metrics.get("numTargetDeletionVectorsAdded", 0)),
        "rows_copied": int(metrics.get("numTargetRowsCopied", 0)),
        "rows_updated": int(metrics.get("numTargetRowsUpdated", 0)),
    }


def spark_merges(work: Path, bootstrap: str, batches: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    spark = spark_session()
    tables = {"with_dv": str(work / "spark_dv"), "without_dv": str(work / "spark_plain")}
    for label, path in tables.items():
        spark.sql(
            f"CREATE TABLE delta.`{path}` ({SCHEMA}, _kafka_partition INT, _kafka_offset BIGINT) USING delta "
            f"TBLPROPERTIES ('delta.enableDeletionVectors' = '{str(label == 'with_dv').lower()}')"
        )
    out: dict[str, list[dict[str, Any]]] = {label: [] for label in tables}
    for i, b in enumerate(batches):
        frame = batch_frame(spark, bootstrap, b["ranges"])
        order = list(tables) if i % 2 == 0 else list(reversed(tables))
        for label in order:
            out[label].append(spark_merge(spark, tables[label], frame))
        frame.unpersist()
        print(json.dumps({"batch": i, "offsetlake": b, **{k: v[-1] for k, v in out.items()}}), flush=True)
    for label, path in tables.items():
        detail = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").first()
        out[label + "_table"] = [{"files": detail["numFiles"], "bytes": detail["sizeInBytes"]}]
    return out


def summary(ours: list[dict[str, Any]], theirs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over the batches after the first (the first merges into an empty table)."""

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return round(statistics.median(r[key] for r in rows[1:]), 2)

    return {
        "batches": len(ours),
        "offsetlake_delta_rs": {
            "batch_s": med(ours, "batch_s"),
            "files_rewritten": med(ours, "files_rewritten"),
            "rows_rewritten": med(ours, "rows_rewritten"),
        },
        **{
            f"delta_spark_{label}": {
                "merge_s": med(theirs[label], "merge_s"),
                "files_removed": med(theirs[label], "files_removed"),
                "files_added": med(theirs[label], "files_added"),
                "deletion_vectors_added": med(theirs[label], "deletion_vectors_added"),
                "rows_copied": med(theirs[label], "rows_copied"),
                "table": theirs[label + "_table"][0],
            }
            for label in ("with_dv", "without_dv")
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="keyed_deletion_vectors", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=2_000_000, help="orders to produce (default 2,000,000)")
    parser.add_argument("--keys", type=int, default=100_000, help="distinct order ids they are drawn from (default 100,000)")
    parser.add_argument("--batch", type=int, default=200_000, help="max_records_per_batch (default 200,000)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-keyed-dv.json", help="where to write every figure as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="offsetlake-keyed-dv-"))
    try:
        with broker_for(work / "broker") as (bootstrap, _):
            ensure_topic(bootstrap, TOPIC, 6)
            rng = random.Random(37)
            produce_order_ids(bootstrap, TOPIC, [rng.randrange(args.keys) for _ in range(args.records)])
            spark_session()
            ours = offsetlake_merges(work, bootstrap, args.batch)
            assert sum(b["records"] for b in ours) == args.records, ours
            theirs = spark_merges(work, bootstrap, ours)
            figures = {"args": {k: str(v) for k, v in vars(args).items()}, "offsetlake": ours, **theirs}
            figures["summary"] = summary(ours, theirs)
            args.out.write_text(json.dumps(figures, indent=1) + "\n")
            print(json.dumps(figures["summary"], indent=1))
            stop_spark()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    # Spark in this process, or a server this script starts itself: never the project's own warm
    # server, which commands use by default (offsetlake.spark_server)
    os.environ.setdefault("OFFSETLAKE_SPARK_SERVER", "off")
    sys.exit(main())
