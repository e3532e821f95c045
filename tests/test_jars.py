"""The pinned jars: the lock names what the issue asks for, in versions that match pyspark, and
``make setup``'s resolver refuses a folder whose files differ from the lock."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pyspark
import pytest
from conftest import ROOT

from offsetlake import jars


def test_the_lock_pins_delta_spark_kafka_source_and_broker_for_this_pyspark() -> None:
    locked = {(j.set, j.group, j.artifact): j.version for j in jars.read_lock()}
    spark_minor = ".".join(pyspark.__version__.split(".")[:2])
    assert locked[("spark", "io.delta", f"delta-spark_{spark_minor}_2.13")]
    assert locked[("spark", "org.apache.spark", "spark-sql-kafka-0-10_2.13")] == pyspark.__version__
    assert locked[("spark", "org.apache.spark", "spark-avro_2.13")] == pyspark.__version__
    assert locked[("kafka", "org.apache.kafka", "kafka_2.13")].startswith("4.")
    assert all(len(j.sha256) == 64 for j in jars.read_lock())


def test_a_malformed_lock_line_is_named(tmp_path) -> None:
    lock = tmp_path / "jars.lock"
    lock.write_text("# comment\nspark io.delta:delta-spark_4.2_2.13 0123\n")
    with pytest.raises(jars.OffsetlakeError, match=r"jars.lock:2: expected"):
        jars.read_lock(lock)


def test_a_session_without_resolved_jars_says_to_run_make_setup(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OFFSETLAKE_JARS", str(tmp_path))
    with pytest.raises(jars.JarsMissingError, match=r"run `make setup`"):
        jars.spark_jars()


@pytest.mark.slow
def test_the_resolver_checks_every_checksum_offline(tmp_path) -> None:
    resolver = [sys.executable, str(ROOT / "scripts" / "resolve_jars.py"), "--offline"]
    copy = tmp_path / "jars"
    shutil.copytree(jars.folder("spark"), copy / "spark")
    shutil.copytree(jars.folder("kafka"), copy / "kafka")
    env = {"OFFSETLAKE_JARS": str(copy), "PATH": "/usr/bin:/bin"}
    (copy / "spark").chmod(0o700)  # as an older resolver left it: an image's service user could not read it
    done = subprocess.run(resolver, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert (copy / "spark").stat().st_mode & 0o777 == 0o755

    tampered = next(j for j in jars.read_lock() if j.artifact.startswith("delta-spark"))
    with open(copy / "spark" / tampered.file_name, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    done = subprocess.run(resolver, capture_output=True, text=True, env=env)
    assert done.returncode == 2
    assert tampered.file_name in done.stderr and "SHA-256" in done.stderr and "make setup" in done.stderr
