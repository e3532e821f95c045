"""Issue 18 in real Airflow: an Avro pipeline whose Schema Registry comes from the Airflow
connection ``schema_registry_<pipeline>``. A schema version registered between two dag runs adds
its column in the second run's commit; clearing that run reruns its recorded plan (with its
recorded reader schema) as a no-op; the registry password reaches no log.

In ``make torture`` (about 60 s on CI's machine): ``make test`` covers its ground with
tests/test_avro_through_the_registry.py (a new version's column, a registry down, the reader
schema a plan recorded) and the Airflow tests of the cleared rerun.
"""

from __future__ import annotations

import json
import shutil
from urllib.parse import urlsplit

import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic

V1 = {
    "type": "record",
    "name": "Order",
    "fields": [{"name": "order_id", "type": "long"}, {"name": "customer", "type": "string"}, {"name": "amount", "type": "double"}],
}
V2 = {**V1, "fields": [*V1["fields"], {"name": "coupon", "type": ["null", "string"], "default": None}]}


def _produce(bootstrap: str, topic: str, registry, schema: dict, first: int, count: int, extra: dict) -> None:
    serializer = AvroSerializer(registry.client(), json.dumps(schema), conf={"auto.register.schemas": True})
    producer = Producer({"bootstrap.servers": bootstrap})
    context = SerializationContext(topic, MessageField.VALUE)
    for i in range(first, first + count):
        record = {"order_id": i, "customer": f"c{i % 7}", "amount": i / 4, **extra}
        producer.produce(topic, value=serializer(record, context), partition=i % 2)
    assert producer.flush(30) == 0


pytestmark = pytest.mark.torture


def test_a_dag_run_adds_the_new_column_and_its_cleared_rerun_is_a_no_op(running_airflow, pipeline, schema_registry):
    airflow = running_airflow
    address = urlsplit(schema_registry.settings["url"])
    user, _, password = schema_registry.settings.get("basic.auth.user.info", ":").partition(":")
    airflow.api(
        "POST",
        "/connections",
        {
            "connection_id": f"schema_registry_{pipeline.name}",
            "conn_type": "http",
            "host": f"{address.scheme}://{address.hostname}",
            "port": address.port,
            **({"login": user, "password": password} if user else {}),
            "extra": json.dumps({"timeout": "20"}),
        },
    )
    config = pipeline.write(format={"type": "avro"}, schedule=None)  # the registry: only in the connection
    shutil.copy(pipeline.file, airflow.pipelines / pipeline.file.name)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    _produce(pipeline.bootstrap, pipeline.topic, schema_registry, V1, 0, 300, {})
    dag_id = f"{pipeline.name}_ingest"
    airflow.wait_for_dag(dag_id)

    first = airflow.trigger(dag_id)
    assert airflow.wait_for_run(dag_id, first) == "success", airflow.task_log(dag_id, first, "ingest", 1)[-4000:]
    plan_log = airflow.task_log(dag_id, first, "plan", 1)
    assert f"come from connection schema_registry_{pipeline.name}" in plan_log, plan_log[-3000:]

    _produce(pipeline.bootstrap, pipeline.topic, schema_registry, V2, 300, 200, {"coupon": "SAVE"})
    _produce(pipeline.bootstrap, pipeline.topic, schema_registry, V1, 500, 100, {})
    second = airflow.trigger(dag_id)
    assert airflow.wait_for_run(dag_id, second) == "success", airflow.task_log(dag_id, second, "ingest", 1)[-4000:]
    version = storage.table(config.layout.sink).version()
    rows = {r["order_id"]: r for r in storage.table(config.layout.sink).to_pyarrow_table().to_pylist()}
    assert rows[0]["coupon"] is None and rows[300]["coupon"] == "SAVE" and rows[550]["coupon"] is None

    airflow.clear(dag_id, second, only_failed=False)  # as the UI's Clear does: plan and ingest again
    assert airflow.wait_for_run(dag_id, second) == "success"
    assert storage.table(config.layout.sink).version() == version, "the cleared run re-executed its committed plan: no-op"

    committed = [r for r in ledger_rows(config) if r["status"] == "committed"]
    assert {json.loads(r["reader_schema"])["version"] for r in committed} == {1, 2}
    logs = "".join(airflow.task_log(dag_id, run, task, 1) for run in (first, second) for task in ("plan", "ingest"))
    assert not password or password not in logs
    deserializer = AvroDeserializer(schema_registry.client())
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic, order_id=lambda v: int(deserializer(v, None)["order_id"])))
