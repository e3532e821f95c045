"""A warm Spark session for the demo, the benchmarks and the tests: ``offsetlake spark-server``
(Spark Connect) on a free loopback port, as a user starts it with ``make spark-server``.

A run given its URL (``--remote``, ``$OFFSETLAKE_SPARK_REMOTE``) and an Airflow task given the
connection ``spark_connect_default`` attach to it instead of starting a JVM of their own.

Lifecycle: ``start`` runs the command in a session of its own and waits for the line it prints
when its session is up; ``stop`` sends the command SIGTERM by its PID (never by name), which it
answers by stopping Spark (its JVM exits with it); a command still there after the timeout has
its whole process group SIGKILLed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from offsetlake.embedded.local_broker import free_port


class LocalSparkServer:
    def __init__(self, log_path: Path, cwd: Path | None = None, port: int | None = None) -> None:
        self.log_path = log_path
        self.cwd = cwd
        self.port = port or free_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180) -> LocalSparkServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "offsetlake", "spark-server", "--port", str(self.port)],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                text=True,
                cwd=self.cwd,
                start_new_session=True,
            )
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.process.stdout.readline() if ready else ""
            if not line and self.process.poll() is not None:
                break
            if line.startswith("{") and "spark_server" in json.loads(line):
                return self
        code = self.process.poll()
        self.stop()
        how = f"exited with {code}" if code is not None else f"not up after {timeout_s:.0f} s"
        raise RuntimeError(f"offsetlake spark-server on {self.url} did not start ({how}):\n{self.log_path.read_text()[-3000:]}")

    @property
    def airflow_connection(self) -> str:
        return airflow_connection(self.url)

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM to the command, which stops its Spark session and exits; its whole process group
        is SIGKILLed if it has not after ``timeout_s``."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # not yet reaped: the group id is still its own
            process.wait(10)


def airflow_connection(url: str) -> str:
    """The value of ``AIRFLOW_CONN_SPARK_CONNECT_DEFAULT`` that makes Airflow's ingest tasks attach
    to the Spark Connect server at ``url`` (``sc://host:port``)."""
    host, _, port = url.removeprefix("sc://").split("/")[0].partition(":")
    return json.dumps({"conn_type": "spark_connect", "host": host, "port": int(port or 15002)})
