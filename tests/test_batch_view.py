"""A batch as people see it (``offsetlake.batch_view``), built from hand-made ledger rows (no services):
one view, and each form it is shown in — the ledger view's JSON, the last batch of the headline and
metrics, the publish task's summary, the asset event's extra."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from offsetlake.batch_view import BatchView, batch_views
from offsetlake.entry import EntryRange, RewindEntry
from offsetlake.ledger import LEDGER_SCHEMA
from offsetlake.plan import BatchPlan, BatchResult, BatchStatus, OffsetRange, ReaderSchema, RunContext

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
SCHEMA = ReaderSchema(source="yaml", fingerprint="sha256:abc", text='{"schema": {}}', key=ReaderSchema("string", "string"))
GX = {
    "outcome": "failed",
    "suite": "orders",
    "on_failure": "fail",
    "rows_validated": 90,
    "expectations": [
        {"expectation": "amount >= 0", "type": "expect_column_values_to_be_between", "success": False, "unexpected_count": 3},
        {"expectation": "order_id not null", "success": True},
    ],
}


def _row(partition: int, status: str, start: int, end: int, **columns) -> dict:
    """One ledger-table row (every column of ``LEDGER_SCHEMA``) of batch ``b1`` on topic ``orders``."""
    row = dict.fromkeys(LEDGER_SCHEMA.names)
    row.update(
        pipeline="p",
        batch_id="b1",
        kind="ingest",
        status=status,
        topic="orders",
        partition=partition,
        start_offset=start,
        end_offset=end,
        run_id="scheduled__1",
        dag_id="p_ingest",
        try_number=2,
        planned_at=T0,
        recorded_at=T0,
    )
    row.update(columns)
    return row


def _committed(partition: int, start: int, end: int, read: int, written: int, dead: int, **columns) -> dict:
    counts = {"records_read": read, "rows_written": written, "dead_letters": dead}
    return _row(partition, "committed", start, end, sink_version=7, **counts, **columns)


def test_status_is_the_least_final_partitions_and_totals_count_only_what_is_known():
    half = BatchView.from_rows([_committed(0, 0, 100, 100, 98, 2), _row(1, "planned", 5, 50)])
    assert half.status == BatchStatus.PLANNED and half.statuses == {BatchStatus.PLANNED, BatchStatus.COMMITTED}
    assert (half.total("records_read"), half.total("dead_letters"), half.offsets) == (100, 2, 145)

    planned = BatchView.from_rows([_row(0, "planned", 0, 100), _row(1, "planned", 5, 50)])
    assert planned.to_json()["records_read"] is None, "a batch that never read has no count, not 0"
    assert planned.last_batch()["records"] == 0 and planned.asset_extra("p", "file:///s")["rows"] == 0

    done = BatchView.from_rows([_committed(1, 5, 50, 45, 45, 0), _committed(0, 0, 100, 100, 98, 2)])
    assert done.status == BatchStatus.COMMITTED and done.sink_version == 7
    assert (done.total("records_read"), done.total("rows_written"), done.total("dead_letters")) == (145, 143, 2)


def test_ranges_are_shown_by_one_formatter_in_every_form():
    view = BatchView.from_rows([_committed(1, 5, 50, 45, 45, 0), _committed(0, 0, 100, 100, 98, 2)])
    labels = ["orders[0] [0, 100)", "orders[1] [5, 50)"]  # half-open, by partition whatever the rows' order
    assert view.asset_extra("p", "file:///lake/sink")["ranges"] == labels
    summary = view.publish_summary("p", {("orders", 0): 100, ("orders", 1): 50})
    assert summary["ranges"] == labels
    assert [str(OffsetRange("orders", 0, 0, 100)), str(view.ranges[1])] == labels
    assert view.to_json()["ranges"] == [
        {"topic": "orders", "partition": 0, "start": 0, "end": 100, "records_read": 100, "rows_written": 98, "dead_letters": 2},
        {"topic": "orders", "partition": 1, "start": 5, "end": 50, "records_read": 45, "rows_written": 45, "dead_letters": 0},
    ]


def test_each_form_keeps_the_keys_its_readers_use():
    view = BatchView.from_rows(
        [
            _row(0, "failed", 0, 100, records_read=100, validation=json.dumps(GX), validation_report="file:///r.html", message="1 failed"),
            _row(1, "failed", 5, 50, records_read=45, reader_schema=json.dumps(SCHEMA.as_dict())),
        ]
    )
    shown = view.to_json()
    assert set(shown) == {
        *("batch_id", "kind", "status", "run_id", "dag_id", "try_number", "planned_at", "recorded_at", "duration_ms"),
        *("sink_version", "ranges", "offsets", "records_read", "rows_written", "dead_letters"),
        *("validation", "validation_report", "message", "reader_schema"),
    }
    assert (shown["status"], shown["planned_at"], shown["message"]) == ("failed", "2026-11-01T12:00:00.000000+00:00", "1 failed")
    assert shown["validation"]["outcome"] == "failed" and [f["expectation"] for f in shown["validation"]["failures"]] == ["amount >= 0"]
    assert "text" not in shown["reader_schema"] and "text" not in shown["reader_schema"]["key"]
    assert shown["reader_schema"]["description"] == SCHEMA.describe()
    assert json.loads(json.dumps(shown)) == shown, "the view's JSON API serves it as it is"

    assert view.last_batch() == {
        "batch_id": "b1",
        "kind": "ingest",
        "status": "failed",
        "planned_at": "2026-11-01T12:00:00.000000+00:00",
        "validation": "failed",
        "message": "1 failed",
        "records": 145,
        "rows": 0,
        "dead_letters": 0,
        "duration_ms": None,
    }
    extra = view.asset_extra("p", "file:///lake/sink")
    assert set(extra) == {
        "pipeline",
        "batch_id",
        "kind",
        "ranges",
        "records",
        "rows",
        "dead_letters",
        "sink_version",
        "validation",
        "table",
    }
    assert (extra["validation"], extra["table"], extra["records"]) == ("failed", "file:///lake/sink", 145)


def test_a_superseded_batch_publishes_the_batch_that_committed_its_ranges():
    why = "another batch committed these ranges first: b0"
    view = BatchView.from_rows([_row(p, "superseded", 0, 10, message=why) for p in (0, 1)])
    summary = view.publish_summary("p", {("orders", 0): 10, ("orders", 1): 10})
    assert (summary["status"], summary["message"], summary["records_read"]) == ("superseded", why, 0)
    assert summary["group_offsets"] == {"orders[0]": 10, "orders[1]": 10}
    assert summary["validation"] == "no suite"
    backfill = BatchView.from_rows([_committed(0, 0, 10, 10, 10, 0, kind="backfill")])
    assert backfill.publish_summary("p", {("orders", 0): 99})["group_offsets"] == {}, "a backfill never moves consumer offsets"


def test_views_are_grouped_per_batch_newest_first_and_read_entry_rows():
    later = datetime(2026, 11, 2, tzinfo=UTC)
    rows = [_committed(0, 0, 10, 10, 10, 0), _row(0, "planned", 10, 20, batch_id="b2", planned_at=later), _committed(1, 0, 5, 5, 5, 0)]
    assert [(b.batch_id, b.status, len(b.ranges)) for b in batch_views(rows)] == [("b2", "planned", 1), ("b1", "committed", 2)]


def test_a_rewind_commits_rows_show_the_offsets_it_undid():
    # rows as the ledger records a rewind commit (``LedgerEntry.ledger_rows``): [new end, old end)
    undone = (EntryRange("orders", 0, 40, 90),)
    rewind = RewindEntry(pipeline="p", batch_id="rw", run_id="r", to_batch="b1", to_version=3, rewound=("b2",), ranges=undone)
    view = BatchView.from_rows(rewind.ledger_rows("committed", 9))
    extra = view.asset_extra("p", "file:///s")
    assert (extra["kind"], extra["ranges"], extra["sink_version"]) == ("rewind", ["orders[0] [40, 90)"], 9)
    assert (extra["validation"], extra["records"], extra["dead_letters"]) == ("not validated", 0, 0), "a rewind reads nothing"


def test_gaps_are_listed_from_gap_batches_only():
    gap = BatchView.from_rows([_row(1, "gap", 300, 450, kind="gap", sink_version=10, message="150 offsets were lost")])
    assert gap.gaps() == [
        {
            "batch_id": "b1",
            "topic": "orders",
            "partition": 1,
            "start": 300,
            "end": 450,
            "recorded_at": "2026-11-01T12:00:00.000000+00:00",
            "sink_version": 10,
            "message": "150 offsets were lost",
        }
    ]
    assert BatchView.from_rows([_committed(0, 0, 10, 10, 10, 0)]).gaps() == []


def test_a_runs_summary_line_shows_its_ranges_in_the_views_shape():
    plan = BatchPlan("p", "b1", "ingest", (OffsetRange("orders", 0, 0, 100), OffsetRange("orders", 1, 5, 50)), RunContext("r"))
    counts = {("orders", 0): {"records_read": 100, "rows_written": 98, "dead_letters": 2}, ("orders", 1): {"records_read": 45}}
    line = BatchResult(plan, BatchStatus.COMMITTED, 7, counts).summary()
    view = BatchView.from_rows([_committed(0, 0, 100, 100, 98, 2), _row(1, "committed", 5, 50, records_read=45)])
    assert line["ranges"][0] == view.to_json()["ranges"][0]
    assert line["ranges"][1] == {"topic": "orders", "partition": 1, "start": 5, "end": 50, "records_read": 45}
    assert (line["records_read"], line["rows_written"], line["dead_letters"]) == (145, 98, 2)


def test_no_rows_no_view():
    with pytest.raises(ValueError):
        BatchView.from_rows([])
