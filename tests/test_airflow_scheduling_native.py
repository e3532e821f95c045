"""Airflow's own features on offsetlake's DAGs, on a real Airflow (api-server, scheduler,
dag-processor, triggerer; SQLite, LocalExecutor):

- the built-in Backfill (``POST /api/v2/backfills``) on ``<pipeline>_ingest`` replaces exactly the
  rows whose record time falls in each run's data interval, never moves the txn versions, repeats
  as a no-op, and an interval without records succeeds doing nothing;
- every committed batch is one event on the sink asset, which the README's downstream example
  DAG (``examples/downstream_on_sink_asset.py``) receives with the batch's facts; a run that
  committed nothing emits none;
- OpenLineage events (the provider's file transport) name the topic and the table, with the rows;
- ``schedule: on_new_data``: records wake the ingest through the Kafka message-queue trigger and a
  burst of 10,000 records costs at most two runs, exactly once.

Assertions use independent reads: a plain consumer for record timestamps and offsets_for_times,
plain delta-rs for the sink and the ledger.
"""

from __future__ import annotations

import json
import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from kafka_truth import assert_exactly_once, last_stable_offsets, ledger_rows, read_topic

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders

ROOT = Path(__file__).resolve().parent.parent
KEEP_OLD_RECORDS = {"retention.ms": "-1"}  # records stamped days ago must survive time-based retention
TAG = """
from pyspark.sql import functions as F


def tag(rows):
    return rows.withColumn("tag", F.lit("reprocessed"))
"""


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _runs(airflow, dag_id: str) -> list[dict]:
    return airflow.api("GET", f"/dags/{dag_id}/dagRuns?order_by=id&limit=100")["dag_runs"]


def _wait(what: str, check, timeout_s: float = 300, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _finished(airflow, dag_id: str, count: int, timeout_s: float = 600) -> list[dict]:
    """The DAG's runs once at least ``count`` exist and none is still queued or running."""

    def done() -> list[dict] | None:
        runs = _runs(airflow, dag_id)
        return runs if len(runs) >= count and all(r["state"] in ("success", "failed") for r in runs) else None

    return _wait(f"{count} finished runs of {dag_id}", done, timeout_s)


def _record_times(bootstrap: str, topic: str) -> dict[tuple[int, int], int]:
    """(partition, offset) -> record timestamp (ms) of every committed record, read with a plain consumer."""
    lso = last_stable_offsets(bootstrap, topic)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"times-{time.time_ns()}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in lso])
    times: dict[tuple[int, int], int] = {}
    deadline = time.monotonic() + 60
    while sum(1 for (p, o) in times if o < lso[p]) < sum(lso.values()) and time.monotonic() < deadline:
        message = consumer.poll(1)
        if message is not None and not message.error():
            times[(message.partition(), message.offset())] = message.timestamp()[1]
    consumer.close()
    return times


def _offsets_for_time(bootstrap: str, topic: str, partitions: list[int], at_ms: int) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"oft-{time.time_ns()}"})
    found = consumer.offsets_for_times([TopicPartition(topic, p, at_ms) for p in partitions], timeout=30)
    consumer.close()
    return {tp.partition: tp.offset for tp in found}


def _tagged(config) -> set[tuple[int, int]]:
    data = storage.table(config.layout.sink).to_pyarrow_dataset().to_table(columns=["_kafka_partition", "_kafka_offset", "tag"]).to_pylist()
    return {(r["_kafka_partition"], r["_kafka_offset"]) for r in data if r["tag"] == "reprocessed"}


def _ends(config, partitions) -> dict[int, int | None]:
    table = storage.table(config.layout.sink)
    return {p: table.transaction_version(config.app_id(config.topic, p)) for p in partitions}


def _downstream_extras(airflow, dag_id: str) -> list[dict]:
    """The batch facts every successful downstream run received, in run order."""
    extras = []
    for run in _runs(airflow, dag_id):
        if run["state"] == "success":
            xcom = airflow.api(
                "GET", f"/dags/{dag_id}/dagRuns/{run['dag_run_id']}/taskInstances/new_batches/xcomEntries/return_value?deserialize=true"
            )
            value = xcom["value"]
            extras += json.loads(value) if isinstance(value, str) else value
    return extras


def _table_uri(location: str) -> str:
    """The sink's URI as written in the test: object storage as given, a local folder as file://."""
    return location.rstrip("/") if storage.is_uri(location) else Path(location).resolve().as_uri()


def _dataset_name(location: str) -> tuple[str, str]:
    """OpenLineage's naming: (file, path) locally, (s3://bucket, key) on object storage."""
    if storage.is_uri(location):
        parts = urlsplit(location)
        return f"{parts.scheme}://{parts.netloc}", parts.path.strip("/")
    return "file", str(Path(location).resolve())


def _at_least(count: int, found: list) -> list | None:
    return found if len(found) >= count else None


def _lineage(airflow, job: str) -> list[dict]:
    if not airflow.lineage_file.exists():
        return []
    events = [json.loads(line) for line in airflow.lineage_file.read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("eventType") == "COMPLETE" and e["job"]["name"] == job]


def test_backfill_button_assets_and_lineage(running_airflow, pipeline):
    airflow = running_airflow
    name, topic, bootstrap = pipeline.name, pipeline.topic, pipeline.bootstrap
    ingest, downstream = f"{name}_ingest", f"{name}_downstream"
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    day = {d: today - timedelta(days=d) for d in range(1, 8)}

    # 30 records on each of four past days, on two partitions, and one late record stamped
    # 5 days ago that arrives after the rest: record times need not grow with offsets
    ensure_topic(bootstrap, topic, 2, config=KEEP_OLD_RECORDS)
    producer = Producer({"bootstrap.servers": bootstrap})
    order_id = 0
    for d in (6, 5, 4, 3):
        for i in range(30):
            producer.produce(
                topic,
                json.dumps({"order_id": order_id, "customer": f"c{i}"}).encode(),
                partition=i % 2,
                timestamp=_ms(day[d] + timedelta(minutes=40 * i)),
            )
            order_id += 1
    producer.produce(
        topic, json.dumps({"order_id": order_id, "customer": "late"}).encode(), partition=0, timestamp=_ms(day[5] + timedelta(hours=12))
    )
    assert producer.flush(30) == 0
    total = order_id + 1

    config = pipeline.write(schedule="@daily")
    example = (ROOT / "examples" / "downstream_on_sink_asset.py").read_text()
    assert 'PIPELINE = "orders"' in example
    (airflow.dags_folder / f"{downstream}.py").write_text(example.replace('PIPELINE = "orders"', f'PIPELINE = "{name}"'))
    shutil.copy(pipeline.file, airflow.pipelines / pipeline.file.name)
    airflow.wait_for_dag(downstream)
    airflow.wait_for_dag(ingest)  # unpaused: the scheduler runs the latest complete interval

    # 1. the scheduled run ingests everything and announces its batch
    [scheduled] = _finished(airflow, ingest, 1)
    assert (scheduled["run_type"], scheduled["state"]) == ("scheduled", "success"), scheduled
    assert_exactly_once(config, read_topic(bootstrap, topic))
    ends = _ends(config, [0, 1])
    assert sum(ends.values()) == total
    [first] = {r["batch_id"] for r in ledger_rows(config) if r["run_id"] == scheduled["dag_run_id"] and r["status"] == "committed"}
    [event] = _wait("the downstream run of the first batch", lambda: _downstream_extras(airflow, downstream))
    assert (event["batch_id"], event["kind"], event["rows"], event["records"]) == (first, "ingest", total, total)
    assert event["sink_version"] == storage.table(config.layout.sink).version() and event["validation"] == "no suite"
    assert sorted(event["ranges"]) == sorted(f"{topic}[{p}] [0, {ends[p]})" for p in (0, 1))
    assert event["table"] == _table_uri(config.sink_path)

    # 2. Airflow's Backfill of two past days: each run replaces the rows of its day, through a
    #    transform that tags what it reprocesses
    for folder in (pipeline.folder, airflow.pipelines):
        (folder / "tag_transform.py").write_text(TAG)
    tagged_config = pipeline.write(schedule="@daily", transform="tag_transform:tag")
    shutil.copy(pipeline.file, airflow.pipelines / pipeline.file.name)
    backfill = airflow.api(
        "POST",
        "/backfills",
        {
            "dag_id": ingest,
            "from_date": _iso(day[5]),
            "to_date": _iso(day[4]),
            "reprocess_behavior": "none",
            "max_active_runs": 1,
            "run_backwards": False,
            "dag_run_conf": {},
        },
    )
    _wait("the backfill to complete", lambda: airflow.api("GET", f"/backfills/{backfill['id']}")["completed_at"])
    runs = [r for r in _finished(airflow, ingest, 3) if r["run_type"] == "backfill"]
    assert [(r["state"], r["data_interval_start"][:10]) for r in runs] == [
        ("success", day[5].date().isoformat()),
        ("success", day[4].date().isoformat()),
    ], runs
    times = _record_times(bootstrap, topic)
    in_window = {coords for coords, ms in times.items() if _ms(day[5]) <= ms < _ms(day[3])}
    assert len(in_window) == 61  # 2 days x 30 + the late record
    version_after = storage.table(config.layout.sink).version()
    assert _tagged(tagged_config) == in_window, "exactly the records stamped in the two intervals are reprocessed"
    assert _ends(config, [0, 1]) == ends, "a backfill never moves the txn versions"
    assert_exactly_once(config, read_topic(bootstrap, topic))
    for run, start in zip(runs, (day[5], day[4]), strict=True):
        mine = [r for r in ledger_rows(config) if r["run_id"] == run["dag_run_id"] and r["status"] == "committed"]
        assert mine and {r["kind"] for r in mine} == {"backfill"}
        expected_starts = _offsets_for_time(bootstrap, topic, [0, 1], _ms(start))
        assert {r["partition"]: (r["start_offset"], r["end_offset"]) for r in mine} == {p: (expected_starts[p], ends[p]) for p in (0, 1)}, (
            "from offsets_for_times(interval start) to the committed end"
        )
        stamped = {c for c, ms in times.items() if _ms(start) <= ms < _ms(start + timedelta(days=1))}
        assert sum(r["rows_written"] for r in mine) == len(stamped)
    backfill_batches = {
        r["batch_id"] for run in runs for r in ledger_rows(config) if r["run_id"] == run["dag_run_id"] and r["status"] == "committed"
    }
    extras = _wait("the downstream runs of the two backfill batches", lambda: _at_least(3, _downstream_extras(airflow, downstream)))
    assert sorted(e["batch_id"] for e in extras) == sorted([first, *backfill_batches]), extras
    assert {e["kind"] for e in extras if e["batch_id"] in backfill_batches} == {"backfill"}

    # lineage of the ingest task: the topic in, the table out, with the rows of each batch
    events = _lineage(airflow, f"{ingest}.ingest")
    by_batch = {}
    for e in events:
        [out] = e["outputs"]
        by_batch[tuple(out["facets"]["offsetlake_batch"]["batches"])] = (e, out)
    for batch_id in (first, *backfill_batches):
        e, out = by_batch[(batch_id,)]
        assert [(i["namespace"], i["name"]) for i in e["inputs"]] == [(f"kafka://{bootstrap}", topic)]
        assert (out["namespace"], out["name"]) == _dataset_name(config.sink_path)
        rows = sum(r["rows_written"] for r in ledger_rows(config) if r["batch_id"] == batch_id and r["status"] == "committed")
        assert out["outputFacets"]["outputStatistics"]["rowCount"] == rows > 0
        assert {f["name"] for f in out["facets"]["schema"]["fields"]} >= {"order_id", "_kafka_offset"}

    # 3. the same Backfill again, reprocessing the completed runs: nothing changes, no new event
    again = airflow.api(
        "POST",
        "/backfills",
        {
            "dag_id": ingest,
            "from_date": _iso(day[5]),
            "to_date": _iso(day[4]),
            "reprocess_behavior": "completed",
            "max_active_runs": 1,
            "run_backwards": False,
            "dag_run_conf": {},
        },
    )
    _wait("the repeated backfill to complete", lambda: airflow.api("GET", f"/backfills/{again['id']}")["completed_at"])
    assert all(r["state"] == "success" for r in _finished(airflow, ingest, 3))
    assert storage.table(config.layout.sink).version() == version_after, "the repeat committed nothing"
    assert _tagged(tagged_config) == in_window and _ends(config, [0, 1]) == ends

    # 4. an interval in which no record falls: the run succeeds, skips the ingest, emits nothing
    empty = airflow.api(
        "POST",
        "/backfills",
        {
            "dag_id": ingest,
            "from_date": _iso(day[2]),
            "to_date": _iso(day[2]),
            "reprocess_behavior": "none",
            "max_active_runs": 1,
            "run_backwards": False,
            "dag_run_conf": {},
        },
    )
    _wait("the empty backfill to complete", lambda: airflow.api("GET", f"/backfills/{empty['id']}")["completed_at"])
    [noop] = [r for r in _finished(airflow, ingest, 4) if r["data_interval_start"][:10] == day[2].date().isoformat()]
    assert noop["state"] == "success"
    assert airflow.task_states(ingest, noop["dag_run_id"])["ingest"][0] == "skipped"
    assert not [r for r in ledger_rows(config) if r["run_id"] == noop["dag_run_id"]]
    assert storage.table(config.layout.sink).version() == version_after

    # 5. a run afterwards continues from the committed ends, and is announced
    produce_orders(bootstrap, topic, 40, first_id=10_000)
    after = airflow.trigger(ingest)
    assert airflow.wait_for_run(ingest, after) == "success"
    assert sum(_ends(config, [0, 1]).values()) == total + 40
    assert_exactly_once(config, read_topic(bootstrap, topic))
    extras = _wait("the downstream run of the last batch", lambda: _at_least(4, _downstream_extras(airflow, downstream)))
    ids = [e["batch_id"] for e in extras]
    assert len(ids) == len(set(ids)) == 4, "one event per committed batch, none for the repeat or the empty interval"
    assert extras[-1]["kind"] == "ingest" and extras[-1]["rows"] == 40
    caught_up = airflow.trigger(ingest)  # nothing new: the run succeeds, commits nothing, announces nothing
    assert airflow.wait_for_run(ingest, caught_up) == "success"
    assert airflow.task_states(ingest, caught_up)["publish"][0] == "skipped"

    # 6. a stream that ends by itself announces each micro-batch it committed, and reports lineage
    produce_orders(bootstrap, topic, 60, first_id=20_000)
    airflow.wait_for_dag(f"{name}_stream")  # unpaused
    stream = airflow.trigger(f"{name}_stream", {"trigger_interval": "2s", "max_duration_minutes": 0.25})  # 15 s: a fraction of a minute
    assert airflow.wait_for_run(f"{name}_stream", stream, timeout_s=300) == "success"
    mine = {r["batch_id"] for r in ledger_rows(config) if r["run_id"] == stream and r["status"] == "committed"}
    assert mine, "the stream committed the 60 records"
    assert sum(_ends(config, [0, 1]).values()) == total + 100
    extras = _wait("the downstream runs of the stream's batches", lambda: _at_least(4 + len(mine), _downstream_extras(airflow, downstream)))
    assert len(extras) == 4 + len(mine), "no event for the caught-up run"
    streamed = [e for e in extras if e["kind"] == "stream"]
    assert sorted(e["batch_id"] for e in streamed) == sorted(mine) and sum(e["rows"] for e in streamed) == 60
    [stream_lineage] = _lineage(airflow, f"{name}_stream.stream")
    [out] = stream_lineage["outputs"]
    assert sorted(out["facets"]["offsetlake_batch"]["batches"]) == sorted(mine)
    assert out["outputFacets"]["outputStatistics"]["rowCount"] == 60


@pytest.mark.torture
def test_on_new_data_wakes_the_ingest_and_a_burst_costs_at_most_two_runs(running_airflow, pipeline):
    """Asset-driven scheduling: new records wake the ingest; a burst costs at most two runs.

    In ``make torture`` (about 70 s on CI's machine): ``make test`` covers the ingest DAG's runs
    with the Backfill-button test here and tests/test_airflow_rerun_after_failure.py."""
    airflow = running_airflow
    name, topic, bootstrap = pipeline.name, pipeline.topic, pipeline.bootstrap
    ingest = f"{name}_ingest"
    ensure_topic(bootstrap, topic, 3)
    airflow.api(
        "POST",
        "/connections",
        {
            "connection_id": f"kafka_{name}",
            "conn_type": "kafka",
            "extra": json.dumps(
                {
                    "bootstrap.servers": bootstrap,
                    "group.id": f"{name}-wake",
                    "auto.offset.reset": "earliest",
                    "isolation.level": "read_committed",
                }
            ),
        },
    )
    config = pipeline.write(schedule="on_new_data")
    shutil.copy(pipeline.file, airflow.pipelines / pipeline.file.name)
    airflow.wait_for_dag(ingest)
    assert _runs(airflow, ingest) == [], "nothing produced: nothing runs"

    # the first records wake the first run (the trigger may still be starting)
    produce_orders(bootstrap, topic, 10)
    _wait("the first woken run", lambda: _runs(airflow, ingest), timeout_s=180, every_s=1)
    _wait(
        "the sink to hold the 10 records",
        lambda: storage.is_table(config.layout.sink) and sum(v or 0 for v in _ends(config, [0, 1, 2]).values()) == 10,
    )
    time.sleep(15)  # a wake-up still queued from the first records runs (and skips) before the burst
    first_runs = _finished(airflow, ingest, 1)
    assert {r["run_type"] for r in first_runs} == {"asset_triggered"} and len(first_runs) <= 2, first_runs

    # a burst of 10,000: woken within seconds, at most two runs, exactly once
    before = len(first_runs)
    produced_at = time.monotonic()
    produce_orders(bootstrap, topic, 10_000, first_id=1_000)
    _wait("a run woken by the burst", lambda: len(_runs(airflow, ingest)) > before, timeout_s=120, every_s=0.5)
    woken_after_s = time.monotonic() - produced_at
    lso = last_stable_offsets(bootstrap, topic)
    _wait("the sink to catch up with the burst", lambda: _ends(config, [0, 1, 2]) == lso, timeout_s=600)
    time.sleep(20)  # any late wake-up would queue its run by now
    runs = _finished(airflow, ingest, before + 1)
    burst_runs = runs[before:]
    print(f"woken {woken_after_s:.1f}s after the burst; {len(burst_runs)} runs: {[(r['run_type'], r['state']) for r in burst_runs]}")
    assert woken_after_s < 60
    assert 1 <= len(burst_runs) <= 2 and all(r["state"] == "success" for r in burst_runs), burst_runs
    assert_exactly_once(config, read_topic(bootstrap, topic))
