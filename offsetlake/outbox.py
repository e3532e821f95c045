"""Lake -> Kafka: ``offsetlake publish`` sends a Delta sink's changes to a topic, exactly once and
in sink version order, so that a consumer following the rule below holds what the table holds
after every version it has read (issue 48, findings 3 and 5: the first contract published only
markers for a rewind and nothing for rows a backfill removed, and consumers lost and kept rows).

Each sink version that changed rows becomes one Kafka transaction (``offsetlake.kafka_transactions``)
holding its records and the outbox's progress: a record keyed ``<pipeline>><topic>`` in the
compacted topic ``offsetlake-outbox-progress`` whose value names the sink table and the last
published version. Progress and output commit together, so a publisher killed anywhere published
a version wholly or not at all, and the next one (which fences it first) starts after the last
whole one.

**What a version publishes.** Records about source coordinates (``offsetlake.topic``,
``.partition``, ``.offset`` and, from a topic's second epoch on, ``.epoch``), each with
``offsetlake.sink_version``, ``offsetlake.batch``, ``offsetlake.kind`` and ``offsetlake.op``:

* ``op=row``: one row the coordinate has at that version (value: the row as JSON);
* ``op=delete``: the coordinate has no row at that version though it had one before (value null).

An ingest or stream commit publishes the rows of its ranges; a backfill the rows of its ranges at
its version and a delete for each coordinate that lost its last row (a filter added, a record now a
dead letter); a rewind the same for the ranges of every batch it undid (the restored earlier rows,
deletes for rows it took away); a commit offsetlake did not make (``offsetlake.foreign``: a user's
DELETE or UPDATE) the same for each coordinate whose rows it changed, kind ``foreign``. Gaps,
epoch commits and maintenance change no row and publish only the progress.

**The consumer's rule** (docs/guides/kafka-outbox.md): keep, per coordinate, the rows of the
highest sink version seen. A record of a higher version replaces the coordinate's rows (a delete
leaves none); a row of the same version joins them (a transform may make several rows of one
record); a record of a lower version is stale and is dropped. Following it, the consumer equals the
table at every version, in whatever order it reads the topic's partitions. ``check_outbox``
replays the topic by this rule and compares it with the table (``offsetlake publish --check``).

Only append sinks: a keyed sink's rows are not per source record.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from offsetlake import storage
from offsetlake.config import PipelineConfig
from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TOPIC, TOPIC_EPOCH, Selection
from offsetlake.errors import ConfigError
from offsetlake.foreign import read_change
from offsetlake.history import ForeignCommit, SinkCommit, foreign_commits, sink_commits
from offsetlake.kafka import group_id
from offsetlake.kafka_transactions import (
    NOT_IN_VALUES,
    OutputRecord,
    TransactionalWriter,
    ensure_topics,
    read_committed_records,
    read_one_partition,
    record_key,
    row_record,
)
from offsetlake.plan import BatchKind
from offsetlake.sink import table_id
from offsetlake.sink_values import encode_json
from offsetlake.write_modes import write_mode

log = logging.getLogger("offsetlake.outbox")

PROGRESS_TOPIC = "offsetlake-outbox-progress"
FOREIGN = "foreign"  # the kind of a commit offsetlake did not make, as the outbox names it
ROW_OP = ("offsetlake.op", b"row")
DELETE_OP = ("offsetlake.op", b"delete")


@dataclass(frozen=True)
class Progress:
    """Where an outbox stands: the sink table it publishes and the last sink version it published."""

    sink_table_id: str | None = None
    version: int = -1
    batch_id: str | None = None


@dataclass(frozen=True)
class Published:
    """One sink commit published: its batch, kind, version and how many records it sent."""

    batch_id: str
    kind: str
    sink_version: int
    records: int

    def as_dict(self) -> dict[str, Any]:
        return {"batch_id": self.batch_id, "kind": self.kind, "sink_version": self.sink_version, "records": self.records}


def progress_key(config: PipelineConfig, topic: str) -> bytes:
    return f"{config.name}>{topic}".encode()


def publish(config: PipelineConfig, to_topic: str, key_columns: Sequence[str] = (), max_batches: int | None = None) -> list[Published]:
    """Publish every sink version after the outbox's progress that changed rows to ``to_topic``
    (at most ``max_batches`` of them), one transaction each; returns what was published, in order."""
    write_mode(config).refuse_publish()
    client = config.kafka_client_config()
    ensure_topics(client, config.name, [to_topic], {PROGRESS_TOPIC: {"cleanup.policy": "compact"}})
    table = storage.open_table(config.layout.sink)
    with TransactionalWriter(client, config.name, slot=f"outbox-{to_topic}") as writer:
        progress = read_progress(config, to_topic)  # after the writer fenced any earlier publisher
        if table is None:
            return []
        columns = table.schema().to_arrow().names
        missing = [c for c in key_columns if c not in columns]
        if missing:
            raise ConfigError(f"--key names {missing}, not columns of the sink (it has {columns})", pipeline=config.name, field="--key")
        identity = table_id(table)
        if progress.sink_table_id not in (None, identity):
            raise ConfigError(
                f"topic '{to_topic}' was published from another sink table ({progress.sink_table_id}, up to its version "
                f"{progress.version}); the sink is now table {identity}. Publish it to a new topic",
                pipeline=config.name,
            )
        commits = sink_commits(table, config.name)
        pending = [c for c in _changes(table, config.name, commits) if c.version > progress.version]
        published = []
        for change in pending[:max_batches]:
            published.append(_publish_change(config, writer, to_topic, change, commits, identity, key_columns))
        return published


Change = SinkCommit | ForeignCommit


def _changes(table: DeltaTable, pipeline: str, commits: list[SinkCommit]) -> list[Change]:
    """offsetlake's commits and the foreign ones, in version order: every version that may have changed rows."""
    found: list[Change] = [*commits, *foreign_commits(table, pipeline)]
    return sorted(found, key=lambda c: c.version)


def _publish_change(
    config: PipelineConfig,
    writer: TransactionalWriter,
    to_topic: str,
    change: Change,
    commits: list[SinkCommit],
    identity: str | None,
    key_columns: Sequence[str],
) -> Published:
    started = time.monotonic()
    version = change.version
    batch_id, kind = (change.batch_id, str(change.kind)) if isinstance(change, SinkCommit) else (f"foreign-{version}", FOREIGN)
    records = list(change_records(config, change, commits, key_columns))
    progress = json.dumps({"sink_table_id": identity, "version": version, "batch_id": batch_id}).encode()
    done = writer.commit(batch_id, kind, to_topic, records, {}, also=[(PROGRESS_TOPIC, progress_key(config, to_topic), progress)])
    log.info(
        "publish pipeline=%s batch=%s kind=%s sink_version=%d topic=%s records=%d ms=%d",
        config.name,
        batch_id,
        kind,
        version,
        to_topic,
        done.records,
        int((time.monotonic() - started) * 1000),
    )
    return Published(batch_id, kind, version, done.records)


def change_records(config: PipelineConfig, change: Change, commits: list[SinkCommit], key_columns: Sequence[str]) -> Iterator[OutputRecord]:
    """The records one sink version publishes (module docstring), in source order."""
    if isinstance(change, ForeignCommit):
        touched = _coordinates_touched(config, change)
        yield from _version_records(config, change.version, _where_coordinates(touched), key_columns, only_changed=True)
        return
    if change.kind in (BatchKind.INGEST, BatchKind.STREAM):
        yield from _version_records(config, change.version, _selection(change).arrow(), key_columns, with_deletes=False)
    elif change.kind == BatchKind.BACKFILL:
        yield from _version_records(config, change.version, _selection(change).arrow(), key_columns)
    elif change.kind == BatchKind.REWIND:
        undone = set(getattr(change.entry, "rewound", ()))
        terms = [where for c in commits if c.batch_id in undone and (where := _selection(c).arrow()) is not None]
        yield from _version_records(config, change.version, _any_of(terms), key_columns)


def _selection(commit: SinkCommit) -> Selection:
    return Selection(commit.entry.offset_ranges, commit.entry.record_time, dict(commit.entry.topic_epochs))


def _any_of(terms: list[pc.Expression]) -> pc.Expression | None:
    where = None
    for term in terms:
        where = term if where is None else where | term
    return where


def _version_records(
    config: PipelineConfig,
    version: int,
    where: pc.Expression | None,
    key_columns: Sequence[str],
    with_deletes: bool = True,
    only_changed: bool = False,
) -> Iterator[OutputRecord]:
    """The rows ``where`` selects at ``version`` (``op=row``) and, ``with_deletes``, a delete for
    each coordinate ``where`` selected just before ``version`` that has no row at it;
    ``only_changed``: only coordinates whose rows differ from just before."""
    if where is None:
        return
    after = _rows_by_coordinate(config, version, where)
    before = _rows_by_coordinate(config, version - 1, where) if (with_deletes or only_changed) and version > 0 else {}
    for coordinate in sorted(set(after) | (set(before) if with_deletes else set())):
        rows = after.get(coordinate, [])
        if only_changed and Counter(encode_json(_value(r)) for r in rows) == Counter(
            encode_json(_value(r)) for r in before.get(coordinate, [])
        ):
            continue
        marks = _marks(version, coordinate)
        if rows:
            for row in rows:
                record = row_record(row, key_columns)
                yield OutputRecord(record.key, record.value, record.topic, record.partition, record.offset, (*marks, ROW_OP))
        else:
            gone = before[coordinate][0]
            topic, partition, offset, _ = coordinate
            yield OutputRecord(record_key(gone, key_columns), None, topic, partition, offset, (*marks, DELETE_OP))


def _marks(version: int, coordinate: Coordinate) -> tuple[tuple[str, bytes], ...]:
    marks: tuple[tuple[str, bytes], ...] = (("offsetlake.sink_version", str(version).encode()),)
    if coordinate[3]:
        marks += (("offsetlake.epoch", str(coordinate[3]).encode()),)
    return marks


Coordinate = tuple[str, int, int, int]  # topic, partition, offset, epoch


def _rows_by_coordinate(config: PipelineConfig, version: int, where: pc.Expression | None) -> dict[Coordinate, list[dict[str, Any]]]:
    """The sink's rows at ``version`` that ``where`` selects (None: all), per source coordinate
    (with the epoch), each coordinate's rows in row order (``_kafka_row``)."""
    then = storage.table(config.layout.sink, version=version)
    rows = then.to_pyarrow_dataset().to_table(filter=where) if where is not None else then.to_pyarrow_table()
    order = [(c, "ascending") for c in (TOPIC, PARTITION, OFFSET, ROW_INDEX) if c in rows.column_names]
    out: dict[Coordinate, list[dict[str, Any]]] = {}
    for row in rows.sort_by(order).to_pylist():
        out.setdefault((row[TOPIC], row[PARTITION], row[OFFSET], row.get(TOPIC_EPOCH) or 0), []).append(row)
    return out


def _value(row: dict[str, Any]) -> dict[str, Any]:
    """A row's value as published (the row_record value: no coordinates), nulls left out, so a
    row written before a nullable column was added compares equal to itself read after."""
    return {k: v for k, v in row.items() if k not in NOT_IN_VALUES and v is not None}


def _coordinates_touched(config: PipelineConfig, change: ForeignCommit) -> set[tuple[str, int, int]]:
    """The source records whose rows sit in the files a foreign commit removed or added."""
    table = storage.table(config.layout.sink, version=change.version)
    found = read_change(storage.table_place(table), config.name, change)
    return {(t, p, o) for t, p, o, _, _ in set(found.before) | set(found.after)}


def _where_coordinates(coordinates: set[tuple[str, int, int]]) -> pc.Expression | None:
    by_partition: dict[tuple[str, int], list[int]] = {}
    for topic, partition, offset in coordinates:
        by_partition.setdefault((topic, partition), []).append(offset)
    terms = [
        (pc.field(TOPIC) == topic) & (pc.field(PARTITION) == partition) & pc.field(OFFSET).isin(pa.array(sorted(offsets), pa.int64()))
        for (topic, partition), offsets in sorted(by_partition.items())
    ]
    return _any_of(terms)


@dataclass
class OutboxCheck:
    """``check_outbox``'s verdict: the topic replayed by the consumer's rule against the sink
    table at the last published version."""

    topic: str
    version: int  # the last published sink version (-1: nothing yet)
    records: int = 0
    coordinates: int = 0  # coordinates with rows in the table at ``version``
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        head = (
            f"outbox {self.topic}: {self.records} records replayed by the consumer's rule against the sink at version "
            f"{self.version} ({self.coordinates} source records with rows)"
        )
        if self.ok:
            return f"{head}\nOK: a consumer following the rule holds exactly the table's rows"
        shown = "\n".join(f"  - {p}" for p in self.problems[:20])
        more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
        return f"{head}\nFAILED ({len(self.problems)} differences):\n{shown}{more}"


def check_outbox(config: PipelineConfig, to_topic: str) -> OutboxCheck:
    """Replay ``to_topic`` as the guide tells a consumer to (module docstring: per coordinate, the
    rows of the highest sink version seen) and compare what it holds with the sink table at the
    last version the outbox published: every source record's rows, no more, no fewer."""
    progress = read_progress(config, to_topic)
    check = OutboxCheck(to_topic, progress.version)
    view: dict[Coordinate, tuple[int, list[str]]] = {}
    group = f"{group_id(config.name)}-outbox-check"
    for _, value, headers in read_committed_records(config.kafka_client_config(), to_topic, config.name, group):
        check.records += 1
        coordinate = (
            headers["offsetlake.topic"].decode(),
            int(headers["offsetlake.partition"]),
            int(headers["offsetlake.offset"]),
            int(headers.get("offsetlake.epoch", b"0")),
        )
        version = int(headers["offsetlake.sink_version"])
        rows = [] if headers.get("offsetlake.op") == b"delete" else [_normal(json.loads(value or b"null"))]
        held = view.get(coordinate)
        if held is None or version > held[0]:
            view[coordinate] = (version, rows)
        elif version == held[0]:
            held[1].extend(rows)
    if progress.version < 0:
        return check
    expected = {
        coordinate: sorted(_normal(json.loads(encode_json(_value(r)))) for r in rows)
        for coordinate, rows in _rows_by_coordinate(config, progress.version, None).items()
    }
    check.coordinates = len(expected)
    seen = {c: sorted(rows) for c, (_, rows) in view.items() if rows}
    for coordinate in sorted(set(expected) | set(seen)):
        want, got = expected.get(coordinate, []), seen.get(coordinate, [])
        if want != got:
            where = f"{coordinate[0]}[{coordinate[1]}] offset {coordinate[2]}" + (f" (epoch {coordinate[3]})" if coordinate[3] else "")
            check.problems.append(
                f"{where}: the table has {len(want)} row(s), a consumer holds {len(got)}" + (" that differ" if want and got else "")
            )
    return check


def _normal(value: Any) -> str:
    """A published value in one spelling: JSON with sorted keys and null fields left out at every
    depth (a field added to a struct later reads null in older rows, absent in what they published)."""
    return json.dumps(_without_nulls(value), sort_keys=True)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def read_progress(config: PipelineConfig, to_topic: str) -> Progress:
    """The outbox's last committed progress: the newest value of its key in the progress topic,
    read by a read_committed consumer up to the stable offset."""
    key = progress_key(config, to_topic)
    found = Progress()
    for _, found_key, value in read_one_partition(
        config.kafka_client_config(), PROGRESS_TOPIC, f"{group_id(config.name)}-outbox-reader", config.name
    ):
        if found_key == key and value:
            body = json.loads(value)
            found = Progress(body.get("sink_table_id"), int(body["version"]), body.get("batch_id"))
    return found
