"""Errors a user can cause: one readable line naming what is wrong, no traceback, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from offsetlake.embedded.local_broker import free_port


def _no_lake_written(lake: Path) -> None:
    assert not (lake / "_offset_ledger").exists() and not any(lake.glob("p_*")), "a failed start must write nothing"


@pytest.mark.local_lake
def test_unreachable_broker_is_named(pipeline):
    dead = f"127.0.0.1:{free_port()}"
    pipeline.write(kafka={"bootstrap_servers": dead})
    for command in ("run", "status"):
        result = pipeline.cli(command, timeout=120)
        assert result.returncode == 2, result.stderr[-2000:]
        assert f"cannot reach Kafka at {dead}" in result.stderr and pipeline.name in result.stderr
        assert "Traceback" not in result.stderr
    _no_lake_written(pipeline.lake)


@pytest.mark.local_lake
def test_missing_topic_is_named(pipeline):
    pipeline.write(topic=f"{pipeline.topic}_missing")
    result = pipeline.cli("run", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"topic '{pipeline.topic}_missing' is not available" in result.stderr
    assert "Traceback" not in result.stderr
    _no_lake_written(pipeline.lake)


def test_bad_yaml_names_file_and_field(pipeline):
    pipeline.file.write_text(pipeline.file.read_text().replace("max_records_per_batch", "max_records_per_bacth"))
    result = pipeline.cli("run")
    assert result.returncode == 2
    assert str(pipeline.file.resolve()) in result.stderr and "max_records_per_bacth" in result.stderr
    assert "Traceback" not in result.stderr
    pipeline.file.write_text("name: [unclosed\n")
    result = pipeline.cli("status")
    assert result.returncode == 2 and "not valid YAML" in result.stderr and "Traceback" not in result.stderr


def test_an_error_that_is_not_offsetlakes_is_one_line_and_exit_2_not_the_audits_1(pipeline):
    """Found by an adversarial run (issue 15): errors from libraries (a full disk inside a JVM
    stack, ...) ended the CLI with a traceback and exit 1, which means "the audit found problems"."""
    from offsetlake.embedded.sample_data import ensure_topic, produce_orders

    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 10)
    not_a_folder = pipeline.lake.parent / "lake-is-a-file"
    not_a_folder.write_text("not a folder")
    pipeline.write(lake=str(not_a_folder))
    result = pipeline.cli("run", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("offsetlake run: error: unexpected ") and "--log-level DEBUG" in last, last
    assert "Traceback" not in result.stderr


def test_status_says_when_records_were_removed_before_the_pipeline_read_any(pipeline):
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    from offsetlake.embedded.sample_data import ensure_topic, produce_orders

    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 100, partition=0)
    admin = AdminClient({"bootstrap.servers": pipeline.bootstrap})
    for future in admin.delete_records([TopicPartition(pipeline.topic, 0, 100)]).values():
        future.result(30)
    result = pipeline.cli("status")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"note: {pipeline.topic}[0] offsets [0, 100) were removed from Kafka before this pipeline committed" in result.stdout
