"""Record-level transforms of the example pipelines: `orders` derives its partition column;
`orders_hourly` leaves out test orders."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def add_order_date(rows: DataFrame) -> DataFrame:
    return rows.withColumn("order_date", F.to_date("created_at")).withColumn("amount", F.round("amount", 2))


def without_test_orders(rows: DataFrame) -> DataFrame:
    """Orders under 5.00 are test orders: they count in no revenue."""
    return rows.where(F.col("amount") >= 5)
