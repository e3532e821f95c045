"""The keyed sinks' checks: each key once, and each key's row against the records Kafka still
holds, replayed by the ordering rule (upsert) or by the merge engine (``engine_replay``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from offsetlake import state_table
from offsetlake.config import PipelineConfig
from offsetlake.config.sink_settings import duration_seconds
from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TIMESTAMP, TOPIC, TOPIC_EPOCH
from offsetlake.engine_replay import replay
from offsetlake.engines import engine_for, group_columns
from offsetlake.kafka import current_offsets, read_range
from offsetlake.keyed import DELETED, HIDDEN, current_rows
from offsetlake.schema_evolution import sink_columns, table_schema
from offsetlake.sink import open_table

if TYPE_CHECKING:
    from deltalake import DeltaTable
from offsetlake.audit.against_kafka import _retained
from offsetlake.audit.report import _SHOW, AuditReport, _duplicates


# ---- keyed sinks --------------------------------------------------------------------------------
def _check_keys_once(config: PipelineConfig, report: AuditReport) -> None:
    """A keyed sink shows each key at most once, and holds at most one state row (visible or
    hidden, ``offsetlake.keyed``) per key and topic-partition."""
    table = open_table(config.layout.sink)
    if table is None:
        return
    key = config.sink.key
    checks = [(current_rows(table, key), key, "rows in the keyed sink")]
    state = state_table.pinned(config, table)
    if state is not None and HIDDEN in table_schema(state).names:
        checks.append(
            (
                state.to_pyarrow_dataset().to_table(columns=[*key, TOPIC, PARTITION]),
                [*key, TOPIC, PARTITION],
                "state rows in the keyed sink's state table",
            )
        )
    for keys, columns, what in checks:
        dupes = _duplicates(keys, columns)
        for d in dupes.slice(0, _SHOW).to_pylist():
            shown = ", ".join(f"{c}={d[c]!r}" for c in key)
            where = f" from {d[TOPIC]}[{d[PARTITION]}]" if TOPIC in columns else ""
            report.problems.append(f"key {shown} has {d['count_all']} {what}{where}")
        if dupes.num_rows > _SHOW:
            report.problems.append(f"... {dupes.num_rows - _SHOW} more keys with several {what}")


def _check_keyed_against_kafka(
    config: PipelineConfig,
    report: AuditReport,
    covered: dict[tuple[str, int], list[tuple[int, int]]],
    earlier_epochs: int = 0,
    starts: dict[str, list[int]] | None = None,
) -> None:
    """Each key's row is the newest record of that key up to the committed ends, and a key whose
    newest record is a delete has no row: the committed records are read back with a plain
    consumer, decoded as the pipeline decodes them, and replayed here by the ordering rule
    (``offsetlake.keyed``), written out again on purpose rather than reusing the merge's code.
    Records of a re-created topic's earlier epochs are gone from Kafka: the sink's state rows of
    those epochs (visible or hidden; a ``deleted`` one is a delete) are their only witness, so
    they join the replay as the key's last records of their topic-partition in that epoch."""
    found = {"records": 0, "keys": 0, "rows_checked": 0, "deleted_keys": 0, "past_retention": 0}
    report.against_kafka = found
    chunks, unreadable = _read_committed(config, covered, found, report)
    sink = open_table(config.layout.sink)
    actual: dict[tuple, list[dict]] = {}
    for r in current_rows(sink).to_pylist() if sink is not None else []:
        actual.setdefault(_key_of(r, config.sink.key), []).append(r)
    state = state_table.pinned(config, sink)
    expected = _replayed(config, state, chunks, unreadable, {t: len(v) for t, v in (starts or {}).items()}) if chunks else {}
    deleted = {k for k, r in expected.items() if r is None}
    found["deleted_keys"] = len(deleted)
    found["keys"] = len(expected) - len(deleted)
    wrong = [problem for key, row in expected.items() for problem in _key_problems(config, key, row, actual.get(key), found)]
    # with records past retention or of a topic's earlier epoch, a row's record may be gone from Kafka
    if not found["past_retention"] and not earlier_epochs:
        for key in actual:
            if key not in expected:
                wrong.append(f"key {_shown(config, key)} has a row but no committed record of it is in Kafka")
    report.problems.extend(wrong[:_SHOW])
    if len(wrong) > _SHOW:
        report.problems.append(f"... {len(wrong) - _SHOW} more keys whose row is not their newest record")


def _check_engine_against_kafka(
    config: PipelineConfig,
    report: AuditReport,
    covered: dict[tuple[str, int], list[tuple[int, int]]],
    starts: dict[str, list[int]],
) -> None:
    """Every visible row of a merge engine's sink equals the replay, record by record, of the
    committed records read back from Kafka, decoded and transformed as the pipeline does
    (``offsetlake.engine_replay``, which shares no code with the merge): every group, every
    output column. Only while every committed record is still in Kafka and the topics were never
    re-created: otherwise the groups cannot be recomputed from Kafka, and the check says so."""
    read = {"records": 0, "past_retention": 0}
    found = {"groups": 0, "groups_checked": 0}
    if report.against_kafka is not None:
        report.against_kafka.update(found)
        found = report.against_kafka
    chunks, unreadable = _read_committed(config, covered, read, report)
    if unreadable or any(starts.values()):  # records gone from Kafka (retention, an earlier epoch of a topic)
        found["groups_skipped"] = 1
        return
    sink = open_table(config.layout.sink)
    current = {t: len(v) for t, v in starts.items()}
    rows = [r for r in _decoded_rows(config, sink, chunks, current, numbered=True) if _engine_takes(config, r)] if chunks else []
    expected = replay(config, rows)
    group = group_columns(config)
    actual = {tuple(r[c] for c in group): r for r in current_rows(sink).to_pylist()} if sink is not None else {}
    found["groups"] = len(expected)
    outputs = engine_for(config).checked_outputs()
    wrong = []
    for key in sorted(set(expected) | set(actual), key=repr):
        want, got = expected.get(key), actual.get(key)
        if want is None or got is None:
            wrong.append(f"group {key!r}: {'no visible row' if got is None else 'a visible row no committed record makes'}")
            continue
        found["groups_checked"] += 1
        for column in outputs or list(want):
            if not _close(want.get(column), got.get(column)):
                wrong.append(f"group {key!r}: {column} is {got.get(column)!r}, the replay of its records gives {want.get(column)!r}")
                break
    report.problems.extend(wrong[:_SHOW])
    if len(wrong) > _SHOW:
        report.problems.append(f"... {len(wrong) - _SHOW} more groups that differ from the replay")


def _engine_takes(config: PipelineConfig, row: dict) -> bool:
    """Whether a decoded row reaches the engine (not a dead letter for its key or window)."""
    from datetime import datetime

    if any(row.get(c) is None for c in config.sink.key):
        return False
    window = config.sink.window
    if window is None:
        return True
    at = row.get(window.on)
    if at is None:
        return False
    if config.sink.allowed_lateness is not None and isinstance(row.get(TIMESTAMP), datetime):
        return (row[TIMESTAMP] - at).total_seconds() <= duration_seconds(config.sink.allowed_lateness)
    return True


def _close(want: object, got: object) -> bool:
    """Equal, floats within the rounding a different summation order gives."""
    import math

    if isinstance(want, float) and isinstance(got, float):
        return math.isclose(want, got, rel_tol=1e-9, abs_tol=1e-9) or _same(want, got)
    return want == got


def _read_committed(
    config: PipelineConfig, covered: dict[tuple[str, int], list[tuple[int, int]]], found: dict[str, int], report: AuditReport
) -> tuple[list[tuple[str, int, list]], dict[tuple[str, int], int]]:
    """The committed records Kafka still holds, in chunks per topic-partition, and the log start
    of each topic-partition where committed offsets lie below it (retention took them)."""
    offsets = current_offsets(config)
    client = config.kafka_client_config()
    chunks: list[tuple[str, int, list]] = []
    unreadable: dict[tuple[str, int], int] = {}
    for (topic, partition), spans in sorted(covered.items()):
        if (topic, partition) not in offsets:
            report.problems.append(f"{topic}[{partition}] has committed ranges but is not a partition of {config.topic_label} any more")
            continue
        log_start = offsets[(topic, partition)].log_start
        if spans and min(start for start, _ in spans) < log_start:
            unreadable[(topic, partition)] = log_start
        for start, end in _retained(spans, log_start, found):
            for chunk in read_range(client, config.name, topic, partition, start, end, config.read_timeout_seconds):
                chunks.append((topic, partition, list(chunk)))
                found["records"] += len(chunk)
    return chunks, unreadable


def _replayed(
    config: PipelineConfig,
    state: DeltaTable | None,
    chunks: list[tuple[str, int, list]],
    unreadable: dict[tuple[str, int], int],
    current: dict[str, int],
) -> dict[tuple, dict | None]:
    """Each key's newest record (None: a delete), from the records read back, decoded and
    transformed as the pipeline does, plus the sink's state (``state``: the state table at the
    sink's pin) where Kafka no longer has the records."""
    from offsetlake.formats import CHANGE, DELETE

    readable = _decoded_rows(config, open_table(config.layout.sink), chunks, current)
    readable += _unreadable_state(state, config.sink.key, readable, unreadable, CHANGE, DELETE, current)
    return _newest_by_key(readable + _earlier_epoch_states(state, current), config.sink.key, CHANGE, DELETE)


def _decoded_rows(
    config: PipelineConfig, sink: DeltaTable | None, chunks: list[tuple[str, int, list]], current: dict[str, int], numbered: bool = False
) -> list[dict]:
    """The rows of the records read back, decoded and transformed as the pipeline does (a delete
    with ``CHANGE``), each with its topic's current epoch."""
    from pyspark.sql import functions as F

    from offsetlake import routing
    from offsetlake.formats import REASON, decoder_for, good_rows
    from offsetlake.keyed import mark_tombstones
    from offsetlake.reader import raw_dataframe
    from offsetlake.spark import spark_session
    from offsetlake.transform import apply_transform, number_rows_per_record

    decoder = decoder_for(config, sink_columns=sink_columns(sink))
    decoded = decoder.decode_in_spark(raw_dataframe(spark_session(), chunks, decoder, max_record_bytes=config.max_record_bytes))
    decoded = decoded.withColumn(REASON, F.coalesce(F.col("read_problem"), F.col(REASON)))
    if config.sink.deletes:
        decoded = mark_tombstones(decoded)
    good = good_rows(decoded, decoder)
    rows = apply_transform(good, config)
    if config.transform and numbered:  # a merge engine's contributions are per row of a record
        rows = number_rows_per_record(rows, before=good)
    rows = routing.rows_written(config, rows)  # one table of routes: its rows only
    return [{**r, TOPIC_EPOCH: current.get(r[TOPIC], 0)} for r in rows.toArrow().to_pylist()]


def _shown(config: PipelineConfig, key: tuple) -> str:
    return ", ".join(f"{c}={v!r}" for c, v in zip(config.sink.key, key, strict=True))


def _key_problems(config: PipelineConfig, key: tuple, row: dict | None, have_rows: list[dict] | None, found: dict[str, int]) -> list[str]:
    """What is wrong with one key's rows (``have_rows``) given its newest record (``row``; None:
    deleted)."""
    from offsetlake.formats import CHANGE

    shown = _shown(config, key)
    if row is None:
        return [
            f"key {shown} was deleted by its newest record but has a row (from {have[TOPIC]}[{have[PARTITION]}] offset {have[OFFSET]})"
            for have in have_rows or []
        ]
    if not have_rows:
        return [f"key {shown} has no row; its newest record is {row[TOPIC]}[{row[PARTITION]}] offset {row[OFFSET]}"]
    problems = []
    for have in have_rows:
        found["rows_checked"] += 1
        # a row written before a column was added reads null there: only values it holds compare
        differs = [c for c in row if c in have and c not in (CHANGE, HIDDEN, TOPIC_EPOCH) and not _holds(have[c], row[c])]
        if _record_of(have) != _record_of(row):
            differs.insert(0, "its record")
        if differs:
            problems.append(
                f"key {shown}: a row differs from its newest record {row[TOPIC]}[{row[PARTITION]}] offset "
                f"{row[OFFSET]} in {', '.join(differs[:5])} (row from {have[TOPIC]}[{have[PARTITION]}] offset "
                f"{have[OFFSET]})"
            )
    return problems


def _unreadable_state(
    sink: DeltaTable | None,
    key: list[str],
    readable: list[dict],
    unreadable: dict[tuple[str, int], int],
    change: str,
    delete: str,
    current: dict[str, int],
) -> list[dict]:
    """The sink's state rows (``offsetlake.keyed``: a key's last record per topic-partition,
    delete markers included) that Kafka can no longer show: in a topic-partition whose committed
    offsets start below its log start, for a key with no record read back from it, at an offset
    below the log start. A key's newest record may be one retention took (a record of another
    topic-partition it wins over by time is still in Kafka); its state row is then the only
    account of it, so the replay takes it as it is — unchecked, like the offsets past retention —
    rather than call the key's row wrong. A state row at or past the log start has its record in
    Kafka and is never taken on trust. Only rows of their topic's ``current`` epoch: those of an
    earlier epoch are replayed by ``_earlier_epoch_states``."""
    if sink is None or not unreadable:
        return []
    seen = {(_key_of(r, key), r[TOPIC], r[PARTITION]) for r in readable}
    state = []
    below = None  # only rows under some topic-partition's log start are read into Python
    for (topic, partition), log_start in unreadable.items():
        term = (pc.field(TOPIC) == topic) & (pc.field(PARTITION) == partition) & (pc.field(OFFSET) < log_start)
        below = term if below is None else below | term
    for r in sink.to_pyarrow_dataset().to_table(filter=below).to_pylist():
        tp = (r[TOPIC], r[PARTITION])
        if (r.get(TOPIC_EPOCH) or 0) != current.get(r[TOPIC], 0):
            continue
        if tp in unreadable and r[OFFSET] < unreadable[tp] and (_key_of(r, key), *tp) not in seen:
            hidden = r.pop(HIDDEN, None)
            state.append({**r, change: delete if hidden == DELETED else None})
    return state


def _earlier_epoch_states(sink: DeltaTable | None, current: dict[str, int]) -> list[dict]:
    """The sink's state rows (hidden ones too) of topic epochs before their topic's current one,
    as replayed records: a ``deleted`` state row as a delete (``CHANGE``), every other as an upsert."""
    from offsetlake.formats import CHANGE, DELETE, UPSERT

    if sink is None or not current or TOPIC_EPOCH not in table_schema(sink).names:
        return []
    older = None
    for topic, epoch in current.items():
        term = (pc.field(TOPIC) == topic) & (pc.coalesce(pc.field(TOPIC_EPOCH), pa.scalar(0, pa.int32())) < epoch)
        older = term if older is None else older | term
    rows = sink.to_pyarrow_dataset().to_table(filter=older).to_pylist()
    return [{**r, TOPIC_EPOCH: r[TOPIC_EPOCH] or 0, CHANGE: DELETE if r.get(HIDDEN) == DELETED else UPSERT} for r in rows]


def _record_of(row: dict) -> tuple:
    """Which record a row is: its coordinates and its topic epoch (null: 0)."""
    return row[TOPIC], row[PARTITION], row.get(TOPIC_EPOCH) or 0, row[OFFSET]


def _holds(stored: object, decoded: object) -> bool:
    """Whether a sink value agrees with today's decoding of its record: null in the sink (written
    before the column or nested field was added), or equal, where structs compare only the fields
    both have (a nested field today's schema dropped stays in the sink, invariant 12) and arrays
    and maps (lists of key/value pairs) compare item by item."""
    if stored is None:
        return True
    if isinstance(stored, dict) and isinstance(decoded, dict):
        return all(_holds(stored[name], decoded[name]) for name in stored.keys() & decoded.keys())
    if isinstance(stored, list | tuple) and isinstance(decoded, list | tuple):
        return len(stored) == len(decoded) and all(_holds(a, b) for a, b in zip(stored, decoded, strict=True))
    return _same(stored, decoded)


def _newest_by_key(rows: list[dict], key: list[str], change: str, delete: str) -> dict[tuple, dict | None]:
    """Each key's newest row (None: its newest record deletes it): the last per topic-partition
    by (topic epoch, offset, row index), then across topic-partitions by (timestamp, topic,
    partition, epoch, offset)."""
    last: dict[tuple, dict] = {}
    for r in rows:
        k = _key_of(r, key)
        if any(v is None for v in k):
            continue
        at = (k, r[TOPIC], r[PARTITION])
        seen = last.get(at)
        if seen is None or (
            (r.get(TOPIC_EPOCH) or 0, r[OFFSET], r.get(ROW_INDEX) or 0)
            > (seen.get(TOPIC_EPOCH) or 0, seen[OFFSET], seen.get(ROW_INDEX) or 0)
        ):
            last[at] = r
    newest: dict[tuple, dict] = {}
    for (k, _, _), r in last.items():
        seen = newest.get(k)
        if seen is None or _order(r) > _order(seen):
            newest[k] = r
    return {k: (None if r.get(change) == delete else r) for k, r in newest.items()}


class _NaN:
    """The one stand-in for a NaN key value: NaN != NaN, so a dict keyed by it finds nothing
    (issue 35, finding 10), while Spark's joins and groupings, and so the merge, take NaNs as equal."""

    def __repr__(self) -> str:
        return "nan"


_NAN = _NaN()


def _key_of(row: dict, key: list[str]) -> tuple:
    """A row's key as a dict key: NaN values as ``_NAN``."""
    return tuple(_NAN if isinstance(v, float) and v != v else v for v in (row[c] for c in key))


def _same(a: object, b: object) -> bool:
    """Equal values, a NaN equal to a NaN."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def _order(row: dict) -> tuple:
    from datetime import datetime

    stamp = row.get("_kafka_timestamp")
    return (
        stamp.timestamp() if isinstance(stamp, datetime) else float("-inf"),
        row[TOPIC],
        row[PARTITION],
        row.get(TOPIC_EPOCH) or 0,
        row[OFFSET],
    )
