"""Where files live: lake locations, the filesystem that reaches them, and Delta's path rules.

The one place that turns a lake location (a local folder, or a URI such as ``file://...``)
into what each library needs — a path for delta-rs, a (filesystem, path) pair for pyarrow, a
URI for people — and that turns a data file path as Delta's log stores it into the file's path
under the table and back. Everything that opens a table, lists, reads or writes a file under the
lake goes through here, so a lake path with a space, ``#``, ``?`` or a non-ASCII character, and a
partition value that needs escaping, are handled the same way by every writer, remover and
reader (ingest, backfill, rewind, maintenance, the history cache, the audit).

Two facts checked on this machine drive the rules (deltalake 1.6.6, pyarrow):

* pyarrow's ``FileSystem.from_uri`` parses its argument as a URI, so an unescaped local path is
  cut at ``#`` or ``?`` and refused with a space; local paths therefore never go through a URI
  here, they go to ``LocalFileSystem`` as paths.
* Delta's log stores a data file's path URI-encoded (delta-rs encodes the path it is given in an
  ``AddAction``/``RemoveAction``, and ``get_add_actions`` returns the encoded form), so a path
  read back from the log is decoded before it is used as a file path or handed to an action.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError
from pyarrow import fs as pafs

HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # how Spark names the folder of a null partition value


# ---- lake locations ---------------------------------------------------------------------------
def is_uri(location: str) -> bool:
    return "://" in location


def resolve_location(location: str, base: Path) -> str:
    """An absolute location: URIs as given (without a trailing slash), relative paths under ``base``."""
    if is_uri(location):
        if location.startswith("file://"):
            return str(Path(unquote(urlsplit(location).path)).resolve())
        return location.rstrip("/")
    candidate = Path(location)
    return str(candidate if candidate.is_absolute() else (base / candidate).resolve())


def child(location: str, *parts: str) -> str:
    """``location/part/...`` (locations and their children are always joined with ``/``)."""
    return "/".join([location.rstrip("/"), *(p.strip("/") for p in parts)])


def display_uri(location: str) -> str:
    """A URI for people and links (``file:///...`` percent-encoded for local folders)."""
    return location if is_uri(location) else Path(location).resolve().as_uri()


def location_problem(location: str) -> str | None:
    """Why delta-rs cannot address ``location``, or None when it can.

    Checked here with deltalake 1.6.6 on local folders, each character in a folder name: ``%``
    is decoded as an escape (``x%20y`` became ``x y``: "File not found"), ``\\`` too, ``[ ] ^ |``
    make it panic ("Invalid object store url"), and a control character is an illegal path
    segment. ``#``, ``?``, spaces, quotes and non-ASCII letters work (see ``history``). These are
    refused when a pipeline loads, never half-way through a batch.
    """
    if not is_uri(location):
        bad = sorted({c for c in location if c in _UNADDRESSABLE})
        if bad:
            shown = " ".join(repr(c) for c in bad)
            return f"contains {shown}, which delta-rs cannot open a table under; rename the folder"
    control = [c for c in location if unicodedata.category(c) == "Cc"]
    if control:
        return f"contains the control character {control[0]!r}, which delta-rs refuses in paths"
    return None


_UNADDRESSABLE = "%[]^|\\"


# ---- filesystems ------------------------------------------------------------------------------
def filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem holding ``location`` and the location's path on it.

    A local folder is a plain path on ``LocalFileSystem`` (never parsed as a URI); a URI goes to
    the filesystem pyarrow has for its scheme.
    """
    if not is_uri(location):
        return pafs.LocalFileSystem(), os.path.abspath(location)
    return pafs.FileSystem.from_uri(location)


def exists(location: str) -> bool:
    fs, path = filesystem(location)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


# ---- Delta tables -----------------------------------------------------------------------------
def open_table(location: str, version: int | None = None) -> DeltaTable | None:
    """The Delta table at ``location`` (at ``version``), or None when there is none yet."""
    try:
        return DeltaTable(location, version=version)
    except TableNotFoundError:
        return None


def table(location: str, version: int | None = None) -> DeltaTable:
    """The Delta table at ``location``; raises TableNotFoundError when there is none."""
    return DeltaTable(location, version=version)


def table_location(delta_table: DeltaTable) -> str:
    """The location of an open table, in this module's terms (a local path or a URI)."""
    uri = delta_table.table_uri.rstrip("/")
    if uri.startswith("file://"):
        return unquote(urlsplit(uri).path)
    return uri


# ---- Delta's data file paths ------------------------------------------------------------------
def file_path_from_log(log_path: str) -> str:
    """A data file's path under the table as Delta's log stores it (URI-encoded) -> the file's
    real relative path, which is also what ``AddAction``/``RemoveAction`` take (delta-rs encodes
    it again when it writes the log)."""
    return unquote(log_path)


def log_path_from_file_path(relative: str) -> str:
    """The inverse of ``file_path_from_log``: how the log stores a relative file path."""
    return quote(relative, safe="/=")


def data_file(table_root: str, log_path: str) -> str:
    """The location of one data file from its path as the log stores it."""
    return child(table_root, file_path_from_log(log_path))


def partition_values_from_path(relative: str) -> dict[str, str | None]:
    """Partition values from the ``col=value/`` folders of a file Spark wrote (Hive escaping:
    ``%XX`` for reserved characters, ``__HIVE_DEFAULT_PARTITION__`` for null)."""
    values: dict[str, str | None] = {}
    for segment in relative.split("/")[:-1]:
        key, sep, value = segment.partition("=")
        if sep:
            values[unquote(key)] = None if value == HIVE_NULL else unquote(value)
    return values
