"""The yardsticks offsetlake is measured against (issue 20), each a plain program a user could write.

* ``consume_limit``: the machine's read limit. ``processes`` plain read_committed consume loops,
  one process per share of the partitions, discarding records: what a 2-core machine can pull
  out of the broker at all.
* ``jvm_consume_limit``: the same limit for Apache Kafka's own Java consumer
  (``ConsumerPerformance``, from the pinned jars), ``processes`` at once: the ceiling of a read
  path that runs in the JVM (Spark's Kafka source).
* ``plain_peer``: the tool a user would otherwise write. One Python process, no Spark:
  confluent-kafka over the exact ranges [0, LSO) → pyarrow's JSON reader → ONE delta-rs commit
  holding the rows and one txn per partition (appId ``<name>:<topic>:<partition>``, version =
  the end), as offsetlake's own commit does.

Both read with offsetlake's read-task consumer settings (``offsetlake.kafka._READ_BUFFER_DEFAULTS``
and the same ``receive.message.max.bytes``), so a broker's fetch behaviour helps or hurts every
side alike.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pyarrow as pa

from offsetlake.kafka import CONSUME_BATCH, CONSUME_WAIT_S, _consumer_config

ORDER_SCHEMA = pa.schema(
    [
        ("order_id", pa.int64()),
        ("customer", pa.string()),
        ("amount", pa.float64()),
        ("currency", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
    ]
)


def _config(bootstrap: str, name: str) -> dict[str, Any]:
    config = _consumer_config({"bootstrap.servers": bootstrap}, name)
    config["group.id"] = f"{name}-{time.monotonic_ns()}"
    # one consumer here reads several partitions, and noida-db answers a fetch with the tails of
    # all of them at once (217 MB for 3 of 6 partitions of 2M orders): room for that response, as
    # the reader's limit leaves room for one partition's tail
    config["receive.message.max.bytes"] = 1_000_000_000
    return config


def last_stable(bootstrap: str, topic: str) -> dict[int, int]:
    from confluent_kafka import IsolationLevel, TopicPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec

    admin = AdminClient({"bootstrap.servers": bootstrap})
    partitions = admin.list_topics(topic=topic, timeout=30).topics[topic].partitions
    futures = admin.list_offsets(
        {TopicPartition(topic, p): OffsetSpec.latest() for p in partitions}, isolation_level=IsolationLevel.READ_COMMITTED
    )
    return {tp.partition: f.result().offset for tp, f in futures.items()}


def _consumer(bootstrap: str, topic: str, ends: dict[int, int]) -> Any:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(_config(bootstrap, "bench-plain"))
    consumer.list_topics(topic, timeout=30)  # connected before anyone times it
    consumer.assign([TopicPartition(topic, p, 0) for p, end in ends.items() if end > 0])
    return consumer


def _drain(consumer: Any, ends: dict[int, int], keep: bool) -> tuple[int, dict[int, list]]:
    """Read [0, end) of each partition in ``ends``; returns (records, partition -> messages if kept)."""
    remaining = {p for p, end in ends.items() if end > 0}
    kept: dict[int, list] = {p: [] for p in ends}
    records = 0
    total = sum(end for end in ends.values() if end > 0)
    while remaining:
        # asked and waited for as offsetlake's read tasks do (offsetlake.kafka.read_range)
        wanted = max(1, min(CONSUME_BATCH, total - records))
        for message in consumer.consume(num_messages=wanted, timeout=CONSUME_WAIT_S):
            if message.error():
                continue
            p, offset = message.partition(), message.offset()
            if offset >= ends[p]:
                remaining.discard(p)
                continue
            records += 1
            if keep:
                kept[p].append(message)
            if offset >= ends[p] - 1:
                remaining.discard(p)
    consumer.close()
    return records, kept


def _consume_share(bootstrap: str, topic: str, ends: dict[int, int], ready: Any, go: Any, out: Any) -> None:
    consumer = _consumer(bootstrap, topic, ends)
    ready.put(1)
    go.wait()
    started = time.monotonic()
    records, _ = _drain(consumer, ends, keep=False)
    out.put((records, time.monotonic() - started))


def consume_limit(bootstrap: str, topic: str, processes: int = 2) -> tuple[int, float]:
    """(records, seconds) for ``processes`` consume loops over a share of the partitions each,
    all released together once every one is connected (process and client start-up are not
    counted); the time is the slowest loop's. On noida-db, small topics: two concurrent loops
    took ~0.5 s more than one (20,000 records: 0.55 vs 0.08 s), not explained yet (issue 20)."""
    ends = last_stable(bootstrap, topic)
    shares = [{p: e for p, e in ends.items() if p % processes == i} for i in range(processes)]
    context = multiprocessing.get_context("spawn")
    ready, out, go = context.Queue(), context.Queue(), context.Event()
    workers = [context.Process(target=_consume_share, args=(bootstrap, topic, share, ready, go, out)) for share in shares]
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=120)
    go.set()
    results = [out.get(timeout=3600) for _ in workers]
    for worker in workers:
        worker.join(60)
    return sum(n for n, _ in results), max(t for _, t in results)


def jvm_consume_limit(bootstrap: str, topic: str, records: int, processes: int = 2) -> tuple[int, float]:
    """(records, seconds) for ``processes`` of Apache Kafka's own consumer benchmark
    (``org.apache.kafka.tools.ConsumerPerformance``, what ``kafka-consumer-perf-test`` runs, from
    the pinned jars), run at once, each reading the whole topic read_committed in a group of its
    own: the machine's JVM read limit is all the records they pulled over the slowest one's fetch
    time (its own figure, which leaves out JVM start-up and the group join)."""
    import subprocess
    import tempfile

    from offsetlake import jars

    with tempfile.NamedTemporaryFile("w", suffix=".properties") as settings:
        settings.write("isolation.level=read_committed\n")
        settings.flush()
        commands = [
            [
                "java",
                "-Xmx1g",
                "-cp",
                jars.classpath("kafka"),
                "org.apache.kafka.tools.ConsumerPerformance",
                "--bootstrap-server",
                bootstrap,
                "--topic",
                topic,
                "--num-records",
                str(records),
                "--group",
                f"bench-jvm-{i}-{time.monotonic_ns()}",
                "--command-config",
                settings.name,
                "--timeout",
                "60000",
            ]
            for i in range(processes)
        ]
        running = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
        outputs = [p.communicate(timeout=3600) for p in running]
    total, slowest = 0, 0.0
    for (out, err), process in zip(outputs, running, strict=True):
        lines = [line for line in out.splitlines() if line.strip()]
        if process.returncode != 0 or len(lines) < 2:
            raise RuntimeError(f"ConsumerPerformance exited {process.returncode}: {out[-1000:]}{err[-2000:]}")
        row = dict(zip([h.strip() for h in lines[-2].split(",")], [v.strip() for v in lines[-1].split(",")], strict=False))
        total += int(row["data.consumed.in.nMsg"])
        slowest = max(slowest, int(row["fetch.time.ms"]) / 1000)
    return total, slowest


def plain_peer(bootstrap: str, topic: str, table_path: str, name: str = "plain_peer") -> tuple[int, float]:
    """(rows, seconds) for the one-process peer: read, parse, one commit with a txn per partition."""
    import pyarrow.json as pajson
    from deltalake import CommitProperties, Transaction, write_deltalake

    started = time.monotonic()
    ends = last_stable(bootstrap, topic)
    _, kept = _drain(_consumer(bootstrap, topic, ends), ends, keep=True)
    parts = []
    options = pajson.ParseOptions(explicit_schema=ORDER_SCHEMA, unexpected_field_behavior="ignore")
    for p, messages in kept.items():
        if not messages:
            continue
        body = b"\n".join(m.value() for m in messages)
        rows = pajson.read_json(pa.py_buffer(body), parse_options=options)
        parts.append(
            rows.append_column("_kafka_topic", pa.array([topic] * len(messages), pa.string()))
            .append_column("_kafka_partition", pa.array([p] * len(messages), pa.int32()))
            .append_column("_kafka_offset", pa.array([m.offset() for m in messages], pa.int64()))
            .append_column("_kafka_timestamp", pa.array([m.timestamp()[1] * 1000 for m in messages], pa.timestamp("us", tz="UTC")))
        )
    table = pa.concat_tables(parts)
    txns = [Transaction(f"{name}:{topic}:{p}", end) for p, end in ends.items() if end > 0]
    write_deltalake(table_path, table, mode="append", commit_properties=CommitProperties(app_transactions=txns))
    return table.num_rows, time.monotonic() - started
