"""The DAG factory: every ``pipelines/*.yaml`` becomes `<name>_ingest`, `_backfill`, `_rewind`, `_stream`.

Building DAGs reads the YAML files and nothing else: no Kafka, no Delta, no Spark at parse time.
A run's ranges come from its plan task, recorded in the ledger, never from "the latest data"
inside a task.
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta
from typing import Any

from airflow.providers.standard.operators.python import PythonOperator, ShortCircuitOperator
from airflow.sdk import DAG, CronDataIntervalTimetable, Param

from offsetlake import jars
from offsetlake.config import PipelineConfig, load_pipeline, pipeline_names
from offsetlake.config.sink_kinds import Capability, sink_kind
from offsetlake.errors import ConfigError
from offsetlake_airflow import pipelines_folder, project_dir
from offsetlake_airflow.assets import commits_alias, sink_asset
from offsetlake_airflow.operators import OffsetlakeSparkSubmitOperator, OffsetlakeStreamOperator
from offsetlake_airflow.tasks import plan_backfill_run, plan_ingest, publish_batch, publish_outbox, rewind_run
from offsetlake_airflow.wake import ON_NEW_DATA, new_data_asset

log = logging.getLogger("offsetlake.airflow")

CRON_PRESETS = ("@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly", "@annually", "@midnight")


def ingest_job() -> str:
    """The spark-submit application: ``jobs/ingest_job.py`` of the project."""
    return str(project_dir() / "jobs" / "ingest_job.py")


def _default_args() -> dict:
    return {
        "owner": "offsetlake",
        "retries": int(os.environ.get("OFFSETLAKE_TASK_RETRIES", "2")),
        "retry_delay": timedelta(seconds=int(os.environ.get("OFFSETLAKE_RETRY_DELAY_SECONDS", "30"))),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=10),
    }


def ingest_schedule(config: PipelineConfig) -> Any:
    """The pipeline's ``schedule``: a cron or preset (the default), ``on_new_data`` (an asset
    watched by the Kafka message-queue trigger: ``offsetlake_airflow.wake``) or null (manual).
    OFFSETLAKE_DISABLE_SCHEDULES=1 (demo, tests) keeps runs to the ones triggered on purpose."""
    if os.environ.get("OFFSETLAKE_DISABLE_SCHEDULES") == "1" or config.schedule is None:
        return None
    if config.schedule == ON_NEW_DATA:
        return [new_data_asset(config)]
    if config.schedule.startswith("@") and config.schedule not in CRON_PRESETS:
        return config.schedule  # @once, @continuous
    # A cron with data intervals (Airflow 3's default for a cron string has none): a run of
    # Airflow's Backfill then covers [interval start, interval end), which it reprocesses.
    return CronDataIntervalTimetable(config.schedule, timezone="UTC")


REPUBLISH_PARAM = Param(
    False,
    type="boolean",
    title="Republish (Kafka sink)",
    description="The sink is a Kafka topic: records cannot be replaced there, so the range is published again, each record "
    "marked offsetlake.kind=backfill, beside what consumers already read. Tick to say so; the committed ends do not move.",
)


def ingest_dag(config: PipelineConfig) -> DAG:
    with DAG(
        dag_id=f"{config.name}_ingest",
        description=f"Kafka {config.topic_label} → {config.sink_label}, exactly once",
        schedule=ingest_schedule(config),
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        default_args=_default_args(),
        tags=["offsetlake", config.name],
        params={"republish": REPUBLISH_PARAM} if sink_kind(config).can(config, Capability.REPUBLISH) else {},
        doc_md=f"""### {config.name}_ingest
**plan** records this run's offset ranges in the ledger (a retry reuses them; nothing new → skip),
**ingest** runs `jobs/ingest_job.py` on `spark_default` for exactly that plan,
**publish** commits the consumer-group offsets after the Delta commit and emits an event on the sink
asset `{config.name}_sink` with the batch's facts (none when nothing was committed).

**Airflow's Backfill** (Trigger → Backfill) on this DAG reprocesses, per run, the records whose
timestamps fall in the run's data interval and replaces their rows (ledger kind `backfill`; the
committed ends never move; an interval without committed records succeeds doing nothing). For
offset ranges use `{config.name}_backfill`. Pipeline file: `{config.source_file}`.""",
    ) as dag:
        plan = ShortCircuitOperator(
            task_id="plan",
            python_callable=plan_ingest,
            op_kwargs={"pipeline": config.name},
            ignore_downstream_trigger_rules=True,
        )
        plan >> _ingest_task(config) >> _publish_task(config)
    return dag


def _ingest_task(config: PipelineConfig):
    """spark-submit of jobs/ingest_job.py for exactly the batch the plan task recorded."""
    return OffsetlakeSparkSubmitOperator(
        pipeline=config.name,
        task_id="ingest",
        application=ingest_job(),
        conn_id="spark_default",
        name=f"offsetlake-{config.name}",
        application_args=[
            "--pipeline",
            config.name,
            "--pipelines-dir",
            str(pipelines_folder()),
            "--batch-id",
            "{{ ti.xcom_pull(task_ids='plan') }}",
        ],
        conf={
            "spark.sql.session.timeZone": "UTC",
            "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
            **jars.DELTA_CONF,  # with the pinned jars the operator passes (--jars)
        },
        driver_memory=os.environ.get("OFFSETLAKE_DRIVER_MEMORY", "2g"),
    )


def _publish_task(config: PipelineConfig) -> PythonOperator:
    return PythonOperator(
        task_id="publish",
        python_callable=publish_batch,
        op_kwargs={"pipeline": config.name, "batch_id": "{{ ti.xcom_pull(task_ids='plan') }}"},
        outlets=[commits_alias(config.name)],
    )


BACKFILL_PARAMS = {
    "topic": Param(
        None,
        type=["null", "string"],
        description="The topic to backfill; leave empty when the pipeline reads one topic.",
    ),
    "partitions": Param(
        [],
        type="array",
        items={"type": "integer", "minimum": 0},
        title="Partitions",
        description="Partition ids to backfill; leave empty for all partitions.",
    ),
    "from_offset": Param(
        None,
        type=["null", "integer"],
        minimum=0,
        title="From offset",
        description="First offset to reprocess (inclusive). Use with To offset, or use the times instead.",
    ),
    "to_offset": Param(
        None,
        type=["null", "integer"],
        minimum=1,
        title="To offset",
        description="End offset (exclusive); at most the pipeline's committed end for each partition.",
    ),
    "from_time": Param(
        None,
        type=["null", "string"],
        title="From time (ISO-8601)",
        description="Start of a record-time range, e.g. 2026-11-01T00:00:00Z; resolved with offsets_for_times.",
    ),
    "to_time": Param(
        None,
        type=["null", "string"],
        title="To time (ISO-8601)",
        description="End of the record-time range (exclusive).",
    ),
}


def _manual_dag(config: PipelineConfig, kind: str, params: dict, description: str, doc_md: str) -> DAG:
    """A manually triggered ``<pipeline>_<kind>`` DAG with Params; one run at a time."""
    return DAG(
        dag_id=f"{config.name}_{kind}",
        description=description,
        schedule=None,
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        default_args=_default_args(),
        params=params,
        tags=["offsetlake", config.name, kind],
        doc_md=doc_md,
    )


def backfill_dag(config: PipelineConfig) -> DAG:
    with _manual_dag(
        config,
        "backfill",
        {**BACKFILL_PARAMS, "republish": REPUBLISH_PARAM} if sink_kind(config).can(config, Capability.REPUBLISH) else BACKFILL_PARAMS,
        f"Reprocess an offset or time range of {config.topic_label}, replacing its rows in {config.sink_label}",
        f"""### {config.name}_backfill
Trigger with Params: partitions, and either from/to offset or from/to time. The rows with those
Kafka coordinates are replaced in one Delta commit (so repeating a backfill changes nothing);
only offsets the pipeline has already committed can be backfilled, and txn versions never move.""",
    ) as dag:
        plan = PythonOperator(
            task_id="plan",
            python_callable=plan_backfill_run,
            op_kwargs={"pipeline": config.name},
            retries=0,
        )
        plan >> _ingest_task(config) >> _publish_task(config)
    return dag


REWIND_PARAMS = {
    "to_batch": Param(
        None,
        type=["null", "string"],
        title="Rewind to batch",
        description="Batch id to rewind to (from the Offset ledger view or `offsetlake ledger`); it stays, "
        "every later batch is rewound and the next ingest run reprocesses from its end.",
    ),
    "reason": Param(
        "",
        type="string",
        title="Reason",
        description="Why; recorded in the rewind commit's userMetadata and the ledger.",
    ),
    "dry_run": Param(
        True,
        type="boolean",
        title="Dry run",
        description="Only log what would change (batches, files, txn versions, dead letters); write nothing.",
    ),
}


def rewind_dag(config: PipelineConfig) -> DAG:
    with _manual_dag(
        config,
        "rewind",
        REWIND_PARAMS,
        f"Restore {config.sink_path} to its state right after an earlier batch, to reprocess from there",
        f"""### {config.name}_rewind
Trigger with Params `to_batch`, `reason` and `dry_run` (on by default: the log shows what would change).
One Delta commit puts the sink's data and committed ends back to where batch `to_batch` left them; later
batches become `rewound` in the ledger and their dead letters are deleted. The next `{config.name}_ingest`
run reprocesses from there. Rerunning a rewind that succeeded changes nothing.""",
    ) as dag:
        PythonOperator(
            task_id="rewind",
            python_callable=rewind_run,
            op_kwargs={"pipeline": config.name},
            retries=0,
            outlets=[commits_alias(config.name)],
        )
    return dag


STREAM_PARAMS = {
    "trigger_interval": Param(
        "5s",
        type="string",
        pattern=r"^[0-9]+(\.[0-9]+)?(ms|s|m|h)?$",
        title="Trigger interval",
        description="Time from one micro-batch's start to the next, e.g. 5s, 500ms, 1m.",
    ),
    "max_records_per_batch": Param(
        None,
        type=["null", "integer"],
        minimum=1,
        title="Max records per micro-batch",
        description="Offsets per micro-batch, all partitions together; empty = the pipeline's max_records_per_batch.",
    ),
    "max_duration_minutes": Param(
        1440,
        type="number",
        minimum=0.1,
        maximum=10080,
        title="Maximum duration (minutes)",
        description="The stream stops cleanly after this long (the task then succeeds), e.g. 0.5 for a 30 s trial; then trigger a new run.",
    ),
}
MAX_STREAM_MINUTES = 10080


def stream_dag(config: PipelineConfig) -> DAG:
    with _manual_dag(
        config,
        "stream",
        STREAM_PARAMS,
        f"Ingest {config.topic_label} continuously into {config.sink_label} (micro-batches on one warm Spark session)",
        f"""### {config.name}_stream
One long-running task runs `offsetlake stream {config.name}`: a micro-batch every trigger interval, each a
ledger batch of kind `stream` with the same exactly-once commit as `{config.name}_ingest`. While it runs it
holds the pipeline's lease and scheduled `{config.name}_ingest` runs skip (backfills still work).
**Stop it** with *Mark as failed* (or *Clear*) on the task: the stream finishes its batch in flight,
releases the lease and exits; scheduled runs take over from its last commit. It also stops by itself after
`max_duration_minutes` (the task succeeds).""",
    ) as dag:
        OffsetlakeStreamOperator(
            task_id="stream",
            pipeline=config.name,
            trigger_interval="{{ params.trigger_interval }}",
            max_records_per_batch="{{ params.max_records_per_batch }}",
            max_duration_minutes="{{ params.max_duration_minutes }}",
            retries=0,
            execution_timeout=timedelta(minutes=MAX_STREAM_MINUTES + 15),  # a backstop: the stream stops itself
            outlets=[commits_alias(config.name)],
        )
    return dag


def outbox_dag(config: PipelineConfig) -> DAG:
    """``<pipeline>_outbox``: scheduled on the sink asset, so every committed batch (ingest,
    backfill, rewind) is followed by a run that publishes what is new to ``outbox.topic``."""
    assert config.outbox is not None
    with DAG(
        dag_id=f"{config.name}_outbox",
        description=f"Delta {config.sink_path} → Kafka {config.outbox.topic}, exactly once, in commit order",
        schedule=None if os.environ.get("OFFSETLAKE_DISABLE_SCHEDULES") == "1" else [sink_asset(config)],
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        default_args=_default_args(),
        tags=["offsetlake", config.name, "outbox"],
        doc_md=f"""### {config.name}_outbox
Runs after each event on the sink asset `{config.name}_sink`: publishes every sink commit not yet
published to Kafka topic `{config.outbox.topic}` (key: {", ".join(config.outbox.key) or "none"}), one Kafka
transaction per commit holding its records and the outbox's progress, as `offsetlake publish`. Rerunning
it publishes nothing twice.""",
    ) as dag:
        PythonOperator(task_id="publish", python_callable=publish_outbox, op_kwargs={"pipeline": config.name})
    return dag


def pipeline_dags() -> dict[str, DAG]:
    """Every pipeline's four DAGs by dag id; a pipeline file that does not load is logged and
    skipped, so one broken file never hides the other pipelines."""
    dags: dict[str, DAG] = {}
    for name in pipeline_names(pipelines_folder()):  # a routed file: one pipeline per table
        try:
            config = load_pipeline(name, pipelines_folder())
        except ConfigError as err:
            log.error("skipping %s: %s", name, err)
            continue
        made = [ingest_dag(config), backfill_dag(config), stream_dag(config)]
        if sink_kind(config).can(config, Capability.REWIND):  # a Kafka sink takes none
            made.append(rewind_dag(config))
        if config.outbox is not None:
            made.append(outbox_dag(config))
        for dag in made:
            dags[dag.dag_id] = dag
    return dags
