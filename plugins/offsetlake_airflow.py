"""What offsetlake's DAGs share that belongs to Airflow: task callables and Kafka secrets.

Kafka credentials can live in an Airflow connection instead of the pipeline YAML: a connection
``kafka_<pipeline>`` (or ``kafka_default``) whose extra JSON holds librdkafka options such as
``{"security.protocol": "SASL_SSL", "sasl.username": "...", "sasl.password": "..."}`` and whose
host (``host:port``) overrides ``bootstrap_servers``. Nothing here logs those values.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from airflow.plugins_manager import AirflowPlugin

log = logging.getLogger("offsetlake.airflow")

PROJECT_DIR = Path(__file__).resolve().parent.parent


def pipelines_folder() -> Path:
    return Path(os.environ.get("OFFSETLAKE_PIPELINES_DIR", PROJECT_DIR / "pipelines"))


def _connection_overrides(pipeline: str) -> tuple[str | None, dict[str, str]]:
    from airflow.sdk import BaseHook

    for conn_id in (f"kafka_{pipeline}", "kafka_default"):
        try:
            conn = BaseHook.get_connection(conn_id)
        except Exception:  # noqa: BLE001 - not defined: the YAML alone configures Kafka
            continue
        extra = conn.extra_dejson or {}
        servers = f"{conn.host}:{conn.port}" if conn.host and conn.port else (conn.host or None)
        log.info("kafka settings of pipeline %s come from connection %s (options: %s)", pipeline, conn_id, sorted(extra))
        return servers, {str(k): str(v) for k, v in extra.items()}
    return None, {}


def load_config(pipeline: str):
    """The pipeline's config with Kafka settings from an Airflow connection, if one exists."""
    from offsetlake.config import load_pipeline

    config = load_pipeline(pipeline, pipelines_folder())
    return config.with_kafka_overrides(*_connection_overrides(config.name))


def ingest_operator_class():
    """SparkSubmitOperator that hands the job the pipeline's Kafka connection through the
    environment ($OFFSETLAKE_KAFKA_OVERRIDES), resolved at run time inside the task."""
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    class OffsetlakeSparkSubmitOperator(SparkSubmitOperator):
        def __init__(self, *, pipeline: str, **kwargs) -> None:
            super().__init__(**kwargs)
            self.pipeline = pipeline

        def execute(self, context):
            from offsetlake.config import KAFKA_OVERRIDES_ENV

            servers, options = _connection_overrides(self.pipeline)
            if servers or options:  # never on the command line, which the hook logs
                self.env_vars = {**(self.env_vars or {}), KAFKA_OVERRIDES_ENV: json.dumps(
                    {"bootstrap_servers": servers, "options": options})}
            try:
                return super().execute(context)
            except AirflowException:
                superseded = _superseded_message(self.pipeline, context["ti"].xcom_pull(task_ids="plan"))
                if superseded is None:
                    raise
                # Retrying this task would re-execute a plan that can never apply again.
                raise AirflowFailException(
                    f"{superseded}. Not retried: clear the whole dag run "
                    f"(plan task included) to plan again from the committed ends."
                ) from None

    return OffsetlakeSparkSubmitOperator


def stream_operator_class():
    """Runs ``offsetlake stream`` as a child process for the length of the task.

    The stream runs in its own session with its output in a file that the task copies into its
    log, so Airflow's escalation (SIGTERM to the task, SIGKILL 5 s later) never kills the stream
    mid-batch: ``on_kill`` (mark failed / clear in the UI, a timeout) sends the stream one
    SIGTERM, the stream finishes its batch in flight, releases its lease and exits, and a stream
    whose task process died stops on its own (``--parent-pid``).
    """
    import signal
    import subprocess
    import sys
    import time

    from airflow.sdk import BaseOperator
    from airflow.sdk.exceptions import AirflowException

    class OffsetlakeStreamOperator(BaseOperator):
        template_fields = ("trigger_interval", "max_records_per_batch", "max_duration_minutes")

        def __init__(self, *, pipeline: str, trigger_interval: str, max_records_per_batch: str,
                     max_duration_minutes: str, **kwargs) -> None:
            super().__init__(**kwargs)
            self.pipeline = pipeline
            self.trigger_interval = trigger_interval
            self.max_records_per_batch = max_records_per_batch
            self.max_duration_minutes = max_duration_minutes
            self._process: subprocess.Popen | None = None

        def execute(self, context):
            from offsetlake.config import KAFKA_OVERRIDES_ENV

            config = load_config(self.pipeline)
            dag_run, ti = context["dag_run"], context["ti"]
            env = dict(os.environ)
            servers, options = _connection_overrides(self.pipeline)
            if servers or options:  # never on the command line
                env[KAFKA_OVERRIDES_ENV] = json.dumps({"bootstrap_servers": servers, "options": options})
            command = [
                sys.executable, "-m", "offsetlake", "--pipelines-dir", str(pipelines_folder()), "stream", self.pipeline,
                "--trigger-interval", str(self.trigger_interval),
                "--max-duration", f"{float(self.max_duration_minutes)}m",
                "--parent-pid", str(os.getpid()), "--run-id", dag_run.run_id, "--dag-id", dag_run.dag_id,
            ]
            if str(self.max_records_per_batch or "").strip() not in ("", "None", "0"):
                command += ["--max-records-per-batch", str(int(self.max_records_per_batch))]
            master = _spark_master()
            if master:
                command += ["--master", master]
            output = Path(config.lake_path) / "_stream_logs" / config.name / f"{dag_run.run_id}.try{ti.try_number}.log"
            output.parent.mkdir(parents=True, exist_ok=True)
            log.info("starting: %s (output also in %s)", " ".join(command), output)
            with open(output, "w") as sink, open(output) as tail:
                self._process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                                 start_new_session=True, cwd=PROJECT_DIR)
                last = ""
                while True:
                    finished = self._process.poll() is not None
                    for line in tail:
                        last = line.strip() or last
                        log.info("%s", line.rstrip())
                    if finished:
                        break
                    time.sleep(0.5)
            if self._process.returncode != 0:
                raise AirflowException(f"pipeline {self.pipeline}: offsetlake stream exited with {self._process.returncode}; "
                                       f"see the lines above ({output})")
            return json.loads(last).get("stream") if last.startswith("{") else None

        def on_kill(self) -> None:
            process = self._process
            if process is not None and process.poll() is None:
                log.warning("stopping the stream of pipeline %s (pid %d): it finishes its batch in flight, "
                            "then releases its lease", self.pipeline, process.pid)
                os.kill(process.pid, signal.SIGTERM)

    return OffsetlakeStreamOperator


def _spark_master() -> str | None:
    """The master of connection ``spark_default`` (what the ingest tasks submit to), if any."""
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection("spark_default")
    except Exception:  # noqa: BLE001 - no connection: the stream's own default (local[2])
        return None
    if not conn.host:
        return None
    return f"{conn.host}:{conn.port}" if conn.port else conn.host


def _superseded_message(pipeline: str, batch_id: str | None) -> str | None:
    """The ledger's reason if ``batch_id`` was superseded (lost a commit race, or went stale)."""
    from offsetlake.ledger import SUPERSEDED, Ledger

    if not batch_id:
        return None
    config = load_config(pipeline)
    import pyarrow.compute as pc

    rows = Ledger(config.ledger_path, config.name).batches(pc.field("batch_id") == batch_id)
    if rows and rows[0]["status"] == SUPERSEDED:
        return f"pipeline {pipeline}: batch {batch_id} was superseded ({rows[0]['message'] or 'no reason recorded'})"
    return None


def plan_ingest(pipeline: str, **context) -> str | None:
    """Plan task: the dag run's ranges, recorded in the ledger; None (skip downstream) if caught up.

    A retry or a cleared rerun of this task returns the plan already recorded for the dag run.
    While a live ``offsetlake stream`` owns the pipeline the task is skipped, saying so.
    """
    from airflow.sdk.exceptions import AirflowSkipException

    from offsetlake.batch import plan_for_dag_run
    from offsetlake.lease import StreamOwnsPipelineError
    from offsetlake.plan import RunContext
    from offsetlake.validation import load_suite

    dag_run, ti = context["dag_run"], context["ti"]
    config = load_config(pipeline)
    load_suite(config)  # a broken expectation suite fails the plan task, before anything is read
    try:
        plan = plan_for_dag_run(config, RunContext(run_id=dag_run.run_id, dag_id=dag_run.dag_id, try_number=ti.try_number))
    except StreamOwnsPipelineError as err:
        log.warning("%s", err)
        raise AirflowSkipException(str(err)) from None
    if plan is None:
        log.info("pipeline %s is caught up with the last stable offsets: nothing to ingest, Spark not started", pipeline)
        return None
    log.info("pipeline %s batch %s plan: %s", pipeline, plan.batch_id, plan.describe())
    return plan.batch_id


def plan_backfill_run(pipeline: str, **context) -> str:
    """Backfill plan task: validate the trigger Params and record the ranges (reused on rerun).

    Bad Params fail here with a message that says what to fix; nothing is committed.
    """
    from offsetlake.backfill import plan_backfill
    from offsetlake.ledger import Ledger
    from offsetlake.plan import RunContext
    from offsetlake.validation import load_suite

    dag_run, ti, params = context["dag_run"], context["ti"], context["params"]
    config = load_config(pipeline)
    load_suite(config)
    ledger = Ledger(config.ledger_path, config.name)
    existing = ledger.plan_for_run(dag_run.dag_id, dag_run.run_id, "backfill")
    if existing is not None:
        log.info("pipeline %s backfill %s: reusing the recorded plan %s", pipeline, existing.batch_id, existing.describe())
        return existing.batch_id
    plan = plan_backfill(
        config,
        RunContext(run_id=dag_run.run_id, dag_id=dag_run.dag_id, try_number=ti.try_number),
        partitions=list(params.get("partitions") or []) or None,
        from_offset=params.get("from_offset"),
        to_offset=params.get("to_offset"),
        from_time=params.get("from_time") or None,
        to_time=params.get("to_time") or None,
    )
    ledger.record_plan(plan)
    log.info("pipeline %s backfill %s plan: %s", pipeline, plan.batch_id, plan.describe())
    return plan.batch_id


def publish_batch(pipeline: str, batch_id: str, **context) -> dict:
    """After the Delta commit only: publish committed ends as consumer-group offsets, log the summary.

    Backfills never move committed ends, so for them only the summary is logged.
    """
    from offsetlake.batch import publishable_batch
    from offsetlake.kafka import commit_group_offsets

    config = load_config(pipeline)
    summary = publishable_batch(config, batch_id)
    if summary["kind"] == "ingest":
        commit_group_offsets(config.kafka_client_config(), config.name, summary.pop("_ends"))
    else:
        summary.pop("_ends")
    log.info("batch summary %s", json.dumps(summary))
    return summary


def rewind_run(pipeline: str, **context) -> dict:
    """Rewind task: restore the sink to its state right after Param ``to_batch`` (one Delta commit).

    With Param ``dry_run`` only logs what would change. A rerun after success is a no-op that
    says so; a refused rewind (unknown, uncommitted or rewound batch, vacuumed files) fails the
    task with the reason and writes nothing.
    """
    from offsetlake.plan import RunContext
    from offsetlake.rewind import RewindError, rewind_pipeline

    dag_run, ti, params = context["dag_run"], context["ti"], context["params"]
    to_batch = (params.get("to_batch") or "").strip()
    if not to_batch:
        raise RewindError(f"pipeline {pipeline}: give the Param to_batch (a batch id from the Offset ledger view)")
    config = load_config(pipeline)
    who = getattr(dag_run, "triggering_user_name", None) or "airflow"
    result = rewind_pipeline(
        config, to_batch, reason=params.get("reason") or None, requested_by=f"{who} via {dag_run.dag_id}",
        dry_run=bool(params.get("dry_run")),
        run=RunContext(run_id=dag_run.run_id, dag_id=dag_run.dag_id, try_number=ti.try_number),
    )
    log.info("%s", result.text())
    return json.loads(json.dumps(result.as_dict(), default=str))


class OffsetlakePlugin(AirflowPlugin):
    name = "offsetlake"
