"""Kafka's own exactly-once test, as an outside check of the Kafka sink (issue 48, item 6).

The shape of Apache Kafka's ``transactions_test.py``: a seeded topic is copied by a
transactional copier (here a Kafka-sink pipeline, in small transactions) while the broker is
bounced, cleanly and hard, and the copier is killed; a read_committed consumer reads the output
beside it the whole time. Afterwards the output holds the same records, none twice, and each
output partition keeps the source order of every source partition's records.

It stops and starts a broker, so it runs on a private Apache Kafka broker of its own.

In ``make torture`` (about 105 s on CI's machine): ``make test`` covers its ground with
tests/test_kafka_sink.py (a run crashed at every step, fenced runners) and
tests/test_broker_faults.py (a broker restarted inside a Kafka-sink transaction).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Consumer, TopicPartition
from conftest import ROOT, attached
from kafka_truth import last_stable_offsets

from offsetlake import failpoints
from offsetlake.config import load_pipeline
from offsetlake.embedded.local_broker import LocalBroker
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import is_transient
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

# Kafka's system test copies 100,000 records; what the faults land among is the number of
# transactions: about 15 here with 18,000 records. The faults take the first 9 to 11 (a bounce in
# the 2nd of 4, a copier killed after 3 of its own, a hard bounce inside 1 of 2); the rest is a
# clean copy after them, and each transaction is a Spark batch of ~4 s
RECORDS = 18_000
PARTITIONS = 3
BATCH = 1_200  # records per batch

pytestmark = pytest.mark.torture


class Beside:
    """A read_committed consumer of the output that reads while the copy runs (and the broker
    bounces), keeping (output partition, output offset, source partition, source offset, kind).
    Only its own thread touches the consumer (a call from another thread while it consumes hung)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic, self.seen = bootstrap, topic, []
        self._until: dict[int, int] | None = None  # the last stable offsets to read up to, once asked to finish
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        consumer = Consumer(
            {"bootstrap.servers": self.bootstrap, "group.id": f"beside-{uuid.uuid4().hex[:6]}", "isolation.level": "read_committed"}
        )
        consumer.assign([TopicPartition(self.topic, p, 0) for p in range(PARTITIONS)])
        try:
            while True:
                for m in consumer.consume(5_000, 0.5):
                    if m.error() is None:
                        h = {k: v.decode() for k, v in (m.headers() or [])}
                        source = (int(h["offsetlake.partition"]), int(h["offsetlake.offset"]))
                        self.seen.append((m.partition(), m.offset(), *source, h["offsetlake.kind"]))
                if self._until is not None:
                    at = {tp.partition: tp.offset for tp in consumer.position([TopicPartition(self.topic, p) for p in self._until])}
                    if all(at.get(p, -1) >= end for p, end in self._until.items()):
                        return
        finally:
            consumer.close()
            self._done.set()

    def finish(self, timeout_s: float = 180) -> None:
        """Read on to the output's last stable offsets, then stop."""
        self._until = last_stable_offsets(self.bootstrap, self.topic)
        assert self._done.wait(timeout_s), f"the consumer beside did not reach {self._until} within {timeout_s:.0f}s"


def _pipeline(folder: Path, bootstrap: str, source: str, out: str) -> Path:
    name = f"eos_{uuid.uuid4().hex[:6]}"
    body = {
        "name": name,
        "topic": source,
        "kafka": {"bootstrap_servers": bootstrap},
        "lake": str(folder / "lake"),
        "start": "earliest",
        "max_records_per_batch": BATCH,
        "read_timeout_seconds": 60,
        "format": {"type": "json", "schema": {"order_id": "long", "customer": "string", "amount": "double"}, "required": ["order_id"]},
        "sink": {"type": "kafka", "topic": out, "key": ["customer"]},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def _copy_until_done(config, spark, attempts: int = 20) -> None:
    """Runs until the source is copied; a run failed by a bounce (a transient error) runs again."""
    for _ in range(attempts):
        try:
            run_pipeline(config, RunContext(f"copy-{uuid.uuid4().hex[:6]}"), lambda: spark, emit=lambda _: None)
            return
        except Exception as err:  # the broker went away under the run: what a scheduler's retry does
            if not is_transient(err) and "fenced" not in str(err):
                raise
            time.sleep(1)
    raise AssertionError(f"the copy did not finish in {attempts} runs")


def test_a_kafka_sink_copies_a_topic_exactly_once_through_bounces_and_kills(tmp_path, spark):
    broker = LocalBroker(tmp_path / "broker", log_path=tmp_path / "broker.log").start()
    try:
        bootstrap = broker.bootstrap
        source, out = f"eos-src-{uuid.uuid4().hex[:6]}", f"eos-out-{uuid.uuid4().hex[:6]}"
        ensure_topic(bootstrap, source, PARTITIONS)
        ensure_topic(bootstrap, out, PARTITIONS)
        for p in range(PARTITIONS):  # seeded, like the system test's verifiable producer
            produce_orders(
                bootstrap, source, RECORDS // PARTITIONS + (1 if p < RECORDS % PARTITIONS else 0), first_id=p * RECORDS, partition=p
            )
        expected = sum(last_stable_offsets(bootstrap, source).values())
        assert expected == RECORDS
        folder = tmp_path / "pipelines"
        folder.mkdir()
        path = _pipeline(folder, bootstrap, source, out)
        config = load_pipeline(str(path))
        beside = Beside(bootstrap, out)

        # 1. a clean bounce (SIGTERM) inside the second batch's transaction, records produced not committed
        bounced: list[str] = []

        def bounce(_: str) -> None:
            if len(bounced) == 1:
                bounced.append("clean")
                broker.restart(wait_for_topics=[source, out])
            elif not bounced:
                bounced.append("first batch passes")

        with failpoints.on("after_flush", bounce):
            try:
                run_pipeline(config, RunContext("bounce-clean"), lambda: spark, max_batches=4, emit=lambda _: None)
            except Exception as err:
                assert is_transient(err) or "fenced" in str(err), err
        assert bounced == ["first batch passes", "clean"]

        # 2. the copier killed (SIGKILL) while it copies, in its own process (attached to the
        # session's warm Spark server: its producer, the transaction's owner, dies with it)
        runner = subprocess.Popen(
            [sys.executable, "-m", "offsetlake", "run", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=attached("run", (), None, cold=False),
        )
        copied_before = sum(1 for s in beside.seen if s[4] == "ingest")
        deadline = time.monotonic() + 180
        while runner.poll() is None and time.monotonic() < deadline:
            if sum(1 for s in beside.seen if s[4] == "ingest") > copied_before + 3 * BATCH:  # a few batches of its own committed
                break
            time.sleep(0.2)
        runner.send_signal(signal.SIGKILL)
        runner.wait(30)

        # 3. a hard bounce (SIGKILL) of the broker between runs, then again inside a run
        broker.kill()
        broker.start()
        broker.wait_for_topics({source: PARTITIONS, out: PARTITIONS})
        hard: list[int] = []

        def kill_broker(_: str) -> None:
            if not hard:
                hard.append(1)
                broker.kill()
                broker.start()
                broker.wait_for_topics({source: PARTITIONS, out: PARTITIONS})

        with failpoints.on("after_produce", kill_broker):
            try:
                run_pipeline(config, RunContext("bounce-hard"), lambda: spark, max_batches=2, emit=lambda _: None)
            except Exception as err:
                assert is_transient(err) or "fenced" in str(err), err
        assert hard == [1]
        _copy_until_done(config, spark)
        beside.finish()

        copied = [s for s in beside.seen if s[4] == "ingest"]
        by_source = defaultdict(int)
        for _, _, sp, so, _ in copied:
            by_source[(sp, so)] += 1
        twice = sorted(k for k, n in by_source.items() if n > 1)
        assert not twice, f"{len(twice)} source records copied more than once, e.g. {twice[:5]}"
        assert len(by_source) == expected, f"{expected - len(by_source)} source records not copied"
        order: dict[tuple[int, int], list[int]] = defaultdict(list)
        for op, _, sp, so, _ in sorted(copied):
            order[(op, sp)].append(so)
        broken = [k for k, offsets in order.items() if offsets != sorted(offsets)]
        assert not broken, f"output partitions out of their source order: {broken}"
        print(json.dumps({"records": expected, "seen_beside": len(beside.seen), "runner_rc": runner.returncode}))
    finally:
        broker.stop()
