"""The Airflow UI "Offset ledger" view and its JSON API, on a real Airflow with the plugin loaded.

One Airflow (api-server, scheduler, dag-processor on SQLite) serves both tests. The ledger gets
its rows the way runs make them, in-process on the shared Spark session while Airflow starts:
two CLI-style batches with dead letters, a gap (records deleted under `on_offsets_lost: skip`)
and a batch planned for a dag run (what the DAG's plan task records), then a batch that fails
its expectation suite; more records after that leave lag. The API's numbers are checked against
the broker's last stable offsets and a plain delta-rs read of the ledger, not against offsetlake.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from conftest import Pipeline
from kafka_truth import last_stable_offsets, ledger_rows

from offsetlake import storage
from offsetlake.config import PipelineConfig
from offsetlake.embedded.sample_data import ensure_topic, produce_orders

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

DAG_RUN_ID = "manual__2026-11-22T08:00:00.123456+00:00"
GAP_OFFSETS = 50
NULL_EVERY = 30


@dataclass
class Scene:
    airflow: object  # scripts/local_airflow.LocalAirflow
    config: PipelineConfig  # with the broker the Airflow connection names
    failed_batch: str
    dag_batch: str
    gap_start: int


def _delete_before(bootstrap: str, topic: str, partition: int, offset: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_records([TopicPartition(topic, partition, offset)]).values():
        future.result(30)


def _make_ledger(pipeline: Pipeline, spark) -> tuple[PipelineConfig, str, str, int]:
    from offsetlake.errors import ValidationFailedError
    from offsetlake.plan import RunContext
    from offsetlake.runs import execute_recorded_batch, plan_for_dag_run, run_pipeline

    def config(**overrides: object) -> PipelineConfig:
        # The YAML names a dead broker: the plugin only finds Kafka through the Airflow connection.
        return pipeline.write(
            kafka={"bootstrap_servers": "127.0.0.1:1"}, schedule=None, max_records_per_batch=1_200, **overrides
        ).with_kafka_overrides(pipeline.bootstrap, {})

    bootstrap, topic = pipeline.bootstrap, pipeline.topic
    ensure_topic(bootstrap, topic, 3)
    next_id = produce_orders(bootstrap, topic, 2_400, malformed_every=301)
    cli = config()
    assert len(run_pipeline(cli, RunContext("cli-ledger-view-1"), lambda: spark)) == 2

    next_id = produce_orders(bootstrap, topic, 600, first_id=next_id)
    gap_start = storage.table(cli.layout.sink).transaction_version(cli.app_id(topic, 0))
    _delete_before(bootstrap, topic, 0, gap_start + GAP_OFFSETS)
    skip = config(on_offsets_lost="skip")
    plan = plan_for_dag_run(skip, RunContext(DAG_RUN_ID, "orders_ingest", 1))  # records the gap, then plans
    assert execute_recorded_batch(skip, plan.batch_id, lambda: spark).status == "committed"

    suite = {"expectations": [{"expect_column_values_to_not_be_null": {"column": "customer"}}]}
    (pipeline.folder / "orders.expectations.yaml").write_text(yaml.safe_dump(suite))
    next_id = produce_orders(bootstrap, topic, 300, first_id=next_id, null_customer_every=NULL_EVERY)
    with pytest.raises(ValidationFailedError):
        run_pipeline(skip, RunContext("cli-ledger-view-bad"), lambda: spark)
    failed = next(r["batch_id"] for r in ledger_rows(skip) if r["status"] == "failed")
    produce_orders(bootstrap, topic, 900, first_id=next_id)  # lag beyond the failed batch
    return skip, failed, plan.batch_id, gap_start


@pytest.fixture(scope="module")
def scene(broker, spark, tmp_path_factory: pytest.TempPathFactory):
    from local_airflow import LocalAirflow

    from offsetlake.embedded.local_broker import free_port

    folder = tmp_path_factory.mktemp("ledger_view")
    (folder / "pipelines").mkdir()
    pipeline = Pipeline(
        name="orders", topic=f"orders_{uuid.uuid4().hex[:8]}", folder=folder / "pipelines", lake=folder / "lake", bootstrap=broker.bootstrap
    )
    host, port = broker.bootstrap.rsplit(":", 1)
    airflow = LocalAirflow(
        folder / "airflow_home",
        free_port(),
        extra_env={
            "OFFSETLAKE_PIPELINES_DIR": str(pipeline.folder),
            "OFFSETLAKE_DISABLE_SCHEDULES": "1",
            "AIRFLOW_CONN_KAFKA_ORDERS": json.dumps({"conn_type": "generic", "host": host, "port": int(port)}),
        },
    )
    # Airflow starts (migrate, three services) while Spark writes the ledger: both take a while.
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(airflow.start)
        try:
            config, failed, dag_batch, gap_start = _make_ledger(pipeline, spark)
        finally:
            try:
                started.result()
            except Exception:
                airflow.stop()
                raise
    try:
        yield Scene(airflow, config, failed, dag_batch, gap_start)
    finally:
        airflow.stop()


def _get(airflow, path: str, token: str | None = None) -> tuple[int, str, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{airflow.url}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read()


def _expected(config: PipelineConfig) -> dict:
    """Lag and committed ends from the broker and a plain delta-rs read of the ledger."""
    rows = ledger_rows(config)
    done = [r for r in rows if r["status"] in ("committed", "gap")]
    ends = {
        p: max((r["end_offset"] for r in done if r["partition"] == p and r["kind"] in ("ingest", "gap")), default=None) for p in range(3)
    }
    lso = last_stable_offsets(config.kafka.bootstrap_servers, config.topic)
    return {
        "rows": rows,
        "ends": ends,
        "lso": lso,
        "lag": {p: lso[p] - ends[p] for p in lso},
        "last_commit": max(r["recorded_at"] for r in done),
    }


def test_plugin_api_answers_only_with_airflow_credentials(scene):
    airflow = scene.airflow
    for path in (
        "/offsetlake/api/pipelines",
        "/offsetlake/api/pipelines/orders",
        "/offsetlake/ledger",
        "/offsetlake/ledger/orders",
        f"/offsetlake/ledger/orders/reports/{scene.failed_batch}",
    ):
        status, _, body = _get(airflow, path)
        assert status == 401, (path, status, body[:300])
        assert scene.config.topic.encode() not in body and b"data-batch-id" not in body, path  # no ledger data leaks
    status, _, _ = _get(airflow, "/offsetlake/api/pipelines", token="not-a-jwt")
    assert status == 403  # Airflow's answer to an invalid token
    token = airflow.token()
    status, kind, body = _get(airflow, "/offsetlake/api/pipelines", token)
    assert status == 200 and kind.startswith("application/json"), body[:300]
    status, kind, body = _get(airflow, "/offsetlake/ledger", token)
    assert status == 200 and kind.startswith("text/html") and b'data-pipeline="orders"' in body
    status, _, _ = _get(airflow, "/offsetlake/api/pipelines/no_such_pipeline", token)
    assert status == 404
    # the nav entry the UI embeds at /plugin/offsetlake-ledger
    plugins = airflow.api("GET", "/plugins")["plugins"]
    mine = next(p for p in plugins if p["name"] == "offsetlake_ledger_view")
    assert [(v["url_route"], v["href"]) for v in mine["external_views"]] == [("offsetlake-ledger", "/offsetlake/ledger")]
    assert [a["url_prefix"] for a in mine["fastapi_apps"]] == ["/offsetlake"]


def test_plugin_api_numbers_match_kafka_and_the_ledger(scene):
    airflow, config = scene.airflow, scene.config
    expected = _expected(config)
    token = airflow.token()

    status, _, body = _get(airflow, "/offsetlake/api/pipelines", token)
    assert status == 200, body[:500]
    listed = {p["pipeline"]: p for p in json.loads(body)["pipelines"]}
    assert set(listed) == {"orders"}
    orders = listed["orders"]
    assert orders["kafka_error"] is None and orders["error"] is None
    assert orders["total_lag"] == sum(expected["lag"].values()) > 0
    assert datetime.fromisoformat(orders["last_commit_at"]) == expected["last_commit"]
    assert orders["last_batch"]["batch_id"] == scene.failed_batch
    assert (orders["last_batch"]["status"], orders["last_batch"]["validation"]) == ("failed", "failed")

    status, _, body = _get(airflow, "/offsetlake/api/pipelines/orders?limit=0", token)
    assert status == 200, body[:500]
    detail = json.loads(body)
    assert detail["total_lag"] == orders["total_lag"]
    assert detail["sink_mode"] == config.sink.mode
    by_partition = {p["partition"]: p for p in detail["partitions"]}
    assert set(by_partition) == {0, 1, 2}
    for p, row in by_partition.items():
        assert row["committed_end"] == expected["ends"][p], p
        assert row["last_stable"] == expected["lso"][p], p
        assert row["lag"] == expected["lag"][p], p

    rows = expected["rows"]
    batches = {b["batch_id"]: b for b in detail["batches"]}
    assert set(batches) == {r["batch_id"] for r in rows} and detail["batch_count"] == len(batches)
    committed = {r["batch_id"] for r in rows if r["status"] == "committed"}
    assert len(committed) == 3 and scene.dag_batch in committed
    for batch_id in committed:
        mine = [r for r in rows if r["batch_id"] == batch_id and r["status"] == "committed"]
        batch = batches[batch_id]
        assert batch["status"] == "committed"
        assert batch["sink_version"] == mine[0]["sink_version"] is not None
        assert batch["rows_written"] == sum(r["rows_written"] for r in mine)
        assert batch["dead_letters"] == sum(r["dead_letters"] for r in mine)
        assert sorted((r["partition"], r["start"], r["end"]) for r in batch["ranges"]) == sorted(
            (r["partition"], r["start_offset"], r["end_offset"]) for r in mine
        )
        assert batch["airflow_run_url"] == (
            f"/dags/orders_ingest/runs/{quote(DAG_RUN_ID, safe='')}" if batch_id == scene.dag_batch else None
        )
    ingest = [batches[b] for b in committed]
    assert sum(b["rows_written"] for b in ingest) == storage.table(config.layout.sink).count()
    assert sum(b["dead_letters"] for b in ingest) == storage.table(config.layout.dead_letters).count() > 0

    failed = batches[scene.failed_batch]
    assert failed["status"] == "failed" and failed["sink_version"] is None and failed["airflow_run_url"] is None
    assert failed["validation"]["outcome"] == "failed"
    [why] = failed["validation"]["failures"]
    assert why["expectation"].startswith("expect_column_values_to_not_be_null")
    assert why["unexpected_count"] == 300 // NULL_EVERY
    status, kind, report = _get(airflow, failed["report_url"], token)
    assert status == 200 and kind.startswith("text/html"), report[:300]
    assert scene.failed_batch.encode() in report and b"FAILED" in report

    [gap] = detail["gaps"]
    assert (gap["partition"], gap["start"], gap["end"]) == (0, scene.gap_start, scene.gap_start + GAP_OFFSETS)
    assert batches[gap["batch_id"]]["status"] == "gap"

    status, _, body = _get(airflow, "/offsetlake/api/pipelines/orders?limit=2", token)
    recent = json.loads(body)["batches"]
    assert [b["batch_id"] for b in recent] == [b["batch_id"] for b in detail["batches"][:2]]
    assert recent[0]["batch_id"] == scene.failed_batch


def test_ledger_view_in_the_airflow_ui_shows_lag_and_batches(scene, tmp_path):
    from headless_chromium import launch, open_logged_in
    from playwright.sync_api import sync_playwright

    airflow = scene.airflow
    expected = _expected(scene.config)
    total_lag = sum(expected["lag"].values())
    token = airflow.token()
    detail = json.loads(_get(airflow, "/offsetlake/api/pipelines/orders", token)[2])
    dag_batch = next(b for b in detail["batches"] if b["batch_id"] == scene.dag_batch)

    with sync_playwright() as p:
        browser = launch(p)
        page = open_logged_in(browser, airflow.url, "/plugin/offsetlake-ledger", airflow.password, {"width": 1500, "height": 1100})

        view = page.frame_locator("iframe[title='Offset ledger']")
        listed = view.locator("tr[data-pipeline=orders]")
        listed.wait_for(timeout=60_000)
        assert listed.locator("td.lag").inner_text() == f"{total_lag:,}"
        listed.get_by_role("link", name="orders").click()

        assert view.locator("#total-lag").inner_text(timeout=60_000) == f"{total_lag:,}"
        for partition, lag in expected["lag"].items():
            assert view.locator(f"tr[data-partition='{partition}'] td.lag").inner_text() == f"{lag:,}"
        assert view.locator("svg.lag-chart rect").count() == 3 * 3
        row = view.locator(f"tr.batch[data-batch-id='{scene.dag_batch}']")
        assert row.is_visible()
        assert row.locator(".status").first.inner_text() == "committed"
        assert row.locator("td.rows").inner_text() == f"{dag_batch['rows_written']:,}"
        assert row.locator("td.sink-version").inner_text() == str(dag_batch["sink_version"])
        why = view.locator(f"tr.why[data-batch-id='{scene.failed_batch}']")
        assert "expect_column_values_to_not_be_null" in why.inner_text()
        assert f"{300 // NULL_EVERY} unexpected of 300 rows" in why.inner_text()
        # the UI keeps its address in step with the embedded page
        page.wait_for_url("**/plugin/offsetlake-ledger/offsetlake/ledger/orders", timeout=30_000)
        page.screenshot(path=str(tmp_path / "ledger-view.png"))

        # a batch's run link opens the dag run in the Airflow UI itself, not inside the frame
        row.get_by_role("link", name=f"orders_ingest / {DAG_RUN_ID}").click()
        page.wait_for_url(f"**/dags/orders_ingest/runs/{quote(DAG_RUN_ID, safe='')}", timeout=30_000)
        page.locator("iframe[title='Offset ledger']").wait_for(state="detached", timeout=30_000)
        browser.close()
    assert (tmp_path / "ledger-view.png").stat().st_size > 20_000


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_metrics_need_a_token_and_match_kafka_and_the_ledger(scene):
    airflow, config = scene.airflow, scene.config
    status, _, body = _get(airflow, "/offsetlake/metrics")
    assert status == 401 and b"offsetlake_lag_records" not in body
    status, _, _ = _get(airflow, "/offsetlake/metrics", token="not-a-jwt")
    assert status == 403
    expected = _expected(config)
    status, kind, body = _get(airflow, "/offsetlake/metrics", airflow.token())
    assert status == 200 and kind.startswith("text/plain"), body[:300]
    samples = _samples(body.decode())

    def value(name: str, **labels: str) -> float:
        return samples[(f"offsetlake_{name}", tuple(sorted({"pipeline": "orders", **labels}.items())))]

    assert value("pipeline_up") == 1 and value("kafka_up") == 1
    for p in range(3):
        where = {"topic": config.topic, "partition": str(p)}
        assert value("lag_records", **where) == expected["lag"][p] and value("last_stable_offset", **where) == expected["lso"][p]
        assert value("committed_end_offset", **where) == expected["ends"][p]
    assert sum(expected["lag"].values()) > 0
    assert value("last_commit_timestamp_seconds") == pytest.approx(expected["last_commit"].timestamp())
    assert value("seconds_since_last_commit") > 0
    rows = expected["rows"]
    final: dict[str, set[str]] = {}
    for r in rows:
        final.setdefault(r["batch_id"], set()).add(r["status"])
    rank = ["planned", "failed", "superseded", "committed", "gap", "rewound"]
    counts: dict[str, int] = {}
    for states in final.values():
        top = max(states, key=rank.index)
        counts[top] = counts.get(top, 0) + 1
    assert counts["failed"] == 1 and counts["committed"] == 3 and counts["gap"] == 1, counts
    for status_name in ("committed", "failed", "gap", "superseded", "rewound"):
        assert value("batches", status=status_name) == counts.get(status_name, 0), status_name
    assert value("validated_batches", outcome="failed") == 1 and value("validated_batches", outcome="quarantined") == 0
    failed = [r for r in rows if r["batch_id"] == scene.failed_batch and r["status"] == "failed"]
    assert value("last_batch_records", kind="ingest", status="failed") == sum(r["records_read"] or 0 for r in failed)
    assert value("stream_lease_live", owner="") == 0
