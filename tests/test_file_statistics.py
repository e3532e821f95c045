"""File statistics never rule out a value the file holds (``offsetlake.file_stats``, issue 35).

Fast property tests, no broker and no Spark, checked against brute force (is the value among the
file's values?):

- through offsetlake's own writer and delta-rs's reader: random values (timestamps with
  microsecond digits, before and after 1970, naive and UTC; strings, with characters beyond
  U+FFFF, which deltalake 1.6.6 misread when escaped; doubles with NaN; integers; dates; nulls)
  written as parquet files, committed with the statistics ``delta_stats`` writes, read back as
  ``live_files`` rows and asked about every value they hold — and, so the answer is not always
  "yes", a value beyond a file's widened bounds is ruled out;
- through statistics other writers produce: a timestamp cut toward zero or rounded to the
  nearest millisecond, a string max cut to a prefix with or without a tie-breaker character,
  decimals or large integers read back as doubles, NaN bounds.

``OFFSETLAKE_PROPERTY_EXAMPLES`` (as in test_properties.py) raises the number of examples.
"""

from __future__ import annotations

import math
import os
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offsetlake.entry import AppliedChange
from offsetlake.file_stats import may_hold_any, may_hold_between, values_of
from offsetlake.sink import CommitActions, StagedFile, add_actions_for, commit, create_table_once, live_files

EXAMPLES = int(os.environ.get("OFFSETLAKE_PROPERTY_EXAMPLES", "3"))
FAST = settings(
    max_examples=max(EXAMPLES * 20, 150),
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MS = timedelta(milliseconds=1)


def _holds(values: list, probe: object) -> bool:
    """Brute force: is ``probe`` among ``values`` (NaN counts as equal to NaN, as Spark groups it)?"""
    if isinstance(probe, float) and math.isnan(probe):
        return any(isinstance(v, float) and math.isnan(v) for v in values)
    return any(v is not None and type(v) is type(probe) and v == probe for v in values)


# ---- values of one column -----------------------------------------------------------------------
def _instants(aware: bool) -> st.SearchStrategy:
    """Timestamps with microsecond digits: clustered in a few milliseconds (so a file's largest
    key shares its millisecond with others), near 1970 on both sides, and anywhere."""
    tz = UTC if aware else None
    near = st.sampled_from(
        [datetime(2026, 11, 23, 10, 0, tzinfo=tz), datetime(1970, 1, 1, tzinfo=tz), datetime(1969, 12, 31, 23, 59, 59, 998_000, tzinfo=tz)]
    )
    clustered = st.builds(lambda base, us: base + timedelta(microseconds=us), near, st.integers(-3_000, 3_000))
    anywhere = st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC) if aware else st.none())
    return st.one_of(clustered, anywhere)


COLUMNS = {
    "timestamp": (pa.timestamp("us", tz="UTC"), _instants(aware=True)),
    "timestamp_ntz": (pa.timestamp("us"), _instants(aware=False)),
    "string": (
        pa.string(),
        st.one_of(st.text(alphabet="ab\u00e9\uffff\U0001f600\U00020000\U0002a6d6\U0010ffff", max_size=6), st.text(max_size=40)),
    ),
    "double": (pa.float64(), st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1.5]))),
    "long": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "date": (pa.date32(), st.dates(min_value=date(1900, 1, 1), max_value=date(2200, 1, 1))),
}


@st.composite
def column_files(draw: st.DrawFn) -> tuple[str, list[list], list]:
    """(column kind, the values of a few files, probe values: some of the files', some others)."""
    kind = draw(st.sampled_from(sorted(COLUMNS)))
    _, values = COLUMNS[kind]
    files = draw(
        st.lists(st.lists(st.one_of(values, st.none()) if draw(st.booleans()) else values, min_size=1, max_size=8), min_size=1, max_size=4)
    )
    held = [v for f in files for v in f if v is not None]
    probes = draw(st.lists(st.sampled_from(held), max_size=4)) if held else []
    return kind, files, probes + draw(st.lists(values, max_size=4))


def _live_files(folder: Path, kind: str, files: list[list]) -> list[dict]:
    """Each list of values as one parquet file of a Delta table, committed with offsetlake's
    statistics, read back by delta-rs as ``live_files`` rows (in the order of ``files``)."""
    column_type, _ = COLUMNS[kind]
    schema = pa.schema([pa.field("v", column_type)])
    (folder / "data").mkdir(parents=True)
    staged = []
    for i, values in enumerate(files):
        relative = f"data/f{i:02d}.parquet"
        pq.write_table(pa.table({"v": pa.array(values, column_type)}), folder / relative)
        staged.append(StagedFile(relative, rows=len(values), counts={}, size=(folder / relative).stat().st_size))
    table = create_table_once(str(folder), schema, [], "file statistics test")
    commit(
        table,
        CommitActions(files=add_actions_for(str(folder), staged).actions),
        AppliedChange(pipeline="file_stats", batch_id="test", sink_version=0),
        partition_by=None,
    )
    table.update_incremental()
    return sorted(live_files(table), key=lambda f: f["path"])


def _micros(value: datetime) -> int:
    return ((value if value.tzinfo else value.replace(tzinfo=UTC)) - EPOCH) // timedelta(microseconds=1)


@FAST
@given(case=column_files())
def test_statistics_offsetlake_writes_never_rule_out_a_value_the_file_holds(tmp_path_factory, case):
    kind, files, probes = case
    live = _live_files(tmp_path_factory.mktemp("stats"), kind, files)
    assert len(live) == len(files)
    for values, f in zip(files, live, strict=True):
        for probe in probes:
            if _holds(values, probe):
                assert may_hold_any(f, "v", values_of([probe])), (kind, probe, f)
        if any(_holds(values, p) for p in probes):
            assert may_hold_any(f, "v", values_of(probes)), (kind, probes, f)
        ordered = sorted(p for p in probes if not (isinstance(p, float) and math.isnan(p)))
        for low, high in zip(ordered, ordered[1:], strict=False):
            if any(
                v is not None and type(v) is type(low) and not (isinstance(v, float) and math.isnan(v)) and low <= v <= high for v in values
            ):
                assert may_hold_between(f, "v", low, high), (kind, low, high, f)


@FAST
@given(values=st.lists(_instants(aware=True), min_size=1, max_size=8), past=st.integers(0, 10_000_000))
def test_a_timestamp_beyond_a_files_widened_bounds_is_ruled_out(tmp_path_factory, values, past):
    """Widening keeps pruning: the max stands for its millisecond, no more (and the min likewise)."""
    [f] = _live_files(tmp_path_factory.mktemp("stats"), "timestamp", [values])
    top, bottom = max(_micros(v) for v in values), min(_micros(v) for v in values)
    above = EPOCH + timedelta(microseconds=(top // 1000 + 1) * 1000 + past)  # the next millisecond or later
    below = EPOCH + timedelta(microseconds=(bottom // 1000) * 1000 - 1000 - past)  # a millisecond before or earlier
    assert may_hold_any(f, "v", values_of(values))
    assert not may_hold_any(f, "v", values_of([above])), (values, above, f)
    assert not may_hold_any(f, "v", values_of([below])), (values, below, f)
    assert not may_hold_between(f, "v", above, above + MS)


# ---- statistics other writers produce -------------------------------------------------------------
def _cut_toward_zero(value: datetime) -> datetime:
    micros = _micros(value)
    return EPOCH + timedelta(milliseconds=int(micros / 1000))  # Rust's integer division of a negative


def _nearest_ms(value: datetime) -> datetime:
    return EPOCH + timedelta(milliseconds=round(_micros(value) / 1000))


def _floor_ms(value: datetime) -> datetime:
    return EPOCH + timedelta(milliseconds=_micros(value) // 1000)


@st.composite
def foreign_statistics(draw: st.DrawFn) -> tuple[list, dict]:
    """(a file's values, a ``live_files`` row of statistics another writer could have made)."""
    kind = draw(st.sampled_from(["timestamp", "string", "decimal", "big_long", "double_nan"]))
    if kind == "timestamp":
        values = draw(st.lists(_instants(aware=True), min_size=1, max_size=6))
        cut = draw(st.sampled_from([_floor_ms, _cut_toward_zero, _nearest_ms]))
        return values, {"min.v": cut(min(values)), "max.v": cut(max(values))}
    if kind == "string":
        values = draw(
            st.lists(
                st.text(alphabet="az\u00e9\ufffd\uffff\U0001f600\U00020000\U0010ffff", min_size=0, max_size=40), min_size=1, max_size=6
            )
        )
        keep = draw(st.integers(0, 33))
        tie = draw(st.sampled_from(["", "\uffff", "\U0010ffff", "\ufffd"]))
        top = max(values)
        top = top if len(top) <= keep else top[:keep] + tie
        if draw(st.booleans()):  # deltalake 1.6.6 reading escaped characters from U+20000 up
            top = "".join(chr((ord(c) - 0x10000) | 0x10000) if ord(c) >= 0x20000 else c for c in top)
        return values, {"min.v": min(values)[:keep], "max.v": top}
    if kind == "decimal":
        values = draw(st.lists(st.decimals(allow_nan=False, allow_infinity=False, places=draw(st.integers(0, 6))), min_size=1, max_size=6))
        return values, {"min.v": float(min(values)), "max.v": float(max(values))}  # read back as doubles
    if kind == "big_long":
        values = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=6))
        return values, {"min.v": float(min(values)), "max.v": float(max(values))}
    values = draw(st.lists(st.floats(allow_nan=True), min_size=1, max_size=6))
    numbers = [v for v in values if not math.isnan(v)]
    low = min(numbers) if numbers and draw(st.booleans()) else math.nan
    high = max(numbers) if numbers and draw(st.booleans()) else math.nan
    return values, {"min.v": low, "max.v": high}


@settings(FAST, max_examples=max(EXAMPLES * 100, 600))
@given(case=foreign_statistics())
def test_statistics_other_writers_make_never_rule_out_a_value_the_file_holds(case):
    values, stats = case
    for value in values:
        assert may_hold_any(stats, "v", values_of([value])), (value, stats)
    assert may_hold_any(stats, "v", values_of(values)), stats
    numbers = sorted(v for v in values if not (isinstance(v, float) and math.isnan(v)))
    if numbers:
        assert may_hold_between(stats, "v", numbers[0], numbers[-1]), stats
        assert may_hold_between(stats, "v", numbers[-1], numbers[-1]), stats


def test_a_partition_value_is_exact_and_a_file_without_statistics_may_hold_anything():
    at = datetime(2026, 11, 23, 10, 0, 0, 900, tzinfo=UTC)
    partitioned = {"partition.at": at}
    assert may_hold_any(partitioned, "at", values_of([at]), partitioned=True)
    assert not may_hold_any(partitioned, "at", values_of([at + timedelta(microseconds=1)]), partitioned=True)
    assert may_hold_any({}, "at", values_of([at])) and may_hold_between({"min.at": None}, "at", at, at)
    assert not may_hold_any({"min.at": at, "max.at": at}, "at", values_of([None])), "no value asked: nothing held"
    assert may_hold_any({"min.at": "text", "max.at": "text"}, "at", values_of([at])), "stats of another type say nothing"
