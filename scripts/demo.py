"""`make demo`: the embedded default end to end, unattended.

1. an Apache Kafka broker (KRaft, the pinned jars; data in .kafka/) with an `orders` topic: 3 partitions, ~100k events
   including malformed ones, an aborted and a committed transaction;
2. one warm Spark session (`offsetlake spark-server`, Spark Connect on loopback) that every `offsetlake`
   command and every Airflow ingest task attaches to (OFFSETLAKE_DEMO_SPARK=cold: each starts its own JVM),
   and Airflow on a SQLite home in .airflow/ (api-server, scheduler, dag-processor on 127.0.0.1);
3. an `orders_ingest` run; then new events and a run whose ingest dies on its first try (a
   one-shot failpoint), is cleared through the REST API like the UI's Clear button, and reruns
   the same ranges; then an `orders_backfill` run over one partition range;
4. events with null customers: the run fails its Great Expectations suite (the task log says
   which expectation, how many rows, where the report is) and commits nothing; the pipeline is
   switched to `on_failure: quarantine` and the failed task cleared: the same ranges commit,
   the failing records become dead letters;
5. `orders_hourly`, revenue per currency and hour from the same topic (a merge engine,
   `sink.mode: aggregate`): its first version counts test orders too; after the transform is
   fixed, `orders_hourly_backfill` runs over every committed offset and each hour is recomputed
   from its records (shown before and after with `offsetlake sql`); `audit --against-kafka`
   replays the records and compares every hour;
6. the ledger, row counts, the audit and where the tables and logs are;
7. a third pipeline, `payments`: Avro in the Confluent wire format through a Schema Registry
   (the test harness's, unless SCHEMA_REGISTRY_URL names one). Its producer registers a new
   schema version mid-stream; the next run's commit adds the column together with its rows, the
   ledger names both versions, the audit passes;
8. `customers`: Debezium change events of a customers table (a snapshot, then creates, updates
   and deletes, each delete followed by a tombstone) into an upsert sink. A plain `deltalake`
   read of the table then has exactly one row per customer the source table still holds, as it
   holds it, and none for a deleted one: no private column, no filter;
9. `offsetlake catalog register` names every pipeline's tables in the embedded metastore, and a
   plain pyspark session (no offsetlake in it) started with `offsetlake catalog settings` counts
   each sink by name, beside a plain delta-rs read of the same table.

The pipelines folder is copied to .airflow/pipelines so step 4 can change the policy without
touching pipelines/orders.yaml (nor step 5 pipelines/orders_hourly.yaml); step 8 writes its
pipeline, `customers.yaml`, there too (its text is `CUSTOMERS_PIPELINE` below).

With KAFKA_BOOTSTRAP_SERVERS set, that broker is used instead of the embedded one. With
OFFSETLAKE_DEMO_LAKE=s3 (`make demo-s3`) the lake is on the embedded S3 server instead of lake/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from local_airflow import LocalAirflow  # noqa: E402

from offsetlake.embedded.local_broker import LocalBroker, free_port  # noqa: E402
from offsetlake.embedded.local_spark_server import LocalSparkServer, airflow_connection  # noqa: E402
from offsetlake.embedded.sample_data import (  # noqa: E402
    ensure_topic,
    produce_customer_changes,
    produce_orders,
    produce_transaction,
)


def offsetlake(*args: str, check: bool = True) -> int:
    print(f"\n$ offsetlake {' '.join(args)}", flush=True)
    done = subprocess.run([sys.executable, "-m", "offsetlake", *args], cwd=ROOT, env=os.environ)
    if check and done.returncode != 0:
        raise SystemExit(f"offsetlake {' '.join(args)} exited {done.returncode}")
    return done.returncode


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def run_dag(airflow: LocalAirflow, dag_id: str, conf: dict | None = None, expect: str = "success") -> str:
    run_id = airflow.trigger(dag_id, conf)
    state = airflow.wait_for_run(dag_id, run_id)
    tasks = ", ".join(f"{task}={state}/try {tries}" for task, (state, tries) in sorted(airflow.task_states(dag_id, run_id).items()))
    print(f"{dag_id} run {run_id}: {state} ({tasks})", flush=True)
    if state != expect:
        raise SystemExit(f"{dag_id} run {run_id} ended {state}, expected {expect}; logs under {airflow.home / 'logs'}")
    return run_id


def main() -> int:
    s3 = None
    if os.environ.get("OFFSETLAKE_DEMO_LAKE") == "s3":
        from offsetlake.embedded.local_s3 import LocalS3

        (ROOT / ".s3").mkdir(exist_ok=True)
        s3 = LocalS3(ROOT / ".s3" / "s3.log").start()
        lake_location = f"s3://{s3.bucket('demo')}/lake"
        os.environ.update(s3.options())  # orders.yaml's storage: block reads them
        print(f"started the embedded S3 server on {s3.endpoint} (pid {s3.process.pid}); lake {lake_location}")
    else:
        lake_location = str(ROOT / "lake")
        shutil.rmtree(ROOT / "lake", ignore_errors=True)
    os.environ["OFFSETLAKE_LAKE"] = lake_location
    started = time.monotonic()
    try:
        return _story(lake_location)
    finally:
        if s3 is not None:
            s3.stop()
        print(f"\nmake demo took {(time.monotonic() - started) / 60:.1f} minutes")


def _story(lake: str) -> int:
    shutil.rmtree(ROOT / ".airflow", ignore_errors=True)
    pipelines = ROOT / ".airflow" / "pipelines"
    shutil.copytree(ROOT / "pipelines", pipelines, ignore=shutil.ignore_patterns("__pycache__"))
    os.environ["OFFSETLAKE_PIPELINES_DIR"] = str(pipelines)
    broker = None
    if not os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        shutil.rmtree(ROOT / ".kafka", ignore_errors=True)
        broker = LocalBroker(ROOT / ".kafka" / "data", log_path=ROOT / ".kafka" / "broker.log").start()
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = broker.bootstrap
        print(f"started the Apache Kafka broker on {broker.bootstrap} (pid {broker.process.pid})")
    bootstrap = os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    topic = os.environ.setdefault("ORDERS_TOPIC", "orders")
    failpoint = ROOT / ".airflow" / "failpoint"
    spark_server = _warm_spark()
    remote = os.environ.get("OFFSETLAKE_SPARK_REMOTE")  # the Airflow tasks attach where the commands do
    airflow = LocalAirflow(
        ROOT / ".airflow",
        int(os.environ.get("AIRFLOW_PORT", free_port())),
        extra_env={
            "OFFSETLAKE_DISABLE_SCHEDULES": "1",
            "OFFSETLAKE_TASK_RETRIES": "0",
            "OFFSETLAKE_FAILPOINT_FILE": str(failpoint),
            **({"AIRFLOW_CONN_SPARK_CONNECT_DEFAULT": airflow_connection(remote)} if remote else {}),
        },
    )
    try:
        ensure_topic(bootstrap, topic, 3)
        next_id = produce_orders(bootstrap, topic, 60_000, malformed_every=500)
        next_id = produce_transaction(bootstrap, topic, 500, next_id, commit=False, transactional_id="demo-aborted")
        next_id = produce_transaction(bootstrap, topic, 500, next_id, commit=True, transactional_id="demo-committed")
        print(f"produced 60,000 events (every 500th malformed), 500 aborted and 500 committed transactional events to '{topic}'")
        offsetlake("status", "orders")

        # the Kafka -> Kafka pipeline's output topic, and an outbox for the orders sink
        ensure_topic(bootstrap, os.environ.setdefault("ORDERS_BY_CUSTOMER_TOPIC", "orders-by-customer"), 3)
        ensure_topic(bootstrap, OUTBOX_TOPIC, 1)  # one partition: the topic's order is the commit order
        orders_yaml = pipelines / "orders.yaml"
        orders_yaml.write_text(
            orders_yaml.read_text()
            + f"outbox:                            # the orders_outbox DAG\n  topic: {OUTBOX_TOPIC}\n  key: [order_id]\n"
        )

        say(f"starting Airflow on {airflow.url} (SQLite home {airflow.home})")
        airflow.start()
        for dag_id in (
            "orders_ingest",
            "orders_backfill",
            "orders_hourly_ingest",
            "orders_hourly_backfill",
            "orders_by_customer_ingest",
            "orders_outbox",
        ):
            airflow.wait_for_dag(dag_id)  # parsed, and unpaused

        say("orders_ingest: a normal run")
        run_dag(airflow, "orders_ingest")

        produce_orders(bootstrap, topic, 40_000, first_id=next_id, malformed_every=1000)
        say("produced 40,000 more events; orders_ingest again, its ingest killed on the first try (failpoint after_read)")
        failpoint.write_text("after_read")
        failed_run = run_dag(airflow, "orders_ingest", expect="failed")
        say("clearing the failed run through the REST API, as the UI's Clear button does")
        airflow.clear("orders_ingest", failed_run)
        state = airflow.wait_for_run("orders_ingest", failed_run)
        print(
            f"orders_ingest run {failed_run} after clear: {state} "
            f"(ingest try {airflow.task_states('orders_ingest', failed_run)['ingest'][1]})"
        )

        say("orders_backfill: reprocess orders[0] offsets [1000, 3000), replacing those rows")
        run_dag(airflow, "orders_backfill", {"partitions": [0], "from_offset": 1000, "to_offset": 3000})

        produce_orders(bootstrap, topic, 5_000, first_id=next_id + 40_000, null_customer_every=100)
        say(
            "produced 5,000 events, every 100th with customer null; orders_ingest validates them with "
            "orders.expectations.yaml (on_failure: fail)"
        )
        bad_run = run_dag(airflow, "orders_ingest", expect="failed")
        log = airflow.task_log("orders_ingest", bad_run, "ingest", 1)
        print("from the ingest task's log:")
        for line in log.splitlines():  # the job's error message, one log event per line
            if "failed validation" in line or line.strip().startswith(("- expect", "report:", "next:")):
                print(f"  {line.strip()}")
        say("switching orders to on_failure: quarantine and clearing the failed ingest task, as the UI's Clear does")
        yaml_file = pipelines / "orders.yaml"
        yaml_file.write_text(yaml_file.read_text().replace("${ORDERS_ON_FAILURE:-fail}", "quarantine"))
        airflow.clear_task("orders_ingest", bad_run, "ingest")
        state = airflow.wait_for_run("orders_ingest", bad_run)
        print(
            f"orders_ingest run {bad_run} after clearing ingest: {state} "
            f"(ingest try {airflow.task_states('orders_ingest', bad_run)['ingest'][1]})"
        )
        if state != "success":
            raise SystemExit(f"the quarantine rerun ended {state}; logs under {airflow.home / 'logs'}")
        _hourly_story(airflow, pipelines, lake)
        say("orders_by_customer_ingest: Kafka -> Kafka, the valid orders re-keyed by customer, one Kafka transaction per batch")
        run_dag(airflow, "orders_by_customer_ingest")
        say(f"orders_outbox: the orders sink's commits (ingests, the backfill, the quarantine rerun) published to '{OUTBOX_TOPIC}'")
        run_dag(airflow, "orders_outbox")
    except BaseException:
        airflow.stop()
        if spark_server is not None:
            spark_server.stop()
        if broker is not None:
            broker.stop()
        raise
    airflow.stop()
    try:
        offsetlake("ledger", "orders")
        from pyarrow import fs as pafs

        from offsetlake import storage
        from offsetlake.config import load_pipeline

        config = load_pipeline("orders", pipelines)
        sink, dead = storage.table(config.layout.sink), storage.table(config.layout.dead_letters)
        print(f"\nsink rows: {sink.count()}  dead letters: {dead.count()}  sink version: {sink.version()}")
        filesystem, folder = storage.filesystem(config.layout.validation)
        reports = [i for i in filesystem.get_file_info(pafs.FileSelector(folder, recursive=True)) if i.path.endswith(".html")]
        print(f"validation reports: {len(reports)} under {config.validation_path}")
        offsetlake("status", "orders")
        if not storage.is_uri(lake):  # Spark reads the local lake's tables as Delta, by name (offsetlake.catalog)
            offsetlake(
                "sql",
                "--pipeline",
                "orders",
                "SELECT kind, status, count(DISTINCT batch_id) AS batches, sum(rows_written) AS rows FROM orders_ledger "
                "WHERE pipeline = 'orders' GROUP BY kind, status ORDER BY kind, status",
            )
        code = offsetlake("audit", "orders", check=False)
        code = max(code, offsetlake("audit", "orders_hourly", "--against-kafka", check=False))
        code = max(code, _check_kafka_outputs(bootstrap, topic, config))
        code = max(code, _avro_story(bootstrap))
        code = max(code, _cdc_story(bootstrap, pipelines))
        code = max(code, _routes_story(pipelines))
        if not storage.is_uri(lake):
            code = max(code, _catalog_story())
        print(f"\ntables: {lake}/orders, {lake}/_dead_letters/orders, {lake}/_offset_ledger")
        print(f"Airflow task logs: {airflow.home / 'logs'}  service logs: {airflow.home / 'service-logs'}")
        if broker is not None:
            print(f"broker log: {broker.log_path}")
        print("browse the same DAGs in the UI with `make airflow`")
        return code
    finally:
        if spark_server is not None:
            spark_server.stop()
        if broker is not None:
            broker.stop()


def _routes_story(pipelines: Path) -> int:
    """One file, three tables: orders_by_currency routes the orders by currency (``routes:``)."""
    from offsetlake import storage
    from offsetlake.config import load_pipeline

    say("orders_by_currency: one pipeline file, a table per currency (routes:), each table a pipeline of its own")
    tables = ("eur", "usd", "other")
    for table in tables:
        offsetlake("run", f"orders_by_currency_{table}")
    failed = 0
    for table in tables:
        config = load_pipeline(f"orders_by_currency_{table}", pipelines)
        rows = storage.table(config.layout.sink).to_pyarrow_table(columns=["currency"])  # a plain delta-rs read
        seen = sorted(set(rows["currency"].to_pylist()), key=str)
        dead = storage.table(config.layout.dead_letters).count() if storage.is_table(config.layout.dead_letters) else 0
        print(f"  {config.sink_path}: {rows.num_rows:,} rows, currencies {seen}; {dead} dead letters")
        failed += table != "other" and seen != [table.upper()]
    if failed:
        print("CHECK FAILED: a routed table holds another table's currency")
    return max(1 if failed else 0, offsetlake("audit", "orders_by_currency_other", "--against-kafka", check=False))


# a user's own Spark session: pyspark alone, its settings read by Spark from $SPARK_CONF_DIR
PLAIN_SESSION = """
import json, sys
from pyspark.sql import SparkSession
spark = SparkSession.builder.master("local[1]").appName("a colleague's pyspark").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
print(json.dumps({name: spark.sql(f"SELECT count(*) AS n FROM {name}").collect()[0]["n"] for name in sys.argv[1:]}))
"""


def _catalog_story() -> int:
    """The tables by name in the embedded metastore, queried from a plain pyspark session."""
    from offsetlake import metastore, storage
    from offsetlake.catalog import committed, named_tables
    from offsetlake.config import pipeline_names, resolve_pipeline

    say("the tables by name, from any Spark session: offsetlake catalog register, then a plain pyspark")
    offsetlake("catalog", "register")
    configs = [resolve_pipeline(name) for name in pipeline_names(None)]
    sinks = [t for t in named_tables(configs) if t.kind == "sink" and committed(t)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFSETLAKE_")}
    env["SPARK_CONF_DIR"] = str(metastore.conf_dir())
    names = [t.name for t in sinks]
    print(f"\n$ SPARK_CONF_DIR={metastore.conf_dir()} .venv/bin/pyspark   # then, for each: SELECT count(*) FROM <name>", flush=True)
    done = subprocess.run([sys.executable, "-c", PLAIN_SESSION, *names], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        print(f"CHECK FAILED: the plain pyspark session failed:\n{done.stderr[-3000:]}")
        return 1
    counted = json.loads(done.stdout.strip().splitlines()[-1])
    failed = 0
    for table in sinks:
        plain = storage.table(table.location).to_pyarrow_table().num_rows  # what a plain delta-rs read sees
        same = "same as a plain delta-rs read" if counted[table.name] == plain else f"CHECK FAILED: delta-rs reads {plain}"
        failed += counted[table.name] != plain
        print(f"  SELECT count(*) FROM {table.name}: {counted[table.name]:,}  ({same})")
    return 1 if failed else 0


def _warm_spark() -> LocalSparkServer | None:
    """One warm Spark session for the whole demo (``offsetlake spark-server``, as `make
    spark-server` starts it): every `offsetlake` command and every Airflow ingest task attaches to
    it instead of starting a JVM of its own. OFFSETLAKE_DEMO_SPARK=cold runs each in its own
    JVM instead; with OFFSETLAKE_SPARK_REMOTE set, that server is used by both."""
    if os.environ.get("OFFSETLAKE_DEMO_SPARK") == "cold":
        os.environ["OFFSETLAKE_SPARK_SERVER"] = "off"  # not the project's own server either
        return None
    if os.environ.get("OFFSETLAKE_SPARK_REMOTE"):
        print(f"attaching every run to the Spark server at {os.environ['OFFSETLAKE_SPARK_REMOTE']}")
        return None
    server = LocalSparkServer(ROOT / ".airflow" / "spark-server.log", cwd=ROOT).start()
    os.environ["OFFSETLAKE_SPARK_REMOTE"] = server.url
    pid = server.process.pid if server.process else "?"
    print(f"started a warm Spark session (offsetlake spark-server) on {server.url} (pid {pid}): every run and Airflow task attaches to it")
    return server


OUTBOX_TOPIC = "orders-outbox"


def _check_kafka_outputs(bootstrap: str, topic: str, orders) -> int:
    """The independent read_committed checker (offsetlake.embedded.checker) on the two Kafka outputs."""
    from offsetlake.embedded.checker import CheckFailed, check_kafka_sink, check_outbox

    out = os.environ["ORDERS_BY_CUSTOMER_TOPIC"]
    say("checking both Kafka outputs with an independent read_committed consumer")
    offsetlake("audit", "orders_by_customer", check=False)
    try:

        def valid(order: dict) -> bool:  # what orders_by_customer's format requires
            return isinstance(order.get("order_id"), int) and order.get("customer") is not None and order.get("created_at") is not None

        found = check_kafka_sink(bootstrap, topic, out, f"{out}.dead-letters", "offsetlake-orders_by_customer", valid, key="customer")
        print(
            f"{out}: each of the {found['rows']} valid orders of {found['source_records']} source records exactly once, keyed by "
            f"customer; {found['dead_letters']} dead letters exactly once; the group committed at the source's end"
        )
        sink = orders.layout.sink
        published = check_outbox(bootstrap, OUTBOX_TOPIC, sink.path, "orders", dict(sink.options) if sink.options else None)
        print(f"{OUTBOX_TOPIC}: {published['records']} records, exactly the rows of the orders sink's {published['commits']} commits")
    except CheckFailed as failed:
        print(f"CHECK FAILED: {failed}")
        return 1
    return 0


PAYMENT_V1 = {
    "type": "record",
    "name": "Payment",
    "namespace": "demo",
    "fields": [
        {"name": "payment_id", "type": "long"},
        {"name": "order_id", "type": "long"},
        {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}},
        {"name": "currency", "type": {"type": "enum", "name": "Currency", "symbols": ["EUR", "USD", "GBP"]}},
        {"name": "paid_at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    ],
}
# v2 adds an optional field: BACKWARD compatible, so the registry accepts it
PAYMENT_V2 = {**PAYMENT_V1, "fields": [*PAYMENT_V1["fields"], {"name": "method", "type": ["null", "string"], "default": None}]}


def _hourly_story(airflow: LocalAirflow, pipelines: Path, lake: str) -> None:
    """orders_hourly: an hourly revenue aggregate of the same topic through Airflow, corrected by
    the backfill DAG after its transform is fixed."""
    from offsetlake import storage
    from offsetlake.config import load_pipeline
    from offsetlake.sink import committed_end

    yaml_file = pipelines / "orders_hourly.yaml"
    fixed = yaml_file.read_text()
    yaml_file.write_text(fixed.replace("transform: orders_transform:without_test_orders", "# version 1: no transform"))
    say(
        "orders_hourly_ingest: revenue per currency and hour from the same topic (sink.mode: aggregate); "
        "version 1 counts test orders (under 5.00) too"
    )
    run_dag(airflow, "orders_hourly_ingest")
    hours = (
        "SELECT currency, window_start, round(revenue, 2) AS revenue, orders FROM orders_hourly "
        "WHERE currency = 'EUR' ORDER BY window_start LIMIT 4"
    )
    if not storage.is_uri(lake):
        offsetlake("sql", "--pipeline", "orders_hourly", hours)
    yaml_file.write_text(fixed)
    say("version 2 leaves test orders out; orders_hourly_backfill over every committed offset recomputes each hour from its records")
    config = load_pipeline("orders_hourly", pipelines)
    table = storage.table(config.layout.sink)
    for partition in range(3):
        end = committed_end(table, config, config.topic, partition)
        run_dag(airflow, "orders_hourly_backfill", {"partitions": [partition], "from_offset": 0, "to_offset": end})
    if not storage.is_uri(lake):
        offsetlake("sql", "--pipeline", "orders_hourly", hours)


def _produce_payments(bootstrap: str, topic: str, registry: dict, first: int, count: int, every_v2: int = 0) -> int:
    import json
    from datetime import UTC, datetime, timedelta
    from decimal import Decimal

    from confluent_kafka import Producer
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    client = SchemaRegistryClient(registry)
    v1 = AvroSerializer(client, json.dumps(PAYMENT_V1), conf={"auto.register.schemas": True})
    v2 = AvroSerializer(client, json.dumps(PAYMENT_V2), conf={"auto.register.schemas": True}) if every_v2 else None
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    context = SerializationContext(topic, MessageField.VALUE)
    base = datetime(2026, 11, 1, tzinfo=UTC)
    for i in range(first, first + count):
        payment = {
            "payment_id": i,
            "order_id": i * 7 % 100_000,
            "amount": Decimal(i % 50_000) / 100,
            "currency": ("EUR", "USD", "GBP")[i % 3],
            "paid_at": base + timedelta(seconds=i),
        }
        serializer = v1
        if v2 is not None and i % every_v2 == 0:
            serializer, payment = v2, {**payment, "method": ("card", "transfer")[i % 2]}
        producer.produce(topic, value=serializer(payment, context), key=str(i % 101).encode())
        if i % 5_000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0
    return first + count


def _avro_story(bootstrap: str) -> int:
    import json

    from offsetlake import storage
    from offsetlake.config import load_pipeline

    registry_server = None
    if not os.environ.get("SCHEMA_REGISTRY_URL"):
        sys.path.insert(0, str(ROOT / "tests"))
        from schema_registry_server import LocalSchemaRegistry

        shutil.rmtree(ROOT / ".registry", ignore_errors=True)
        (ROOT / ".registry").mkdir()
        registry_server = LocalSchemaRegistry(ROOT / ".registry" / "registry.log").start()
        os.environ["SCHEMA_REGISTRY_URL"] = registry_server.url
        print(f"\nstarted the test harness's Schema Registry on {registry_server.url}")
    registry = {"url": os.environ["SCHEMA_REGISTRY_URL"]}
    if os.environ.get("SCHEMA_REGISTRY_USER_INFO"):
        registry["basic.auth.user.info"] = os.environ["SCHEMA_REGISTRY_USER_INFO"]
    topic = os.environ.setdefault("PAYMENTS_TOPIC", "payments")
    try:
        ensure_topic(bootstrap, topic, 3)
        say(f"payments: 20,000 Avro events (schema v1, Confluent wire format) to '{topic}'; offsetlake run payments")
        next_id = _produce_payments(bootstrap, topic, registry, 0, 20_000)
        offsetlake("run", "payments")
        say("a producer registers payment schema v2 (adds optional 'method') mid-stream: v1 and v2 records interleave")
        _produce_payments(bootstrap, topic, registry, next_id, 10_000, every_v2=3)
        offsetlake("run", "payments")
        config = load_pipeline("payments", Path(os.environ["OFFSETLAKE_PIPELINES_DIR"]))
        table = storage.table(config.layout.sink)
        filesystem, root = storage.filesystem(config.layout.sink)
        with filesystem.open_input_stream(f"{root}/_delta_log/{table.version():020d}.json") as log:
            actions = [json.loads(line) for line in log.read().decode().splitlines()]
        kinds = sorted({next(iter(a)) for a in actions})
        schema = next(json.loads(a["metaData"]["schemaString"]) for a in actions if "metaData" in a)
        print(
            f"sink version {table.version()}: one commit holding {', '.join(kinds)}; "
            f"its schema now has {', '.join(f['name'] for f in schema['fields'] if not f['name'].startswith('_'))}"
        )
        offsetlake("ledger", "payments")
        return offsetlake("audit", "payments", check=False)
    finally:
        if registry_server is not None:
            registry_server.stop()


CUSTOMERS_PIPELINE = """\
# Debezium change events of a `customers` table (the JsonConverter's JSON) into an upsert sink,
# <lake>/customers: one row per customer the source table holds; a delete removes the row, the
# tombstone after it is nothing (docs/guides/keyed-sinks-and-cdc.md).
name: customers
topic: ${CUSTOMERS_TOPIC:-customers}
kafka:
  bootstrap_servers: ${KAFKA_BOOTSTRAP_SERVERS:-127.0.0.1:9092}
lake: ${OFFSETLAKE_LAKE:-lake}
storage:
  AWS_ENDPOINT_URL: ${AWS_ENDPOINT_URL:-}
  AWS_REGION: ${AWS_REGION:-}
  AWS_ACCESS_KEY_ID: ${AWS_ACCESS_KEY_ID:-}
  AWS_SECRET_ACCESS_KEY: ${AWS_SECRET_ACCESS_KEY:-}
  AWS_ALLOW_HTTP: ${AWS_ALLOW_HTTP:-}
start: earliest
key_format: none                   # the key is the row's id, taken from before/after
format:
  type: json
  envelope: debezium
  schema: {id: long, name: string, tier: int}
  required: [id]
sink:
  mode: upsert
  key: [id]
"""


def _cdc_story(bootstrap: str, pipelines: Path) -> int:
    """Step 8: Debezium changes into an upsert sink, read back as any reader reads it."""
    from offsetlake import storage
    from offsetlake.config import load_pipeline

    topic = os.environ.setdefault("CUSTOMERS_TOPIC", "customers")
    ensure_topic(bootstrap, topic, 3)
    (pipelines / "customers.yaml").write_text(CUSTOMERS_PIPELINE)
    snapshot, changes = 2000, 8000
    live, deleted = produce_customer_changes(bootstrap, topic, customers=snapshot, changes=changes)
    say(
        f"customers: Debezium change events of a customers table to '{topic}' (a snapshot of {snapshot:,} rows, then {changes:,} "
        "creates, updates and deletes, each delete followed by a tombstone); offsetlake run customers (sink.mode: upsert)"
    )
    offsetlake("run", "customers")
    config = load_pipeline("customers", pipelines)
    rows = storage.table(config.layout.sink).to_pyarrow_table()  # a plain deltalake read: no filter
    got = {r["id"]: r for r in rows.to_pylist()}
    print(
        f"a plain deltalake read of {storage.display_uri(config.layout.sink.path)}: {rows.num_rows} rows "
        f"({', '.join(rows.column_names)}); the source table holds {len(live)} customers and deleted {len(deleted)} others"
    )
    wrong = [i for i, row in live.items() if i not in got or any(got[i][k] != v for k, v in row.items())]
    kept = sorted(set(got) & deleted)
    if rows.num_rows != len(live) or wrong or kept:
        print(
            f"MISMATCH: {len(wrong)} customers missing or stale (e.g. {wrong[:5]}), {len(kept)} deleted ones still there (e.g. {kept[:5]})"
        )
        return 1
    print("each of them once, as the source holds it; no row for a deleted customer")
    return offsetlake("audit", "customers", "--against-kafka", check=False)


if __name__ == "__main__":
    sys.exit(main())
