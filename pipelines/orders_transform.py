"""Record-level transform of the `orders` pipeline: derive the partition column."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def add_order_date(rows: DataFrame) -> DataFrame:
    return rows.withColumn("order_date", F.to_date("created_at")).withColumn("amount", F.round("amount", 2))
