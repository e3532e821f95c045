"""offsetlake against this machine's limits (`make bench`): one command, its own data, medians.

    .venv/bin/python bench/offsetlake_bench.py [--records 2000000] [--partitions 6] [--repeats 3]
        [--only consume,write,steady,peer,paths,s3,avro,overhead,suite,scheduled,planning,upsert,memory]
        [--out bench-results.json]

Produces ``--records`` JSON orders (~200 bytes each) over ``--partitions`` partitions on a private
Apache Kafka broker (or $KAFKA_BOOTSTRAP_SERVERS), then measures, each as the median of ``--repeats``:

consume   a plain confluent-kafka consumer reading every partition to its end and discarding
          the records, and the machine's read limit: 2 such loops in 2 processes, a share of the
          partitions each, with offsetlake's read-task consumer settings (bench/plain_peers.py);
          the limit is the baseline of the steady-state ratios;
write     the same rows (the sink's columns, parsed beforehand) written as ONE Delta commit
          with deltalake from Arrow;
steady    offsetlake ingesting the whole topic (default batch cap) into a fresh lake, with the
          Spark session already up (records/s), and the same as a fresh `offsetlake run`
          process, so including JVM and session start, and as a fresh `offsetlake run --remote`
          attached to a warm `offsetlake spark-server`; next to each warm run (peer, offsetlake,
          offsetlake, peer, ...) the one-process plain peer (bench/plain_peers.py: exact ranges,
          pyarrow JSON parse, one delta-rs commit with a txn per partition, no Spark);
peer      the peer a Spark user would write instead (bench/spark_streaming_peer.py: Structured
          Streaming's Kafka source, from_json, the Delta sink, trigger availableNow, a checkpoint),
          side by side with offsetlake on the same topic: warm (one session, offsetlake, peer,
          peer, offsetlake, ...) and cold (a fresh `offsetlake run` process against the peer's
          own process, alternating); then, warm, the shipped orders pipeline (transform,
          partitions, its suite) against the same shape in the peer (``ingest_shipped``: the
          checks in foreachBatch, Delta's idempotent txn options); medians and speed-ups;
paths     the warm drain of the whole topic on each data path (jvm, direct, spark), in turn in one
          session, and Spark's Kafka source alone into the noop sink: each over the JVM limit;
s3        the warm steady ingest with the lake on the embedded S3 server (moto, loopback), each
          run next to the same ingest into a local folder (local, S3, S3, local, ...): the
          batch time of the same records on both, and their ratio;
overhead  wall time of `offsetlake run` with nothing new and with 1,000 new records (its own JVM,
          attached to a warm server, and by default: the project's own server), and of
          `airflow dags test <pipeline>_ingest` with nothing new (which must start no Spark)
          and with 1,000 new records; then both with 1,000 new records attached to a warm
          `offsetlake spark-server` (`--remote`; the connection spark_connect_default);
suite     1,000 new records through `offsetlake run` by default with the shipped orders pipeline
          (transform and suite): the suite checked against Great Expectations in the command (as
          on its first run) against the check remembered under the project's home, alternating
scheduled an Airflow ingest as production runs it, by default: the api-server, scheduler,
          dag-processor and triggerer running (LocalExecutor), the project's own Spark server
          up; 1,000 new records, then the dag run triggered through the REST API and polled
          every 0.1 s until it succeeds: wall time from the trigger to success, and the run's
          own queued-to-end time as Airflow records it (`airflow dags test` parses the DAG file
          and sets up a database each time; a scheduled run does not);
planning  the plan step of a dag run (`plan_for_dag_run`: reconcile the ledger with the sink's
          history, read offsets, plan, record the plan) after 10, 100 and 1,000 committed
          batches. The batches are committed through offsetlake's own commit path (txn per
          partition + ledger entry in the commit, ledger rows appended) without data files,
          since planning reads only the Delta logs and the ledger;
avro      the same orders as Avro in the Confluent wire format through a Schema Registry (the
          test harness's), written with a newer schema version than the pipeline's pinned reader
          (so every record is resolved): warm ingest of the Avro topic next to the JSON one
          (json, avro, avro, json, ...), medians and their ratio, and the decode step alone on
          100,000 records in one process (µs per record, median of 5);
upsert    a 100,000-update batch into a keyed sink (``sink.mode: upsert``, key order_id) of
          1,000,000 and of 10,000,000 rows, warm, each repeat on a fresh copy of the seeded
          table (files of 500,000 rows sorted by key, as the merge writes them): the updates hit
          one block of keys (900,000-999,999, the keys CDC on recent rows touches), so the merge
          reads the files holding those keys, whatever the table's size; the ratio 10M/1M is the
          target. Then once each, the same number of updates spread uniformly over all keys:
          every file holds some, so copy-on-write rewrites the whole table (shown, not a target);
memory    peak RSS of a `offsetlake run` process tree (driver JVM + Python + Python workers,
          sampled every 100 ms) draining a backlog of 10 x max_records_per_batch, against a
          backlog of 1 x.

Prints one JSON line per measurement and writes every figure to ``--out``; BENCHMARKS.md holds
the latest figures with the targets.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offsetlake.config import load_pipeline  # noqa: E402
from offsetlake.embedded.local_broker import broker_for  # noqa: E402
from offsetlake.embedded.local_spark_server import LocalSparkServer  # noqa: E402
from offsetlake.embedded.sample_data import ensure_topic, produce_orders  # noqa: E402
from offsetlake.kafka import CONSUME_BATCH, CONSUME_WAIT_S  # noqa: E402

SECTIONS = ("consume", "write", "steady", "peer", "paths", "s3", "avro", "overhead", "suite", "scheduled", "planning", "upsert", "memory")
PY = sys.executable
log = logging.getLogger("bench")


def emit(figures: dict, key: str, **values: object) -> None:
    figures[key] = values
    print(json.dumps({"measure": key, **values}), flush=True)


def median_of(repeats: int, measure: Callable[[int], float]) -> tuple[float, list[float]]:
    samples = [measure(i) for i in range(repeats)]
    return statistics.median(samples), [round(s, 3) for s in samples]


# ---- pipelines --------------------------------------------------------------------------------
def write_pipeline(folder: Path, name: str, topic: str, bootstrap: str, lake: Path | str, **overrides: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    body = {
        "name": name,
        "topic": topic,
        "lake": str(lake),
        "start": "earliest",
        "read_timeout_seconds": 600,
        "kafka": {"bootstrap_servers": bootstrap, "options": {"client.id": f"bench-{name}"}},
        "format": {
            "type": "json",
            "schema": {"order_id": "long", "customer": "string", "amount": "double", "currency": "string", "created_at": "timestamp"},
            "required": ["order_id"],
        },
        **overrides,
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def cli(*args: str, env: dict | None = None, timeout: float = 3600) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [PY, "-m", "offsetlake", *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=ROOT
    )
    if done.returncode != 0:
        raise RuntimeError(f"offsetlake {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done


def cold_run(work: Path, name: str, topic: str, bootstrap: str, lake: Path) -> float:
    """Seconds of a fresh `offsetlake run` process (JVM and session start included) ingesting
    ``topic`` into a new ``lake``, which is removed after."""
    path = write_pipeline(work / "p", name, topic, bootstrap, lake)
    t = time.monotonic()
    cli("run", str(path))
    elapsed = time.monotonic() - t
    shutil.rmtree(lake)
    return elapsed


# ---- the warm Spark server ----------------------------------------------------------------------
class SparkServer(LocalSparkServer):
    """`offsetlake spark-server` on a free loopback port for one section, stopped by its PID."""

    def __init__(self, log_path: Path) -> None:
        super().__init__(log_path, cwd=ROOT)

    def __enter__(self) -> SparkServer:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


# ---- consume / write ----------------------------------------------------------------------------
def raw_consume(bootstrap: str, topic: str, keep: bool = False) -> tuple[int, int, list[bytes]]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            # noida-db answers a fetch with everything it has (433 MB for 2M records), as
            # offsetlake's reader allows for too (offsetlake.kafka: 200 MB per partition)
            "receive.message.max.bytes": 1_000_000_000,
        }
    )
    partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
    ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in partitions}
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    remaining = {p for p, end in ends.items() if end > 0}
    records = size = 0
    values: list[bytes] = []
    total = sum(ends.values())
    while remaining:  # asked and waited for as the read tasks do (offsetlake.kafka.read_range)
        for message in consumer.consume(num_messages=max(1, min(CONSUME_BATCH, total - records)), timeout=CONSUME_WAIT_S):
            if message.error():
                continue
            records += 1
            value = message.value() or b""
            size += len(value)
            if keep:
                values.append(value)
            if message.offset() >= ends[message.partition()] - 1:
                remaining.discard(message.partition())
    consumer.close()
    return records, size, values


def sink_rows(values: list[bytes], topic: str) -> pa.Table:
    """The sink's columns for ``values`` (parsed once, outside any timing)."""
    parsed = [json.loads(v) for v in values]
    return pa.table(
        {
            "order_id": pa.array([p.get("order_id") for p in parsed], pa.int64()),
            "customer": pa.array([p.get("customer") for p in parsed], pa.string()),
            "amount": pa.array([p.get("amount") for p in parsed], pa.float64()),
            "currency": pa.array([p.get("currency") for p in parsed], pa.string()),
            "created_at": pa.array([p.get("created_at") for p in parsed], pa.string()).cast(pa.timestamp("us", tz="UTC")),
            "_kafka_topic": pa.array([topic] * len(parsed), pa.string()),
            "_kafka_partition": pa.array([i % 6 for i in range(len(parsed))], pa.int32()),
            "_kafka_offset": pa.array(range(len(parsed)), pa.int64()),
        }
    )


# ---- memory ---------------------------------------------------------------------------------------
def peak_rss_of(command: list[str], env: dict | None = None) -> tuple[int, float, dict[str, int]]:
    """Run ``command``; return the peak summed RSS (bytes) of its process tree, its wall time and
    the split of that peak by process kind (the JVM, the Python driver, Python workers)."""
    started = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, cwd=ROOT
    )
    peak = 0
    stop = threading.Event()
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.append(process.stderr.read()), daemon=True)
    reader.start()
    root = psutil.Process(process.pid)
    split: dict[str, int] = {}
    while not stop.is_set() and process.poll() is None:
        kinds: dict[str, int] = {}
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    kind = "jvm" if p.name() == "java" else "python_driver" if p.pid == root.pid else "python_workers"
                    kinds[kind] = kinds.get(kind, 0) + p.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            break
        if sum(kinds.values()) > peak:
            peak, split = sum(kinds.values()), kinds
        time.sleep(0.1)
    process.wait()
    reader.join()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{''.join(stderr)[-3000:]}")
    return peak, time.monotonic() - started, split


def cpu_seconds(broker) -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process (the driver), the JVM, the
    Python workers under it, and the broker, if it is the local one: where a batch's time goes."""
    me = psutil.Process()
    times = me.cpu_times()
    split = {"python_driver": times.user + times.system, "jvm": 0.0, "python_workers": 0.0, "broker": 0.0}
    broker_pids: set[int] = set()
    if broker is not None and broker.process is not None:
        try:
            root = psutil.Process(broker.process.pid)
            broker_pids = {p.pid for p in [root, *root.children(recursive=True)]}
        except psutil.Error:
            pass
    for p in me.children(recursive=True):
        try:
            t = p.cpu_times()
            kind = "broker" if p.pid in broker_pids else "jvm" if p.name() == "java" else "python_workers"
            split[kind] += t.user + t.system
        except psutil.Error:
            pass
    return split


# ---- planning -----------------------------------------------------------------------------------
def commit_synthetic_batches(config, count: int, start_at: int) -> None:
    """``count`` committed batches of one offset per partition, through offsetlake's commit path."""
    from offsetlake.entry import for_plan
    from offsetlake.history import SinkCommit
    from offsetlake.ledger import Ledger, reconcile_ledger
    from offsetlake.plan import BatchPlan, OffsetRange, RunContext, new_batch_id
    from offsetlake.sink import WrittenFiles, commit_batch, ensure_table

    schema = pa.schema(
        [("order_id", pa.int64()), ("_kafka_topic", pa.string()), ("_kafka_partition", pa.int32()), ("_kafka_offset", pa.int64())]
    )
    ledger = Ledger(config.layout.ledger, config.name)
    for i in range(start_at, start_at + count):
        ranges = tuple(OffsetRange(config.topic, p, i, i + 1) for p in range(6))
        plan = BatchPlan(config.name, new_batch_id(config.name), "ingest", ranges, RunContext(f"bench-{i}"))
        ledger.record_plan(plan)
        table = ensure_table(config, schema)
        entry = for_plan(plan, {(r.topic, r.partition): {"records_read": 1, "rows_written": 1} for r in ranges}, time.monotonic())
        version = commit_batch(table, config, plan, WrittenFiles([], 0, schema), entry)
        ledger.record_commit(SinkCommit(version, entry))
        if i % 20 == 0:  # what every run does at its start and end (compacts the ledger as it grows)
            reconcile_ledger(config, ledger)


def time_plan(config, label: str) -> float:
    from offsetlake.plan import RunContext
    from offsetlake.runs import plan_for_dag_run

    started = time.monotonic()
    plan = plan_for_dag_run(config, RunContext(f"bench-plan-{label}-{time.monotonic_ns()}", f"{config.name}_ingest", 1))
    elapsed = time.monotonic() - started
    assert plan is not None, "the planning topic must have records beyond the synthetic batches"
    return elapsed


# ---- the sections -------------------------------------------------------------------------------
def run_sections(args: argparse.Namespace, work: Path, bootstrap: str, figures: dict, broker=None) -> None:
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    topic = "bench_orders"
    if only == {"suite"}:  # it produces its own records: the main topic's 2M (about 70 s) are not needed
        suite_checked_once(args, work, bootstrap, figures)
        return
    ensure_topic(bootstrap, topic, args.partitions)
    started = time.monotonic()
    produce_orders(bootstrap, topic, args.records)
    produce_s = time.monotonic() - started
    records, size, _ = raw_consume(bootstrap, topic)
    assert records == args.records, f"the topic holds {records} records, expected {args.records}"
    emit(
        figures,
        "data",
        records=records,
        partitions=args.partitions,
        mean_value_bytes=round(size / records, 1),
        produce_s=round(produce_s, 1),
    )

    if "consume" in only:

        def consume(_: int) -> float:
            t = time.monotonic()
            n, _, _ = raw_consume(bootstrap, topic)
            assert n == records
            return time.monotonic() - t

        med, samples = median_of(args.repeats, consume)
        emit(
            figures,
            "raw_consume",
            median_s=round(med, 2),
            samples_s=samples,
            records_per_s=round(records / med),
            mb_per_s=round(size / med / 1e6, 1),
        )

        from plain_peers import consume_limit

        def limit(_: int) -> float:
            n, elapsed = consume_limit(bootstrap, topic, processes=2)
            assert n == records, f"the 2-process loop read {n} of {records}"
            return elapsed

        med, samples = median_of(args.repeats, limit)
        emit(
            figures,
            "consume_limit_2_processes",
            median_s=round(med, 2),
            samples_s=samples,
            records_per_s=round(records / med),
            mb_per_s=round(size / med / 1e6, 1),
        )

        from plain_peers import jvm_consume_limit

        pulled: list[int] = []

        def jvm_limit(_: int) -> float:
            n, elapsed = jvm_consume_limit(bootstrap, topic, records, processes=2)
            assert n == 2 * records, f"the 2 JVM consumers read {n} of {2 * records}"
            pulled.append(n)
            return elapsed

        med, samples = median_of(args.repeats, jvm_limit)
        emit(
            figures,
            "jvm_consume_limit_2_processes",
            median_s=round(med, 2),
            samples_s=samples,
            records_per_s=round(pulled[0] / med),
            mb_per_s=round(2 * size / med / 1e6, 1),
        )

    if "write" in only:
        from deltalake import write_deltalake

        _, _, values = raw_consume(bootstrap, topic, keep=True)
        rows = sink_rows(values, topic)
        del values

        def write(i: int) -> float:
            path = work / f"raw_write_{i}"
            t = time.monotonic()
            write_deltalake(str(path), rows, mode="append")
            elapsed = time.monotonic() - t
            shutil.rmtree(path)
            return elapsed

        med, samples = median_of(args.repeats, write)
        emit(figures, "raw_write", median_s=round(med, 2), samples_s=samples, records_per_s=round(records / med))
        del rows

    if "steady" in only:
        from offsetlake.plan import RunContext
        from offsetlake.runs import run_pipeline
        from offsetlake.spark import spark_session, stop_spark

        spark_session()
        ensure_topic(bootstrap, "bench_warmup", 2)
        produce_orders(bootstrap, "bench_warmup", 20_000)
        warm = load_pipeline(str(write_pipeline(work / "p", "bench_warmup", "bench_warmup", bootstrap, work / "lake_warm")))
        run_pipeline(warm, RunContext("warmup"), spark_session, emit=lambda _: None)

        cpu_splits: list[dict[str, float]] = []
        from plain_peers import plain_peer

        peer_samples: list[float] = []

        def peer(i: int) -> None:  # the one-process peer, run next to each warm offsetlake run
            path = work / f"peer_{i}"
            rows, elapsed = plain_peer(bootstrap, topic, str(path))
            assert rows == records, f"the plain peer wrote {rows} of {records}"
            shutil.rmtree(path)
            peer_samples.append(elapsed)

        def steady(i: int) -> float:
            if i % 2 == 0:
                peer(i)
            lake = work / f"lake_steady_{i}"
            config = load_pipeline(str(write_pipeline(work / "p", "bench_steady", topic, bootstrap, lake)))
            before = cpu_seconds(broker)
            t = time.monotonic()
            results = run_pipeline(config, RunContext(f"steady-{i}"), spark_session, emit=lambda _: None)
            elapsed = time.monotonic() - t
            after = cpu_seconds(broker)
            cpu_splits.append({k: round(after[k] - before.get(k, 0.0), 1) for k in after})
            assert sum(r.total("records_read") for r in results) == records
            shutil.rmtree(lake)
            if i % 2 == 1:
                peer(i)
            return elapsed

        med, samples = median_of(args.repeats, steady)
        emit(figures, "steady_warm", median_s=round(med, 2), samples_s=samples, records_per_s=round(records / med), cpu_s=cpu_splits)
        peer_median = statistics.median(peer_samples)
        emit(
            figures,
            "plain_peer_one_process",
            median_s=round(peer_median, 2),
            samples_s=[round(x, 2) for x in peer_samples],
            records_per_s=round(records / peer_median),
        )
        emit(
            figures,
            "ratio_warm_to_peers",
            warm_over_limit=round(
                figures["steady_warm"]["records_per_s"] / figures.get("consume_limit_2_processes", {}).get("records_per_s", float("nan")), 3
            ),
            warm_over_plain_peer=round(figures["steady_warm"]["records_per_s"] / (records / peer_median), 3),
        )
        stop_spark()

        def cold(i: int) -> float:
            return cold_run(work, "bench_cold", topic, bootstrap, work / f"lake_cold_{i}")

        med, samples = median_of(args.repeats, cold)
        emit(figures, "steady_with_session_start", median_s=round(med, 2), samples_s=samples, records_per_s=round(records / med))
        with SparkServer(work / "spark_server_steady.log") as server:
            cli(
                "run",
                str(write_pipeline(work / "p", "bench_attach_warmup", "bench_warmup", bootstrap, work / "lake_attach_warmup")),
                "--remote",
                server.url,
            )

            def attached(i: int) -> float:  # a fresh `offsetlake run` process attached to the warm server
                lake = work / f"lake_attached_{i}"
                path = write_pipeline(work / "p", "bench_attached", topic, bootstrap, lake)
                t = time.monotonic()
                cli("run", str(path), "--remote", server.url)
                elapsed = time.monotonic() - t
                shutil.rmtree(lake)
                return elapsed

            med, samples = median_of(args.repeats, attached)
        emit(
            figures,
            "steady_cli_attached",
            median_s=round(med, 2),
            samples_s=samples,
            records_per_s=round(records / med),
            over_warm=round(med / figures["steady_warm"]["median_s"], 3),
        )
        if "raw_consume" in figures:
            emit(
                figures,
                "ratio_steady_to_raw_consume",
                warm=round(figures["steady_warm"]["records_per_s"] / figures["raw_consume"]["records_per_s"], 3),
                with_session_start=round(
                    figures["steady_with_session_start"]["records_per_s"] / figures["raw_consume"]["records_per_s"], 3
                ),
            )

    if "peer" in only:
        streaming_peer(args, work, bootstrap, topic, records, figures)

    if "paths" in only:
        data_paths(args, work, bootstrap, topic, records, figures)

    if "s3" in only:
        from offsetlake.embedded.local_s3 import LocalS3
        from offsetlake.plan import RunContext
        from offsetlake.runs import run_pipeline
        from offsetlake.spark import spark_session, stop_spark

        server = LocalS3(work / "s3.log").start()
        try:
            spark_session()
            ensure_topic(bootstrap, "bench_warmup_s3", 2)
            produce_orders(bootstrap, "bench_warmup_s3", 20_000)
            warm_lake = f"s3://{server.bucket()}/lake"
            warm = load_pipeline(
                str(write_pipeline(work / "p", "bench_warmup_s3", "bench_warmup_s3", bootstrap, warm_lake, storage=server.options()))
            )
            run_pipeline(warm, RunContext("warmup"), spark_session, emit=lambda _: None)
            times: dict[str, list[float]] = {"local": [], "s3": []}
            order = [("local", "s3"), ("s3", "local")]
            for i in range(args.repeats):
                for where in order[i % 2]:
                    lake: Path | str = work / f"lake_s3cmp_{i}" if where == "local" else f"s3://{server.bucket()}/lake"
                    storage_opts = {"storage": server.options()} if where == "s3" else {}
                    config = load_pipeline(str(write_pipeline(work / "p", f"bench_{where}", topic, bootstrap, lake, **storage_opts)))
                    t = time.monotonic()
                    results = run_pipeline(config, RunContext(f"{where}-{i}"), spark_session, emit=lambda _: None)
                    times[where].append(round(time.monotonic() - t, 3))
                    assert sum(r.total("records_read") for r in results) == records
                    if where == "local":
                        shutil.rmtree(lake)
            local_med, s3_med = statistics.median(times["local"]), statistics.median(times["s3"])
            emit(
                figures,
                "steady_warm_local_vs_s3",
                local_median_s=round(local_med, 2),
                s3_median_s=round(s3_med, 2),
                local_samples_s=times["local"],
                s3_samples_s=times["s3"],
                s3_over_local=round(s3_med / local_med, 2),
                records=records,
            )
            stop_spark()
        finally:
            server.stop()

    if "avro" in only:
        avro_vs_json(args, work, bootstrap, figures, topic, records)

    if "upsert" in only:
        upsert_scaling(args, work, bootstrap, figures)

    if "memory" in only:
        cap = max(args.records // 10, 1)
        ensure_topic(bootstrap, "bench_memory_1x", args.partitions)
        produce_orders(bootstrap, "bench_memory_1x", cap)
        peaks = {}
        for label, source in (("1x", "bench_memory_1x"), ("10x", topic)):
            splits: list[dict[str, int]] = []

            def drain(i: int, label: str = label, source: str = source, splits: list = splits) -> float:
                lake = work / f"lake_memory_{label}_{i}"
                path = write_pipeline(work / "p", f"bench_memory_{label}", source, bootstrap, lake, max_records_per_batch=cap)
                peak, _, split = peak_rss_of([PY, "-m", "offsetlake", "run", str(path)])
                splits.append({k: round(v / 2**20) for k, v in split.items()})
                shutil.rmtree(lake)
                return peak / 2**20

            med, samples = median_of(args.repeats, drain)
            peaks[label] = med
            emit(
                figures,
                f"memory_{label}",
                backlog_records=cap if label == "1x" else records,
                max_records_per_batch=cap,
                peak_rss_mib_median=round(med),
                samples_mib=[round(s) for s in samples],
                peak_split_mib=splits,
            )
        emit(figures, "ratio_memory_10x_to_1x", ratio=round(peaks["10x"] / peaks["1x"], 3))

    if "overhead" in only:
        overhead(args, work, bootstrap, figures)

    if "suite" in only:
        suite_checked_once(args, work, bootstrap, figures)

    if "scheduled" in only:
        scheduled(args, work, bootstrap, figures)

    if "planning" in only:
        ensure_topic(bootstrap, "bench_planning", 6)
        produce_orders(bootstrap, "bench_planning", 6 * 1_200)
        config = load_pipeline(
            str(
                write_pipeline(work / "p", "bench_planning", "bench_planning", bootstrap, work / "lake_planning", max_records_per_batch=600)
            )
        )
        done = 0
        plan_s = {}
        for target in (10, 100, 1_000):
            commit_synthetic_batches(config, target - done, done)
            done = target
            med, samples = median_of(args.repeats, lambda _: time_plan(config, str(target)))  # noqa: B023
            plan_s[target] = med
            emit(figures, f"plan_after_{target}_batches", median_s=round(med, 3), samples_s=samples)
        emit(figures, "ratio_plan_1000_to_10", ratio=round(plan_s[1_000] / plan_s[10], 3))


ORDER_V1 = {
    "type": "record",
    "name": "Order",
    "namespace": "bench",
    "fields": [
        {"name": "order_id", "type": "long"},
        {"name": "customer", "type": ["null", "string"], "default": None},
        {"name": "amount", "type": "double"},
        {"name": "currency", "type": "string"},
        {"name": "created_at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    ],
}
ORDER_V2 = {**ORDER_V1, "fields": [*ORDER_V1["fields"], {"name": "note", "type": "string", "default": ""}]}


def avro_records(values: list[bytes]) -> list[dict]:
    from datetime import datetime

    out = []
    for value in values:
        order = json.loads(value)
        at = datetime.fromisoformat(order["created_at"].replace("Z", "+00:00"))
        out.append({**order, "created_at": int(at.timestamp() * 1000)})
    return out


def avro_vs_json(args: argparse.Namespace, work: Path, bootstrap: str, figures: dict, topic: str, records: int) -> None:
    """The same orders as JSON and as Avro through the registry, ingested side by side."""
    import io

    import fastavro
    from confluent_kafka import Producer
    from confluent_kafka.schema_registry import Schema

    sys.path.insert(0, str(ROOT / "tests"))
    from schema_registry_server import LocalSchemaRegistry

    from offsetlake.formats import decoder_for
    from offsetlake.plan import RunContext
    from offsetlake.runs import run_pipeline
    from offsetlake.spark import spark_session, stop_spark

    registry = LocalSchemaRegistry(work / "registry.log").start()
    try:
        client = registry.client_config()
        from confluent_kafka.schema_registry import SchemaRegistryClient

        sr = SchemaRegistryClient(client)
        avro_topic = f"{topic}_avro"
        sr.register_schema(f"{avro_topic}-value", Schema(json.dumps(ORDER_V1), "AVRO"))
        writer_id = sr.register_schema(f"{avro_topic}-value", Schema(json.dumps(ORDER_V2), "AVRO"))
        writer = fastavro.parse_schema(ORDER_V2)
        header = b"\x00" + writer_id.to_bytes(4, "big")
        ensure_topic(bootstrap, avro_topic, args.partitions)
        _, json_bytes, values = raw_consume(bootstrap, topic, keep=True)
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10_000})
        avro_bytes = 0
        payloads = []
        for order in avro_records(values):
            out = io.BytesIO()
            fastavro.schemaless_writer(out, writer, order)
            payload = header + out.getvalue()
            avro_bytes += len(payload)
            if len(payloads) < 100_000:
                payloads.append(payload)
            while True:
                try:
                    producer.produce(avro_topic, value=payload, key=f"c{order['order_id'] % 997}".encode())
                    break
                except BufferError:
                    producer.poll(0.1)
        assert producer.flush(120) == 0
        sample_json = values[:100_000]
        del values

        def pipeline_of(kind: str, lake: Path, source: str | None = None, subject: str | None = None) -> Any:
            fmt = (
                {
                    "format": {
                        "type": kind,
                        "schema_registry": client,
                        "subject": subject or f"{avro_topic}-value",
                        **({"version": 1} if kind == "avro" else {}),
                    }
                }
                if kind not in ("json", "json_no_key")
                else {}
            )
            if kind == "json_no_key":  # the same JSON pipeline without the _kafka_key column (key_format: none)
                fmt = {"key_format": "none"}
            source = source or (avro_topic if kind == "avro" else topic)
            return load_pipeline(str(write_pipeline(work / "p", f"bench_{kind}", source, bootstrap, lake, **fmt)))

        # the decode step alone, in this process: what the read tasks do per chunk
        decode_us = {}
        for kind, sample in (("json", sample_json), ("avro", payloads)):
            decoder = decoder_for(pipeline_of(kind, work / "lake_decode"))
            samples = []
            for _ in range(5):
                t = time.perf_counter()
                for start in range(0, len(sample), 10_000):
                    decoder.decode_chunk(sample[start : start + 10_000])
                samples.append(time.perf_counter() - t)
            decode_us[kind] = round(statistics.median(samples) / len(sample) * 1e6, 2)
        emit(
            figures,
            "decode_json_vs_avro",
            json_us_per_record=decode_us["json"],
            avro_us_per_record=decode_us["avro"],
            records=len(payloads),
            avro_over_json=round(decode_us["avro"] / decode_us["json"], 2),
        )
        registry_decode(sr, client, work, bootstrap, figures, sample_json, decode_us["json"], pipeline_of)

        spark_session()
        warm_topics = {"json": "bench_warm_json", "avro": "bench_warm_avro"}
        for warm_topic in warm_topics.values():
            ensure_topic(bootstrap, warm_topic, 2)
        produce_orders(bootstrap, warm_topics["json"], 20_000)
        for payload in payloads[:20_000]:
            producer.produce(warm_topics["avro"], value=payload)
        assert producer.flush(60) == 0
        for kind, warm_topic in warm_topics.items():  # both paths warm (worker imports, registry cache)
            run_pipeline(
                pipeline_of(kind, work / f"lake_warm_{kind}", warm_topic), RunContext(f"warm-{kind}"), spark_session, emit=lambda _: None
            )
        times: dict[str, list[float]] = {"json": [], "avro": [], "json_no_key": []}
        order = [("json", "avro", "json_no_key"), ("json_no_key", "avro", "json")]
        for i in range(args.repeats):
            for kind in order[i % 2]:
                lake = work / f"lake_{kind}_{i}"
                config = pipeline_of(kind, lake)
                t = time.monotonic()
                results = run_pipeline(config, RunContext(f"{kind}-{i}"), spark_session, emit=lambda _: None)
                times[kind].append(round(time.monotonic() - t, 3))
                assert sum(r.total("rows_written") for r in results) == records, (kind, [r.summary() for r in results])
                shutil.rmtree(lake)
        json_med, avro_med = statistics.median(times["json"]), statistics.median(times["avro"])
        emit(
            figures,
            "steady_warm_json_vs_avro",
            json_median_s=round(json_med, 2),
            avro_median_s=round(avro_med, 2),
            json_samples_s=times["json"],
            avro_samples_s=times["avro"],
            avro_over_json=round(avro_med / json_med, 2),
            json_records_per_s=round(records / json_med),
            avro_records_per_s=round(records / avro_med),
            json_mean_value_bytes=round(json_bytes / records, 1),
            avro_mean_value_bytes=round(avro_bytes / records, 1),
            records=records,
        )
        no_key_med = statistics.median(times["json_no_key"])
        emit(
            figures,
            "steady_warm_json_key_column",
            with_key_median_s=round(json_med, 2),
            without_key_median_s=round(no_key_med, 2),
            without_key_samples_s=times["json_no_key"],
            with_over_without=round(json_med / no_key_med, 2),
            records=records,
        )
        stop_spark()
    finally:
        registry.stop()


def _protobuf_order() -> tuple[Any, str]:
    """The bench's Order as a Protobuf message class (built from a descriptor: no protoc here)
    and its schema as the registry takes it."""
    import base64

    from google.protobuf import descriptor_pb2, timestamp_pb2
    from google.protobuf.descriptor_pool import DescriptorPool
    from google.protobuf.message_factory import GetMessageClass

    field = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(
        name="bench/order.proto", package="bench", syntax="proto3", dependency=["google/protobuf/timestamp.proto"]
    )
    message = fd.message_type.add(name="Order")
    for number, (name, kind) in enumerate(
        [("order_id", field.TYPE_INT64), ("customer", field.TYPE_STRING), ("amount", field.TYPE_DOUBLE), ("currency", field.TYPE_STRING)], 1
    ):
        message.field.add(name=name, number=number, type=kind, label=field.LABEL_OPTIONAL)
    message.field.add(
        name="created_at", number=5, type=field.TYPE_MESSAGE, type_name=".google.protobuf.Timestamp", label=field.LABEL_OPTIONAL
    )
    pool = DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.AddSerializedFile(fd.SerializeToString())
    return GetMessageClass(pool.FindMessageTypeByName("bench.Order")), base64.b64encode(fd.SerializeToString()).decode()


ORDER_JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"},
        "customer": {"type": ["string", "null"]},
        "amount": {"type": "number"},
        "currency": {"type": "string"},
        "created_at": {"type": "string", "format": "date-time"},
    },
    "required": ["order_id"],
}


def registry_decode(
    sr: Any, client: dict, work: Path, bootstrap: str, figures: dict, sample_json: list[bytes], json_us: float, pipeline_of: Any
) -> None:
    """Decode cost per record of the other registry formats and of a string key, on the same
    orders, measured like the JSON/Avro decode (median of 5 passes over 10k-record chunks)."""
    from datetime import datetime

    from confluent_kafka.schema_registry import Schema

    from offsetlake.formats import decoder_for
    from offsetlake.formats.keys import TextKey

    order_class, proto_text = _protobuf_order()
    proto_id = sr.register_schema("bench_decode_pb-value", Schema(proto_text, "PROTOBUF"))
    json_id = sr.register_schema("bench_decode_js-value", Schema(json.dumps(ORDER_JSON_SCHEMA), "JSON"))
    samples: dict[str, list[bytes]] = {"protobuf": [], "json_schema": []}
    for value in sample_json:
        order = json.loads(value)
        message = order_class(
            order_id=order["order_id"], customer=order.get("customer") or "", amount=order["amount"], currency=order["currency"]
        )
        message.created_at.FromDatetime(datetime.fromisoformat(order["created_at"].replace("Z", "+00:00")))
        samples["protobuf"].append(b"\x00" + proto_id.to_bytes(4, "big") + b"\x00" + message.SerializeToString())
        samples["json_schema"].append(b"\x00" + json_id.to_bytes(4, "big") + value)
    keys = [f"c{i % 997}".encode() for i in range(len(sample_json))]

    def per_record(decode: Any, sample: list[bytes]) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for start in range(0, len(sample), 10_000):
                decode(sample[start : start + 10_000])
            times.append(time.perf_counter() - t)
        return round(statistics.median(times) / len(sample) * 1e6, 2)

    us = {}
    for kind, subject in (("protobuf", "bench_decode_pb-value"), ("json_schema", "bench_decode_js-value")):
        decoder = decoder_for(pipeline_of(kind, work / "lake_decode", subject=subject))
        assert decoder.decode_chunk(samples[kind][:1000]).problems is None, f"{kind}: the sample must decode to rows"
        us[kind] = per_record(decoder.decode_chunk, samples[kind])
    us["string_key"] = per_record(TextKey(True).decode_chunk, keys)
    emit(
        figures,
        "decode_protobuf_json_schema_and_keys",
        json_us_per_record=json_us,
        protobuf_us_per_record=us["protobuf"],
        json_schema_us_per_record=us["json_schema"],
        string_key_us_per_record=us["string_key"],
        records=len(sample_json),
        protobuf_over_json=round(us["protobuf"] / json_us, 2),
        json_schema_over_json=round(us["json_schema"] / json_us, 2),
    )


def overhead(args: argparse.Namespace, work: Path, bootstrap: str, figures: dict) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from local_airflow import LocalAirflow

    topic = "bench_overhead"
    ensure_topic(bootstrap, topic, args.partitions)
    next_id = produce_orders(bootstrap, topic, 1_000)
    pipelines = work / "overhead_pipelines"
    path = write_pipeline(pipelines, "bench_overhead", topic, bootstrap, work / "lake_overhead")
    cli("run", str(path))

    def timed_cli(_: int) -> float:
        t = time.monotonic()
        cli("run", str(path))
        return time.monotonic() - t

    med, samples = median_of(args.repeats, timed_cli)
    emit(figures, "cli_run_nothing_new", median_s=round(med, 2), samples_s=samples)

    def timed_cli_1k(i: int) -> float:
        nonlocal next_id
        next_id = produce_orders(bootstrap, topic, 1_000, first_id=next_id)
        return timed_cli(i)

    med, samples = median_of(args.repeats, timed_cli_1k)
    emit(figures, "cli_run_1k_new", median_s=round(med, 2), samples_s=samples)

    airflow = LocalAirflow(
        work / "airflow_home",
        0,
        extra_env={"OFFSETLAKE_PIPELINES_DIR": str(pipelines), "OFFSETLAKE_TASK_RETRIES": "0", "OFFSETLAKE_DISABLE_SCHEDULES": "1"},
    )
    airflow.migrate()
    dag_id = "bench_overhead_ingest"
    subprocess.run([airflow.airflow, "dags", "reserialize"], env=airflow.env, capture_output=True, timeout=600, cwd=ROOT, check=True)

    def dags_test(_: int, expect_spark: bool) -> float:
        t = time.monotonic()
        done = subprocess.run(
            [airflow.airflow, "dags", "test", dag_id], env=airflow.env, capture_output=True, text=True, timeout=1800, cwd=ROOT
        )
        elapsed = time.monotonic() - t
        output = done.stdout + done.stderr
        if done.returncode != 0:
            raise RuntimeError(f"airflow dags test {dag_id} failed:\n{output[-3000:]}")
        started_spark = "spark-submit" in output or "SparkContext: Running Spark version" in output
        assert started_spark == expect_spark, f"expected Spark {'started' if expect_spark else 'not started'}:\n{output[-3000:]}"
        return elapsed

    next_id = produce_orders(bootstrap, topic, 1_000, first_id=next_id)
    dags_test(0, expect_spark=True)  # warm-up: the first dag run of a fresh Airflow home
    med, samples = median_of(args.repeats, lambda i: dags_test(i, expect_spark=False))
    emit(figures, "airflow_dags_test_nothing_new", median_s=round(med, 2), samples_s=samples, spark_started=False)

    def airflow_1k(i: int) -> float:
        nonlocal next_id
        next_id = produce_orders(bootstrap, topic, 1_000, first_id=next_id)
        return dags_test(i, expect_spark=True)

    med, samples = median_of(args.repeats, airflow_1k)
    emit(figures, "airflow_dags_test_1k_new", median_s=round(med, 2), samples_s=samples)

    # the same, attached to a warm `offsetlake spark-server` (CLI --remote; Airflow: spark_connect_default)
    with SparkServer(work / "spark_server_overhead.log") as server:
        next_id = produce_orders(bootstrap, topic, 1_000, first_id=next_id)
        cli("run", str(path), "--remote", server.url)  # the server's first job (Python workers) is not a run's cost

        def attached_1k(i: int) -> float:
            nonlocal next_id
            next_id = produce_orders(bootstrap, topic, 1_000, first_id=next_id)
            t = time.monotonic()
            cli("run", str(path), "--remote", server.url)
            return time.monotonic() - t

        med, samples = median_of(args.repeats, attached_1k)
        emit(figures, "cli_run_1k_new_attached", median_s=round(med, 2), samples_s=samples)

        host_port = server.url.removeprefix("sc://")
        airflow.env["AIRFLOW_CONN_SPARK_CONNECT_DEFAULT"] = json.dumps(
            {"conn_type": "spark_connect", "host": host_port.split(":")[0], "port": int(host_port.split(":")[1])}
        )

        def airflow_attached_1k(i: int) -> float:
            nonlocal next_id
            next_id = produce_orders(bootstrap, topic, 1_000, first_id=next_id)
            return dags_test(i, expect_spark=False)  # attached: no spark-submit, no JVM in the task

        med, samples = median_of(args.repeats, airflow_attached_1k)
        emit(figures, "airflow_dags_test_1k_new_attached", median_s=round(med, 2), samples_s=samples)
        airflow.env.pop("AIRFLOW_CONN_SPARK_CONNECT_DEFAULT")

    # by default: no --remote, no connection; the project's own server (offsetlake.spark_server),
    # which the first command starts (its home is the project folder, where the CLI and the ingest
    # job run) and the later ones attach to
    from offsetlake import spark_server

    default = {"OFFSETLAKE_SPARK_SERVER": "auto", "OFFSETLAKE_SPARK_SERVER_IDLE": "30m"}
    spark_server.stop(ROOT)

    def default_1k(i: int) -> float:
        nonlocal next_id
        next_id = produce_orders(bootstrap, topic, 1_000, first_id=next_id)
        t = time.monotonic()
        cli("run", str(path), env=default)
        return time.monotonic() - t

    try:
        first = default_1k(0)  # starts the server
        emit(figures, "cli_run_1k_new_default_first", median_s=round(first, 2), samples_s=[round(first, 2)])
        med, samples = median_of(args.repeats, default_1k)
        emit(figures, "cli_run_1k_new_default", median_s=round(med, 2), samples_s=samples)
        airflow.env.update(default)

        def airflow_default_1k(i: int) -> float:
            nonlocal next_id
            next_id = produce_orders(bootstrap, topic, 1_000, first_id=next_id)
            return dags_test(i, expect_spark=False)  # attached to the project's server: no spark-submit

        med, samples = median_of(args.repeats, airflow_default_1k)
        emit(figures, "airflow_dags_test_1k_new_default", median_s=round(med, 2), samples_s=samples)
    finally:
        for name in default:
            airflow.env.pop(name, None)
        spark_server.stop(ROOT)


def scheduled(args: argparse.Namespace, work: Path, bootstrap: str, figures: dict) -> None:
    """``scheduled`` (module docstring)."""
    from datetime import datetime

    sys.path.insert(0, str(ROOT / "scripts"))
    from local_airflow import LocalAirflow

    from offsetlake import spark_server
    from offsetlake.embedded.local_broker import free_port

    topic = "bench_scheduled"
    ensure_topic(bootstrap, topic, args.partitions)
    next_id = produce_orders(bootstrap, topic, 1_000)
    pipelines = work / "scheduled_pipelines"
    write_pipeline(pipelines, "bench_scheduled", topic, bootstrap, work / "lake_scheduled")
    default = {"OFFSETLAKE_SPARK_SERVER": "auto", "OFFSETLAKE_SPARK_SERVER_IDLE": "30m"}
    airflow = LocalAirflow(
        work / "airflow_scheduled",
        free_port(),
        extra_env={
            "OFFSETLAKE_PIPELINES_DIR": str(pipelines),
            "OFFSETLAKE_TASK_RETRIES": "0",
            "OFFSETLAKE_DISABLE_SCHEDULES": "1",
            **default,
        },
    )
    dag_id = "bench_scheduled_ingest"
    spark_server.stop(ROOT)
    airflow.start()
    try:
        airflow.wait_for_dag(dag_id)

        def one_run(_: int) -> tuple[float, float]:
            t = time.monotonic()
            run_id = airflow.trigger(dag_id)
            while True:
                run = airflow.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")
                if run["state"] in ("success", "failed"):
                    break
                if time.monotonic() - t > 600:
                    raise RuntimeError(f"{dag_id} run {run_id} did not finish within 600 s")
                time.sleep(0.1)
            wall = time.monotonic() - t
            if run["state"] != "success":
                raise RuntimeError(f"{dag_id} run {run_id} ended {run['state']}; logs under {airflow.home / 'logs'}")
            recorded = datetime.fromisoformat(run["end_date"]) - datetime.fromisoformat(run["queued_at"])
            queued = datetime.fromisoformat(run["queued_at"])
            for ti in airflow.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]:
                if ti["start_date"] and ti["end_date"]:  # where the run's time goes, per task
                    start, end = datetime.fromisoformat(ti["start_date"]), datetime.fromisoformat(ti["end_date"])
                    tasks.setdefault(ti["task_id"], []).append(
                        ((start - queued).total_seconds(), (end - start).total_seconds(), (end - queued).total_seconds())
                    )
            return wall, recorded.total_seconds()

        tasks: dict[str, list[tuple[float, float, float]]] = {}
        one_run(0)  # the first run starts the project's Spark server and Airflow's first task process
        tasks.clear()
        walls, recorded = [], []
        for i in range(args.repeats):
            next_id = produce_orders(bootstrap, topic, 1_000, first_id=next_id)
            wall, own = one_run(i)
            walls.append(round(wall, 2))
            recorded.append(round(own, 2))
        from deltalake import DeltaTable

        rows = DeltaTable(str(work / "lake_scheduled" / "bench_scheduled")).to_pyarrow_dataset().count_rows()
        if rows != 1_000 * (args.repeats + 1):  # every run ingested its 1,000 new records
            raise RuntimeError(f"the sink holds {rows} rows after {args.repeats + 1} runs of 1,000 new records each")
        emit(
            figures,
            "airflow_scheduled_1k_new_default",
            median_s=round(statistics.median(walls), 2),
            samples_s=walls,
            recorded_median_s=round(statistics.median(recorded), 2),
            recorded_samples_s=recorded,
            sink_rows=rows,
            # per task, medians: seconds from the run's queueing to its start, its duration, to its end
            tasks={
                task: {
                    "starts_after_s": round(statistics.median(t[0] for t in times), 2),
                    "duration_s": round(statistics.median(t[1] for t in times), 2),
                    "ends_after_s": round(statistics.median(t[2] for t in times), 2),
                }
                for task, times in tasks.items()
            },
        )
    finally:
        airflow.stop()
        spark_server.stop(ROOT)


UPSERT_KEYS = ("order_id",)


def seeded_keyed_table(path: Path, rows: int, file_rows: int = 500_000) -> None:
    """A keyed sink of ``rows`` orders (order_id 0..rows-1) as earlier merges leave it: files of
    ``file_rows`` rows, each sorted by the key and holding one range of it."""
    import numpy as np
    from deltalake import write_deltalake

    stamp = pa.scalar(1_700_000_000_000_000, pa.timestamp("us", tz="UTC"))
    for start in range(0, rows, file_rows):
        ids = np.arange(start, min(start + file_rows, rows), dtype=np.int64)
        n = len(ids)
        table = pa.table(
            {
                "order_id": ids,
                "customer": pa.array([f"c{i % 997}" for i in ids.tolist()]),
                "amount": pa.array(ids.astype(np.float64) / 100),
                "currency": pa.array(["EUR"] * n),
                "created_at": pa.array(np.full(n, stamp.value), pa.timestamp("us", tz="UTC")),
                "_kafka_topic": pa.array(["seed"] * n),
                "_kafka_partition": pa.array(np.zeros(n, np.int32)),
                "_kafka_offset": pa.array(ids),
                "_kafka_timestamp": pa.array(np.full(n, stamp.value), pa.timestamp("us", tz="UTC")),
            }
        )
        write_deltalake(str(path), table, mode="append", configuration={"delta.enableExpiredLogCleanup": "false"})


def produce_order_ids(bootstrap: str, topic: str, ids: list[int]) -> None:
    import random as _random
    from datetime import UTC, datetime

    from confluent_kafka import Producer

    from offsetlake.embedded.sample_data import order_event

    rng = _random.Random(19)
    base = datetime(2026, 11, 1, tzinfo=UTC)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10_000})
    for n, order_id in enumerate(ids):
        while True:
            try:
                producer.produce(topic, value=order_event(order_id, rng, base), key=str(order_id).encode())
                break
            except BufferError:
                producer.poll(0.2)
        if n % 20_000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0


def upsert_scaling(args: argparse.Namespace, work: Path, bootstrap: str, figures: dict) -> None:
    import random as _random

    from offsetlake.plan import RunContext
    from offsetlake.runs import run_pipeline
    from offsetlake.spark import spark_session

    spark_session()
    updates = 100_000
    sizes = (1_000_000, 10_000_000)
    block = "bench_upsert_block"
    ensure_topic(bootstrap, block, 2)
    produce_order_ids(bootstrap, block, list(range(900_000, 900_000 + updates)))
    spread: dict[int, str] = {}
    for size in sizes:
        spread[size] = f"bench_upsert_spread_{size}"
        ensure_topic(bootstrap, spread[size], 2)
        produce_order_ids(bootstrap, spread[size], _random.Random(size).sample(range(size), updates))
    seeds = {}
    for size in sizes:
        seeds[size] = work / f"upsert_seed_{size}"
        t = time.monotonic()
        seeded_keyed_table(seeds[size], size)
        log.warning("seeded a keyed table of %d rows in %.1f s", size, time.monotonic() - t)

    def batch(size: int, topic: str, label: str) -> tuple[float, dict]:
        sink = work / f"upsert_{label}"
        shutil.rmtree(sink, ignore_errors=True)
        shutil.copytree(seeds[size], sink)
        config = load_pipeline(
            str(
                write_pipeline(
                    work / "p",
                    f"bench_upsert_{label}",
                    topic,
                    bootstrap,
                    work / "lake_upsert",
                    key_format="none",
                    sink={"table": str(sink), "mode": "upsert", "key": list(UPSERT_KEYS)},
                )
            )
        )
        t = time.monotonic()
        [result] = run_pipeline(config, RunContext(label), spark_session, emit=lambda _: None)
        elapsed = time.monotonic() - t
        from offsetlake.history import sink_commits
        from offsetlake.storage import table as open_delta

        merge = sink_commits(open_delta(str(sink)), config.name)[-1].entry.merge
        assert merge["updated"] == updates, merge
        shutil.rmtree(sink, ignore_errors=True)
        return elapsed, merge

    batch(sizes[0], block, "warmup")
    times: dict[int, list[float]] = {size: [] for size in sizes}
    merges: dict[int, dict] = {}
    for i in range(args.repeats):  # side by side: 1M, 10M, 1M, 10M, ...
        for size in sizes:
            elapsed, merges[size] = batch(size, block, f"block_{size}_{i}")
            times[size].append(elapsed)
    small, large = (statistics.median(times[s]) for s in sizes)
    emit(
        figures,
        "upsert_block",
        updates=updates,
        sizes=list(sizes),
        median_s={str(s): round(statistics.median(times[s]), 2) for s in sizes},
        samples_s={str(s): [round(x, 2) for x in times[s]] for s in sizes},
        files_rewritten={str(s): merges[s]["files_rewritten"] for s in sizes},
        rows_rewritten={str(s): merges[s]["rows_rewritten"] for s in sizes},
        ratio_10m_over_1m=round(large / small, 2),
    )
    spread_figures = {}
    for size in sizes:
        elapsed, merge = batch(size, spread[size], f"spread_{size}")
        spread_figures[str(size)] = {
            "s": round(elapsed, 2),
            "files_rewritten": merge["files_rewritten"],
            "rows_rewritten": merge["rows_rewritten"],
        }
    emit(figures, "upsert_spread", updates=updates, runs=spread_figures)


def spark_source_to_noop(spark: Any, bootstrap: str, topic: str) -> float:
    """Seconds for Spark's Kafka source to read the whole topic into the noop sink (no decode, no
    write, as many splits as the jvm path makes): the ceiling of any path that reads through it."""
    from confluent_kafka import Consumer, TopicPartition

    from offsetlake.spark import default_parallelism

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-noop"})
    partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
    ends = {str(p): consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in partitions}
    consumer.close()
    source = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("kafka.isolation.level", "read_committed")
        .option("assign", json.dumps({topic: [int(p) for p in ends]}))
        .option("startingOffsets", json.dumps({topic: dict.fromkeys(ends, 0)}))
        .option("endingOffsets", json.dumps({topic: ends}))
        .option("includeHeaders", "true")
        .option("minPartitions", str(2 * default_parallelism(spark)))
        .load()
    )
    t = time.monotonic()
    source.write.format("noop").mode("overwrite").save()
    return round(time.monotonic() - t, 2)


def suite_checked_once(args: argparse.Namespace, work: Path, bootstrap: str, figures: dict) -> None:
    """1,000 new orders through `offsetlake run` by default (the project's own Spark server) with
    the shipped orders pipeline (transform and suite): the suite checked against Great
    Expectations in the command (its remembered check removed first, as on the first run of a new
    or edited suite) against the check remembered under the project's home, alternating."""
    from offsetlake import spark_server

    topic = "bench_suite"
    ensure_topic(bootstrap, topic, args.partitions)
    next_id = produce_orders(bootstrap, topic, 1_000)
    home = work / "suite_home"
    home.mkdir(parents=True, exist_ok=True)
    path = shipped_orders_pipeline(work / "suite_pipelines", "bench_suite", topic, bootstrap, work / "lake_suite")
    env = {"OFFSETLAKE_HOME": str(home), "OFFSETLAKE_SPARK_SERVER": "auto", "OFFSETLAKE_SPARK_SERVER_IDLE": "30m"}
    remembered = home / ".offsetlake" / "suites-checked"
    try:
        cli("run", str(path), env=env)  # starts the project's server and warms its Python workers
        samples: dict[str, list[float]] = {"checked": [], "remembered": []}
        for i in range(args.repeats):
            for kind in ("checked", "remembered") if i % 2 == 0 else ("remembered", "checked"):
                if kind == "checked":
                    shutil.rmtree(remembered, ignore_errors=True)
                next_id = produce_orders(bootstrap, topic, 1_000, first_id=next_id)
                t = time.monotonic()
                cli("run", str(path), env=env)
                samples[kind].append(round(time.monotonic() - t, 3))
        from offsetlake.storage import table as open_delta

        rows = open_delta(load_pipeline(str(path)).layout.sink).count()
        assert rows == 1_000 * (1 + 2 * args.repeats), f"the shipped pipeline's sink holds {rows} rows"
        medians = {kind: statistics.median(s) for kind, s in samples.items()}
        for kind, s in samples.items():
            emit(figures, f"cli_run_1k_new_shipped_suite_{kind}", median_s=round(medians[kind], 2), samples_s=s)
        emit(figures, "ratio_suite_checked_to_remembered", ratio=round(medians["checked"] / medians["remembered"], 3))
    finally:
        spark_server.stop(home)


def shipped_orders_pipeline(folder: Path, name: str, topic: str, bootstrap: str, lake: Path) -> Path:
    """``pipelines/orders.yaml`` as shipped (transform, ``partition_by``, the expectation suite,
    batches of 200,000) reading ``topic`` into ``lake``."""
    folder.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_load((ROOT / "pipelines" / "orders.yaml").read_text().replace("${", "$${"))
    body.pop("storage", None)  # its escaped ${AWS_...:-} defaults are not empty: a local lake takes none
    body.pop("schedule", None)
    body.update(
        {
            "name": name,
            "topic": topic,
            "lake": str(lake),
            "read_timeout_seconds": 600,
            "kafka": {"bootstrap_servers": bootstrap, "options": {"client.id": f"bench-{name}"}},
            "validation": {"on_failure": "fail"},
        }
    )
    shutil.copy(ROOT / "pipelines" / "orders_transform.py", folder / "orders_transform.py")
    shutil.copy(ROOT / "pipelines" / "orders.expectations.yaml", folder / f"{name}.expectations.yaml")
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def streaming_peer(args: argparse.Namespace, work: Path, bootstrap: str, topic: str, records: int, figures: dict) -> None:
    """offsetlake against Structured Streaming availableNow into Delta, warm then cold, each pair
    alternating which goes first; both must write every record."""
    from spark_streaming_peer import ingest, ingest_shipped, rows_in

    from offsetlake.plan import RunContext
    from offsetlake.runs import run_pipeline
    from offsetlake.spark import spark_session, stop_spark

    spark = spark_session()
    ensure_topic(bootstrap, "bench_warmup", 2)
    produce_orders(bootstrap, "bench_warmup", 20_000)
    warmup = load_pipeline(str(write_pipeline(work / "p", "bench_peer_warmup", "bench_warmup", bootstrap, work / "lake_peer_warmup")))
    run_pipeline(warmup, RunContext("warmup"), spark_session, emit=lambda _: None)
    ingest(spark, bootstrap, "bench_warmup", str(work / "ss_warmup"), str(work / "ss_warmup_checkpoint"))
    times: dict[str, list[float]] = {
        "offsetlake_warm": [],
        "peer_warm": [],
        "offsetlake_cold": [],
        "peer_cold": [],
        "offsetlake_shipped_warm": [],
        "peer_shipped_warm": [],
    }

    def offsetlake_side(shape: str, pipeline: Callable[[Path], Path]) -> Callable[[int], None]:
        def measure(i: int) -> None:
            lake = work / f"lake_{shape}_{i}"
            config = load_pipeline(str(pipeline(lake)))
            t = time.monotonic()
            results = run_pipeline(config, RunContext(f"{shape}-{i}"), spark_session, emit=lambda _: None)
            times[f"offsetlake_{shape}"].append(round(time.monotonic() - t, 2))
            assert sum(r.total("rows_written") for r in results) == records
            shutil.rmtree(lake)

        return measure

    def peer_side(shape: str, run: Callable[..., float]) -> Callable[[int], None]:
        def measure(i: int) -> None:
            table, checkpoint = work / f"ss_{shape}_{i}", work / f"ss_{shape}_{i}_checkpoint"
            times[f"peer_{shape}"].append(round(run(spark, bootstrap, topic, str(table), str(checkpoint)), 2))
            written = rows_in(spark, str(table))
            assert written == records, f"the Structured Streaming peer ({shape}) wrote {written} of {records}"
            shutil.rmtree(table)
            shutil.rmtree(checkpoint)

        return measure

    # plain (every order a row), then the shipped orders pipeline's shape on both sides:
    # transform, partitions, the suite
    sides = {
        "warm": (lambda lake: write_pipeline(work / "p", "bench_peer", topic, bootstrap, lake), ingest),
        "shipped_warm": (lambda lake: shipped_orders_pipeline(work / "p_shipped", "bench_shipped", topic, bootstrap, lake), ingest_shipped),
    }
    for shape, (pipeline, run) in sides.items():
        ours, theirs = offsetlake_side(shape, pipeline), peer_side(shape, run)
        for i in range(args.repeats):
            for measure in (ours, theirs) if i % 2 == 0 else (theirs, ours):
                measure(i)
    stop_spark()

    def offsetlake_cold(i: int) -> None:
        times["offsetlake_cold"].append(round(cold_run(work, "bench_peer_cold", topic, bootstrap, work / f"lake_peer_cold_{i}"), 2))

    def peer_cold(i: int) -> None:
        table, checkpoint = work / f"ss_cold_{i}", work / f"ss_cold_{i}_checkpoint"
        command = [PY, str(ROOT / "bench" / "spark_streaming_peer.py"), bootstrap, topic, str(table), str(checkpoint)]
        t = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=ROOT)
        elapsed = time.monotonic() - t
        if done.returncode != 0:
            raise RuntimeError(f"the Structured Streaming peer failed:\n{done.stderr[-3000:]}")
        written = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
        assert written == records, f"the Structured Streaming peer wrote {written} of {records}"
        times["peer_cold"].append(round(elapsed, 2))
        shutil.rmtree(table)
        shutil.rmtree(checkpoint)

    for i in range(args.repeats):
        for measure in (offsetlake_cold, peer_cold) if i % 2 == 0 else (peer_cold, offsetlake_cold):
            measure(i)
    medians = {name: statistics.median(samples) for name, samples in times.items()}
    emit(
        figures,
        "structured_streaming_peer",
        records=records,
        samples_s=times,
        median_s={name: round(m, 2) for name, m in medians.items()},
        speedup_warm=round(medians["peer_warm"] / medians["offsetlake_warm"], 3),
        speedup_cold=round(medians["peer_cold"] / medians["offsetlake_cold"], 3),
        speedup_shipped_warm=round(medians["peer_shipped_warm"] / medians["offsetlake_shipped_warm"], 3),
    )


def data_paths(args: argparse.Namespace, work: Path, bootstrap: str, topic: str, records: int, figures: dict) -> None:
    """The warm ingest of the whole topic on each data path, side by side in one session (jvm,
    direct, spark, then the next order, ...): medians, and each over the JVM consume limit."""
    from offsetlake.plan import RunContext
    from offsetlake.runs import run_pipeline
    from offsetlake.spark import spark_session, stop_spark

    spark_session()
    ensure_topic(bootstrap, "bench_warmup", 2)
    produce_orders(bootstrap, "bench_warmup", 20_000)
    paths = ("jvm", "direct", "spark")
    for path in paths:  # each path's first batch (Kafka source classes, Python workers) before timing
        lake = work / f"lake_warm_{path}"
        warm = load_pipeline(str(write_pipeline(work / "p", f"bench_warm_{path}", "bench_warmup", bootstrap, lake, data_path=path)))
        run_pipeline(warm, RunContext("warmup"), spark_session, emit=lambda _: None)
    samples: dict[str, list[float]] = {path: [] for path in paths}
    for i in range(args.repeats):
        for path in paths[i % len(paths) :] + paths[: i % len(paths)]:
            lake = work / f"lake_path_{path}_{i}"
            config = load_pipeline(str(write_pipeline(work / "p", f"bench_path_{path}", topic, bootstrap, lake, data_path=path)))
            t = time.monotonic()
            results = run_pipeline(config, RunContext(f"path-{path}-{i}"), spark_session, emit=lambda _: None)
            samples[path].append(round(time.monotonic() - t, 2))
            assert sum(r.total("records_read") for r in results) == records
            shutil.rmtree(lake)
    source_samples = [spark_source_to_noop(spark_session(), bootstrap, topic) for _ in range(args.repeats)]
    limit = figures.get("jvm_consume_limit_2_processes", {}).get("records_per_s")
    med = statistics.median(source_samples)
    extra = {"over_jvm_limit": round(records / med / limit, 3)} if limit else {}
    emit(
        figures, "spark_kafka_source_to_noop", median_s=round(med, 2), samples_s=source_samples, records_per_s=round(records / med), **extra
    )
    for path in paths:
        med = statistics.median(samples[path])
        extra = {"over_jvm_limit": round(records / med / limit, 3)} if limit else {}
        emit(figures, f"warm_{path}_path", median_s=round(med, 2), samples_s=samples[path], records_per_s=round(records / med), **extra)
    stop_spark()


def main() -> int:
    parser = argparse.ArgumentParser(prog="offsetlake_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=2_000_000, help="records to produce (default 2,000,000)")
    parser.add_argument("--partitions", type=int, default=6, help="partitions of the main topic (default 6)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is reported (default 3)")
    parser.add_argument("--only", help=f"comma-separated sections out of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results.json", help="where to write every figure as JSON")
    args = parser.parse_args()
    unknown = set(args.only.split(",")) - set(SECTIONS) if args.only else set()
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    figures: dict = {
        "machine": {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)},
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    work = Path(tempfile.mkdtemp(prefix="offsetlake-bench-"))
    try:
        with broker_for(work / "broker") as (bootstrap, broker):
            run_sections(args, work, bootstrap, figures, broker)
    finally:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
        shutil.rmtree(work, ignore_errors=True)
    print(f"figures written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # Spark in this process, or a server this script starts itself: never the project's own warm
    # server, which commands use by default (offsetlake.spark_server)
    os.environ.setdefault("OFFSETLAKE_SPARK_SERVER", "off")
    sys.exit(main())
