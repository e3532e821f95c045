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

from offsetlake.batch_view import BatchView
from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import Capability, sink_kind
from offsetlake.errors import BackfillParamsError, RewindError, StreamOwnsPipelineError, message
from offsetlake.kafka import commit_group_offsets
from offsetlake.ledger import Ledger
from offsetlake.plan import BatchKind, BatchPlan, BatchStatus, RunContext
from offsetlake.validation import load_suite
from offsetlake_airflow.assets import announce, batch_extra
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
    if context["dag_run"].run_type == "backfill":  # DagRunType.BACKFILL_JOB, a str enum
        return plan_interval_backfill_run(config, context)
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


def plan_interval_backfill_run(config: PipelineConfig, context: dict[str, Any]) -> str | None:
    """Plan of a run of Airflow's own Backfill (Trigger -> Backfill, ``/api/v2/backfills``,
    ``airflow backfill create``) on ``<pipeline>_ingest``: the records whose timestamps fall in
    the run's data interval are reprocessed and replace their rows, exactly as a by-time
    ``<pipeline>_backfill`` (invariant 6; ledger kind ``backfill``; committed ends never move).
    A rerun (a retry, a clear, a Backfill that reprocesses the run) reuses the recorded plan.
    None (downstream skipped, the run succeeds) when nothing committed falls in the interval.
    """
    from offsetlake.backfill import plan_interval_backfill
    from offsetlake.runs import plan_or_reuse

    run = _run(context)
    start, end = context["data_interval_start"], context["data_interval_end"]

    def plan_new() -> BatchPlan | None:
        if start is None or end is None:
            raise BackfillParamsError(
                f"backfill run {run.run_id} has no data interval; use the {config.name}_backfill DAG with offsets or times",
                pipeline=config.name,
            )
        return plan_interval_backfill(config, run, start, end, republish=bool((context.get("params") or {}).get("republish")))

    plan, reused = plan_or_reuse(Ledger.of(config), run, BatchKind.BACKFILL, plan_new)
    if plan is None:
        log.info(
            "pipeline %s backfill run %s: no committed record falls in the data interval [%s, %s): nothing to reprocess, Spark not started",
            config.name,
            run.run_id,
            start.isoformat(),
            end.isoformat(),
        )
        return None
    what = "reusing the recorded plan" if reused else f"of the data interval [{start.isoformat()}, {end.isoformat()})"
    log.info("pipeline %s backfill %s %s: %s", config.name, plan.batch_id, what, plan.describe())
    return plan.batch_id


def plan_backfill_run(pipeline: str, **context: Any) -> str:
    """Backfill plan task: validate the trigger Params and record the ranges (reused on rerun).

    Bad Params fail here with a message that says what to fix; nothing is committed.
    """
    from offsetlake.backfill import plan_backfill
    from offsetlake.runs import plan_or_reuse

    params = context["params"]
    run = _run(context)
    config = load_config(pipeline)
    load_suite(config)
    plan, reused = plan_or_reuse(
        Ledger.of(config),
        run,
        BatchKind.BACKFILL,
        lambda: plan_backfill(
            config,
            run,
            partitions=list(params.get("partitions") or []) or None,
            from_offset=params.get("from_offset"),
            to_offset=params.get("to_offset"),
            from_time=params.get("from_time") or None,
            to_time=params.get("to_time") or None,
            topic=params.get("topic") or None,
            republish=bool(params.get("republish")),
        ),
    )
    assert plan is not None  # plan_backfill plans or raises
    log.info("pipeline %s backfill %s %s: %s", pipeline, plan.batch_id, "reusing the recorded plan" if reused else "plan", plan.describe())
    return plan.batch_id


def publish_batch(pipeline: str, batch_id: str, **context: Any) -> dict:
    """After the Delta commit only: publish committed ends as consumer-group offsets, log the summary.

    Backfills never move committed ends, so for them only the summary is logged.
    """
    from offsetlake.runs import publishable_batch

    config = load_config(pipeline)
    publishable = publishable_batch(config, batch_id)
    batch, summary = publishable.batch, publishable.summary()
    if batch.kind == BatchKind.INGEST and sink_kind(config).can(config, Capability.GROUP_OFFSETS_AFTER_COMMIT):
        commit_group_offsets(config.kafka_client_config(), config.name, publishable.committed_ends)
    log.info("batch summary %s", json.dumps(summary))
    if batch.status == BatchStatus.COMMITTED:  # superseded: the batch that committed the ranges announced them
        announce(context, config, [batch_extra(config, batch)])
    return summary


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
        raise RewindError("give the Param to_batch (a batch id from the Offset ledger view)", pipeline=pipeline)
    config = load_config(pipeline)
    who = getattr(dag_run, "triggering_user_name", None) or "airflow"
    result = rewind_pipeline(
        config,
        to_batch,
        reason=params.get("reason") or None,
        requested_by=f"{who} via {dag_run.dag_id}",
        dry_run=bool(params.get("dry_run")),
        run=_run(context),
    )
    log.info("%s", result.text())
    if not result.dry_run and result.rewind_version is not None:
        # the rewind's commit as the ledger records it (rewind_pipeline reconciled it): its
        # ranges are the offsets undone per partition, [new committed end, old one)
        rows = Ledger.of(config).batches(pc.field("batch_id") == result.rewind_id)
        announce(context, config, [batch_extra(config, BatchView.from_rows(rows))] if rows else [])
    return json.loads(json.dumps(result.as_dict(), default=str))


def superseded_message(pipeline: str, batch_id: str | None) -> str | None:
    """The ledger's reason if ``batch_id`` was superseded (lost a commit race, or went stale)."""
    if not batch_id:
        return None
    config = load_config(pipeline)
    rows = Ledger.of(config).batches(pc.field("batch_id") == batch_id)
    if rows and rows[0]["status"] == BatchStatus.SUPERSEDED:
        return message(
            f"batch {batch_id} was superseded ({rows[0]['message'] or 'no reason recorded'})", {"pipeline": pipeline, "batch_id": batch_id}
        )
    return None


def publish_outbox(pipeline: str, **context: Any) -> list[dict]:
    """Outbox task (``outbox:`` in the YAML): every sink commit not yet published goes to the
    outbox topic, one Kafka transaction each with the outbox's progress (``offsetlake.outbox``);
    a retry or an overlapping run publishes nothing twice (the newer publisher fences the older)."""
    from offsetlake.outbox import publish

    config = load_config(pipeline)
    assert config.outbox is not None  # the DAG exists only with an outbox
    published = [p.as_dict() for p in publish(config, config.outbox.topic, config.outbox.key)]
    log.info("pipeline %s outbox to %s: %d commits published %s", pipeline, config.outbox.topic, len(published), json.dumps(published))
    return published
