"""The pipeline's dead-letter Delta table: records that could not become sink rows.

Invariant 8: nothing is dropped, and a retry never duplicates a dead letter. A batch writes its
dead letters **before** its sink commit, as staged parquet files under the dead-letter table
(inert: no commit names them yet), and its sink commit's ledger entry lists them
(``dead_letter_files``). The dead-letter table then follows the sink: ``apply_pending`` makes ONE
dead-letter commit per sink commit, in sink-version order — it replaces the rows inside that
batch's ranges with its staged files (like a backfill), or, for a rewind, restores the table as
it was right after the rewind's target batch — and records the sink version it applied as the
table's txn (appId ``sink``). So:

* a batch that fails or dies before its sink commit changes no dead letter (its staged files
  stay inert and vacuum removes them after the retention);
* a crash between the sink commit and the dead-letter commit is repaired by the next run,
  stream, Airflow task, rewind or maintenance, which all call ``apply_pending`` first;
* the dead-letter table as of any committed batch is a table version (``version_as_of``), so a
  rewind restores dead letters exactly as it restores the sink (invariant 2's entry is the
  record of what to do; the sink commit stays the one commit point).

Two processes applying the same change conflict on the txn and the loser finds it applied.
Sink commits made before this scheme (no ``dead_letter_files`` in their entry) wrote their dead
letters directly; they need nothing applied, and a rewind over them falls back to deleting the
dead letters of the rewound batches.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction

from offsetlake import storage
from offsetlake.config import PipelineConfig
from offsetlake.coordinates import Selection
from offsetlake.errors import OffsetlakeError
from offsetlake.history import SinkCommit, commit_infos, sink_commits
from offsetlake.log_lines import log_line
from offsetlake.sink import (
    CommitActions,
    commit,
    create_table_once,
    file_stats,
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
    ]
)
STAGED = "dead_letter_files"  # ledger entry key: the batch's staged files (a replace of its ranges)
RESTORE = "dead_letter_restore"  # ledger entry key of a rewind: {"to_sink_version": v}
SINK_APP_ID = "sink"  # txn of the dead-letter table: the last sink version whose change it applied
_ATTEMPTS = 10


# ---- before the sink commit -------------------------------------------------------------------
def stage(config: PipelineConfig, batch_id: str, rows: pa.Table) -> list[dict[str, Any]]:
    """Write ``rows`` (DEAD_LETTER_SCHEMA) as a parquet file under the dead-letter table, named by
    no commit yet; returns what the batch's ledger entry lists (``[]`` for no rows)."""
    if rows.num_rows == 0:
        return []
    rows = rows.cast(DEAD_LETTER_SCHEMA)
    relative = f"staged/{batch_id}-{uuid.uuid4().hex[:8]}.parquet"
    fs, path = storage.filesystem(storage.child(config.dead_letter_path, relative))
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as out:
        pq.write_table(rows, out)
    size = fs.get_file_info(path).size
    return [{"path": relative, "size": size, "rows": rows.num_rows}]


# ---- after it ---------------------------------------------------------------------------------
def _table(config: PipelineConfig) -> DeltaTable:
    return create_table_once(config.dead_letter_path, DEAD_LETTER_SCHEMA, [], f"dead letters of {config.name}")


def applied_through(table: DeltaTable | None) -> int:
    """The last sink version whose dead-letter change the table holds (-1: none yet)."""
    if table is None:
        return -1
    version = table.transaction_version(SINK_APP_ID)
    return -1 if version is None else version


def pending(config: PipelineConfig, commits: list[SinkCommit] | None = None) -> list[SinkCommit]:
    """Sink commits whose dead-letter change the dead-letter table does not hold yet, oldest first."""
    if commits is None:
        commits = sink_commits(open_table(config.sink_path), config.name)
    done = applied_through(open_table(config.dead_letter_path))
    return [c for c in commits if c.version > done and (STAGED in c.entry or RESTORE in c.entry)]


def apply_pending(config: PipelineConfig, commits: list[SinkCommit] | None = None) -> int:
    """Apply every pending dead-letter change, one dead-letter commit per sink commit, in sink
    order; returns how many were applied (by this call)."""
    applied = 0
    for change in pending(config, commits):
        if _apply(config, change):
            applied += 1
    return applied


def _apply(config: PipelineConfig, change: SinkCommit) -> bool:
    """ONE dead-letter commit for ``change`` (txn = its sink version); False if another process
    applied it first."""
    for attempt in range(_ATTEMPTS):
        table = _table(config)
        if applied_through(table) >= change.version:
            return False
        if RESTORE in change.entry:
            files = _restore_actions(config, table, int(change.entry[RESTORE]["to_sink_version"]), change)
        else:
            files = _replace_actions(config, table, change)
        entry = {"pipeline": config.name, "batch_id": change.batch_id, "kind": "dead_letters",
                 "sink_version": change.version}
        try:
            commit(table, CommitActions(files=files, txns=txns_for([(SINK_APP_ID, change.version)])), entry,
                   partition_by=None, max_commit_retries=0)
        except CommitFailedError:  # a concurrent apply or compaction: read the table again
            continue
        log_line(log, "dead_letters", "applied", pipeline=config.name, batch=change.batch_id,
                 sink_version=change.version, actions=len(files), attempt=attempt + 1)
        return True
    raise OffsetlakeError(f"pipeline {config.name}: the dead letters of batch {change.batch_id} (sink version "
                          f"{change.version}) could not be applied in {_ATTEMPTS} attempts; run again")


def _replace_actions(config: PipelineConfig, table: DeltaTable, change: SinkCommit) -> list:
    """Removes of the files holding dead letters of the batch's records, an add of their other
    rows (rewritten), and adds of the batch's staged files."""
    selected = Selection.of_entry(change.entry)
    touched = [f for f in live_files(table) if selected.file_may_hold(f)]
    actions: list = remove_actions(touched, [])
    kept = _rows_outside(config, touched, selected)
    if kept.num_rows:
        actions += _add_files(config, stage(config, change.batch_id, kept))
    return actions + _add_files(config, change.entry.get(STAGED, []))


def _rows_outside(config: PipelineConfig, files: list[dict[str, Any]], selected: Selection) -> pa.Table:
    outside = selected.outside()
    parts = []
    for f in files:
        fs, path = storage.filesystem(storage.data_file(config.dead_letter_path, f["path"]))
        with fs.open_input_file(path) as handle:
            rows = pq.read_table(handle)
        parts.append(rows.filter(outside) if outside is not None else rows)
    return pa.concat_tables([p.cast(DEAD_LETTER_SCHEMA) for p in parts]) if parts else DEAD_LETTER_SCHEMA.empty_table()


def _add_files(config: PipelineConfig, staged: list[dict[str, Any]]) -> list:
    """Add actions for staged files (their statistics read from their footers)."""
    fs, _ = storage.filesystem(config.dead_letter_path)
    actions = []
    for s in staged:
        _, path = storage.filesystem(storage.child(config.dead_letter_path, s["path"]))
        try:
            with fs.open_input_file(path) as handle:
                metadata = pq.read_metadata(handle)
        except FileNotFoundError:
            raise OffsetlakeError(
                f"pipeline {config.name}: staged dead-letter file {path} is gone (vacuumed before it was applied?); "
                "its batch's dead letters cannot be applied"
            ) from None
        actions.append(AddAction(path=s["path"], size=int(s["size"]), partition_values={},
                                 modification_time=int(time.time() * 1000), data_change=True,
                                 stats=json.dumps(file_stats(metadata))))
    return actions


# ---- the table as of a sink version (rewind) --------------------------------------------------
def version_as_of(config: PipelineConfig, sink_version: int) -> int | None:
    """The dead-letter table version holding its state right after sink version ``sink_version``,
    or None when the table's history cannot say (dead letters written before this scheme)."""
    table = open_table(config.dead_letter_path)
    if table is None:
        return None
    best = 0  # the empty table as created
    for info in commit_infos(table, 0, table.version()):
        meta = _marked(info)
        version = int(info["version"])
        if meta is not None:
            if int(meta.get("sink_version", -1)) <= sink_version:
                best = max(best, version)
        elif version > 0 and info.get("operation") not in _NO_DATA_CHANGE:
            return None  # a dead-letter write of the old scheme: no version maps to a sink version
    return best


_NO_DATA_CHANGE = {"CREATE TABLE", "OPTIMIZE", "SET TBLPROPERTIES", "VACUUM START", "VACUUM END", "CHECKPOINT"}


def _marked(info: dict) -> dict | None:
    raw = info.get("userMetadata")
    if not raw:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    return meta if isinstance(meta, dict) and meta.get("offsetlake") == 1 and meta.get("kind") == "dead_letters" else None


def missing_files_as_of(config: PipelineConfig, version: int) -> list[str]:
    """Data files of dead-letter table ``version`` that are gone from storage (vacuumed)."""
    then = storage.table(config.dead_letter_path, version=version)
    now = {f["path"] for f in live_files(storage.table(config.dead_letter_path))}
    return [f["path"] for f in live_files(then)
            if f["path"] not in now and not storage.exists(storage.data_file(config.dead_letter_path, f["path"]))]


def _restore_actions(config: PipelineConfig, table: DeltaTable, to_sink_version: int, change: SinkCommit) -> list:
    """Removes and re-adds that make the live files those of the table as of ``to_sink_version``
    (or, for dead letters of the old scheme, removes of the rewound batches' rows)."""
    version = version_as_of(config, to_sink_version)
    if version is None:
        return _legacy_delete_actions(config, table, list(change.entry.get("rewound", [])))
    now = {f["path"]: f for f in live_files(table)}
    then = {f["path"]: f for f in live_files(storage.table(config.dead_letter_path, version=version))}
    return [*remove_actions([now[p] for p in sorted(set(now) - set(then))], []),
            *readd_actions(config.dead_letter_path, [then[p] for p in sorted(set(then) - set(now))], [])]


def _legacy_delete_actions(config: PipelineConfig, table: DeltaTable, batch_ids: list[str]) -> list:
    gone = pc.field("batch_id").isin(batch_ids)
    touched = []
    kept_parts = []
    for f in live_files(table):
        fs, path = storage.filesystem(storage.data_file(config.dead_letter_path, f["path"]))
        with fs.open_input_file(path) as handle:
            rows = pq.read_table(handle)
        if rows.filter(gone).num_rows:
            touched.append(f)
            kept_parts.append(rows.filter(~gone).cast(DEAD_LETTER_SCHEMA))
    actions: list = remove_actions(touched, [])
    kept = pa.concat_tables(kept_parts) if kept_parts else DEAD_LETTER_SCHEMA.empty_table()
    if kept.num_rows:
        actions += _add_files(config, stage(config, "rewind-kept", kept))
    return actions


# ---- reading ----------------------------------------------------------------------------------
def count_by_batch(config: PipelineConfig, batch_ids: list[str]) -> dict[str, int]:
    """How many dead letters each of ``batch_ids`` wrote that the table holds now (0 for none)."""
    table = open_table(config.dead_letter_path)
    if table is None or not batch_ids:
        return {b: 0 for b in batch_ids}
    found = table.to_pyarrow_dataset().to_table(columns=["batch_id"], filter=pc.field("batch_id").isin(batch_ids))
    counts = {r["batch_id"]: r["count_all"] for r in found.group_by("batch_id").aggregate([([], "count_all")]).to_pylist()}
    return {b: counts.get(b, 0) for b in batch_ids}


def coordinates_applied(config: PipelineConfig, columns: list[str]) -> pa.Table:
    """``columns`` of every dead letter as the table will hold them once its pending changes are
    applied (what an audit checks: a crash between a sink commit and its dead-letter commit is a
    state the next run repairs, not a loss)."""
    table = open_table(config.dead_letter_path)
    empty = DEAD_LETTER_SCHEMA.empty_table().select(columns)
    rows = table.to_pyarrow_dataset().to_table(columns=columns) if table is not None else empty
    for change in pending(config):
        if RESTORE in change.entry:
            version = version_as_of(config, int(change.entry[RESTORE]["to_sink_version"]))
            if version is None:
                rows = rows.filter(~pc.field("batch_id").isin(list(change.entry.get("rewound", [])))) \
                    if "batch_id" in columns else rows
            else:
                rows = storage.table(config.dead_letter_path, version=version).to_pyarrow_dataset().to_table(columns=columns)
            continue
        outside = Selection.of_entry(change.entry).outside()
        if outside is not None:
            rows = rows.filter(outside)
        for s in change.entry.get(STAGED, []):
            fs, path = storage.filesystem(storage.child(config.dead_letter_path, s["path"]))
            with fs.open_input_file(path) as handle:
                rows = pa.concat_tables([rows, pq.read_table(handle, columns=columns).cast(rows.schema)])
    return rows


def row_count(config: PipelineConfig) -> int:
    table = open_table(config.dead_letter_path)
    return 0 if table is None else sum(int(f.get("num_records") or 0) for f in live_files(table))


def rows_readded_by_restore(config: PipelineConfig, version: int) -> int:
    """Dead letters a restore to ``version`` brings back (in files later commits removed)."""
    now = {f["path"] for f in live_files(storage.table(config.dead_letter_path))}
    return sum(int(f.get("num_records") or 0) for f in live_files(storage.table(config.dead_letter_path, version=version))
               if f["path"] not in now)
