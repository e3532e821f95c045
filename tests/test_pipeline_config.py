"""Pipeline YAML: errors name the file and field; env interpolation; secrets never shown."""

from __future__ import annotations

import pytest
import yaml

from offsetlake.config import load_pipeline
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
    body = {**BASE, "kafka": {"bootstrap_servers": "b:9092",
                              "options": {"security.protocol": "SASL_SSL", "sasl.password": marker}}}
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
