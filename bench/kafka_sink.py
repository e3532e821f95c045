"""A Kafka topic as the sink (``sink.type: kafka``): Kafka -> Kafka throughput against a plain loop,
and what a transaction costs per batch size.

    .venv/bin/python bench/kafka_sink.py [--records 2000000] [--batch 200000] [--repeats 3]
                                         [--queue-messages 1000000] [--out bench-kafka-sink.json]

Produces ``--records`` JSON orders (``offsetlake.embedded.sample_data.produce_orders``: order_id,
customer, amount, currency, created_at, and a note the schema drops) over 6 partitions on a
private Apache Kafka broker (or $KAFKA_BOOTSTRAP_SERVERS). One warm Spark session (and a 20,000
record warm-up pipeline into a Kafka sink) first; then, ``--repeats`` times, alternating
(offsetlake, plain, offsetlake, plain, ...), each into a fresh output topic of 6 partitions:

offsetlake  ``run_pipeline`` of a pipeline (a fresh name and lake each time, so its group has no
            offsets and it drains everything) with ``sink: {type: kafka, key: [customer]}`` and
            ``max_records_per_batch: --batch``: wall time of the whole drain (records/s), and per
            batch (batches 2..n) the median of each ``timings_ms`` phase (read, dead_letters,
            commit, total), of ``to_records`` (the batch's rows as Kafka records in the driver:
            Spark's toArrow, the sort by coordinates, keys and values made from the columns
            (``kafka_transactions.table_records``), timed by wrapping
            ``kafka_sink._output_records``, which ``_commit`` does before its commit timer starts)
            and ``other`` (total minus those: ensuring topics, the writer's init_transactions,
            reading the sink's state, the ledger), the data path of its batches, and the CPU
            seconds of the driver, the JVM, the Python workers and the broker;
plain       ONE Python process, no Spark: a read_committed consumer (a fresh group, assigned every
            partition from 0, bench/plain_peers.py's consumer settings) and a transactional,
            idempotent producer (linger.ms 20, as offsetlake's writer): consume(num_messages=...),
            json.loads each value, skip it unless a dict with an int order_id, produce
            json.dumps(value) keyed by customer; every ``--batch`` records
            send_offsets_to_transaction(position) + commit_transaction; until every partition
            reached its high watermark. Wall time from the first client to the last commit.

Their medians (records/s) and the ratio offsetlake/plain. Then the transaction's own cost, with
``offsetlake.kafka_commit.TransactionalWriter.commit`` (the code offsetlake commits with) on
prepared ``OutputRecord`` lists of 1,000 / 10,000 / 100,000 records (the rows offsetlake would
produce, with its headers, plus one commit-log record, and 6 source ends), against producing the
same records and headers with an idempotent non-transactional producer (linger.ms 20) + flush,
alternating, 5 times each: the medians, the per-transaction overhead (transactional minus plain)
in ms and as % of the transactional batch time; an empty transaction (the commit-log record and
the ends only); and a ``TransactionalWriter``'s start (init_transactions, made once per batch by
offsetlake's Kafka sink) + close.

Every producer here (the pipeline's, through its ``kafka.options``, the plain loop's, the
overhead section's) gets ``queue.buffering.max.messages: --queue-messages`` (0: librdkafka's
default, 100,000). Why: ``TransactionalWriter.commit`` produces the batch's rows with a retry on a
full local queue but its ``also`` records (the commit-log entry, the dead letters) without one, so
at the default a batch of 100,000 rows or more fails with ``BufferError: Local: Queue full``
(seen here with one batch of 100,000 rows). A larger queue lets a ``--batch`` of 200,000 commit.

Prints one JSON line per figure and writes every figure to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from offsetlake_bench import cpu_seconds, write_pipeline  # noqa: E402
from plain_peers import _config as plain_consumer_config  # noqa: E402

from offsetlake import kafka_sink  # noqa: E402
from offsetlake.config import load_pipeline  # noqa: E402
from offsetlake.embedded.local_broker import broker_for  # noqa: E402
from offsetlake.embedded.sample_data import ensure_topic, produce_orders  # noqa: E402
from offsetlake.kafka import CONSUME_BATCH, CONSUME_WAIT_S  # noqa: E402
from offsetlake.kafka_commit import group_offsets as committed_ends  # noqa: E402
from offsetlake.kafka_transactions import OutputRecord, TransactionalWriter, row_record  # noqa: E402
from offsetlake.plan import RunContext  # noqa: E402
from offsetlake.runs import run_pipeline  # noqa: E402
from offsetlake.spark import spark_session, stop_spark  # noqa: E402

TOPIC = "bench_kafka_sink"
PARTITIONS = 6
OVERHEAD_SIZES = (1_000, 10_000, 100_000)
OVERHEAD_REPEATS = 5


def emit(figures: dict, key: str, **values: Any) -> None:
    figures[key] = values
    print(json.dumps({"measure": key, **values}), flush=True)


def med(values: list[float]) -> float:
    return round(statistics.median(values), 1) if values else float("nan")


# ---- what offsetlake's batches did: its step log lines and the rows -> records time ---------------
class StepLines(logging.Handler):
    """Collects the ``offsetlake.batch`` step lines (``step=<s> ... batch=<id> ... duration_ms=<n>``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def paths(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for line in self.lines:
            if line.startswith("step=path "):
                match = re.search(r" path=(\S+) reason=(.*?) duration_ms=", line)
                if match:
                    label = f"{match.group(1)}: {match.group(2)}"
                    found[label] = found.get(label, 0) + 1
        return found


TO_RECORDS_MS: list[int] = []
_output_records = kafka_sink._output_records


def _timed_output_records(config: Any, processed: Any) -> Any:
    t = time.monotonic()
    records = list(_output_records(config, processed))
    TO_RECORDS_MS.append(int((time.monotonic() - t) * 1000))
    return iter(records)


kafka_sink._output_records = _timed_output_records  # looked up by kafka_sink._commit at call time


def delete_topics(bootstrap: str, topics: list[str]) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept until every answer is in
    for future in admin.delete_topics(topics).values():
        try:
            future.result(60)
        except Exception as err:
            logging.getLogger("bench").warning("deleting a topic failed: %s", err)


# ---- offsetlake -----------------------------------------------------------------------------------
def producer_options(queue_messages: int) -> dict[str, Any]:
    return {"queue.buffering.max.messages": queue_messages} if queue_messages else {}


def offsetlake_drain(
    work: Path, bootstrap: str, broker: Any, i: int, batch: int, records: int, steps: StepLines, queue_messages: int
) -> dict[str, Any]:
    out = f"bench_ks_out_offsetlake_{i}"
    ensure_topic(bootstrap, out, PARTITIONS)
    name = f"bench_ks_{i}"
    sink = {"type": "kafka", "topic": out, "key": ["customer"]}
    kafka = {"bootstrap_servers": bootstrap, "options": {"client.id": f"bench-{name}", **producer_options(queue_messages)}}
    config = load_pipeline(
        str(write_pipeline(work / "p", name, TOPIC, bootstrap, work / f"lake_{i}", max_records_per_batch=batch, sink=sink, kafka=kafka))
    )
    steps.lines.clear()
    TO_RECORDS_MS.clear()
    before = cpu_seconds(broker)
    t = time.monotonic()
    results = run_pipeline(config, RunContext(f"bench-kafka-sink-{i}"), spark_session, emit=lambda _: None)
    drained = time.monotonic() - t
    after = cpu_seconds(broker)
    read = sum(r.total("records_read") for r in results)
    written = sum(r.total("rows_written") for r in results)
    assert read == records and written == records, f"offsetlake read {read} and wrote {written} of {records}"
    ends = committed_ends(config.kafka_client_config(), config.name, [(TOPIC, p) for p in range(PARTITIONS)])
    assert sum(e or 0 for e in ends.values()) == records, f"the group's committed ends {ends} do not add up to {records}"
    timings = [dict(r.timings_ms) for r in results]
    for timing, to_records in zip(timings, TO_RECORDS_MS, strict=True):
        timing["to_records"] = to_records
        known = sum(timing.get(k, 0) for k in ("read", "dead_letters", "to_records", "commit"))
        timing["other"] = timing["total"] - known
    figures = {
        "repeat": i,
        "records": records,
        "batches": len(results),
        "drain_s": round(drained, 2),
        "records_per_s": round(records / drained),
        "batch_total_ms_median": med([t["total"] for t in timings[1:]] or [timings[0]["total"]]),
        "paths": steps.paths(),
        "cpu_s": {k: round(after[k] - before.get(k, 0.0), 1) for k in after},
        "timings_ms": timings,
    }
    delete_topics(bootstrap, [out])
    return figures


# ---- the plain consume-transform-produce loop --------------------------------------------------------
def plain_drain(bootstrap: str, broker: Any, i: int, batch: int, records: int, queue_messages: int) -> dict[str, Any]:
    from confluent_kafka import Consumer, Producer, TopicPartition

    out = f"bench_ks_out_plain_{i}"
    ensure_topic(bootstrap, out, PARTITIONS)
    before = cpu_seconds(broker)
    t = time.monotonic()
    consumer = Consumer(plain_consumer_config(bootstrap, f"bench-ks-plain-{i}"))
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"bench-ks-plain-{i}-{time.monotonic_ns()}",
            "enable.idempotence": True,
            "transaction.timeout.ms": 60_000,
            "linger.ms": 20,
            **producer_options(queue_messages),
        }
    )
    partitions = consumer.list_topics(TOPIC, timeout=30).topics[TOPIC].partitions
    ends = {p: consumer.get_watermark_offsets(TopicPartition(TOPIC, p), timeout=30)[1] for p in partitions}
    consumer.assign([TopicPartition(TOPIC, p, 0) for p, end in ends.items() if end > 0])
    producer.init_transactions(60)
    group = consumer.consumer_group_metadata()
    remaining = {p for p, end in ends.items() if end > 0}
    total = sum(ends.values())
    consumed = produced = skipped = in_txn = transactions = 0

    def commit() -> None:
        positions = [tp for tp in consumer.position(consumer.assignment()) if tp.offset >= 0]
        producer.send_offsets_to_transaction(positions, group, 60)
        producer.commit_transaction(60)

    producer.begin_transaction()
    while remaining:
        # never more than the transaction still takes, so position() is exactly what it produced
        wanted = max(1, min(CONSUME_BATCH, batch - in_txn, total - consumed))
        for message in consumer.consume(num_messages=wanted, timeout=CONSUME_WAIT_S):
            if message.error():  # end of partition
                continue
            partition, offset = message.partition() or 0, message.offset() or 0
            consumed += 1
            in_txn += 1
            try:
                value = json.loads(message.value() or b"")
            except ValueError:
                value = None
            if isinstance(value, dict) and isinstance(value.get("order_id"), int):
                customer = value.get("customer")
                key = customer.encode() if isinstance(customer, str) else None
                while True:
                    try:
                        producer.produce(out, value=json.dumps(value).encode(), key=key)
                        break
                    except BufferError:
                        producer.poll(0.2)
                produced += 1
            else:
                skipped += 1
            if offset >= ends[partition] - 1:
                remaining.discard(partition)
        producer.poll(0)
        if in_txn >= batch or (not remaining and in_txn):
            commit()
            transactions += 1
            in_txn = 0
            if remaining:
                producer.begin_transaction()
    consumer.close()
    drained = time.monotonic() - t
    after = cpu_seconds(broker)
    assert consumed == records and produced == records, f"the plain loop consumed {consumed} and produced {produced} of {records}"
    figures = {
        "repeat": i,
        "records": records,
        "transactions": transactions,
        "skipped": skipped,
        "drain_s": round(drained, 2),
        "records_per_s": round(records / drained),
        "cpu_s": {k: round(after[k] - before.get(k, 0.0), 1) for k in after},
    }
    delete_topics(bootstrap, [out])
    return figures


# ---- a transaction's own cost -----------------------------------------------------------------------
def prepared_records(count: int) -> list[OutputRecord]:
    """``count`` rows as offsetlake's Kafka sink makes them (``row_record``, key customer)."""
    import random
    from datetime import UTC, datetime

    from offsetlake.coordinates import OFFSET, PARTITION
    from offsetlake.coordinates import TOPIC as TOPIC_COLUMN
    from offsetlake.embedded.sample_data import order_event

    rng = random.Random(11)
    base = datetime(2026, 11, 1, tzinfo=UTC)
    out = []
    for n in range(count):
        order = json.loads(order_event(n, rng, base))
        row = {
            "order_id": order["order_id"],
            "customer": order["customer"],
            "amount": order["amount"],
            "currency": order["currency"],
            "created_at": datetime.fromisoformat(order["created_at"]),
            TOPIC_COLUMN: TOPIC,
            PARTITION: n % PARTITIONS,
            OFFSET: n // PARTITIONS,
        }
        out.append(row_record(row, ["customer"]))
    return out


def transaction_overhead(bootstrap: str, figures: dict, queue_messages: int) -> None:
    from confluent_kafka import Producer

    out, log_topic, pipeline = "bench_ks_overhead", "bench_ks_overhead_log", "bench_ks_overhead"
    ensure_topic(bootstrap, out, PARTITIONS)
    ensure_topic(bootstrap, log_topic, 1)
    client = {"bootstrap.servers": bootstrap, **producer_options(queue_messages)}
    prepared = prepared_records(max(OVERHEAD_SIZES))
    entry = json.dumps({"pipeline": pipeline, "note": "x" * 1500}).encode()  # about a ledger entry's size
    plain = Producer({**client, "enable.idempotence": True, "linger.ms": 20})
    plain.list_topics(out, timeout=30)

    def plain_batch(batch_id: str, records: list[OutputRecord]) -> float:
        t = time.monotonic()
        for record in records:
            headers = record.all_headers(batch_id, "ingest")
            while True:
                try:
                    plain.produce(out, value=record.value, key=record.key, headers=headers)
                    break
                except BufferError:
                    plain.poll(0.5)
        plain.produce(log_topic, value=entry, key=batch_id.encode())
        assert plain.flush(60) == 0
        return (time.monotonic() - t) * 1000

    starts: list[float] = []
    for n in range(OVERHEAD_REPEATS):
        t = time.monotonic()
        TransactionalWriter(client, pipeline, slot=f"start-{n}").close()
        starts.append((time.monotonic() - t) * 1000)
    emit(figures, "writer_start", median_ms=med(starts), samples_ms=[round(s, 1) for s in starts])

    with TransactionalWriter(client, pipeline) as writer:
        serial = 0

        def txn_batch(records: list[OutputRecord]) -> float:
            nonlocal serial
            serial += 1
            batch_id = f"overhead-{serial}"
            ends = {(TOPIC, p): serial for p in range(PARTITIONS)}
            t = time.monotonic()
            done = writer.commit(batch_id, "ingest", out, records, ends, also=[(log_topic, batch_id.encode(), entry)])
            elapsed = (time.monotonic() - t) * 1000
            assert done.records == len(records)
            return elapsed

        txn_batch(prepared[:1000])  # warm: the first transaction adds the partitions to the coordinator's view
        plain_batch("warm", prepared[:1000])
        empty = [txn_batch([]) for _ in range(OVERHEAD_REPEATS)]
        emit(figures, "empty_transaction", median_ms=med(empty), samples_ms=[round(s, 1) for s in empty])
        for size in OVERHEAD_SIZES:
            records = prepared[:size]
            txn: list[float] = []
            non: list[float] = []
            for n in range(OVERHEAD_REPEATS):
                txn.append(txn_batch(records))
                non.append(plain_batch(f"plain-{size}-{n}", records))
            overhead = statistics.median(txn) - statistics.median(non)
            emit(
                figures,
                f"transaction_{size}",
                records=size,
                transactional_ms=med(txn),
                non_transactional_ms=med(non),
                overhead_ms=round(overhead, 1),
                overhead_pct_of_batch=round(100 * overhead / statistics.median(txn), 1),
                transactional_samples_ms=[round(s, 1) for s in txn],
                non_transactional_samples_ms=[round(s, 1) for s in non],
            )
    delete_topics(bootstrap, [out, log_topic])


# ---- the run -------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(prog="kafka_sink", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=2_000_000, help="orders to produce (default 2,000,000)")
    parser.add_argument("--batch", type=int, default=200_000, help="max_records_per_batch, and the plain loop's records per transaction")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating (default 3)")
    parser.add_argument(
        "--queue-messages",
        type=int,
        default=1_000_000,
        help="queue.buffering.max.messages of every producer (default 1,000,000; 0: librdkafka's 100,000, at which "
        "offsetlake's Kafka sink fails a batch of 100,000 rows or more with BufferError)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench-kafka-sink.json", help="where to write every figure as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    steps = StepLines()
    batch_log = logging.getLogger("offsetlake.batch")
    batch_log.setLevel(logging.INFO)
    batch_log.addHandler(steps)
    batch_log.propagate = False
    work = Path(tempfile.mkdtemp(prefix="offsetlake-kafka-sink-"))
    figures: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        with broker_for(work / "broker") as (bootstrap, broker):
            ensure_topic(bootstrap, TOPIC, PARTITIONS)
            t = time.monotonic()
            produce_orders(bootstrap, TOPIC, args.records)
            emit(figures, "produced", records=args.records, partitions=PARTITIONS, seconds=round(time.monotonic() - t, 1))

            spark_session()
            ensure_topic(bootstrap, "bench_ks_warmup", 2)
            ensure_topic(bootstrap, "bench_ks_warmup_out", 2)
            produce_orders(bootstrap, "bench_ks_warmup", 20_000)
            warm_sink = {"type": "kafka", "topic": "bench_ks_warmup_out", "key": ["customer"]}
            warm = load_pipeline(
                str(write_pipeline(work / "p", "bench_ks_warmup", "bench_ks_warmup", bootstrap, work / "lake_warm", sink=warm_sink))
            )
            run_pipeline(warm, RunContext("warmup"), spark_session, emit=lambda _: None)

            ours: list[dict] = []
            plains: list[dict] = []
            for i in range(args.repeats):
                ours.append(offsetlake_drain(work, bootstrap, broker, i, args.batch, args.records, steps, args.queue_messages))
                emit(figures, f"offsetlake_{i}", **ours[-1])
                plains.append(plain_drain(bootstrap, broker, i, args.batch, args.records, args.queue_messages))
                emit(figures, f"plain_{i}", **plains[-1])
            ours_rate = statistics.median(r["records_per_s"] for r in ours)
            plain_rate = statistics.median(r["records_per_s"] for r in plains)
            emit(
                figures,
                "throughput",
                offsetlake_records_per_s=round(ours_rate),
                plain_records_per_s=round(plain_rate),
                ratio_offsetlake_over_plain=round(ours_rate / plain_rate, 3),
                offsetlake_samples=[r["records_per_s"] for r in ours],
                plain_samples=[r["records_per_s"] for r in plains],
            )
            # batches 2..n of every repeat: the median of each phase
            later = [t for r in ours for t in (r["timings_ms"][1:] or r["timings_ms"])]
            phases = sorted({k for t in later for k in t})
            emit(
                figures,
                "offsetlake_batch_phases_ms",
                batch_records=args.batch,
                batches=len(later),
                **{k: med([t.get(k, 0) for t in later]) for k in phases},
            )
            stop_spark()
            transaction_overhead(bootstrap, figures, args.queue_messages)
    finally:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    # Spark in this process, or a server this script starts itself: never the project's own warm
    # server, which commands use by default (offsetlake.spark_server)
    os.environ.setdefault("OFFSETLAKE_SPARK_SERVER", "off")
    sys.exit(main())
