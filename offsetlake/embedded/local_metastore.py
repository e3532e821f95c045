"""A Hive Metastore server (thrift) for the tests and the demo: Apache Hive's own metastore, the
``hive-metastore`` 2.3.10 that pyspark ships (the version Spark's Hive client speaks), run with
pyspark's jars on its classpath and a Derby database in its folder.

It stands for the production case of ``OFFSETLAKE_METASTORE=thrift://host:9083``: a metastore
that outlives every Spark session and that many sessions reach at once. Started on a free
loopback port like the embedded broker, and stopped by its PID (its process group), never by name.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

from offsetlake.embedded.local_broker import free_port, java_binary, stop_process_group


def _pyspark_jars() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "jars"


class LocalMetastore:
    def __init__(self, folder: Path, port: int | None = None) -> None:
        self.folder = Path(folder)
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"thrift://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.folder / "metastore.log"

    def _command(self) -> list[str]:
        hive = {
            "hive.async.log.enabled": "false",  # Hive's async logger needs the disruptor jar, which pyspark does not ship
            "javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={self.folder / 'metastore_db'};create=true",
            "datanucleus.schema.autoCreateAll": "true",
            "hive.metastore.schema.verification": "false",
            "hive.metastore.warehouse.dir": str(self.folder / "warehouse"),
        }
        settings = [arg for key, value in hive.items() for arg in ("--hiveconf", f"{key}={value}")]
        return [
            java_binary(),
            "-Xmx512m",
            f"-Dderby.system.home={self.folder}",
            "-cp",
            str(_pyspark_jars() / "*"),
            "org.apache.hadoop.hive.metastore.HiveMetaStore",
            "-p",
            str(self.port),
            *settings,
        ]

    def start(self, timeout_s: float = 90) -> LocalMetastore:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self._command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.folder
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the Hive Metastore exited with {self.process.returncode}; see {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the Hive Metastore did not listen on {self.uri} within {timeout_s:.0f} s; see {self.log_path}")

    def stop(self, timeout_s: float = 30) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            stop_process_group(process, signal.SIGTERM, timeout_s)
