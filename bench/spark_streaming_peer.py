"""The peer a Spark user would write instead of offsetlake (issue 52): Structured Streaming's
Kafka source, ``from_json``, and delta-spark's Delta sink, ``trigger(availableNow=True)`` with a
checkpoint. Exactly once into Delta in a dozen lines: the checkpoint keeps the offsets, the Delta
sink's txn keeps the batch id.

    .venv/bin/python bench/spark_streaming_peer.py BOOTSTRAP TOPIC TABLE CHECKPOINT

runs it cold: its own process, its own JVM and session (the same pinned jars as offsetlake's,
Delta Lake for Spark and Spark's Kafka source), and prints the rows it wrote and its seconds as
one JSON line. ``ingest`` is the same program in a session that is already up (warm).

Like offsetlake it reads ``read_committed`` and keeps each record's coordinates as columns; a
value that is not an order becomes a row of nulls here, where offsetlake makes it a dead letter
(the bench's topics hold none).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ORDER_DDL = "order_id long, customer string, amount double, currency string, created_at timestamp"


def ingest(spark: Any, bootstrap: str, topic: str, table: str, checkpoint: str) -> float:
    """Everything the topic holds now into ``table``; returns the seconds it took."""
    from pyspark.sql import functions as F

    started = time.monotonic()
    source = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("kafka.isolation.level", "read_committed")
        .load()
    )
    rows = source.select(
        F.from_json(F.col("value").cast("string"), ORDER_DDL).alias("order"),
        F.col("topic").alias("_kafka_topic"),
        F.col("partition").alias("_kafka_partition"),
        F.col("offset").alias("_kafka_offset"),
        F.col("timestamp").alias("_kafka_timestamp"),
    ).select("order.*", "_kafka_topic", "_kafka_partition", "_kafka_offset", "_kafka_timestamp")
    query = rows.writeStream.format("delta").option("checkpointLocation", checkpoint).trigger(availableNow=True).start(table)
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"the Structured Streaming peer failed: {query.exception()}")
    return time.monotonic() - started


def rows_in(spark: Any, table: str) -> int:
    return int(spark.read.format("delta").load(table).count())


def main(argv: list[str]) -> int:
    bootstrap, topic, table, checkpoint = argv
    started = time.monotonic()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from offsetlake.spark import classic_builder

    spark = classic_builder(None, "structured-streaming-peer").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    ingest(spark, bootstrap, topic, table, checkpoint)
    elapsed = time.monotonic() - started
    print(json.dumps({"rows": rows_in(spark, table), "seconds": round(elapsed, 2)}), flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
