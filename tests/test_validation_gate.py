"""Invariant 9: the pipeline's Great Expectations suite gates every commit.

Through the CLI, as a user runs it: a batch with nulls in a not-null column commits nothing and
records why; the same run, rerun under `on_failure: quarantine`, commits, and sink rows plus
dead letters hold every record of the range exactly once. The HTML report opens in Chromium.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from kafka_truth import dead_letter_coordinates, read_topic, sink_coordinates

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import SuiteError
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline
from offsetlake.sink import live_files
from offsetlake.validation import load_suite

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

SUITE = {
    "expectations": [
        {"expect_column_values_to_not_be_null": {"column": "customer"}},
        {"expect_column_values_to_be_in_set": {"column": "currency", "value_set": ["EUR", "USD", "GBP", "INR"]}},
        {"expect_column_values_to_be_between": {"column": "amount", "min_value": 0, "max_value": 500}},
        {"expect_table_row_count_to_be_between": {"min_value": 1}},
    ]
}


def ledger_rows(config, batch_id: str) -> list[dict]:
    data = storage.table(config.layout.ledger).to_pyarrow_dataset().to_table().to_pylist()
    return [r for r in data if r["batch_id"] == batch_id]


def with_policy(pipeline, policy: str):
    body = yaml.safe_load(pipeline.file.read_text())
    body["validation"] = {"on_failure": policy}
    pipeline.file.write_text(yaml.safe_dump(body, sort_keys=False))
    return pipeline.config()


def _report_exists(report: str) -> bool:
    """A report's URI: file:// on a local lake, the object's own URI on an object store."""
    return storage.exists(urlparse(report).path if report.startswith("file://") else report)


def test_failed_validation_commits_nothing_and_the_quarantine_rerun_holds_every_record_once(pipeline, spark, caplog):
    caplog.set_level(logging.INFO, logger="offsetlake.batch")
    (pipeline.folder / f"{pipeline.name}.expectations.yaml").write_text(yaml.safe_dump(SUITE, sort_keys=False))
    config = pipeline.write(validation={"on_failure": "fail"})
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)

    # 1. a clean batch passes: its ledger rows and commit metadata carry the summary and the report
    produce_orders(pipeline.bootstrap, pipeline.topic, 400)
    passed = run_pipeline(config, RunContext("clean-run"), lambda: spark)[0].summary()
    rows = ledger_rows(config, passed["batch_id"])
    committed = [r for r in rows if r["status"] == "committed"]
    assert committed and all(r["validation_report"] for r in committed)
    summary = json.loads(committed[0]["validation"])
    assert summary["outcome"] == "passed" and summary["rows_validated"] == 400 and summary["failed"] == []
    assert {e["type"] for e in summary["expectations"]} == {next(iter(e)) for e in SUITE["expectations"]}
    assert _report_exists(summary["report"])
    # an append sink's ingest: the suite was observed during the write, not run before it
    gated = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step=validate ")]
    assert gated and all("observed=True" in line for line in gated), gated
    sink = storage.table(config.layout.sink)
    metadata = json.loads(sink.history(1)[0]["userMetadata"])
    assert metadata["validation"]["outcome"] == "passed"
    version_before = sink.version()
    txns_before = {p: sink.transaction_version(config.app_id(pipeline.topic, p)) for p in (0, 1)}

    # 2. nulls in a not-null column under `fail`: nothing moves, the ledger row says why (the CLI:
    #    its exit status 3 and its one-line message are part of what is checked)
    produce_orders(pipeline.bootstrap, pipeline.topic, 600, first_id=400, null_customer_every=25, malformed_every=50)
    failed = pipeline.cli("run", "--run-id", "bad-run")
    assert failed.returncode == 3, failed.stderr[-3000:]
    assert "expect_column_values_to_not_be_null(column=customer): 24 unexpected of 588 rows" in failed.stderr
    assert "nothing was committed" in failed.stderr
    assert "report: file://" in failed.stderr or f"report: {config.lake_path}/_validation/" in failed.stderr, failed.stderr
    assert storage.table(config.layout.sink).version() == version_before
    after = storage.table(config.layout.sink)
    assert {p: after.transaction_version(config.app_id(pipeline.topic, p)) for p in (0, 1)} == txns_before
    bad_rows = [
        r
        for r in storage.table(config.layout.ledger).to_pyarrow_dataset().to_table().to_pylist()
        if r["run_id"] == "bad-run" and r["status"] == "failed"
    ]
    assert bad_rows, "the failed batch must have failed ledger rows"
    bad_batch = bad_rows[0]["batch_id"]
    assert "expect_column_values_to_not_be_null(column=customer)" in bad_rows[0]["message"]
    failed_summary = json.loads(bad_rows[0]["validation"])
    assert failed_summary["failed"] == ["expect_column_values_to_not_be_null(column=customer)"]
    null_check = next(e for e in failed_summary["expectations"] if e["type"] == "expect_column_values_to_not_be_null")
    assert null_check["unexpected_count"] == 24 and null_check["examples"] == [None] * 5
    assert _report_exists(bad_rows[0]["validation_report"])
    planned = {(r["partition"], r["start_offset"], r["end_offset"]) for r in bad_rows}

    # 3. switch to quarantine, rerun the SAME run: same batch, same ranges, and it commits
    config = with_policy(pipeline, "quarantine")
    rerun = run_pipeline(config, RunContext("bad-run"), lambda: spark)
    assert len(rerun) == 1, "the rerun re-executes the failed batch, then nothing is new"
    result = rerun[0].summary()
    assert result["batch_id"] == bad_batch
    assert {(r["partition"], r["start"], r["end"]) for r in result["ranges"]} == planned
    assert result["rows_written"] == 600 - 12 - 24 and result["dead_letters"] == 12 + 24

    truth = read_topic(pipeline.bootstrap, pipeline.topic)
    sink_rows = sink_coordinates(config.layout.sink)
    dead = dead_letter_coordinates(config.layout.dead_letters)
    every = [(p, o) for p, o, _ in sink_rows] + dead
    assert len(every) == len(set(every)), "a record is both in the sink and a dead letter, or twice in one"
    assert set(every) == set(truth.good) | truth.bad
    dead_reasons = storage.table(config.layout.dead_letters).to_pyarrow_dataset().to_table(columns=["reason"])["reason"].to_pylist()
    assert dead_reasons.count("failed expectation: expect_column_values_to_not_be_null(column=customer)") == 24
    customers = storage.table(config.layout.sink).to_pyarrow_dataset().to_table(columns=["customer"])["customer"]
    assert customers.null_count == 0
    final = [r for r in ledger_rows(config, bad_batch) if r["status"] == "committed"]
    assert len(final) == 2, "one committed ledger row per partition of the rerun batch"
    quarantined = json.loads(final[0]["validation"])
    assert quarantined["outcome"] == "quarantined" and quarantined["quarantined_records"] == 24
    # the observed gate saw the nulls: the batch's staged files went, and GX decided it before a write
    assert any(r.getMessage().startswith("step=revalidate ") and bad_batch in r.getMessage() for r in caplog.records)
    # and what that first attempt staged is gone: every dead-letter file on disk is one the table's log names
    folder = Path(config.layout.dead_letters.path)
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*.parquet")}
    named = {storage.file_path_from_log(f["path"]) for f in live_files(storage.table(config.layout.dead_letters))}
    assert on_disk == named, (on_disk, named)
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout + audit.stderr


def test_suite_typos_fail_at_load_naming_file_and_entry_before_any_read(pipeline):
    suite_file = pipeline.folder / f"{pipeline.name}.expectations.yaml"
    pipeline.write()
    cases = [
        (
            {
                "expectations": [
                    {"expect_column_values_to_not_be_null": {"column": "customer"}},
                    {"expect_column_values_to_not_be_nul": {"column": "customer"}},
                ]
            },
            "expectations[1] expect_column_values_to_not_be_nul: unknown expectation (did you mean expect_column_values_to_not_be_null",
        ),
        (
            {"expectations": [{"expect_column_values_to_be_between": {"column": "amount", "min_vale": 0}}]},
            "expectations[0] expect_column_values_to_be_between: bad kwargs: min_vale: extra fields not permitted",
        ),
        (
            {"expectations": [{"expect_column_values_to_be_in_set": {"value_set": ["EUR"]}}]},
            "expectations[0] expect_column_values_to_be_in_set: bad kwargs: column: field required",
        ),
        ({"expectations": []}, "expected a non-empty list under 'expectations'"),
    ]
    for i, (suite, message) in enumerate(cases):
        suite_file.write_text(yaml.safe_dump(suite))
        if i == 0:
            # the topic does not even exist: the error must come from the suite, before any Kafka read
            result = pipeline.cli("run", timeout=120)
            assert result.returncode == 2, result.stderr[-2000:]
            assert str(suite_file) in result.stderr and message in result.stderr, result.stderr[-2000:]
            assert "Traceback" not in result.stderr
        else:  # the same check, which the CLI runs first, in this process (a CLI run is ~10 s of imports)
            with pytest.raises(SuiteError) as refused:
                load_suite(pipeline.config())
            assert str(suite_file) in str(refused.value) and message in str(refused.value), str(refused.value)
    assert not Path(pipeline.config().sink_path).exists()


def test_a_suite_checked_once_is_remembered_and_a_passing_run_imports_no_great_expectations(pipeline, tmp_path, monkeypatch):
    """Importing GX's expectation registry costs a command seconds: a suite's text that passed the
    check is remembered under the project's home, so a run of an unchanged suite whose batch passes
    (a verdict Spark gives alone) never imports GX; an edited suite is checked again."""
    home = tmp_path / "home"
    monkeypatch.setenv("OFFSETLAKE_HOME", str(home))
    suite_file = pipeline.folder / f"{pipeline.name}.expectations.yaml"
    suite_file.write_text(yaml.safe_dump(SUITE, sort_keys=False))
    config = pipeline.write()
    assert len(load_suite(config).expectations) == 4  # checked against GX in this process, and remembered
    assert len(list((home / ".offsetlake" / "suites-checked").iterdir())) == 1

    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 50)
    ran = pipeline.cli("run", env={"OFFSETLAKE_HOME": str(home), "PYTHONPROFILEIMPORTTIME": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in ran.stderr.splitlines() if line.startswith("import time:")}
    assert "offsetlake.validation" in imported and "great_expectations" not in imported, sorted(imported)[:20]
    [entry] = [r for r in storage.table(config.layout.ledger).to_pyarrow_table().to_pylist() if r["status"] == "committed"]
    assert json.loads(entry["validation"])["outcome"] == "passed" and storage.table(config.layout.sink).count() == 50

    edited = {"expectations": [*SUITE["expectations"], {"expect_column_values_to_be_unique": {"colum": "order_id"}}]}
    suite_file.write_text(yaml.safe_dump(edited, sort_keys=False))
    with pytest.raises(SuiteError, match=r"expectations\[4\] expect_column_values_to_be_unique: bad kwargs"):
        load_suite(pipeline.config())


@pytest.mark.local_lake  # a browser opens the report's file:// URI (on S3 the ledger view serves it)
def test_validation_report_opens_in_headless_chromium(pipeline, tmp_path, spark, caplog):
    import logging

    from headless_chromium import launch
    from playwright.sync_api import sync_playwright

    (pipeline.folder / f"{pipeline.name}.expectations.yaml").write_text(yaml.safe_dump(SUITE, sort_keys=False))
    config = pipeline.write(validation={"on_failure": "quarantine"})
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 300, null_customer_every=30)
    with caplog.at_level(logging.INFO, logger="offsetlake"):
        batch = run_pipeline(config, RunContext("report"), lambda: spark)[0].plan.batch_id
    report = next(r for r in ledger_rows(config, batch) if r["status"] == "committed")["validation_report"]
    assert report.startswith("file://") and f"step=validate pipeline={pipeline.name} batch={batch}" in caplog.text
    assert f"report={report}" in caplog.text
    with sync_playwright() as p:
        browser = launch(p)
        page = browser.new_page(viewport={"width": 1300, "height": 800})
        page.goto(report)
        assert page.title() == f"offsetlake validation: {pipeline.name} {batch}"
        assert page.locator(".verdict").inner_text() == "QUARANTINED"
        failing = page.locator("tr.bad")
        assert failing.count() == 1 and "expect_column_values_to_not_be_null" in failing.inner_text()
        assert "10 (3.3333%)" in failing.inner_text()
        shot = ROOT / "docs" / "validation-report.png" if os.environ.get("OFFSETLAKE_UPDATE_DOCS") == "1" else tmp_path / "r.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert shot.stat().st_size > 10_000


def test_quarantine_flags_exactly_the_rows_great_expectations_counts(pipeline, spark):
    """Each quarantinable expectation's row filter agrees with GX on nulls, bounds, sets, regexes,
    duplicates and `mostly`; a row failing two expectations names both."""
    from offsetlake.plan import BatchPlan, OffsetRange, RunContext
    from offsetlake.validation import load_suite, quarantine_reasons, validate_rows

    suite = {
        "expectations": [
            {"expect_column_values_to_be_unique": {"column": "order_id"}},
            {"expect_column_values_to_be_between": {"column": "amount", "min_value": 0, "max_value": 100, "strict_max": True}},
            {"expect_column_values_to_match_regex": {"column": "customer", "regex": "^c[0-9]+$"}},
            {"expect_column_values_to_not_match_regex": {"column": "customer", "regex": "^test"}},
            {"expect_column_values_to_be_in_set": {"column": "currency", "value_set": ["EUR", "USD", "BTC"]}},
            {"expect_column_values_to_not_be_in_set": {"column": "currency", "value_set": ["BTC"]}},
            {"expect_column_values_to_not_be_null": {"column": "customer"}},
            {"expect_column_values_to_not_be_null": {"column": "note", "mostly": 0.5}},  # fails on 1 of 14: passes
        ]
    }
    (pipeline.folder / f"{pipeline.name}.expectations.yaml").write_text(yaml.safe_dump(suite, sort_keys=False))
    config = pipeline.write(validation={"on_failure": "quarantine"})
    good = (1, "c1", 10.0, "EUR", "n")
    data = {
        0: good,
        1: (2, "c2", 0.0, "USD", "n"),
        2: (3, "c3", 99.5, "EUR", None),
        3: (7, "c4", 1.0, "EUR", "n"),
        4: (7, "c5", 1.0, "EUR", "n"),  # duplicate order_id: both
        5: (None, "c6", 1.0, "EUR", "n"),
        6: (8, "c7", 100.0, "EUR", "n"),  # strict max: 100 fails
        7: (9, "c8", None, "EUR", "n"),
        8: (10, "bad", 1.0, "EUR", "n"),
        9: (11, None, 1.0, "EUR", "n"),
        10: (12, "c9", 1.0, "XXX", "n"),
        11: (13, "c10", 1.0, "BTC", "n"),
        12: (14, "test1", 1.0, "EUR", "n"),
        13: (15, "c11", 1.0, None, "n"),
    }
    rows = spark.createDataFrame(
        [(pipeline.topic, 0, offset, *values) for offset, values in data.items()],
        "_kafka_topic string, _kafka_partition int, _kafka_offset long, order_id long, customer string, amount double, "
        "currency string, note string",
    ).persist()
    plan = BatchPlan(config.name, "b-1", "ingest", (OffsetRange(pipeline.topic, 0, 0, 14),), RunContext("r-1"))
    validation = validate_rows(rows, load_suite(config), config, plan)
    assert validation.summary["outcome"] == "quarantined"
    by_label = {e["expectation"]: e for e in validation.summary["expectations"]}
    assert by_label["expect_column_values_to_not_be_null(column=note, mostly=0.5)"]["success"] is True
    flagged = {
        r["_kafka_offset"]: r["_offsetlake_failed_expectations"]
        for r in quarantine_reasons(rows, validation.quarantine, validation.summary).collect()
    }
    assert flagged == {
        3: "expect_column_values_to_be_unique(column=order_id)",
        4: "expect_column_values_to_be_unique(column=order_id)",
        6: "expect_column_values_to_be_between(column=amount, min_value=0, max_value=100, strict_max=true)",
        8: "expect_column_values_to_match_regex(column=customer, regex=^c[0-9]+$)",
        9: "expect_column_values_to_not_be_null(column=customer)",
        10: 'expect_column_values_to_be_in_set(column=currency, value_set=["EUR", "USD", "BTC"])',
        11: 'expect_column_values_to_not_be_in_set(column=currency, value_set=["BTC"])',
        12: "expect_column_values_to_match_regex(column=customer, regex=^c[0-9]+$); "
        "expect_column_values_to_not_match_regex(column=customer, regex=^test)",
    }
    rows.unpersist()


def test_a_gx_json_suite_loads_and_its_errors_name_the_entry(pipeline):
    from offsetlake.errors import SuiteError
    from offsetlake.validation import load_suite

    suite_file = pipeline.folder / "orders_suite.json"
    suite_file.write_text(
        json.dumps(
            {
                "name": "orders_suite",
                "expectations": [
                    {"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "customer"}, "meta": {}},
                    {"type": "expect_table_row_count_to_be_between", "kwargs": {"min_value": 1}},
                ],
            }
        )
    )
    config = pipeline.write(validation={"suite": "orders_suite.json"})
    suite = load_suite(config)
    assert suite.name == "orders_suite"
    assert [(e.type, e.row_level) for e in suite.expectations] == [
        ("expect_column_values_to_not_be_null", True),
        ("expect_table_row_count_to_be_between", False),
    ]
    suite_file.write_text(
        json.dumps({"expectations": [{"type": "expect_table_row_count_to_be_between", "kwargs": {"min_value": 1, "maximum": 3}}]})
    )
    try:
        load_suite(pipeline.config())
    except SuiteError as err:
        assert str(err) == (
            f"{suite_file}: expectations[0] expect_table_row_count_to_be_between: bad kwargs: maximum: extra fields not permitted"
        )
    else:
        raise AssertionError("a suite entry with an unknown kwarg must not load")
