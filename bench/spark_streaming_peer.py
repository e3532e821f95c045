"""The peer a Spark user would write instead of offsetlake (issue 52): Structured Streaming's
Kafka source, ``from_json``, and delta-spark's Delta sink, ``trigger(availableNow=True)`` with a
checkpoint. Exactly once into Delta in a dozen lines: the checkpoint keeps the offsets, the Delta
sink's txn keeps the batch id.

    .venv/bin/python bench/spark_streaming_peer.py BOOTSTRAP TOPIC TABLE CHECKPOINT

runs it cold: its own process, its own JVM and session (the same pinned jars as offsetlake's,
Delta Lake for Spark and Spark's Kafka source), and prints the rows it wrote and its seconds as
one JSON line. ``ingest`` is the same program in a session that is already up (warm);
``ingest_shipped`` is the shape of the shipped ``orders`` pipeline (transform, partitions, its
expectations as checks), warm only.

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


def _orders(spark: Any, bootstrap: str, topic: str) -> Any:
    """The topic's orders as a stream of rows: the order's fields and each record's coordinates."""
    from pyspark.sql import functions as F

    source = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("kafka.isolation.level", "read_committed")
        .load()
    )
    return source.select(
        F.from_json(F.col("value").cast("string"), ORDER_DDL).alias("order"),
        F.col("topic").alias("_kafka_topic"),
        F.col("partition").alias("_kafka_partition"),
        F.col("offset").alias("_kafka_offset"),
        F.col("timestamp").alias("_kafka_timestamp"),
    ).select("order.*", "_kafka_topic", "_kafka_partition", "_kafka_offset", "_kafka_timestamp")


def ingest(spark: Any, bootstrap: str, topic: str, table: str, checkpoint: str) -> float:
    """Everything the topic holds now into ``table``; returns the seconds it took."""

    started = time.monotonic()
    query = (
        _orders(spark, bootstrap, topic)
        .writeStream.format("delta")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start(table)
    )
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"the Structured Streaming peer failed: {query.exception()}")
    return time.monotonic() - started


def ingest_shipped(spark: Any, bootstrap: str, topic: str, table: str, checkpoint: str) -> float:
    """The shipped ``orders`` pipeline's shape written the Spark way: the same transform
    (``order_date``, the amount rounded), the table partitioned by ``order_date``, and its six
    expectations as one aggregation per micro-batch in ``foreachBatch`` that fails the batch on
    any unexpected value (null skipped, as Great Expectations does), then the batch appended
    with Delta's idempotent-write options (``txnAppId``, ``txnVersion`` = the batch id), the
    documented exactly-once idiom for ``foreachBatch``. Returns the seconds it took."""
    from pyspark.sql import functions as F

    started = time.monotonic()
    rows = _orders(spark, bootstrap, topic).withColumn("order_date", F.to_date("created_at")).withColumn("amount", F.round("amount", 2))

    def unexpected(condition: Any) -> Any:
        return F.sum(F.when(condition, 1).otherwise(0))

    def write(batch: Any, batch_id: int) -> None:
        batch = batch.persist()
        try:
            customer, currency, amount = F.col("customer"), F.col("currency"), F.col("amount")
            counted = batch.agg(
                F.count("*").alias("rows"),
                unexpected(customer.isNull()).alias("customer_null"),
                unexpected(customer.isNotNull() & ~customer.rlike("^c[0-9]{5}$")).alias("customer_pattern"),
                unexpected(currency.isNotNull() & ~currency.isin("EUR", "USD", "GBP", "INR")).alias("currency"),
                unexpected(amount.isNotNull() & ~amount.between(0, 10000)).alias("amount"),
                unexpected(F.col("order_date").isNull()).alias("order_date_null"),
            ).first()
            failed = {name: n for name, n in counted.asDict().items() if name != "rows" and n}
            if counted["rows"] < 1 or failed:
                raise RuntimeError(f"micro-batch {batch_id} failed its checks: {failed or 'no rows'}")
            (
                batch.write.format("delta")
                .mode("append")
                .partitionBy("order_date")
                .option("txnAppId", "orders-peer")
                .option("txnVersion", batch_id)
                .save(table)
            )
        finally:
            batch.unpersist()

    query = rows.writeStream.foreachBatch(write).option("checkpointLocation", checkpoint).trigger(availableNow=True).start()
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
