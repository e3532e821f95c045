"""Routes (issue 53): one pipeline file's rows into several sink tables, each table a pipeline of
its own (``<file>_<table>``) with its own txns, entries and dead letters.

Checked as a plain reader sees the tables (delta-rs, no filter): each table holds only its values,
every record read is in exactly one table as a row or in the owner's dead letters, after a crash
of one table between its files and its commit, the other table's run, a rerun and a backfill of
one route; ``audit --against-kafka`` of each table passes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, attached, warm_spark_server
from kafka_truth import ledger_rows, read_topic

from offsetlake import failpoints, storage
from offsetlake.config import load_pipeline, pipeline_names
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import ConfigError
from offsetlake.history import sink_commits
from offsetlake.plan import RunContext
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import run_pipeline

SCHEMA = {"order_id": "long", "customer": "string", "amount": "double", "currency": "string", "created_at": "timestamp"}


def _file(folder: Path, name: str, **fields: object) -> Path:
    body = {
        "name": name,
        "topic": "t",
        "kafka": {"bootstrap_servers": "127.0.0.1:9"},
        "lake": str(folder.parent / "lake"),
        "format": {"type": "json", "schema": SCHEMA, "required": ["order_id"]},
        **fields,
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


BY_CURRENCY = {"by": "currency", "tables": {"eur": ["EUR"], "usd": ["USD"]}}


def test_a_routed_file_is_one_pipeline_per_table(tmp_path):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    _file(folder, "orders", routes=BY_CURRENCY)
    _file(folder, "payments")
    assert pipeline_names(folder) == ["orders_eur", "orders_usd", "payments"]
    _file(folder, "refunds", routes={**BY_CURRENCY, "unmapped": "other"})
    assert pipeline_names(folder)[-3:] == ["refunds_eur", "refunds_usd", "refunds_other"]
    eur = load_pipeline("orders_eur", folder)
    assert (eur.name, eur.route, eur.sink_path) == ("orders_eur", "eur", str(tmp_path / "lake" / "orders_eur"))
    assert eur.layout.dead_letters.path.endswith("_dead_letters/orders_eur")
    with pytest.raises(ConfigError, match=r"routes its rows to the tables of pipelines orders_eur, orders_usd.*offsetlake run orders_eur"):
        load_pipeline("orders", folder)
    with pytest.raises(ConfigError, match=r"no pipeline 'orders_gbp'.*known: orders_eur, orders_usd, payments"):
        load_pipeline("orders_gbp", folder)


@pytest.mark.parametrize(
    ("name", "fields", "problem"),
    [
        (
            "orders_eur",
            {"routes": {"by": "currency", "tables": {"eur": ["EUR"], "also": ["EUR"]}}},
            "value 'EUR' is mapped to both eur and also",
        ),
        ("orders_eur", {"routes": {**BY_CURRENCY, "unmapped": "Rest"}}, "tables: 'Rest' is not allowed: a table's name is [a-z0-9_]+"),
        ("orders_eu", {"routes": {"by": "region", "tables": {"eu": ["EU"]}}}, "routes.by: column 'region' is not a field of format.schema"),
        (
            "orders_eur",
            {"routes": BY_CURRENCY, "sink": {"table": "elsewhere"}},
            "sink.table: names one table, and a routed pipeline writes several",
        ),
        ("orders_a", {"routes": {"by": "topic", "tables": {"a": ["t"], "b": ["u"]}}}, "topic 'u' is not one the pipeline reads"),
        (
            "orders_a",
            {"topic": None, "topics": ["t", "u"], "routes": {"by": "topic", "tables": {"a": ["t"]}}},
            "topic 'u' goes to no table",
        ),
        ("orders", {"route": "eur"}, "route: is not a field of the file"),
    ],
)
def test_routes_the_pipeline_cannot_take_are_refused_at_load(tmp_path, name, fields, problem):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    path = _file(folder, "orders", **fields)
    raw = {k: v for k, v in yaml.safe_load(path.read_text()).items() if v is not None}  # "topic": None drops the topic
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError, match=re.escape(problem)):
        load_pipeline(name, folder)


def test_a_table_named_like_another_pipeline_file_is_refused(tmp_path):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    _file(folder, "orders", routes=BY_CURRENCY)
    _file(folder, "orders_usd")
    with pytest.raises(ConfigError, match=r"routes.tables.usd: pipeline orders_usd is also the file"):
        load_pipeline("orders_eur", folder)


def _cli(folder: Path, command: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = attached(command, args, env, cold=False)
    return subprocess.run(
        [sys.executable, "-m", "offsetlake", "--pipelines-dir", str(folder), command, *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
        cwd=ROOT,
    )


def _rows(config) -> list[dict]:
    if not storage.is_table(config.layout.sink):
        return []
    return storage.table(config.layout.sink).to_pyarrow_table().to_pylist()


def _dead(config) -> list[dict]:
    if not storage.is_table(config.layout.dead_letters):
        return []
    return storage.table(config.layout.dead_letters).to_pyarrow_table().to_pylist()


@pytest.mark.also_on_s3
def test_rows_go_to_their_table_once_through_a_crash_a_rerun_and_a_backfill(pipeline, spark):
    """EUR and USD rows to two tables, GBP and INR (mapped to none) and undecodable records to the
    first table's dead letters: each record once across them, as a plain reader sees them."""
    pipeline.write(routes=BY_CURRENCY, max_records_per_batch=600)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_200, malformed_every=97)
    eur, usd = (pipeline.route(t) for t in ("eur", "usd"))

    # usd dies after writing its first batch's files, before its commit: nothing of it is visible
    def crash(_: str) -> None:
        raise failpoints.SimulatedCrash

    with failpoints.on("after_files_written", crash), pytest.raises(failpoints.SimulatedCrash):
        run_pipeline(usd, RunContext("usd-crashed"), lambda: spark)
    assert _rows(usd) == []
    run_pipeline(eur, RunContext("eur"), lambda: spark)
    again = run_pipeline(usd, RunContext("usd-again"), lambda: spark)
    assert len(again) >= 2, "max_records_per_batch=600 splits the 1,200 records into several batches"

    # each decodable record's currency (a record without an order id is a dead letter: "bad")
    truth = read_topic(pipeline.bootstrap, pipeline.topic, order_id=lambda v: (int(json.loads(v)["order_id"]), json.loads(v)["currency"]))
    sources = {(p, o): currency for (p, o), (_, currency) in truth.good.items()}
    currencies = Counter()
    for config, currency in ((eur, "EUR"), (usd, "USD")):
        rows = _rows(config)
        assert rows and {r["currency"] for r in rows} == {currency}, f"{config.name} holds {sorted({r['currency'] for r in rows})}"
        currencies[currency] = len(rows)
    placed = Counter((r["_kafka_partition"], r["_kafka_offset"]) for c in (eur, usd) for r in _rows(c))
    dead = _dead(eur)
    placed.update((d["_kafka_partition"], d["_kafka_offset"]) for d in dead)
    assert _dead(usd) == [], "only the owner (the first table) dead-letters what no table takes"
    assert max(placed.values()) == 1, f"records in two places: {[k for k, n in placed.items() if n > 1][:5]}"
    assert set(placed) == set(sources) | {c for c in truth.bad}, "every record is a row of one table or a dead letter"
    codes = Counter(d["reason_code"] for d in dead)
    assert codes["undecodable"] + codes.get("required_missing", 0) == len(truth.bad)
    unrouted = [d for d in dead if d["reason_code"] == "unrouted"]
    assert len(unrouted) == len(sources) - sum(currencies.values()) > 0
    assert "column 'currency' is 'GBP'" in next(d["reason"] for d in unrouted if b"GBP" in d["value"])

    for config in (eur, usd):
        # the audit decodes and routes the records this table does not hold (Spark): on the warm server
        audit = _cli(pipeline.folder, "audit", "--against-kafka", config.name, env={"OFFSETLAKE_SPARK_REMOTE": warm_spark_server()})
        assert audit.returncode == 0 and "OK" in audit.stdout, audit.stdout + audit.stderr

    # a backfill of one route replaces that table's rows of the range and touches nothing else
    before_eur = (storage.table(eur.layout.sink).version(), sorted(r["order_id"] for r in _rows(eur)))
    before_usd = sorted(r["order_id"] for r in _rows(usd))
    done = _cli(pipeline.folder, "backfill", "--partition", "0", "--from-offset", "0", "--to-offset", "400", usd.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(r["order_id"] for r in _rows(usd)) == before_usd, "the backfill replaced usd's rows of the range with the same rows"
    assert (storage.table(eur.layout.sink).version(), sorted(r["order_id"] for r in _rows(eur))) == before_eur, "eur was not touched"
    kinds = Counter(r["kind"] for r in ledger_rows(usd) if r["status"] == "committed")
    assert kinds["backfill"] == 1 and not any(r["kind"] == "backfill" for r in ledger_rows(eur))

    # a rewind of one route to its first batch: that table holds the batch's rows only, eur keeps
    # everything; the next run of usd brings the rest back once
    first = again[0].plan
    rewind_pipeline(usd, first.batch_id, reason="test: rewind one route")
    ends = {r.partition: r.end for r in first.ranges}
    assert {(r["_kafka_partition"], r["_kafka_offset"]) for r in _rows(usd)} == {
        (p, o) for (p, o), currency in sources.items() if o < ends[p] and currency == "USD"
    }
    assert (storage.table(eur.layout.sink).version(), sorted(r["order_id"] for r in _rows(eur))) == before_eur
    run_pipeline(usd, RunContext("usd-after-rewind"), lambda: spark)
    assert sorted(r["order_id"] for r in _rows(usd)) == before_usd


def test_the_unmapped_table_takes_what_no_other_maps_and_topic_routes_read_their_topics(pipeline, spark):
    second = f"{pipeline.topic}_b"
    pipeline.write(
        topic=None,
        topics=[pipeline.topic, second],
        routes={"by": "topic", "tables": {"a": [pipeline.topic]}, "unmapped": "rest"},
    )
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    ensure_topic(pipeline.bootstrap, second, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 300)
    produce_orders(pipeline.bootstrap, second, 200, first_id=10_000)
    a, rest = (pipeline.route(t) for t in ("a", "rest"))
    assert (a.topics, rest.topics) == ([pipeline.topic], [second])
    for config in (a, rest):
        run_pipeline(config, RunContext(config.name), lambda: spark)
    assert Counter(r["_kafka_topic"] for r in _rows(a)) == {pipeline.topic: 300}
    assert Counter(r["_kafka_topic"] for r in _rows(rest)) == {second: 200}


def test_a_column_routes_unmapped_values_to_the_named_table_and_the_read_tasks_route_as_spark_does(pipeline, spark, tmp_path):
    routes = {"by": "currency", "tables": {"eur": ["EUR"]}, "unmapped": "other"}  # other: a table of its own
    pipeline.write(routes=routes)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    # two malformed records: the read tasks settle the other records and leave those two to
    # Spark, so both paths route rows
    produce_orders(pipeline.bootstrap, pipeline.topic, 400, malformed_every=200)
    eur, other = (pipeline.route(t) for t in ("eur", "other"))
    for config in (eur, other):
        run_pipeline(config, RunContext(config.name), lambda: spark)
    assert {r["currency"] for r in _rows(eur)} == {"EUR"}
    assert {r["currency"] for r in _rows(other)} == {"USD", "GBP", "INR"}
    assert _dead(eur) == [] and len(_dead(other)) == 400 // 200, "the unmapped table owns the undecodable records"
    assert len(_rows(eur)) + len(_rows(other)) + len(_dead(other)) == 400
    assert os.path.basename(other.sink_path) == f"{pipeline.name}_other"

    # a string column is routed in the read tasks (the direct path), and the tables are those
    # the Spark path makes of the same records
    for config in (eur, other):
        assert {c.entry.data_path for c in sink_commits(storage.table(config.layout.sink), config.name)} == {"direct"}
    pipeline.write(routes=routes, data_path="spark", lake=str(tmp_path / "lake_spark"))
    in_spark = [pipeline.route(t) for t in ("eur", "other")]
    for config in in_spark:
        run_pipeline(config, RunContext(f"{config.name}-spark"), lambda: spark)
        assert {c.entry.data_path for c in sink_commits(storage.table(config.layout.sink), config.name)} == {"spark"}

    def placed(config) -> tuple[list, list]:
        rows = sorted((r["_kafka_partition"], r["_kafka_offset"], r["order_id"], r["currency"], r["amount"]) for r in _rows(config))
        return rows, sorted((d["_kafka_partition"], d["_kafka_offset"], d["reason_code"]) for d in _dead(config))

    assert [placed(c) for c in (eur, other)] == [placed(c) for c in in_spark]


def test_a_keyed_sink_routes_each_key_to_its_table_and_a_tombstone_deletes_it_wherever_it_is(pipeline, spark):
    """Upsert by the record key, routed by currency (a key keeps its currency): each table holds the
    newest row of its keys only; a tombstone (no currency) reaches every table and deletes the key."""
    import random

    from confluent_kafka import Producer
    from kafka_truth import read_records, replay_by_key

    from offsetlake.audit import audit_pipeline

    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    pipeline.write(routes=BY_CURRENCY, max_records_per_batch=300, sink={"mode": "upsert", "key": ["_kafka_key"]})
    rng = random.Random(53)
    producer = Producer({"bootstrap.servers": pipeline.bootstrap, "linger.ms": 5})
    currency = {k: ("EUR", "USD", "GBP")[k % 3] for k in range(60)}
    for i in range(400):
        k = rng.randrange(60)
        value = None if rng.random() < 0.1 else json.dumps({"order_id": i, "currency": currency[k], "amount": float(i)}).encode()
        producer.produce(pipeline.topic, key=f"k{k}".encode(), value=value, partition=k % 2)
    assert producer.flush(30) == 0
    eur, usd = (pipeline.route(t) for t in ("eur", "usd"))
    for config in (eur, usd):
        run_pipeline(config, RunContext(config.name), lambda: spark)

    newest = replay_by_key(
        read_records(pipeline.bootstrap, pipeline.topic),
        key_of=lambda r: r.key.decode(),
        row_of=lambda r: None if r.value is None else json.loads(r.value),
    )
    for config, wanted in ((eur, "EUR"), (usd, "USD")):
        rows = {r["_kafka_key"]: r for r in _rows(config)}
        expected = {k: row for k, row in newest.items() if row["currency"] == wanted}
        assert set(rows) == set(expected), f"{config.name}: {sorted(set(rows) ^ set(expected))[:10]}"
        assert all(rows[k]["order_id"] == row["order_id"] for k, row in expected.items())
        report = audit_pipeline(config, against_kafka=True)
        assert report.ok, report.text()
    unrouted = [d for d in _dead(eur) if d["reason_code"] == "unrouted"]
    assert unrouted and all(b"GBP" in d["value"] for d in unrouted)
