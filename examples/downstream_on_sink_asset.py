"""A downstream DAG that runs once per batch committed to the `orders` sink, with the batch's facts.

Copy it into your DAGs folder (next to dags/offsetlake_dags.py) and set PIPELINE. Every ingest,
backfill, rewind or stream commit of the pipeline emits an event on the sink asset; a run that
committed nothing emits none. The event's extra holds: pipeline, batch_id, kind, ranges, records,
rows, dead_letters, sink_version, validation, table.
"""

from __future__ import annotations

import logging
from datetime import datetime

from airflow.sdk import DAG, task

from offsetlake_airflow.assets import sink_asset

PIPELINE = "orders"
SINK = sink_asset(PIPELINE)

with DAG(
    dag_id=f"{PIPELINE}_downstream",
    schedule=[SINK],
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["offsetlake", PIPELINE, "example"],
):

    @task
    def new_batches(**context) -> list[dict]:
        """The batches this run was triggered by (more than one when commits came close together)."""
        batches = [dict(event.extra) for event in context["triggering_asset_events"][SINK]]
        for batch in batches:
            logging.getLogger(__name__).info(
                "batch %s (%s): %d rows, ranges %s, sink version %s",
                batch["batch_id"],
                batch["kind"],
                batch["rows"],
                batch["ranges"],
                batch["sink_version"],
            )
        return batches

    new_batches()
