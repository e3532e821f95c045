"""The job is not tied to local mode: a Spark standalone master and worker on loopback, started
from pyspark's own `spark-class`, run `offsetlake run --master spark://...` exactly once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pyspark
import pytest
from kafka_truth import assert_exactly_once, read_topic

from offsetlake.embedded.sample_data import ensure_topic, produce_orders

SPARK_CLASS = Path(pyspark.__file__).parent / "bin" / "spark-class"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(ui_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=5) as response:
        return json.load(response)


@pytest.fixture
def standalone_cluster(tmp_path):
    """Master + one worker (2 cores, 2 GiB), each in its own process group, stopped by PID."""
    port, ui_port = _free_port(), _free_port()
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(tmp_path), "SPARK_PID_DIR": str(tmp_path)}
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("master", "worker")}
    master = subprocess.Popen(
        [
            str(SPARK_CLASS),
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--webui-port",
            str(ui_port),
        ],
        stdout=logs["master"],
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    worker = subprocess.Popen(
        [
            str(SPARK_CLASS),
            "org.apache.spark.deploy.worker.Worker",
            "--host",
            "127.0.0.1",
            "--cores",
            "2",
            "--memory",
            "2g",
            "--webui-port",
            str(_free_port()),
            "--work-dir",
            str(tmp_path / "work"),
            f"spark://127.0.0.1:{port}",
        ],
        stdout=logs["worker"],
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if _state(ui_port).get("aliveworkers", 0) >= 1:
                    break
            except OSError:
                pass
            assert master.poll() is None and worker.poll() is None, (tmp_path / "master.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no worker registered within 120 s:\n" + (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(1)
        yield f"spark://127.0.0.1:{port}", ui_port
    finally:
        for process in (worker, master):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        for log in logs.values():
            log.close()


def test_a_run_on_a_standalone_cluster_is_exactly_once(pipeline, standalone_cluster):
    master_url, ui_port = standalone_cluster
    config = pipeline.write(max_records_per_batch=20_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3)
    produce_orders(pipeline.bootstrap, pipeline.topic, 30_000, malformed_every=301)

    # one run (two JVMs start for it: the driver's and the worker's executor); a later run
    # continuing from its commits is the same code path as every CLI test's
    run = pipeline.cli("run", "--master", master_url, timeout=600, cold=True)  # on the cluster, not the warm server
    assert run.returncode == 0, run.stderr[-4000:]
    summaries = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert summaries and all(s["status"] == "committed" for s in summaries), summaries
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))

    # the batches ran as an application of this master, on its worker's executors
    apps = _state(ui_port)["completedapps"]
    assert len([a for a in apps if a["name"] == "offsetlake"]) == 1, apps
    assert all(a["cores"] >= 1 for a in apps), apps
    assert pipeline.cli("audit", "--against-kafka").returncode == 0
