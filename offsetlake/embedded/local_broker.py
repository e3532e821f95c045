"""The embedded Apache Kafka broker for the demo, `make airflow`, the benchmarks and the tests.

A real Apache Kafka broker (KRaft, one node that is its own controller) from the pinned jars
(``offsetlake.jars``, set ``kafka``), on free loopback ports with its data in a folder of its own:
transactions and the consumer-offsets topic with replication factor 1, so idempotent and
transactional producers, ``read_committed`` consumers and group offsets behave as in production.

Lifecycle: ``start`` formats the folder on first use (``kafka-storage format --standalone``) and
starts the JVM in a session of its own; ``stop`` signals that process group by its PID (never by
name) with SIGTERM, which a broker answers with a controlled shutdown, and SIGKILLs it if it is
still there after the timeout; ``kill`` is the crash (SIGKILL, no shutdown); ``start`` on the same
folder again recovers its logs and serves the same topics on the same ports.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from base64 import urlsafe_b64encode
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from offsetlake import jars

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(below: tuple[int, int] = (12_000, 0)) -> int:
    """A free loopback port below the kernel's ephemeral range, where none is handed to an
    outgoing connection: a broker restarted on its ports gets them back. A port the kernel chose
    (bind to 0) is an ephemeral one, and while its broker was down any connection could take it
    as its local port: the fault campaign's broker restart failed with "Address already in use"
    (seed 5105, beside a test run). Where the range is unknown, the kernel's choice.

    ``below``: how far under the range's start the ports are taken from (farthest, nearest). Two
    programs that pick ports side by side and bind them later (the compose test's stack beside
    the test suite) take disjoint spans, so neither binds a port the other picked."""
    import random

    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    ports = range(max(1024, low - below[0]), max(1024, low - below[1]))
    for port in random.sample(ports, min(200, len(ports))) if low > 1024 else ():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# the broker's settings beyond its ports and folder: one node, so every internal topic has one
# replica; few partitions for the internal topics, so the first group commit or transaction does
# not wait for 50 partitions to be created
SETTINGS = {
    "process.roles": "broker,controller",
    "node.id": "1",
    "controller.listener.names": "CONTROLLER",
    "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
    "inter.broker.listener.name": "PLAINTEXT",
    "num.partitions": "1",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "5",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "5",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    # a transaction left open past its transaction.timeout.ms is aborted within 2 s of it, not
    # Kafka's 10 s: a stalled Kafka-sink runner is fenced sooner
    "transaction.abort.timed.out.transaction.cleanup.interval.ms": "2000",
    # keep every record whatever its timestamp: Kafka 4 refuses records stamped more than an hour
    # ahead by default, and deletes by time those stamped long ago; the tests produce both, as
    # any producer may
    "log.retention.ms": "-1",
    "log.message.timestamp.after.max.ms": "9223372036854775807",
}
JVM_OPTIONS = ["-Xms256m", "-Xmx768m", "-XX:+UseG1GC", "-Djava.awt.headless=true"]
LOG_CONFIG = """Configuration:
  Appenders:
    Console:
      name: STDOUT
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
  Loggers:
    Root:
      level: WARN
      AppenderRef:
        - ref: STDOUT
    Logger:
      - name: kafka.server.BrokerServer
        level: INFO
      - name: kafka.server.ControllerServer
        level: INFO
"""


def java_binary() -> str:
    """The ``java`` a server started here runs on: ``$JAVA_HOME``'s, else the one on PATH."""
    return str(Path(os.environ["JAVA_HOME"]) / "bin" / "java") if os.environ.get("JAVA_HOME") else "java"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class LocalBroker:
    """One Apache Kafka broker in ``data_dir`` (its settings in ``server.properties`` there, its
    logs under ``log/``); ``log_path`` gets the JVM's output."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        log_path: Path | None = None,
        cluster_id: str | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.settings = dict(settings or {})  # broker settings over SETTINGS (e.g. a short offsets.retention.minutes)
        self.cluster_id = cluster_id  # the id a first start formats the folder with (default: a random one)
        self.log_path = log_path or self.data_dir.parent / f"{self.data_dir.name}.log"
        self.process: subprocess.Popen | None = None
        existing = self._read_properties()
        listeners = existing.get("listeners", "")
        self.port = port or _port_of(listeners, "PLAINTEXT") or free_port()
        self.controller_port = _port_of(listeners, "CONTROLLER") or free_port()

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def properties_path(self) -> Path:
        return self.data_dir / "server.properties"

    def _read_properties(self) -> dict[str, str]:
        if not self.properties_path.is_file():
            return {}
        pairs = (line.split("=", 1) for line in self.properties_path.read_text().splitlines() if "=" in line and not line.startswith("#"))
        return {key.strip(): value.strip() for key, value in pairs}

    def _configure(self) -> None:
        """Write ``server.properties`` and format the log folder the first time."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_dir = self.data_dir / "log"
        settings = {
            **SETTINGS,
            **self.settings,
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}",
            "log.dirs": str(log_dir),
        }
        self.properties_path.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
        (self.data_dir / "log4j2.yaml").write_text(LOG_CONFIG)
        if (log_dir / "meta.properties").is_file():
            return
        cluster_id = self.cluster_id or urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        # "--cluster-id=": an id may begin with "-" (one in 64), which would read as an option
        command = self._java(
            "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(self.properties_path), "--standalone"
        )
        done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"formatting the Kafka log folder {log_dir} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")

    def _java(self, main_class: str, *args: str) -> list[str]:
        java = java_binary()
        logging = f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.yaml'}"
        return [java, *JVM_OPTIONS, logging, "-cp", jars.classpath("kafka"), main_class, *args]

    def start(self, timeout_s: float = 90) -> LocalBroker:
        self._configure()
        deadline = time.monotonic() + timeout_s
        with open(self.log_path, "ab") as log:
            command = self._java("kafka.Kafka", str(self.properties_path))
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        if self._wait_ready(deadline):
            return self
        if self.process.poll() is None:
            self.stop()
            raise RuntimeError(f"the Kafka broker did not become ready on {self.bootstrap}; see {self.log_path}")
        raise RuntimeError(f"the Kafka broker exited with {self.process.returncode}; see {self.log_path}")

    def _wait_ready(self, deadline: float) -> bool:
        from confluent_kafka.admin import AdminClient

        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                metadata = AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=5)
                if metadata.brokers:
                    return True
            except Exception:
                pass
            time.sleep(0.2)
        return False

    def stop(self, timeout_s: float = 60) -> None:
        """Controlled shutdown (SIGTERM to the broker's process group), SIGKILL after ``timeout_s``."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        stop_process_group(process, signal.SIGTERM, timeout_s)
        deadline = time.monotonic() + timeout_s
        while _group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)

    def kill(self) -> None:
        """The crash: SIGKILL to the broker's process group, no shutdown (the next start recovers the logs)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            stop_process_group(process, signal.SIGKILL, 10)

    def partition_counts(self) -> dict[str, int]:
        """Topics served with a leader for every partition, and how many partitions each has."""
        from confluent_kafka.admin import AdminClient

        metadata = AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=10)
        return {
            name: len(t.partitions)
            for name, t in metadata.topics.items()
            if t.error is None and all(p.error is None and p.leader >= 0 for p in t.partitions.values())
        }

    def wait_for_topics(self, wanted: dict[str, int], timeout_s: float = 60) -> None:
        """Until every topic in ``wanted`` is served with at least that many partitions, each with
        a leader (right after a start the broker answers metadata before it leads every partition)."""
        deadline = time.monotonic() + timeout_s
        while True:
            served = self.partition_counts()
            missing = sorted(name for name, count in wanted.items() if served.get(name, 0) < count)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Kafka broker on {self.bootstrap} does not serve topics {missing}; see {self.log_path}")
            time.sleep(0.2)

    def restart(self, wait_for_topics: Iterable[str] = ()) -> None:
        """Stop, start on the same folder and ports, and wait until ``wait_for_topics`` are led again."""
        names = set(wait_for_topics)
        wanted = {name: count for name, count in self.partition_counts().items() if name in names}
        self.stop()
        self.start()
        self.wait_for_topics(wanted)


def _port_of(listeners: str, name: str) -> int | None:
    """The port of listener ``name`` in a ``listeners`` setting, if there."""
    for listener in listeners.split(","):
        if listener.startswith(f"{name}://"):
            return int(listener.rsplit(":", 1)[1])
    return None


@contextmanager
def broker_for(data_dir: Path, settings: dict[str, str] | None = None) -> Iterator[tuple[str, LocalBroker | None]]:
    """(bootstrap, local broker or None) for a tool: ``$KAFKA_BOOTSTRAP_SERVERS`` if set, else an
    Apache Kafka broker in ``data_dir`` (with ``settings`` over the usual ones) for the duration,
    stopped by its PID afterwards."""
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if external:
        yield external, None
        return
    broker = LocalBroker(data_dir, settings=settings).start()
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


def main(argv: list[str] | None = None) -> int:
    """``python -m offsetlake.embedded.local_broker``: one broker in the foreground until SIGTERM
    or Ctrl-C (the compose stack's ``kafka`` service, or a broker to point a pipeline at)."""
    import argparse

    parser = argparse.ArgumentParser(description="Run the embedded Apache Kafka broker (KRaft, one node) until SIGTERM or Ctrl-C.")
    parser.add_argument("--data-dir", type=Path, required=True, help="its folder: formatted on first use, reused after (topics survive)")
    parser.add_argument("--port", type=int, default=None, help="the client port on 127.0.0.1 (default: the folder's, else a free one)")
    args = parser.parse_args(argv)
    broker = LocalBroker(args.data_dir, port=args.port).start()
    print(
        f"Apache Kafka broker on {broker.bootstrap} (pid {broker.process.pid if broker.process else '?'}, log {broker.log_path})",
        flush=True,
    )
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        while not stopping and broker.process is not None and broker.process.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
