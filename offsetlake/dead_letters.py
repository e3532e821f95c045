"""The pipeline's dead-letter Delta table: records that could not become sink rows.

Invariant 8: nothing is dropped, and a retry never duplicates a dead letter. A batch writes its
dead letters **before** its sink commit, as staged parquet files under the dead-letter table
(inert: no commit names them yet), and its sink commit's ledger entry lists them
(``dead_letter_files``). The dead-letter table then follows the sink: ``apply_pending`` makes ONE
dead-letter commit per sink commit, in sink-version order — it replaces the rows inside that
batch's ranges with its staged files (like a backfill), or, for a rewind, restores the table as
it was right after the rewind's target batch — and records the sink version it applied as the
table's txn, keyed by the sink table's identity (appId ``sink:<Delta table id>``). So:

* a batch that fails or dies before its sink commit changes no dead letter (its staged files
  stay inert and vacuum removes them after the retention);
* a crash between the sink commit and the dead-letter commit is repaired by the next run,
  stream, Airflow task, rewind or maintenance, which all call ``apply_pending`` first;
* the dead-letter table as of any committed batch is a table version (``version_as_of``), so a
  rewind restores dead letters exactly as it restores the sink (invariant 2's entry is the
  record of what to do; the sink commit stays the one commit point).

Two processes applying the same change conflict on the txn and the loser finds it applied.

**The dead letters follow one sink table, by its identity** (invariant 16). The sink's versions
count from 0 again in a new table (``sink.table: orders_v2``, the way forward a refused type
change suggests) or a deleted and re-created one, so a marker keyed by version alone made the
new table's first dead-letter changes look applied and left the old table's dead letters beside
the new rows (issue 35, finding 8). Each dead-letter commit names its sink table
(``sink_table_id`` in its entry) and moves that table's txn. Before the first change of a sink
table the dead-letter table does not follow, one commit makes it follow (``_follow``): it restores
the dead letters as they were after that table's last applied change — none for a new table — and
so starts clean; switching back to an earlier table brings its own dead letters back.

Lakes written before the table id: their dead-letter commits name no table and their marker is
the txn ``sink``. Such a commit belongs to a sink table only if that table's commit at the
commit's ``sink_version`` is the same batch (batch ids are unique), so the old marker is adopted
by the table it was written for and by no other (``_belongs``); the next change applied writes the
keyed marker. A lake where the old code already mixed two tables' dead letters is not repaired by
this: ``audit --against-kafka`` names the records, and a backfill of their ranges replaces them.

Sink commits made before this scheme (no ``dead_letter_files`` in their entry) wrote their dead
letters directly; they need nothing applied, and a rewind over them falls back to deleting the
dead letters of the rewound batches.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction

from offsetlake import storage
from offsetlake.config import PipelineConfig
from offsetlake.coordinates import TOPIC, Selection
from offsetlake.entry import AppliedChange, DeadLetterFile, RewindEntry, RowsEntry
from offsetlake.errors import OffsetlakeError
from offsetlake.file_stats import delta_stats
from offsetlake.history import SinkCommit, commit_infos, epoch_at, epoch_starts, sink_commits
from offsetlake.log_lines import log_line
from offsetlake.sink import (
    CommitActions,
    commit,
    create_table_once,
    live_files,
    open_table,
    readd_actions,
    remove_actions,
    txns_for,
)

log = logging.getLogger("offsetlake.dead_letters")

DEAD_LETTER_SCHEMA = pa.schema(
    [
        ("_kafka_topic", pa.string()),
        ("_kafka_partition", pa.int32()),
        ("_kafka_offset", pa.int64()),
        ("_kafka_timestamp", pa.timestamp("us", tz="UTC")),
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
        ("reason", pa.string()),
        ("pipeline", pa.string()),
        ("batch_id", pa.string()),
        # what ``reason`` says, as a code (``formats.reasons.CODES``); null in rows written before it
        ("reason_code", pa.string()),
    ]
)
REASON_CODE = "reason_code"
SINK_APP_ID = "sink"  # txn appId prefix: "sink:<table id>" = the last version of that sink table applied
_ATTEMPTS = 10


def applied_app_id(sink_table_id: str) -> str:
    """The dead-letter table's txn appId holding the last applied version of one sink table."""
    return f"{SINK_APP_ID}:{sink_table_id}"


@dataclass(frozen=True)
class SinkTable:
    """The sink table the dead letters follow: its identity and the pipeline's commits on it."""

    table_id: str
    commits: list[SinkCommit]

    @property
    def batch_at(self) -> dict[int, str]:
        return {c.version: c.batch_id for c in self.commits}


def sink_table(config: PipelineConfig) -> SinkTable | None:
    """The pipeline's sink table now (None before its first batch)."""
    table = open_table(config.layout.sink)
    return None if table is None else SinkTable(str(table.metadata().id), sink_commits(table, config.name))


# ---- before the sink commit -------------------------------------------------------------------
def stage(config: PipelineConfig, batch_id: str, rows: pa.Table) -> tuple[DeadLetterFile, ...]:
    """Write ``rows`` (DEAD_LETTER_SCHEMA) as a parquet file under the dead-letter table, named by
    no commit yet; returns what the batch's ledger entry lists (``()`` for no rows)."""
    if rows.num_rows == 0:
        return ()
    rows = conformed(rows)
    relative = f"staged/{batch_id}-{uuid.uuid4().hex[:8]}.parquet"
    fs, path = storage.filesystem(config.layout.dead_letters.child(relative))
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as out:
        pq.write_table(rows, out)
    size = fs.get_file_info(path).size
    return (DeadLetterFile(relative, size, rows.num_rows),)


# ---- after it ---------------------------------------------------------------------------------
def conformed(rows: pa.Table) -> pa.Table:
    """``rows`` as DEAD_LETTER_SCHEMA; rows written before ``reason_code`` (an older offsetlake's
    staged or table files) get it null."""
    if REASON_CODE not in rows.column_names:
        rows = rows.append_column(REASON_CODE, pa.nulls(rows.num_rows, pa.string()))
    return rows.select(DEAD_LETTER_SCHEMA.names).cast(DEAD_LETTER_SCHEMA)


def _table(config: PipelineConfig) -> DeltaTable:
    """The dead-letter table, created with DEAD_LETTER_SCHEMA if there is none. A table an older
    offsetlake created gets the nullable ``reason_code`` first, in a metadata-only commit (its
    rows read null there); two processes racing to add it both go on with the column."""
    table = create_table_once(config.layout.dead_letters, DEAD_LETTER_SCHEMA, [], f"dead letters of {config.name}")
    if REASON_CODE in table.schema().to_arrow().names:
        return table
    from deltalake.schema import Field as DeltaField

    try:
        table.alter.add_columns([DeltaField.from_arrow(DEAD_LETTER_SCHEMA.field(REASON_CODE))])
    except Exception:
        table = storage.table(config.layout.dead_letters)
        if REASON_CODE not in table.schema().to_arrow().names:
            raise
    return table


def applied_through(table: DeltaTable | None, sink: SinkTable) -> int:
    """The last version of ``sink`` whose dead-letter change the table holds (-1: none yet).

    The txn keyed by the sink's table id; for a lake written before the id, the old unkeyed
    marker if the commit that set it belongs to this sink table (see the module doc)."""
    if table is None:
        return -1
    version = table.transaction_version(applied_app_id(sink.table_id))
    if version is not None:
        return version
    if table.transaction_version(SINK_APP_ID) is None:
        return -1
    legacy = next((meta for _, meta in _marked_newest_first(table) if meta.sink_table_id is None), None)
    return legacy.sink_version if legacy is not None and _belongs(legacy, sink) else -1


def pending(config: PipelineConfig, sink: SinkTable | None = None) -> list[SinkCommit]:
    """Commits of the pipeline's sink table whose dead-letter change the dead-letter table does not
    hold yet, oldest first."""
    sink = sink or sink_table(config)
    if sink is None:
        return []
    changes = [c for c in sink.commits if c.entry.dead_letter_change]
    if not changes:
        return []
    done = applied_through(open_table(config.layout.dead_letters), sink)
    return [c for c in changes if c.version > done]


def apply_pending(config: PipelineConfig) -> int:
    """Apply every pending dead-letter change, one dead-letter commit per sink commit, in sink
    order; returns how many were applied (by this call)."""
    sink = sink_table(config)
    applied = 0
    for change in pending(config, sink):
        assert sink is not None  # there are changes, so there is a sink
        if _apply(config, change, sink):
            applied += 1
    return applied


def _apply(config: PipelineConfig, change: SinkCommit, sink: SinkTable) -> bool:
    """ONE dead-letter commit for ``change`` (txn ``sink:<table id>`` = its sink version); False if
    another process applied it first. A dead-letter table that does not follow ``sink`` yet is
    made to follow it first (``_follow``, its own commit)."""
    for attempt in range(_ATTEMPTS):
        table = _table(config)
        if applied_through(table, sink) >= change.version:
            return False
        if not _follows(table, sink):
            _follow(config, table, sink)
            continue
        restore = _restore_to(change)
        if restore is not None:
            files = _restore_actions(config, table, restore[1], restore[0], sink)
        else:
            files = _replace_actions(config, table, change, sink.commits)
        entry = AppliedChange(pipeline=config.name, batch_id=change.batch_id, sink_version=change.version, sink_table_id=sink.table_id)
        try:
            commit(
                table,
                CommitActions(files=files, txns=txns_for([(applied_app_id(sink.table_id), change.version)])),
                entry,
                partition_by=None,
                max_commit_retries=0,
            )
        except CommitFailedError:  # a concurrent apply or compaction: read the table again
            continue
        log_line(
            log,
            "dead_letters",
            "applied",
            pipeline=config.name,
            batch=change.batch_id,
            sink_version=change.version,
            actions=len(files),
            attempt=attempt + 1,
        )
        return True
    raise OffsetlakeError(
        f"the dead letters of batch {change.batch_id} (sink version "
        f"{change.version}) could not be applied in {_ATTEMPTS} attempts; run again",
        pipeline=config.name,
    )


# ---- which sink table the dead letters follow -------------------------------------------------
def _belongs(meta: AppliedChange, sink: SinkTable) -> bool:
    """Whether a dead-letter commit (its entry) applied a change of ``sink``: by the table id it
    names, or, written before table ids, by the batch it applied being ``sink``'s commit at that
    version (batch ids are unique: a commit of another table never matches)."""
    if meta.sink_table_id is not None:
        return meta.sink_table_id == sink.table_id
    return sink.batch_at.get(meta.sink_version) == meta.batch_id


def _follows(table: DeltaTable, sink: SinkTable) -> bool:
    """Whether the dead-letter table's live rows are ``sink``'s: its newest marked commit belongs to
    ``sink``. An empty table follows any sink; so does one written only by the scheme before
    dead-letter commits were marked (its rows are taken as the current sink's, as they were)."""
    newest = next(_marked_newest_first(table), None)
    return newest is None or _belongs(newest[1], sink)


def _follow(config: PipelineConfig, table: DeltaTable, sink: SinkTable) -> None:
    """ONE dead-letter commit that makes the table follow ``sink``: its live files become those of
    the table right after ``sink``'s last applied change (none for a new or re-created sink table:
    it starts clean). Its txn is ``sink``'s marker, unchanged (0 for none: version 0 of a sink is
    its create commit, never a change), so it conflicts with a concurrent apply or follow."""
    applied = applied_through(table, sink)
    version = 0 if applied < 0 else _version_as_of(table, sink, applied)
    if version is None:
        raise OffsetlakeError(
            f"the dead letters at {config.dead_letter_path} cannot be restored as they were "
            f"after sink version {applied} of {config.sink_path}: their history holds writes of an old scheme that "
            "name no sink version. Nothing was changed; backfill the sink's ranges to rewrite its dead letters",
            pipeline=config.name,
        )
    files = _diff_to(config, table, version)
    entry = AppliedChange(pipeline=config.name, batch_id=f"follow-{sink.table_id}", sink_version=applied, sink_table_id=sink.table_id)
    try:
        commit(
            table,
            CommitActions(files=files, txns=txns_for([(applied_app_id(sink.table_id), max(applied, 0))])),
            entry,
            partition_by=None,
            max_commit_retries=0,
        )
    except CommitFailedError:  # a concurrent apply or follow: the caller reads the table again
        return
    log_line(
        log,
        "dead_letters",
        "now follow the sink table",
        pipeline=config.name,
        sink=config.sink_path,
        sink_table_id=sink.table_id,
        applied_through=applied,
        actions=len(files),
    )


def _marked_newest_first(table: DeltaTable) -> Iterator[tuple[int, AppliedChange]]:
    """(version, entry) of the dead-letter table's marked commits, newest first, read a few commit
    files at a time (what is asked is nearly always the newest). An unmarked write of the scheme
    before marked commits ends the walk: nothing older says which sink it followed."""
    newest = table.version()
    while newest > 0:
        first = max(1, newest - 9)
        for info in reversed(commit_infos(table, first, newest)):
            meta = _marked(info)
            if meta is not None:
                yield int(info["version"]), meta
            elif info.get("operation") not in _NO_DATA_CHANGE:
                return
        newest = first - 1


def _replace_actions(config: PipelineConfig, table: DeltaTable, change: SinkCommit, commits: list[SinkCommit]) -> list:
    """Removes of the files holding dead letters of the batch's records, an add of their other
    rows (rewritten), and adds of the batch's staged files. Dead letters of an earlier epoch of
    a topic (before ``offsetlake topic reset-epoch``) are other records at the same offsets: they
    stay (invariant 16)."""
    selected = Selection.of_entry(change.entry)
    staged = change.entry.staged if isinstance(change.entry, RowsEntry) else None
    touched = [f for f in live_files(table) if selected.file_may_hold(f)]
    actions: list = remove_actions(touched, [])
    kept = _rows_outside(config, touched, _kept_by(change, commits))
    if kept.num_rows:
        actions += _add_files(config, stage(config, change.batch_id, kept))
    return actions + _add_files(config, staged or ())


def _earlier_epoch_batches(commits: list[SinkCommit], change: SinkCommit) -> dict[str, list[str]]:
    """Per topic of ``change`` that had an epoch reset: the batches of its earlier epochs."""
    starts = epoch_starts(commits)
    out: dict[str, list[str]] = {}
    for topic in change.entry.topics() & set(starts):
        now = epoch_at(starts[topic], change.version)
        out[topic] = [c.batch_id for c in commits if epoch_at(starts[topic], c.version) < now]
    return out


def _kept_by(change: SinkCommit, commits: list[SinkCommit]) -> pc.Expression | None:
    """The dead letters a change keeps: those outside its ranges, and those of an earlier epoch of
    their topic (None: all of them)."""
    kept = Selection.of_entry(change.entry).outside()
    for topic, batches in _earlier_epoch_batches(commits, change).items():
        older = (pc.field(TOPIC) == topic) & pc.field("batch_id").isin(batches)
        kept = older if kept is None else (kept | older)
    return kept


def _rows_outside(config: PipelineConfig, files: list[dict[str, Any]], kept: pc.Expression | None) -> pa.Table:
    parts = []
    for f in files:
        fs, path = storage.filesystem(storage.data_file(config.layout.dead_letters, f["path"]))
        with fs.open_input_file(path) as handle:
            rows = pq.read_table(handle)
        parts.append(rows.filter(kept) if kept is not None else rows)
    return pa.concat_tables([conformed(p) for p in parts]) if parts else DEAD_LETTER_SCHEMA.empty_table()


def _add_files(config: PipelineConfig, staged: Iterable[DeadLetterFile]) -> list:
    """Add actions for staged files (their statistics read from their footers)."""
    fs, _ = storage.filesystem(config.layout.dead_letters)
    actions = []
    for s in staged:
        _, path = storage.filesystem(config.layout.dead_letters.child(s.path))
        try:
            with fs.open_input_file(path) as handle:
                metadata = pq.read_metadata(handle)
        except FileNotFoundError:
            raise OffsetlakeError(
                f"staged dead-letter file {path} is gone (vacuumed before it was applied?); its batch's dead letters cannot be applied",
                pipeline=config.name,
            ) from None
        actions.append(
            AddAction(
                path=s.path,
                size=s.size,
                partition_values={},
                modification_time=int(time.time() * 1000),
                data_change=True,
                stats=delta_stats(metadata),
            )
        )
    return actions


# ---- the table as of a sink version (rewind) --------------------------------------------------
def version_as_of(config: PipelineConfig, sink_version: int) -> int | None:
    """The dead-letter table version holding its state right after version ``sink_version`` of the
    pipeline's sink table, or None when the table's history cannot say (dead letters written
    before this scheme)."""
    table = open_table(config.layout.dead_letters)
    sink = sink_table(config)
    if table is None or sink is None:
        return None
    return _version_as_of(table, sink, sink_version)


def _version_as_of(table: DeltaTable, sink: SinkTable, sink_version: int) -> int | None:
    best = 0  # the empty table as created: a sink table's state before its first change
    for info in commit_infos(table, 0, table.version()):
        meta = _marked(info)
        version = int(info["version"])
        if meta is not None:
            if _belongs(meta, sink) and meta.sink_version <= sink_version:
                best = max(best, version)
        elif version > 0 and info.get("operation") not in _NO_DATA_CHANGE:
            return None  # a dead-letter write of the old scheme: no version maps to a sink version
    return best


_NO_DATA_CHANGE = {"CREATE TABLE", "OPTIMIZE", "SET TBLPROPERTIES", "VACUUM START", "VACUUM END", "CHECKPOINT"}


def _marked(info: dict) -> AppliedChange | None:
    return AppliedChange.parse(info.get("userMetadata"))


def _restore_to(change: SinkCommit) -> tuple[RewindEntry, int] | None:
    """``change``'s entry and the sink version it restores the dead letters to, if it is a
    rewind that does (else None)."""
    entry = change.entry
    if isinstance(entry, RewindEntry) and entry.restore_to_sink_version is not None:
        return entry, entry.restore_to_sink_version
    return None


def missing_files_as_of(config: PipelineConfig, version: int) -> list[str]:
    """Data files of dead-letter table ``version`` that are gone from storage (vacuumed)."""
    then = storage.table(config.layout.dead_letters, version=version)
    now = {f["path"] for f in live_files(storage.table(config.layout.dead_letters))}
    return [
        f["path"]
        for f in live_files(then)
        if f["path"] not in now and not storage.exists(storage.data_file(config.layout.dead_letters, f["path"]))
    ]


def _restore_actions(config: PipelineConfig, table: DeltaTable, to_sink_version: int, change: RewindEntry, sink: SinkTable) -> list:
    """Removes and re-adds that make the live files those of the table as of ``to_sink_version``
    (or, for dead letters of the old scheme, removes of the rewound batches' rows)."""
    version = _version_as_of(table, sink, to_sink_version)
    if version is None:
        return _legacy_delete_actions(config, table, list(change.rewound))
    return _diff_to(config, table, version)


def _diff_to(config: PipelineConfig, table: DeltaTable, version: int) -> list:
    """Removes and re-adds that make ``table``'s live files those of its ``version``."""
    now = {f["path"]: f for f in live_files(table)}
    then = {f["path"]: f for f in live_files(storage.table(config.layout.dead_letters, version=version))}
    return [
        *remove_actions([now[p] for p in sorted(set(now) - set(then))], []),
        *readd_actions(config.layout.dead_letters, [then[p] for p in sorted(set(then) - set(now))], []),
    ]


def _legacy_delete_actions(config: PipelineConfig, table: DeltaTable, batch_ids: list[str]) -> list:
    gone = pc.field("batch_id").isin(batch_ids)
    touched = []
    kept_parts = []
    for f in live_files(table):
        fs, path = storage.filesystem(storage.data_file(config.layout.dead_letters, f["path"]))
        with fs.open_input_file(path) as handle:
            rows = pq.read_table(handle)
        if rows.filter(gone).num_rows:
            touched.append(f)
            kept_parts.append(conformed(rows.filter(~gone)))
    actions: list = remove_actions(touched, [])
    kept = pa.concat_tables(kept_parts) if kept_parts else DEAD_LETTER_SCHEMA.empty_table()
    if kept.num_rows:
        actions += _add_files(config, stage(config, "rewind-kept", kept))
    return actions


# ---- reading ----------------------------------------------------------------------------------
def count_by_batch(config: PipelineConfig, batch_ids: list[str]) -> dict[str, int]:
    """How many dead letters each of ``batch_ids`` wrote that the table holds now (0 for none)."""
    table = open_table(config.layout.dead_letters)
    if table is None or not batch_ids:
        return {b: 0 for b in batch_ids}
    found = table.to_pyarrow_dataset().to_table(columns=["batch_id"], filter=pc.field("batch_id").isin(batch_ids))
    counts = {r["batch_id"]: r["count_all"] for r in found.group_by("batch_id").aggregate([([], "count_all")]).to_pylist()}
    return {b: counts.get(b, 0) for b in batch_ids}


def coordinates_applied(config: PipelineConfig, columns: list[str]) -> pa.Table:
    """``columns`` of every dead letter as the table will hold them once its pending changes are
    applied (what an audit checks: a crash between a sink commit and its dead-letter commit is a
    state the next run repairs, not a loss)."""
    table = open_table(config.layout.dead_letters)
    sink = sink_table(config)
    empty = DEAD_LETTER_SCHEMA.empty_table().select(columns)
    rows = table.to_pyarrow_dataset().to_table(columns=columns) if table is not None else empty
    if sink is None:
        return rows
    changes = pending(config, sink)
    if changes and table is not None and not _follows(table, sink):  # the rows of the sink table's own last state
        applied = applied_through(table, sink)
        start = 0 if applied < 0 else _version_as_of(table, sink, applied)
        if start is not None:
            rows = storage.table(config.layout.dead_letters, version=start).to_pyarrow_dataset().to_table(columns=columns)
    for change in changes:
        restore = _restore_to(change)
        if restore is not None:
            version = None if table is None else _version_as_of(table, sink, restore[1])
            if version is None:
                rows = rows.filter(~pc.field("batch_id").isin(list(restore[0].rewound))) if "batch_id" in columns else rows
            else:
                rows = storage.table(config.layout.dead_letters, version=version).to_pyarrow_dataset().to_table(columns=columns)
            continue
        kept = _kept_by(change, sink.commits) if "batch_id" in columns else Selection.of_entry(change.entry).outside()
        if kept is not None:
            rows = rows.filter(kept)
        for s in (change.entry.staged if isinstance(change.entry, RowsEntry) else None) or ():
            fs, path = storage.filesystem(config.layout.dead_letters.child(s.path))
            with fs.open_input_file(path) as handle:
                rows = pa.concat_tables([rows, pq.read_table(handle, columns=columns).cast(rows.schema)])
    return rows


def row_count(config: PipelineConfig) -> int:
    table = open_table(config.layout.dead_letters)
    return 0 if table is None else sum(int(f.get("num_records") or 0) for f in live_files(table))


def rows_readded_by_restore(config: PipelineConfig, version: int) -> int:
    """Dead letters a restore to ``version`` brings back (in files later commits removed)."""
    now = {f["path"] for f in live_files(storage.table(config.layout.dead_letters))}
    return sum(
        int(f.get("num_records") or 0)
        for f in live_files(storage.table(config.layout.dead_letters, version=version))
        if f["path"] not in now
    )
