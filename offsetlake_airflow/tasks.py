"""The Python callables of offsetlake's DAG tasks: plan, publish, rewind.

Each reads the pipeline's YAML afresh (Kafka settings from an Airflow connection on top) and
calls the same ``offsetlake`` functions as the CLI. A run's ranges come from its plan, recorded
in the ledger (invariant 3): a retry or a cleared rerun of a dag run gets the same plan back.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pyarrow.compute as pc

from offsetlake.errors import RewindError, StreamOwnsPipelineError
from offsetlake.kafka import commit_group_offsets
from offsetlake.ledger import Ledger
from offsetlake.plan import BatchKind, BatchStatus, RunContext
from offsetlake.validation import load_suite
from offsetlake_airflow.connections import load_config

log = logging.getLogger("offsetlake.airflow")


def _run(context: dict[str, Any]) -> RunContext:
    dag_run, ti = context["dag_run"], context["ti"]
    return RunContext(run_id=dag_run.run_id, dag_id=dag_run.dag_id, try_number=ti.try_number)


def plan_ingest(pipeline: str, **context: Any) -> str | None:
    """Plan task: the dag run's ranges, recorded in the ledger; None (skip downstream) if caught up.

    A retry or a cleared rerun of this task returns the plan already recorded for the dag run.
    While a live ``offsetlake stream`` owns the pipeline the task is skipped, saying so.
    """
    from airflow.sdk.exceptions import AirflowSkipException

    from offsetlake.runs import plan_for_dag_run

    config = load_config(pipeline)
    load_suite(config)  # a broken expectation suite fails the plan task, before anything is read
    try:
        plan = plan_for_dag_run(config, _run(context))
    except StreamOwnsPipelineError as err:
        log.warning("%s", err)
        raise AirflowSkipException(str(err)) from None
    if plan is None:
        log.info("pipeline %s is caught up with the last stable offsets: nothing to ingest, Spark not started", pipeline)
        return None
    log.info("pipeline %s batch %s plan: %s", pipeline, plan.batch_id, plan.describe())
    return plan.batch_id


def plan_backfill_run(pipeline: str, **context: Any) -> str:
    """Backfill plan task: validate the trigger Params and record the ranges (reused on rerun).

    Bad Params fail here with a message that says what to fix; nothing is committed.
    """
    from offsetlake.backfill import plan_backfill

    params = context["params"]
    run = _run(context)
    config = load_config(pipeline)
    load_suite(config)
    ledger = Ledger.of(config)
    recorded = ledger.run_plan(run, BatchKind.BACKFILL)
    if recorded is not None:
        existing = recorded[0]
        log.info("pipeline %s backfill %s: reusing the recorded plan %s", pipeline, existing.batch_id, existing.describe())
        return existing.batch_id
    plan = plan_backfill(
        config, run,
        partitions=list(params.get("partitions") or []) or None,
        from_offset=params.get("from_offset"),
        to_offset=params.get("to_offset"),
        from_time=params.get("from_time") or None,
        to_time=params.get("to_time") or None,
        topic=params.get("topic") or None,
    )
    ledger.record_plan(plan)
    log.info("pipeline %s backfill %s plan: %s", pipeline, plan.batch_id, plan.describe())
    return plan.batch_id


def publish_batch(pipeline: str, batch_id: str, **context: Any) -> dict:
    """After the Delta commit only: publish committed ends as consumer-group offsets, log the summary.

    Backfills never move committed ends, so for them only the summary is logged.
    """
    from offsetlake.runs import publishable_batch

    config = load_config(pipeline)
    batch = publishable_batch(config, batch_id)
    if batch["kind"] == BatchKind.INGEST:
        commit_group_offsets(config.kafka_client_config(), config.name, batch.committed_ends)
    log.info("batch summary %s", json.dumps(batch))
    return dict(batch)


def rewind_run(pipeline: str, **context: Any) -> dict:
    """Rewind task: restore the sink to its state right after Param ``to_batch`` (one Delta commit).

    With Param ``dry_run`` only logs what would change. A rerun after success is a no-op that
    says so; a refused rewind (unknown, uncommitted or rewound batch, vacuumed files) fails the
    task with the reason and writes nothing.
    """
    from offsetlake.rewind import rewind_pipeline

    dag_run, params = context["dag_run"], context["params"]
    to_batch = (params.get("to_batch") or "").strip()
    if not to_batch:
        raise RewindError(f"pipeline {pipeline}: give the Param to_batch (a batch id from the Offset ledger view)")
    config = load_config(pipeline)
    who = getattr(dag_run, "triggering_user_name", None) or "airflow"
    result = rewind_pipeline(
        config, to_batch, reason=params.get("reason") or None, requested_by=f"{who} via {dag_run.dag_id}",
        dry_run=bool(params.get("dry_run")), run=_run(context),
    )
    log.info("%s", result.text())
    return json.loads(json.dumps(result.as_dict(), default=str))


def superseded_message(pipeline: str, batch_id: str | None) -> str | None:
    """The ledger's reason if ``batch_id`` was superseded (lost a commit race, or went stale)."""
    if not batch_id:
        return None
    config = load_config(pipeline)
    rows = Ledger.of(config).batches(pc.field("batch_id") == batch_id)
    if rows and rows[0]["status"] == BatchStatus.SUPERSEDED:
        return f"pipeline {pipeline}: batch {batch_id} was superseded ({rows[0]['message'] or 'no reason recorded'})"
    return None
