"""offsetlake's operators: the spark-submit ingest job and the long-running stream."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from offsetlake import jars
from offsetlake.errors import message
from offsetlake_airflow import pipelines_folder, project_dir
from offsetlake_airflow.assets import announce, batch_extra, committed_batches_of_run
from offsetlake_airflow.connections import load_config, overrides_env, spark_connect_url, spark_master
from offsetlake_airflow.tasks import superseded_message

log = logging.getLogger("offsetlake.airflow")


class _ReportsLineage:
    """OpenLineage through the provider's operator hooks: the pipeline's Kafka topics in, its
    Delta table out; on completion with the batches the task committed, which ``execute`` read
    before returning (``lineage.completed``)."""

    pipeline: str
    _lineage: Any = None

    def get_openlineage_facets_on_start(self) -> Any:
        from offsetlake_airflow.lineage import lineage

        return lineage(load_config(self.pipeline), [], with_schema=False)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        from offsetlake_airflow.lineage import lineage

        return self._lineage or lineage(load_config(self.pipeline), [], with_schema=False)


class OffsetlakeSparkSubmitOperator(_ReportsLineage, SparkSubmitOperator):
    """SparkSubmitOperator that hands the job the pipeline's Kafka connection through the
    environment ($OFFSETLAKE_KAFKA_OVERRIDES), resolved at run time inside the task, and that
    does not retry a batch another writer superseded (its plan can never apply again).

    With a Spark Connect server configured (connection ``spark_connect_default``, e.g. to
    ``offsetlake spark-server``), the same job runs as a plain Python process attached to it:
    no spark-submit, no JVM of its own, the same arguments, exit codes and crash semantics.
    """

    def __init__(self, *, pipeline: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline

    def execute(self, context: Any) -> Any:
        overrides = overrides_env(self.pipeline)
        if overrides:  # never on the command line, which the hook logs
            self.env_vars = {**(self.env_vars or {}), **overrides}
        try:
            remote = spark_connect_url()
            result = None
            if remote or _project_server():
                self._run_attached(remote)
            else:
                self.jars = self.jars or jars.spark_jars()  # the pinned jars, as every offsetlake session has them
                result = super().execute(context)
        except AirflowException:
            superseded = superseded_message(self.pipeline, context["ti"].xcom_pull(task_ids="plan"))
            if superseded is None:
                raise
            # Retrying this task would re-execute a plan that can never apply again.
            raise AirflowFailException(
                f"{superseded}. Not retried: clear the whole dag run (plan task included) to plan again from the committed ends."
            ) from None
        from offsetlake_airflow.lineage import batch_lineage, completed

        self._lineage = completed(f"pipeline {self.pipeline}", lambda: batch_lineage(load_config(self.pipeline), self._batch_id()))
        return result

    def _batch_id(self) -> str | None:
        """The batch this task executes: its rendered ``--batch-id`` argument."""
        args = [str(a) for a in self.application_args or []]
        return args[args.index("--batch-id") + 1] if "--batch-id" in args else None

    def _run_attached(self, remote: str | None) -> None:
        command = [sys.executable, str(self.application), *[str(a) for a in self.application_args or []]]
        env = {**os.environ, **(self.env_vars or {})}
        if remote:
            log.info("attached to the Spark server at %s: %s", remote.split(";")[0], " ".join(command))
            env["OFFSETLAKE_SPARK_REMOTE"] = remote
        else:
            log.info("attached to the project's own Spark server (started if none runs): %s", " ".join(command))
        self._attached = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=project_dir())
        assert self._attached.stdout is not None
        for line in self._attached.stdout:
            log.info("%s", line.rstrip())
        if self._attached.wait() != 0:
            raise AirflowException(
                message(f"the ingest job exited with {self._attached.returncode}; see the lines above", {"pipeline": self.pipeline})
            )

    def on_kill(self) -> None:
        attached = getattr(self, "_attached", None)
        if attached is not None and attached.poll() is None:
            attached.kill()  # as spark-submit's driver would die: the batch commits nothing, a retry redoes it
            return
        super().on_kill()


def _project_server() -> bool:
    """Whether an ingest task attaches to the project's own warm Spark server
    (``offsetlake.spark_server``) rather than spark-submit: by default, when ``spark_default`` is
    absent or a local master (the server is ``local[2]``); never with ``$OFFSETLAKE_SPARK_SERVER=off``
    or a cluster master, which spark-submit serves."""
    from offsetlake import spark_server

    master = spark_master()
    return spark_server.enabled() and (master is None or master.startswith("local"))


class OffsetlakeStreamOperator(_ReportsLineage, BaseOperator):
    """Runs ``offsetlake stream`` as a child process for the length of the task.

    The stream runs in its own session with its output in a file that the task copies into its
    log, so Airflow's escalation (SIGTERM to the task, SIGKILL 5 s later) never kills the stream
    mid-batch: ``on_kill`` (mark failed / clear in the UI, a timeout) sends the stream one
    SIGTERM, the stream finishes its batch in flight, releases its lease and exits, and a stream
    whose task process died stops on its own (``--parent-pid``).

    When the stream ends and the task succeeds, each micro-batch it committed becomes an event
    on the sink asset: Airflow 3 registers a task's asset events only when the task finishes,
    so downstream DAGs hear of a stream's commits at its end (ingest runs announce each batch).
    """

    template_fields = ("trigger_interval", "max_records_per_batch", "max_duration_minutes")

    def __init__(
        self, *, pipeline: str, trigger_interval: str, max_records_per_batch: str, max_duration_minutes: str, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.trigger_interval = trigger_interval
        self.max_records_per_batch = max_records_per_batch
        self.max_duration_minutes = max_duration_minutes
        self._process: subprocess.Popen | None = None

    def execute(self, context: Any) -> Any:
        config = load_config(self.pipeline)
        dag_run, ti = context["dag_run"], context["ti"]
        env = {**os.environ, **overrides_env(self.pipeline)}
        command = [
            sys.executable,
            "-m",
            "offsetlake",
            "--pipelines-dir",
            str(pipelines_folder()),
            "stream",
            self.pipeline,
            "--trigger-interval",
            str(self.trigger_interval),
            "--max-duration",
            f"{float(self.max_duration_minutes)}m",
            "--parent-pid",
            str(os.getpid()),
            "--run-id",
            dag_run.run_id,
            "--dag-id",
            dag_run.dag_id,
        ]
        if str(self.max_records_per_batch or "").strip() not in ("", "None", "0"):
            command += ["--max-records-per-batch", str(int(self.max_records_per_batch))]
        remote = spark_connect_url()
        if remote:  # in the environment, not on the command line: the URL may hold a token
            env["OFFSETLAKE_SPARK_REMOTE"] = remote
        master = spark_master()
        if master and not remote:
            command += ["--master", master]
        output = Path(config.stream_log_path) / f"{dag_run.run_id}.try{ti.try_number}.log"
        output.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting: %s (output also in %s)", " ".join(command), output)
        with open(output, "w") as sink, open(output) as tail:
            self._process = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=project_dir()
            )
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
            raise AirflowException(
                message(
                    f"offsetlake stream exited with {self._process.returncode}; see the lines above ({output})", {"pipeline": self.pipeline}
                )
            )
        batches = committed_batches_of_run(config, dag_run.run_id)
        announce(context, config, [batch_extra(config, b) for b in batches])
        from offsetlake_airflow.lineage import completed, lineage

        self._lineage = completed(f"pipeline {self.pipeline}", lambda: lineage(config, batches))
        return json.loads(last).get("stream") if last.startswith("{") else None

    def on_kill(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            log.warning(
                "stopping the stream of pipeline %s (pid %d): it finishes its batch in flight, then releases its lease",
                self.pipeline,
                process.pid,
            )
            os.kill(process.pid, signal.SIGTERM)
