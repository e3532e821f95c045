"""The embedded Kafka-protocol broker (noida-db) for the demo, `make airflow` and the tests.

Started on a free loopback port with its own data folder and stopped by its PID, never by name.
A stop takes a few seconds while it saves; starting again on the same folder waits for the old
PID to be gone first (noida-db refuses with "already running" otherwise).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _binary() -> str:
    beside = Path(sys.executable).parent / "noida-db"
    found = str(beside) if beside.exists() else shutil.which("noida-db")
    if not found:
        raise RuntimeError("noida-db is not installed; run `make setup`")
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class LocalBroker:
    def __init__(self, data_dir: Path, port: int | None = None, log_path: Path | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.log_path = log_path or self.data_dir.parent / f"{self.data_dir.name}.log"
        self.process: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> LocalBroker:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = [
            _binary(),
            "start",
            "--only",
            "kafka",
            "--host",
            "127.0.0.1",
            "--kafka-port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
        ]
        deadline = time.monotonic() + timeout_s
        while True:
            log = open(self.log_path, "ab")
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            log.close()
            if self._wait_ready(deadline):
                return self
            if self.process.poll() is None:
                self.stop()
                raise RuntimeError(f"noida-db did not become ready on {self.bootstrap}; see {self.log_path}")
            if time.monotonic() > deadline:  # exited early, e.g. "already running" right after a stop
                raise RuntimeError(f"noida-db exited with {self.process.returncode}; see {self.log_path}")
            time.sleep(0.5)

    def _wait_ready(self, deadline: float) -> bool:
        from confluent_kafka.admin import AdminClient

        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=5)
                return True
            except Exception:
                time.sleep(0.2)
        return False

    def stop(self, timeout_s: float = 60) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        # The launcher runs the server binary as its child, in the session we gave it: signal
        # that process group (its id is the launcher's PID) and wait for the launcher to exit.
        stop_process_group(process, signal.SIGINT, timeout_s)
        deadline = time.monotonic() + timeout_s
        while _group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)

    def partition_counts(self) -> dict[str, int]:
        from confluent_kafka.admin import AdminClient

        metadata = AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=10)
        return {name: len(t.partitions) for name, t in metadata.topics.items() if t.error is None}

    def wait_for_topics(self, wanted: dict[str, int], timeout_s: float = 60) -> None:
        """Until every topic in ``wanted`` is served with at least that many partitions.

        Seen here: after a start on existing data, noida-db answers metadata requests about a
        second before it has loaded every topic (a client then gets "unknown topic").
        """
        deadline = time.monotonic() + timeout_s
        while True:
            served = self.partition_counts()
            missing = sorted(name for name, count in wanted.items() if served.get(name, 0) < count)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"noida-db on {self.bootstrap} does not serve topics {missing}; see {self.log_path}")
            time.sleep(0.2)

    def restart(self, wait_for_topics: Iterable[str] = ()) -> None:
        """Stop, start, and wait until ``wait_for_topics`` are served again with their partitions.

        A topic that holds no records at all does not survive a noida-db restart (Apache Kafka
        keeps it), so only name topics that have records.
        """
        names = set(wait_for_topics)
        wanted = {name: count for name, count in self.partition_counts().items() if name in names}
        self.stop()
        self.start()
        self.wait_for_topics(wanted)


@contextmanager
def broker_for(data_dir: Path) -> Iterator[tuple[str, LocalBroker | None]]:
    """(bootstrap, local broker or None) for a tool: ``$KAFKA_BOOTSTRAP_SERVERS`` if set, else a
    noida-db broker in ``data_dir`` for the duration, stopped by its PID afterwards."""
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if external:
        yield external, None
        return
    broker = LocalBroker(data_dir).start()
    try:
        yield broker.bootstrap, broker
    finally:
        broker.stop()


def stop_process_group(process: subprocess.Popen, first: signal.Signals, timeout_s: float) -> None:
    """Signal the process group a server was started in (its id is ``process``'s PID, never a
    name) with ``first``; SIGKILL it if ``process`` has not exited within ``timeout_s``."""
    os.killpg(process.pid, first)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
