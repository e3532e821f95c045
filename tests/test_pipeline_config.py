"""Pipeline YAML: errors name the file and field; env interpolation; secrets never shown."""

from __future__ import annotations

import pytest
import yaml

from offsetlake.config import load_pipeline
from offsetlake.config.sink_kinds import sink_kind
from offsetlake.errors import ConfigError

BASE = {
    "name": "orders_x",
    "topic": "orders",
    "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
    "format": {"type": "json", "schema": {"order_id": "long"}},
}


def write(tmp_path, body, name="orders_x"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body) if isinstance(body, dict) else body)
    return path


def test_unknown_field_is_named_with_the_file(tmp_path):
    path = write(tmp_path, {**BASE, "max_records_per_bacth": 5})
    with pytest.raises(ConfigError) as err:
        load_pipeline(str(path))
    assert str(path) in str(err.value) and "max_records_per_bacth" in str(err.value)


def test_bad_type_in_schema_names_the_field(tmp_path):
    path = write(tmp_path, {**BASE, "format": {"type": "json", "schema": {"order_id": "lnog"}}})
    with pytest.raises(ConfigError, match="format.schema.*order_id.*unknown type 'lnog'"):
        load_pipeline(str(path))


def test_pipeline_names_are_restricted(tmp_path):
    with pytest.raises(ConfigError, match=r"\[a-z0-9_\]\+"):
        load_pipeline("../x", tmp_path)
    path = write(tmp_path, {**BASE, "name": "Orders-X"}, name="Orders-X")
    with pytest.raises(ConfigError, match="not allowed"):
        load_pipeline(str(path))


def test_env_interpolation_and_missing_variable(tmp_path, monkeypatch):
    body = {**BASE, "kafka": {"bootstrap_servers": "${OL_TEST_BROKER}", "options": {"sasl.password": "${OL_PW:-dflt}"}}}
    path = write(tmp_path, body)
    monkeypatch.delenv("OL_TEST_BROKER", raising=False)
    with pytest.raises(ConfigError, match="kafka.bootstrap_servers: environment variable OL_TEST_BROKER is not set"):
        load_pipeline(str(path))
    monkeypatch.setenv("OL_TEST_BROKER", "broker:9092")
    config = load_pipeline(str(path))
    assert config.kafka.bootstrap_servers == "broker:9092"
    assert config.kafka_client_config()["sasl.password"] == "dflt"


def test_secrets_are_redacted_everywhere_humans_look(tmp_path):
    marker = "s3cr3t-MARKER-42"
    body = {**BASE, "kafka": {"bootstrap_servers": "b:9092", "options": {"security.protocol": "SASL_SSL", "sasl.password": marker}}}
    config = load_pipeline(str(write(tmp_path, body)))
    assert marker not in repr(config) and marker not in str(config)
    assert config.redacted_kafka_options()["sasl.password"] == "***"
    assert config.redacted_kafka_options()["security.protocol"] == "SASL_SSL"


def test_managed_kafka_options_cannot_be_overridden(tmp_path):
    body = {**BASE, "kafka": {"bootstrap_servers": "b:9092", "options": {"isolation.level": "read_uncommitted"}}}
    with pytest.raises(ConfigError, match="isolation.level are set by offsetlake"):
        load_pipeline(str(write(tmp_path, body)))


def test_example_orders_pipeline_loads():
    from pathlib import Path

    config = load_pipeline(str(Path(__file__).resolve().parent.parent / "pipelines" / "orders.yaml"))
    assert config.name == "orders" and config.sink.partition_by == ["order_date"]


@pytest.mark.parametrize(
    ("declared", "said"),
    [
        ("decimal(40,2)", "precision 40: Spark's decimals hold 1 to 38 digits"),
        ("array<strng>", "unknown type 'strng'"),
        ("struct<a int, b>", "struct field 'b' has no type"),
        ("map<string>", "',' expected at '>'"),
    ],
)
def test_types_spark_cannot_read_fail_at_load_naming_the_field(tmp_path, declared, said):
    """Found by an adversarial run (issue 15): these passed the YAML check and failed only after
    planning and reading, with Spark's message naming another field ("near 'long'")."""
    schema = {"order_id": "long", "amount": declared, "customer": "string"}
    path = write(tmp_path, {**BASE, "format": {"type": "json", "schema": schema}})
    with pytest.raises(ConfigError) as err:
        load_pipeline(str(path))
    assert f"format.schema: field 'amount': type '{declared}': {said}" in str(err.value), str(err.value)


def test_every_spark_type_name_loads(tmp_path):
    schema = {
        "a": "timestamp_ltz",
        "b": "timestamp_ntz",
        "c": "tinyint",
        "d": "smallint",
        "e": "decimal(38,38)",
        "f": "map<string, array<struct<x: long, `y z`: decimal(10,2)>>>",
        "g": "varchar(10)",
        "h": "real",
    }
    config = load_pipeline(str(write(tmp_path, {**BASE, "format": {"type": "json", "schema": schema}})))
    assert set(config.format.schema_) == set(schema)


def test_transforms_that_can_never_run_and_partitions_the_rows_lack_fail_at_load(tmp_path):
    with pytest.raises(ConfigError, match="transform: .* names a module in a package"):
        load_pipeline(str(write(tmp_path, {**BASE, "transform": "mypkg.tf:fn"})))
    with pytest.raises(ConfigError, match=r"transform: .*missing_module\.py does not exist"):
        load_pipeline(str(write(tmp_path, {**BASE, "transform": "missing_module:fn"})))
    with pytest.raises(ConfigError, match="sink.partition_by: column 'order_date' is not a field of format.schema"):
        load_pipeline(str(write(tmp_path, {**BASE, "sink": {"partition_by": ["order_date"]}})))
    (tmp_path / "tf.py").write_text("def fn(rows):\n    return rows\n")
    config = load_pipeline(str(write(tmp_path, {**BASE, "transform": "tf:fn", "sink": {"partition_by": ["order_date"]}})))
    assert config.transform == "tf:fn", "with a transform, partition columns may be ones it adds"


def test_lake_locations_local_file_uri_and_object_store(tmp_path):
    """``lake:`` and ``sink.table`` take a local path, a ``file://`` URI (decoded to the folder) or an
    object-store URI; storage secrets stay out of the config's repr and shown settings."""
    folder = tmp_path / "my lake"
    as_uri = load_pipeline(str(write(tmp_path, {**BASE, "lake": folder.as_uri()})))
    assert as_uri.lake_path == str(folder) and as_uri.sink_path == str(folder / "orders_x")
    marker = "s3cr3t-STORAGE-42"
    on_s3 = load_pipeline(
        str(
            write(
                tmp_path,
                {
                    **BASE,
                    "lake": "s3://bucket/prefix/",
                    "sink": {"table": "s3://other-bucket/orders"},
                    "storage": {"AWS_REGION": "eu-west-1", "AWS_SECRET_ACCESS_KEY": marker, "AWS_ACCESS_KEY_ID": ""},
                },
            )
        )
    )
    assert on_s3.lake_path == "s3://bucket/prefix" and on_s3.sink_path == "s3://other-bucket/orders"
    assert on_s3.ledger_path.startswith("s3://bucket/prefix/")
    assert marker not in repr(on_s3) and marker not in str(on_s3)
    shown = on_s3.redacted_storage_options()
    assert shown["AWS_SECRET_ACCESS_KEY"] == "***" and shown["AWS_REGION"] == "eu-west-1"
    assert "AWS_ACCESS_KEY_ID" not in shown  # an empty value is unset
    with pytest.raises(ConfigError, match=r"lake: s3://bucket/my%20lake contains '%'"):
        load_pipeline(str(write(tmp_path, {**BASE, "lake": "s3://bucket/my%20lake"})))


def test_model_validate_enforces_the_rules_between_fields_as_loading_does(tmp_path):
    """A config built without a file is as checked as one load_pipeline read (issue 36)."""
    from pydantic import ValidationError

    from offsetlake.config import PipelineConfig

    unknown_column = {**BASE, "sink": {"partition_by": ["region"]}}
    with pytest.raises(ValidationError, match="sink.partition_by: column 'region' is not a field of format.schema"):
        PipelineConfig.model_validate(unknown_column)
    with pytest.raises(ConfigError, match=r"orders_x\.yaml: sink\.partition_by: column 'region' is not a field"):
        load_pipeline(str(write(tmp_path, unknown_column)))
    local_lake_with_storage = {**BASE, "lake": str(tmp_path / "lake"), "storage": {"AWS_REGION": "eu-west-1"}}
    with pytest.raises(ValidationError, match="storage: settings for object storage, but lake .* is a local folder"):
        PipelineConfig.model_validate(local_lake_with_storage)


@pytest.mark.parametrize(
    ("sink", "problem"),
    [
        ({"type": "kafka"}, "a Kafka sink \\(type: kafka\\) needs topic"),
        ({"type": "kafka", "topic": "out", "mode": "upsert", "key": ["order_id"]}, "takes mode append only, not upsert"),
        ({"type": "kafka", "topic": "out", "table": "t"}, "table applies to a Delta sink"),
        ({"type": "kafka", "topic": "no good"}, "topic: 'no good' is not a Kafka topic name"),
        ({"type": "kafka", "topic": "orders"}, "sink.topic: orders is also a source of pipeline orders_x: it would read its own output"),
        ({"type": "kafka", "topic": "out", "dead_letter_topic": "orders"}, "sink.dead_letter_topic: orders is also a source"),
        ({"topic": "out"}, "topic applies to a Kafka sink"),
        ({"type": "kafka", "topic": "out", "data_path": "direct"}, "data_path: a Kafka sink takes auto or spark"),
        ({"format": "json"}, "format applies to a Kafka sink"),
        ({"register": False}, "register applies to a Kafka sink"),
        ({"subject": "s-value"}, "subject applies to a Kafka sink"),
        ({"type": "kafka", "topic": "out", "format": "xml"}, "sink.format: Input should be 'json', 'avro', 'json_schema' or 'protobuf'"),
        ({"type": "kafka", "topic": "out", "subject": "s-value"}, "subject applies to the registry formats .* not to format json"),
        ({"type": "kafka", "topic": "out", "register": False}, "register applies to the registry formats"),
        ({"type": "kafka", "topic": "out", "format": "avro", "schema_registry": {"nope": "x"}}, "schema_registry"),
        # sink.routes: topics in the one transaction
        ({"routes": {"by": "currency", "topics": {"eu": ["EUR"]}}}, "routes applies to a Kafka sink .* with routes: at the top"),
        (
            {"type": "kafka", "topic": "out", "routes": {"by": "region", "topics": {"eu": ["EU"]}}},
            "sink.routes.by: column 'region' is not a field",
        ),
        ({"type": "kafka", "topic": "out", "routes": {"by": "order_id", "topics": {}}}, "topics: name one or more output topics"),
        ({"type": "kafka", "topic": "out", "routes": {"by": "order_id", "topics": {"a b": [1]}}}, "'a b' is not a Kafka topic name"),
        (
            {"type": "kafka", "topic": "out", "routes": {"by": "order_id", "topics": {"a": [1], "b": [1]}}},
            "value '1' is mapped to both a and b",
        ),
        ({"type": "kafka", "topic": "out", "routes": {"by": "order_id", "topics": {"a": []}}}, "topics.a: give the values it takes"),
        (
            {"type": "kafka", "topic": "out", "routes": {"by": "order_id", "topics": {"orders": [1]}}},
            "sink.routes.topics.orders: orders is also a source",
        ),
        ({"type": "kafka", "topic": "out", "routes": {"by": "order_id", "topics": {"out.dead-letters": [1]}}}, "is the dead-letter topic"),
        (
            {"type": "kafka", "topic": "out", "routes": {"by": "topic", "topics": {"a": ["payments"]}}},
            "topic 'payments' is not one the pipeline reads",
        ),
    ],
)
def test_a_kafka_sink_is_checked_with_the_yaml(tmp_path, sink, problem):
    sink = dict(sink)
    top = {"data_path": sink.pop("data_path")} if "data_path" in sink else {}
    with pytest.raises(ConfigError, match=problem):
        load_pipeline(str(write(tmp_path, {**BASE, **top, "sink": sink})))


def test_a_kafka_sinks_registry_settings_come_from_the_file_or_the_connection(tmp_path):
    sink = {"type": "kafka", "topic": "out", "format": "protobuf", "subject": "out-v", "register": False}
    config = load_pipeline(str(write(tmp_path, {**BASE, "sink": sink})))
    assert config.sink.format == "protobuf" and config.sink.subject == "out-v" and config.sink.register_schema is False
    assert config.with_registry_overrides({"url": "http://registry:8081"}).sink.schema_registry == {"url": "http://registry:8081"}


def test_a_kafka_sink_keys_its_records_and_names_its_dead_letter_topic(tmp_path):
    config = load_pipeline(str(write(tmp_path, {**BASE, "sink": {"type": "kafka", "topic": "orders-by-customer", "key": ["order_id"]}})))
    assert config.sink.is_kafka and config.sink.key == ["order_id"] and config.sink.dead_letters_to == "orders-by-customer.dead-letters"


def test_a_kafka_sink_routes_to_topics_in_one_pipeline_and_table_routes_point_there(tmp_path):
    routes = {"by": "order_id", "topics": {"out.low": [1, 2], "out.high": [3]}}
    config = load_pipeline(str(write(tmp_path, {**BASE, "sink": {"type": "kafka", "topic": "out", "routes": routes}})))
    topics = config.sink.output_topics
    assert topics[0] == "out" and sorted(topics[1:]) == ["out.high", "out.low"]  # out takes what no route maps
    assert config.sink.routes.mapping() == {"1": "out.low", "2": "out.low", "3": "out.high"}
    assert config.sink_label == "Kafka topics out, out.high, out.low" and sink_kind(config).output(config) == "out, out.high, out.low"
    table_routes = {"by": "order_id", "tables": {"low": [1]}, "unmapped": "rest"}
    with pytest.raises(ConfigError, match="routes: makes one pipeline per Delta table; a Kafka sink routes .* with sink.routes"):
        load_pipeline(str(write(tmp_path, {**BASE, "routes": table_routes, "sink": {"type": "kafka", "topic": "out"}})))
