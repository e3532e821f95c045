"""The ledger entry's JSON round trip, for every kind and both format versions (no services)."""

from __future__ import annotations

import json

import pytest

from offsetlake.entry import (
    FORMAT_VERSION,
    MARKER,
    AppliedChange,
    EntryFormatError,
    EpochEntry,
    GapEntry,
    IngestEntry,
    RewindEntry,
    for_plan,
    from_dict,
    parse,
)
from offsetlake.plan import BatchKind, BatchPlan, OffsetRange, RunContext

_COMMON = {
    "pipeline": "p",
    "run_id": "r",
    "dag_id": None,
    "try_number": None,
    "planned_at": "2026-11-01T00:00:00+00:00",
    "committed_at": "2026-11-01T00:00:01+00:00",
    "duration_ms": 5,
    MARKER: 1,
}

# Entries as offsetlake up to main 3e10e68 wrote them (format version 1: the marker only).
VERSION_1 = [
    {**_COMMON, "batch_id": "first", "ranges": [{"topic": "t", "partition": 0, "start": 0, "end": 1}]},  # no kind yet
    {
        **_COMMON,
        "batch_id": "i",
        "kind": "ingest",
        "topic_ids": {"t": "id-1"},
        "sink_table_id": "tab",
        "ranges": [
            {
                "topic": "t",
                "partition": 0,
                "start": 0,
                "end": 10,
                "records_read": 10,
                "rows_written": 9,
                "dead_letters": 1,
                "empty_as_null": 2,
            }
        ],
        "dead_letter_files": [{"path": "staged/i-1.parquet", "size": 12, "rows": 1}],
        "validation": {"outcome": "passed", "report": "file:///r.html"},
        "reader_schema": {"source": "yaml", "fingerprint": "f", "text": "{}"},
        "merge": {"inserted": 3, "updated": 1},
    },
    {
        **_COMMON,
        "batch_id": "b",
        "kind": "backfill",
        "record_time": {"from_ms": 1, "to_ms": 2},
        "message": "replaced",
        "ranges": [{"topic": "t", "partition": 0, "start": 0, "end": 5}],
        "dead_letter_files": [],
        "topic_epochs": {"t": 1},
    },
    {
        **_COMMON,
        "batch_id": "g",
        "kind": "gap",
        "message": "lost",
        "dead_letter_files": [],
        "ranges": [{"topic": "t", "partition": 1, "start": 3, "end": 9}],
    },
    {
        **_COMMON,
        "batch_id": "w",
        "kind": "rewind",
        "ranges": [],
        "to_batch": "i",
        "to_version": 3,
        "rewound": ["b"],
        "reason": "x",
        "requested_by": "me",
        "files_removed": 1,
        "files_readded": 0,
        "kept_columns": ["c"],
        "dead_letter_restore": {"to_sink_version": 3},
        "message": "m",
    },
    {
        **_COMMON,
        "batch_id": "e",
        "kind": "epoch",
        "ranges": [{"topic": "t", "partition": 0, "start": 5, "end": 5}],
        "reason": "x",
        "requested_by": "me",
        "message": "m",
        "topic_ids": {"t": "id-2"},
        "epoch": {
            "topic": "t",
            "previous_topic_id": "id-1",
            "topic_id": "id-2",
            "moves": [{"partition": 0, "from": 9, "to": 5}],
            "problems": ["p"],
        },
    },
    {**_COMMON, "batch_id": "s", "kind": "stream", "ranges": [], "dead_letter_files": [], "a_later_key": {"kept": True}},
]


@pytest.mark.parametrize("old", VERSION_1, ids=[e["batch_id"] for e in VERSION_1])
def test_a_version_1_entry_reads_and_writes_back_unchanged(old):
    entry = parse(json.dumps(old))
    assert entry is not None and entry.format_version == 1 and entry.batch_id == old["batch_id"]
    again = json.loads(entry.to_json())
    assert {k: v for k, v in again.items() if k != "kind"} == {**{k: v for k, v in old.items() if k != "kind"}, "format_version": 1}
    assert again["kind"] == old.get("kind", "ingest")
    assert from_dict(again) == entry


def test_each_kind_has_its_class_and_its_facts():
    by_id = {e.batch_id: e for e in (parse(json.dumps(o)) for o in VERSION_1) if e is not None}
    assert isinstance(by_id["first"], IngestEntry) and by_id["first"].staged is None  # before staged dead letters
    assert not by_id["first"].dead_letter_change and by_id["i"].dead_letter_change
    assert by_id["i"].ranges[0].count("empty_as_null") == 2 and by_id["i"].staged[0].path == "staged/i-1.parquet"
    assert isinstance(by_id["g"], GapEntry) and by_id["g"].dead_letter_change and by_id["g"].staged == ()
    rewind = by_id["w"]
    assert isinstance(rewind, RewindEntry) and rewind.rewound == ("b",) and rewind.restore_to_sink_version == 3
    epoch = by_id["e"]
    assert isinstance(epoch, EpochEntry) and epoch.epoch is not None and epoch.epoch.topic_id == "id-2"
    assert by_id["s"].other == {"a_later_key": {"kept": True}}
    rows = by_id["i"].ledger_rows("committed", 7)
    assert [(r["topic_id"], r["rows_written"], r["sink_version"], r["validation_report"]) for r in rows] == [
        ("id-1", 9, 7, "file:///r.html")
    ]


def test_a_new_entry_is_version_2_and_keeps_the_old_keys():
    plan = BatchPlan("p", "n", BatchKind.GAP, (OffsetRange("t", 0, 1, 5),), RunContext("r"))
    entry = for_plan(plan, message="lost", staged=())
    written = json.loads(entry.to_json())
    assert written["format_version"] == FORMAT_VERSION == 2 and written[MARKER] == 1
    assert set(written) <= set().union(*VERSION_1) | {"format_version", "kind"}
    assert from_dict(written) == entry
    with pytest.raises(TypeError):  # a fact the kind does not have
        for_plan(plan, to_batch="x")


def test_the_data_path_is_recorded_and_an_older_entry_reads_it_as_not_known():
    plan = BatchPlan("p", "d", BatchKind.INGEST, (OffsetRange("t", 0, 0, 5),), RunContext("r"))
    entry = for_plan(plan, {("t", 0): {"records_read": 5}}, staged=(), data_path="direct")
    written = json.loads(entry.to_json())
    assert written["data_path"] == "direct" and written["format_version"] == FORMAT_VERSION
    assert from_dict(written) == entry and from_dict(written).data_path == "direct"
    old = parse(json.dumps(VERSION_1[1]))
    assert isinstance(old, IngestEntry) and old.data_path is None and "data_path" not in json.loads(old.to_json())
    gap = for_plan(BatchPlan("p", "g", BatchKind.GAP, (), RunContext("r")), staged=())
    assert "data_path" not in json.loads(gap.to_json())


def test_what_is_not_an_entry_or_is_too_new():
    assert parse(None) is None and parse("not json") is None and parse('{"offsetlake_sink_of": "p"}') is None
    applied = AppliedChange(pipeline="p", batch_id="i", sink_version=4, sink_table_id="tab")
    assert parse(applied.to_json()) is None and AppliedChange.parse(applied.to_json()) == applied
    with pytest.raises(EntryFormatError, match="format version 3"):
        parse(json.dumps({**VERSION_1[1], "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(EntryFormatError):
        parse(json.dumps({**VERSION_1[1], "kind": "a-kind-from-the-future"}))
