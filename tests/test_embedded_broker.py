"""The embedded Apache Kafka broker's lifecycle, which the demo and every test rely on: a first
start formats its folder (whatever its cluster id looks like), a stop and a crash both keep what
was committed, and a restart serves the same topics and transactions on the same port."""

from __future__ import annotations

import os
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from offsetlake.embedded.local_broker import LocalBroker
from offsetlake.embedded.sample_data import ensure_topic

pytestmark = pytest.mark.slow  # it starts brokers of its own


def _committed(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list[bytes]:
    """The committed values of partition 0 once every transaction on it has its marker. A
    read_committed consumer stops at the last stable offset, which trails a commit or an abort
    until the broker has written its marker (commit_transaction may return before): the read is
    repeated until it stops at the log end (the event, not a sleep, ends the wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values, stopped_at = _read_committed(bootstrap, topic)
        if stopped_at >= _log_end(bootstrap, topic) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def _read_committed(bootstrap: str, topic: str) -> tuple[list[bytes], int]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "check", "isolation.level": "read_committed", "enable.partition.eof": True}
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    values = []
    while True:
        message = consumer.poll(10)
        assert message is not None, "the broker answered nothing within 10 s"
        if message.error():
            stopped_at = message.offset()  # end of the partition, as far as read_committed may read
            break
        values.append(message.value())
    consumer.close()
    return values, stopped_at


def _log_end(bootstrap: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "check-end"})
    _, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    consumer.close()
    return high


def test_start_stop_crash_and_restart_keep_topics_transactions_and_port(tmp_path):
    # a cluster id that begins with "-", as one random id in 64 does: the format step must take it
    broker = LocalBroker(tmp_path / "data", cluster_id="-" + "A" * 21).start()
    try:
        port, pid = broker.port, broker.process.pid if broker.process else None
        ensure_topic(broker.bootstrap, "t", 1)
        producer = Producer({"bootstrap.servers": broker.bootstrap, "transactional.id": "lifecycle"})
        producer.init_transactions()
        producer.begin_transaction()
        producer.produce("t", b"committed", partition=0)
        producer.commit_transaction()
        producer.begin_transaction()
        producer.produce("t", b"aborted", partition=0)
        producer.abort_transaction()
        assert _committed(broker.bootstrap, "t") == [b"committed"]

        broker.restart(wait_for_topics=["t"])  # a controlled shutdown by PID, then the same folder
        assert broker.port == port and broker.process is not None and broker.process.pid != pid
        assert _committed(broker.bootstrap, "t") == [b"committed"]

        crashed = broker.process.pid
        broker.kill()  # SIGKILL: no shutdown
        with pytest.raises(ProcessLookupError):
            os.kill(crashed, 0)
        broker.start()
        broker.wait_for_topics({"t": 1})
        assert broker.bootstrap.endswith(f":{port}")
        assert _committed(broker.bootstrap, "t") == [b"committed"]
    finally:
        broker.stop()
    assert broker.process is None
