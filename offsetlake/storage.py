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
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import DeltaError, TableNotFoundError
from pyarrow import fs as pafs

from offsetlake.errors import CatalogManagedTableError, StorageError

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


def table_uri(location: str) -> str:
    """A table's URI as Airflow Assets and lineage name it: object storage as it is, a local
    folder as ``file://``."""
    if is_uri(location) and not location.startswith("file://"):
        return location.rstrip("/")
    return Path(resolve_location(location, Path.cwd())).as_uri()


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
    elif "%" in location and not location.startswith("file://"):
        # delta-rs decodes a %XX in the table's URI once, pyarrow (and the data files' folder
        # names under it) take the key as written: the two would address different objects
        return "contains '%'; write the characters themselves (s3://bucket/my lake, not my%20lake)"
    control = [c for c in location if unicodedata.category(c) == "Cc"]
    if control:
        return f"contains the control character {control[0]!r}, which delta-rs refuses in paths"
    return None


_UNADDRESSABLE = "%[]^|\\"


# ---- storage options ----------------------------------------------------------------------------
# Object-store settings (delta-rs / object_store keys such as AWS_ENDPOINT_URL, AWS_REGION,
# AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ALLOW_HTTP) travel with the location they are for
# (``Location``), so two pipelines on one bucket with different credentials each reach it with
# their own, and none reaches a log line, the ledger or a table's metadata.

# Keys offsetlake refuses: each would make a commit on object storage unsafe or hang a run.
UNSAFE_OPTIONS = {
    "aws_conditional_put": "offsetlake commits only with put-if-absent; leave it unset (the default, If-None-Match)",
    "aws_s3_allow_unsafe_rename": "an unsafe rename lets two writers overwrite each other's commit; "
    "offsetlake commits with put-if-absent instead, so leave it unset",
    "aws_s3_locking_provider": "deltalake 1.6 ignores lock providers (commits are put-if-absent); remove it",
    "aws_copy_if_not_exists": "offsetlake commits with put-if-absent, not copy-if-not-exists; remove it",
}
# Keys whose values are not secrets (shown in status output and errors); every other value is.
_SHOWN_OPTIONS = {
    "aws_endpoint_url",
    "aws_endpoint",
    "endpoint",
    "endpoint_url",
    "aws_region",
    "region",
    "aws_allow_http",
    "allow_http",
    "aws_virtual_hosted_style_request",
    "virtual_hosted_style_request",
    "timeout",
    "connect_timeout",
    "max_retries",
    "retry_timeout",
    "aws_default_region",
}
# Without these, one unreachable endpoint holds a run for minutes (object_store's defaults:
# 10 retries, 180 s); a user's own value wins.
_DEFAULT_OPTIONS = {"timeout": "30s", "connect_timeout": "10s", "max_retries": "3", "retry_timeout": "60s"}


def normalized_options(options: Mapping[str, str]) -> dict[str, str]:
    """Option keys in object_store's lower-case form (delta-rs accepts either)."""
    return {str(k).lower(): str(v) for k, v in options.items()}


def option_problem(key: str, value: str) -> str | None:
    """Why offsetlake refuses this storage option, or None."""
    key = key.lower()
    if key in UNSAFE_OPTIONS:
        return UNSAFE_OPTIONS[key]
    return None


def effective_options(location: str, options: Mapping[str, str] | None) -> dict[str, str] | None:
    """What the store clients get for ``location``: None for a local folder; for a URI the given
    settings on top of offsetlake's timeouts (with none given, the defaults alone, and the client
    reads credentials from the environment the way delta-rs does)."""
    if not is_uri(location) or location.startswith("file://"):
        return None
    return {**_DEFAULT_OPTIONS, **normalized_options(options or {})}


@dataclass(frozen=True)
class Location:
    """A location in or under a lake (a local folder or a URI) with the object-store settings
    that reach it: what every function here that touches a store takes.

    Build one with ``Location.of``: ``options`` is then None for a local folder and, for a URI, the
    pipeline's settings on top of the default timeouts. Equal only with equal settings (the
    safety probe is per location and settings); its repr shows the path, never a setting.
    """

    path: str
    options: Mapping[str, str] | None = field(default=None, repr=False, hash=False)

    @classmethod
    def of(cls, location: str, options: Mapping[str, str] | None = None) -> Location:
        return cls(location, effective_options(location, options))

    def child(self, *parts: str) -> Location:
        """``path/part/...`` reached with the same settings."""
        return Location(child(self.path, *parts), self.options)

    def __str__(self) -> str:
        return self.path


Where = Location | str  # a bare str: a local folder, or a URI reached with the default settings


def _reach(where: Where) -> tuple[str, dict[str, str] | None]:
    """(path, store options) of ``where``."""
    if isinstance(where, Location):
        return where.path, dict(where.options) if where.options is not None else None
    return where, effective_options(where, None)


def shown_options(options: dict[str, str]) -> dict[str, str]:
    """``options`` for people: secrets (every value not known to be harmless) as ``***``."""
    return {k: (v if k.lower() in _SHOWN_OPTIONS else "***") for k, v in options.items()}


def scheme(location: str) -> str:
    """``file`` for local folders, else the URI scheme (``s3``, ``gs``, ``az``, ``abfss``, ...)."""
    return urlsplit(location).scheme.lower() if is_uri(location) else "file"


# ---- filesystems ------------------------------------------------------------------------------
def filesystem(where: Where) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem holding ``where`` and the location's path on it.

    A local folder is a plain path on ``LocalFileSystem`` (never parsed as a URI); an ``s3://``
    location gets an ``S3FileSystem`` built from the location's own settings (the same ones
    delta-rs uses; Spark tasks get them with the ``Location`` the driver ships); other URIs go
    to the filesystem pyarrow has for their scheme.
    """
    location, options = _reach(where)
    if not is_uri(location):
        return pafs.LocalFileSystem(), os.path.abspath(location)
    if scheme(location) in ("s3", "s3a"):
        parts = urlsplit(location)
        # the key as written: a data file's folder holds Spark's escapes (customer=a%2Fb) literally
        return s3_filesystem(options or {}), f"{parts.netloc}{parts.path}".rstrip("/")
    return pafs.FileSystem.from_uri(location)


def s3_filesystem(options: dict[str, str]) -> pafs.S3FileSystem:
    """pyarrow's S3 client configured from object_store's keys (endpoint, region, credentials,
    http, addressing style, timeouts)."""
    o = normalized_options(options)

    def get(*keys: str) -> str | None:
        return next((o[k] for k in keys if o.get(k)), None)

    kwargs: dict[str, object] = {}
    endpoint = get("aws_endpoint_url", "aws_endpoint", "endpoint_url", "endpoint")
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        kwargs["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
        kwargs["scheme"] = parts.scheme
    region = get("aws_region", "region", "aws_default_region")
    if region:
        kwargs["region"] = region
    key, secret = get("aws_access_key_id", "access_key_id"), get("aws_secret_access_key", "secret_access_key")
    if key and secret:
        kwargs["access_key"], kwargs["secret_key"] = key, secret
        token = get("aws_session_token", "session_token", "aws_token", "token")
        if token:
            kwargs["session_token"] = token
    kwargs["force_virtual_addressing"] = (
        get("aws_virtual_hosted_style_request", "virtual_hosted_style_request") or "false"
    ).lower() == "true"
    timeout = _seconds(get("timeout"))
    if timeout:
        kwargs["request_timeout"] = timeout
    connect = _seconds(get("connect_timeout"))
    if connect:
        kwargs["connect_timeout"] = connect
    retries = get("max_retries")
    if retries is not None and retries.isdigit():
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=int(retries) + 1)
    return pafs.S3FileSystem(**kwargs)


def _seconds(text: str | None) -> float | None:
    """object_store durations ("30s", "500ms", "2m", "1.5") in seconds."""
    if not text:
        return None
    text = text.strip().lower()
    for unit, factor in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return float(text[: -len(unit)]) * factor
    return float(text) if text.replace(".", "", 1).isdigit() else None


def exists(where: Where) -> bool:
    fs, path = filesystem(where)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


# ---- Delta tables -----------------------------------------------------------------------------
def open_table(where: Where, version: int | None = None) -> DeltaTable | None:
    """The Delta table at ``where`` (at ``version``), or None when there is none yet."""
    try:
        return table(where, version)
    except TableNotFoundError:
        return None


def table(where: Where, version: int | None = None) -> DeltaTable:
    """The Delta table at ``where``; raises TableNotFoundError when there is none, and
    CatalogManagedTableError when its commits belong to a catalog: delta-rs refuses to load a
    table with the ``catalogManaged`` (or ``catalogOwned-preview``) feature without the catalog's
    version, and that refusal becomes one that says what to do."""
    location, options = _reach(where)
    try:
        opened = DeltaTable(location, version=version, storage_options=options)
    except DeltaError as err:
        if "catalog-managed" in str(err) or "catalog version" in str(err).lower():
            raise _catalog_managed(location) from None
        raise
    _OPENED_AT[id(opened)] = Location(location, options)
    weakref.finalize(opened, _OPENED_AT.pop, id(opened), None)
    return opened


# The location each open table was opened at, with its settings: what reaches the table's own
# files (its log, the history cache) when a caller holds only the table. An entry lives as long
# as its table object (DeltaTable is not hashable, so by id, dropped when the table is).
_OPENED_AT: dict[int, Location] = {}


def _catalog_managed(location: str) -> CatalogManagedTableError:
    return CatalogManagedTableError(
        f"the Delta table at {location} is catalog-managed (table feature catalogManaged, e.g. a Unity Catalog managed "
        "table): its commits must go through the catalog that owns it, and offsetlake commits to a table's folder "
        "directly (delta-rs cannot commit through a catalog). Nothing was read or written. Point the pipeline's lake at "
        "a folder of its own (offsetlake creates path-based tables there, which a catalog can name as external tables), "
        "or have the catalog's owner turn the table into an external one"
    )


def table_place(delta_table: DeltaTable) -> Location:
    """Where an open table lives, with the settings it was opened with (``table``)."""
    return _OPENED_AT.get(id(delta_table)) or Location.of(table_location(delta_table))


def create_table(where: Where, schema: pa.Schema, **kwargs: Any) -> None:
    """``DeltaTable.create`` at ``where`` with its storage options."""
    location, options = _reach(where)
    DeltaTable.create(location, schema, storage_options=options, **kwargs)


def append(where: Where, data: pa.Table, **kwargs: Any) -> None:
    """``write_deltalake(mode="append")`` at ``where`` with its storage options."""
    location, options = _reach(where)
    write_deltalake(location, data, mode="append", storage_options=options, **kwargs)


def is_table(where: Where) -> bool:
    location, options = _reach(where)
    return DeltaTable.is_deltatable(location, storage_options=options)


def table_location(delta_table: DeltaTable) -> str:
    """The location of an open table, in this module's terms (a local path or a URI)."""
    uri = delta_table.table_uri.rstrip("/")
    if uri.startswith("file://"):
        return unquote(urlsplit(uri).path)
    parts = urlsplit(uri)  # delta-rs gives the path URI-encoded (a space as %20); keys are written as is
    return f"{parts.scheme}://{parts.netloc}{unquote(parts.path)}"


# ---- Delta's data file paths ------------------------------------------------------------------
def file_path_from_log(log_path: str) -> str:
    """A data file's path under the table as Delta's log stores it (URI-encoded) -> the file's
    real relative path, which is also what ``AddAction``/``RemoveAction`` take (delta-rs encodes
    it again when it writes the log)."""
    return unquote(log_path)


def log_path_from_file_path(relative: str) -> str:
    """The inverse of ``file_path_from_log``: how the log stores a relative file path."""
    return quote(relative, safe="/=")


def data_file(table_root: Location, log_path: str) -> Location:
    """The location of one data file from its path as the log stores it."""
    return table_root.child(file_path_from_log(log_path))


# The characters Spark's ExternalCatalogUtils.escapePathName escapes as %XX in a partition folder
# name; it writes the rest as UTF-8. Every data path names folders with these (``partition_folder``)
# and the Spark path sizes a value's folder name with them before writing (``process``).
PARTITION_ESCAPES = frozenset("\"#%'*/:=?\\\x7f{[]^" + "".join(chr(c) for c in range(1, 32)))
# A partition value becomes a folder name ``<column>=<value>``, which Linux (and most filesystems)
# caps at 255 bytes.
MAX_FOLDER_NAME_BYTES = 255


def escape_partition_value(value: str) -> str:
    """``value`` as Spark writes it in a folder name: each of ``PARTITION_ESCAPES`` as ``%XX``."""
    return "".join(f"%{ord(c):02X}" if c in PARTITION_ESCAPES else c for c in value)


def stores_as_null(value: Any) -> bool:
    """Whether a partition value is stored as null: Delta's protocol reads an empty partition
    value as null and Spark writes "" to the default partition, so "" cannot be kept; such
    rows are counted (``StagedFile.empty_as_null``) and the YAML reference says so."""
    return value is None or value == ""


def partition_folder(column: str, value: Any) -> str:
    """``column=value`` as Spark names the folder (null and "" both as Hive's default partition);
    ``partition_values_from_path`` reads it back."""
    if stores_as_null(value):
        text = HIVE_NULL
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, datetime):
        text = value.isoformat(sep=" ")
    elif isinstance(value, date):
        text = value.isoformat()
    else:
        text = escape_partition_value(str(value))
    return f"{escape_partition_value(column)}={text}"


def partition_values_from_path(relative: str) -> dict[str, str | None]:
    """Partition values from the ``col=value/`` folders of a file Spark wrote (Hive escaping:
    ``%XX`` for reserved characters, ``__HIVE_DEFAULT_PARTITION__`` for null)."""
    values: dict[str, str | None] = {}
    for segment in relative.split("/")[:-1]:
        key, sep, value = segment.partition("=")
        if sep:
            values[unquote(key)] = None if value == HIVE_NULL else unquote(value)
    return values


# ---- the safety probe -------------------------------------------------------------------------
_CLIENT_KEYS = {
    "allow_http",
    "allow_invalid_certificates",
    "connect_timeout",
    "timeout",
    "proxy_url",
    "proxy_ca_certificate",
    "proxy_excludes",
    "user_agent",
    "pool_idle_timeout",
    "read_timeout",
}
_PROBED: set[Location] = set()


def check_store(where: Where, pipeline: str) -> None:
    """Refuse an object store offsetlake cannot commit to safely, before anything is read.

    Every Delta commit on object storage is a put-if-absent of the next log file (delta-rs sends
    ``If-None-Match: *``); exactly-once (invariant 10: two writers at one version, one wins)
    holds only if the store rejects the second put. This writes a probe object under
    ``<location>/_offsetlake_probe/`` with put-if-absent twice, through object_store (the
    same client delta-rs commits with, same settings), and requires the second to be refused;
    then deletes it. It also turns an unknown bucket, refused credentials and an unreachable
    endpoint into one clear error naming the pipeline and the setting. Done once per location and
    its settings per process; local folders need no probe (delta-rs commits there with an atomic
    rename-if-absent).
    """
    location, reached = _reach(where)
    probed = Location(location, reached)
    if scheme(location) == "file" or probed in _PROBED:
        return
    import obstore
    from obstore.exceptions import AlreadyExistsError

    where = f"lake {location}"
    options = reached or {}
    try:
        store = _object_store(location, options)
        key = f"_offsetlake_probe/{os.getpid()}-{uuid.uuid4().hex}"
        obstore.put(store, key, b"1", mode="create")
        try:
            obstore.put(store, key, b"2", mode="create")
        except AlreadyExistsError:
            pass
        else:
            obstore.delete(store, key)
            raise StorageError(
                f"{where}: the store accepted a second put-if-absent of the same object, so two writers could "
                "overwrite each other's Delta commit; offsetlake needs conditional writes (If-None-Match on PUT, "
                "as AWS S3, MinIO and Ceph RGW support); use a store or version that supports them",
                pipeline=pipeline,
            )
        obstore.delete(store, key)
    except StorageError:
        raise
    except NotImplementedError as err:
        raise StorageError(
            f"{where}: put-if-absent is disabled by the storage settings ({_first_line(err)}); remove the setting", pipeline=pipeline
        ) from None
    except Exception as err:
        raise StorageError(f"{where}: {_store_problem(err, location, options)}", pipeline=pipeline) from None
    _PROBED.add(probed)


def _object_store(location: str, options: dict[str, str]) -> Any:
    from obstore.store import from_url

    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    retry: dict[str, Any] = {}
    for key, value in normalized_options(options).items():
        bare = key.removeprefix("aws_")
        if bare in _CLIENT_KEYS:
            client[bare] = value.lower() == "true" if bare in ("allow_http", "allow_invalid_certificates") else value
        elif key == "max_retries":
            retry["max_retries"] = int(value)
        elif key == "retry_timeout":
            retry["retry_timeout"] = timedelta(seconds=_seconds(value) or 60)
        else:
            config[key] = value
    open_store: Any = from_url  # its overloads want literal keys; these come from the user's settings
    return open_store(location, config=config, client_options=client, retry_config=retry or None)


def _store_problem(err: Exception, location: str, options: dict[str, str]) -> str:
    text = str(err)
    bucket = urlsplit(location).netloc
    endpoint = options.get("aws_endpoint_url") or options.get("aws_endpoint") or "the default endpoint"
    if "NoSuchBucket" in text:
        return f"bucket '{bucket}' does not exist at {endpoint} (create it, or fix lake:)"
    if any(
        s in text
        for s in (
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "AccessDenied",
            "403 Forbidden",
            "lacked the necessary privileges",
            "Unauthenticated",
        )
    ) or type(err).__name__ in ("PermissionDeniedError", "UnauthenticatedError"):
        return (
            f"the credentials were refused by {endpoint} for bucket '{bucket}' (check AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY in storage: or the storage connection)"
        )
    if any(s in text for s in ("error sending request", "Connection refused", "timed out", "dns error", "tcp connect")):
        return f"cannot reach the object store at {endpoint} (check AWS_ENDPOINT_URL and the network)"
    return f"the object store refused a test write: {_first_line(err)}"


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__


def store_name(where: Where) -> str:
    """The location and the endpoint that serves it, for messages (never a credential)."""
    location, reached = _reach(where)
    options = {k.lower(): v for k, v in (reached or {}).items()}
    endpoint = next((options[k] for k in ("aws_endpoint_url", "aws_endpoint", "endpoint_url", "endpoint") if options.get(k)), None)
    return f"{location} at {endpoint}" if endpoint else location


def describe_store_error(err: BaseException) -> str:
    """One line from a delta-rs / pyarrow / object_store error: what was attempted and why it failed."""
    lines = [line.strip(" ↳") for line in str(err).splitlines() if line.strip()]
    useful = [
        line
        for line in lines
        if any(
            s in line
            for s in (
                "Error performing",
                "Connection refused",
                "timed out",
                "Timeout",
                "error sending request",
                "AWS Error",
                "When ",
                "403",
                "404",
                "500",
                "503",
            )
        )
    ]
    text = useful[0] if useful else (lines[0] if lines else type(err).__name__)
    return text[:400]
