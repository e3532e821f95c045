"""A merge engine's batch states, kept beside its state table so a backfill need not fold every
contribution again (issue 51: a 1 % backfill folded all 10,010,000 contributions left after 10M
records, 5.1× a batch).

An ingest whose read tasks fold its contributions (the direct path, ``offsetlake.engine_arrow``)
already holds their fold, one row per group (``engine_merge.BatchContributions.held``). That fold
is written here as a **segment**: one parquet file under ``<state table>/_offsetlake_segments/``
naming, in its footer, the contribution files it is the exact fold of. A backfill folds the
groups it touches from every contribution outside its ranges; for the contribution files a
usable segment covers it reads the segment's rows of those groups instead (about one row per
group and batch, not one per record).

A segment is a cache and never the truth: the contributions stay in the state table, and a
segment is used only when every file it names is live in the state version the backfill merges
on (``usable``). So a crash before the batch's commit (its files never live), a rewind, a fold
below the horizon or a backfill that rewrites one of its files (one of them removed), a segment
cut short, unreadable or of another schema, all leave it unused and its files read as before: the
backfill's result is the same either way, only slower. Two segments that name a file in common
are never both used, nor one naming a file with a deletion vector. The folder
starts with ``_``: Delta readers and vacuum leave it alone; ``offsetlake maintain`` removes the
segments no live file needs (``remove_unused``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from offsetlake import storage

log = logging.getLogger(__name__)

FOLDER = "_offsetlake_segments"
FILES_KEY = b"offsetlake.segment.files"  # the footer's JSON list of the files it folds (paths under the table root)


@dataclass(frozen=True)
class Segment:
    """One segment: its path under the table root, the contribution files it folds, its rows."""

    path: str
    files: frozenset[str]
    rows: int
    modified_s: float  # seconds since the epoch, from the store's listing


def write(table_root: storage.Location, batch_id: str, states: pa.Table, files: Iterable[str]) -> str | None:
    """Write ``states`` (one row per group: the fold of every contribution in ``files``, paths
    under ``table_root`` as ``sink.StagedFile`` has them) as a segment; its path, or None when
    there is nothing to cover or the store refused it (logged: a backfill then reads the files)."""
    names = sorted(set(files))
    if not names:
        return None
    relative = f"{FOLDER}/segment-{batch_id}-{uuid.uuid4().hex[:12]}.parquet"
    fs, root = storage.filesystem(table_root)
    root = root.rstrip("/")
    metadata = {**(states.schema.metadata or {}), FILES_KEY: json.dumps(names).encode()}
    try:
        if isinstance(fs, pafs.LocalFileSystem):
            fs.create_dir(f"{root}/{FOLDER}", recursive=True)
        with fs.open_output_stream(f"{root}/{relative}") as out:
            pq.write_table(states.replace_schema_metadata(metadata), out)
    except OSError as err:
        log.warning("step=segment batch=%s not written (a backfill reads its %d files instead): %s", batch_id, len(names), err)
        return None
    return relative


def listed(table_root: storage.Location) -> list[Segment]:
    """Every segment whose footer reads; one that does not (cut short, not parquet) is left out."""
    fs, root = storage.filesystem(table_root)
    root = root.rstrip("/")
    try:
        infos = fs.get_file_info(pafs.FileSelector(f"{root}/{FOLDER}", allow_not_found=True))
    except OSError:
        return []
    out = []
    for info in sorted(infos, key=lambda i: i.path):
        if info.type != pafs.FileType.File or not info.path.endswith(".parquet"):
            continue
        try:
            with fs.open_input_file(info.path) as handle:
                meta = pq.read_metadata(handle)
            files = json.loads((meta.metadata or {})[FILES_KEY])
        except (OSError, KeyError, ValueError, pa.ArrowException):
            continue
        modified = info.mtime.timestamp() if info.mtime is not None else 0.0
        out.append(Segment(f"{FOLDER}/{info.path.rsplit('/', 1)[1]}", frozenset(files), meta.num_rows, modified))
    return out


def usable(segments: list[Segment], files: Iterable[str]) -> list[Segment]:
    """The segments that fold only files of ``files`` (paths under the table root), no two naming
    a file in common (the first of them, by path, wins): what a fold may take instead of them."""
    offered = set(files)
    taken: set[str] = set()
    out = []
    for segment in segments:
        if segment.files <= offered and not (segment.files & taken):
            out.append(segment)
            taken |= segment.files
    return out


def read(table_root: storage.Location, segments: list[Segment], schema: pa.Schema) -> pa.Table | None:
    """The rows of ``segments`` as one table of ``schema`` (a merge engine's states), or None when
    one of them is unreadable or of another schema (the caller then reads their files)."""
    tables = [schema.empty_table()]
    for segment in segments:
        table = rows_of(table_root, segment)
        if table is None or table.schema.remove_metadata() != schema.remove_metadata():
            return None
        tables.append(table.replace_schema_metadata(schema.metadata))
    return pa.concat_tables(tables)


def rows_of(table_root: storage.Location, segment: Segment) -> pa.Table | None:
    """One segment's rows in the schema it was written with, or None when it is unreadable."""
    fs, path = storage.filesystem(table_root.child(segment.path))
    try:
        with fs.open_input_file(path) as handle:
            return pq.read_table(handle)
    except (OSError, pa.ArrowException):
        return None


def remove_unused(table_root: storage.Location, live: Iterable[str], older_than_s: float) -> int:
    """Delete the segments that name a file no longer in ``live`` (removed by a fold, a rewind or a
    backfill: never usable again), and unreadable ones, last written more than ``older_than_s``
    ago (a batch in flight writes its segment before its commit makes its files live). Returns
    how many were deleted."""
    fs, root = storage.filesystem(table_root)
    root = root.rstrip("/")
    live_files = set(live)
    readable = {s.path: s for s in listed(table_root)}
    try:
        infos = fs.get_file_info(pafs.FileSelector(f"{root}/{FOLDER}", allow_not_found=True))
    except OSError:
        return 0
    cutoff = time.time() - older_than_s
    removed = 0
    for info in infos:
        relative = f"{FOLDER}/{info.path.rsplit('/', 1)[1]}"
        segment = readable.get(relative)
        modified = info.mtime.timestamp() if info.mtime is not None else 0.0
        if info.type != pafs.FileType.File or modified > cutoff or (segment is not None and segment.files <= live_files):
            continue
        fs.delete_file(info.path)
        removed += 1
    return removed


def covered_files(segments: list[Segment]) -> set[str]:
    return {f for s in segments for f in s.files}


def file_paths(files: list[dict[str, Any]]) -> list[str]:
    """``sink.live_files`` rows as the paths segments name (the log's paths, unescaped), leaving out
    a file with a deletion vector: its live rows are no longer all the rows it was written with."""
    return [
        storage.file_path_from_log(f["path"]) for f in files if not any(k.startswith("deletion") and v is not None for k, v in f.items())
    ]
