"""Every offsetlake error: one small hierarchy, each class saying what went wrong and what to do.

Messages name the pipeline, topic, partition and offsets involved, because the reader is a
data platform engineer looking at an Airflow task log or a terminal, not at a stack trace.

An error carries what it is about as data too: the keyword fields ``pipeline``, ``batch_id``,
``topic``, ``partition``, ``start``, ``end`` and ``field`` (only those that apply) are kept as
attributes (``err.fields``) and the message is made of them by one formatter (``message``):
``pipeline P: T[p] range [start, end): <text>`` — where, then the raise site's sentence. A
batch, a field or a whole topic is named by that sentence (it is its subject: "batch B was
rewound by ..."), so ``batch_id``, ``field`` and a topic without a partition are data only.
``transient`` says whether running the same thing again later, with nothing changed by anyone,
can succeed (an outage); ``is_transient`` reads it for any exception, and the stream's back-off
follows it.

All classes live here so that an error raised inside a Spark task can be rebuilt as itself in
the driver from its data: the task reports it as class name, text and fields
(``reported_as_data``), the driver rebuilds it (``from_task_failure``, used by
``offsetlake.reader.errors_from_spark_tasks``). ``exit_code`` is what the CLI exits with: 2 for
errors, 1 for an audit that found problems, 3 for a failed validation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

# the keyword fields an error may carry, in the order the formatter shows them
FIELDS = ("pipeline", "batch_id", "topic", "partition", "start", "end", "field")


class OffsetlakeError(Exception):
    """Base class; the CLI prints ``str(err)`` and exits with ``exit_code``.

    ``text`` is the raise site's sentence; the keyword fields say what the error is about and are
    shown before it the same way for every error (``message``). Unset fields are None.
    """

    exit_code = 2
    transient = False

    def __init__(
        self,
        text: str = "",
        *,
        pipeline: str | None = None,
        batch_id: str | None = None,
        topic: str | None = None,
        partition: int | None = None,
        start: int | None = None,
        end: int | None = None,
        field: str | None = None,
    ) -> None:
        self.text = text
        self.pipeline, self.batch_id, self.field = pipeline, batch_id, field
        self.topic, self.partition, self.start, self.end = topic, partition, start, end
        super().__init__(message(text, self.fields))

    @property
    def fields(self) -> dict[str, Any]:
        """The fields that are set, by name (``FIELDS`` order)."""
        return {name: getattr(self, name) for name in FIELDS if getattr(self, name, None) is not None}

    def __reduce__(self) -> tuple[Any, ...]:
        # keyword fields do not survive Exception's default pickling (it replays ``args`` only)
        # (and what a subclass adds, e.g. a validation summary, travels as the instance's state)
        return (rebuild, (type(self).__name__, self.text, self.fields), dict(self.__dict__))


def message(text: str, fields: dict[str, Any]) -> str:
    """The one way an error shows its fields: ``pipeline P: T[p] range [start, end): text``.

    Each part appears when its fields are set: the pipeline; the partition ``T[p]`` (topic and
    partition), with ``range [start, end)`` when both offsets are set. ``batch_id``, ``field`` and
    a topic without a partition are not shown here: the sentence names them.
    """
    parts = []
    if fields.get("pipeline") is not None:
        parts.append(f"pipeline {fields['pipeline']}")
    topic, partition, start, end = (fields.get(name) for name in ("topic", "partition", "start", "end"))
    if topic is not None and partition is not None:
        parts.append(f"{topic}[{partition}]" + (f" range [{start}, {end})" if start is not None and end is not None else ""))
    where = ": ".join(parts)
    if not where:
        return text
    return f"{where}: {text}" if text else where


def is_transient(err: BaseException) -> bool:
    """True when ``err`` is an outage that the same run, tried again later, can get past with
    nothing changed by anyone (the class's ``transient``); False for every other exception."""
    return isinstance(err, OffsetlakeError) and err.transient


def rebuild(kind: str, text: str, fields: dict[str, Any]) -> OffsetlakeError:
    """The error of class ``kind`` (a name in this module) with ``text`` and ``fields``, as its
    raise site made it. An unknown name (an older or newer offsetlake) gives an OffsetlakeError."""
    cls = globals().get(kind)
    if not (isinstance(cls, type) and issubclass(cls, OffsetlakeError)):
        cls = OffsetlakeError
    err = cls.__new__(cls)
    OffsetlakeError.__init__(err, text, **{k: v for k, v in fields.items() if k in FIELDS})
    return err


# ---- errors raised inside Spark tasks -----------------------------------------------------------
# A Python exception raised in a Spark task reaches the driver only as text (the worker's
# traceback inside a PythonException, classic or Spark Connect alike). So a task reports its
# OffsetlakeError as data: this marker, then one line of JSON (class name, text, fields).
TASK_FAILURE = "offsetlake-task-failure:"


class TaskFailure(Exception):
    """What a Spark task raises for an OffsetlakeError: the error as data (``TASK_FAILURE`` and
    its JSON), rebuilt in the driver by ``from_task_failure``."""


def task_failure(err: OffsetlakeError) -> TaskFailure:
    """``err`` as the exception a Spark task raises instead (raise it ``from err``)."""
    data = {"error": type(err).__name__, "text": err.text, "fields": err.fields}
    return TaskFailure(TASK_FAILURE + json.dumps(data, separators=(",", ":")))


def reported_as_data(task: Callable[[Iterator[Any]], Iterator[Any]]) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """``task`` (a Spark task's function, e.g. for ``mapInArrow``) that lets an OffsetlakeError
    leave the task as data (``task_failure``), for ``from_task_failure`` in the driver; other
    exceptions pass as they are."""

    def reporting(batches: Iterator[Any]) -> Iterator[Any]:
        try:
            yield from task(batches)
        except OffsetlakeError as err:
            raise task_failure(err) from err

    return reporting


def from_task_failure(err: BaseException) -> OffsetlakeError | None:
    """The OffsetlakeError a Spark task reported (``task_failure``) somewhere in ``err``'s text,
    rebuilt as itself; None when ``err`` carries none. The last report wins (the task's own; the
    driver's wrappers only quote it)."""
    text = str(err)
    at = text.rfind(TASK_FAILURE)
    if at < 0:
        return None
    try:
        data, _ = json.JSONDecoder().raw_decode(text, at + len(TASK_FAILURE))
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("fields"), dict):
        return None
    return rebuild(str(data.get("error")), str(data.get("text", "")), data["fields"])


# ---- configuration ----------------------------------------------------------------------------
class ConfigError(OffsetlakeError):
    """A pipeline file is missing, malformed or names something that does not exist."""


class SuiteError(ConfigError):
    """The expectation suite file cannot be turned into Great Expectations expectations."""


class JarsMissingError(OffsetlakeError):
    """A pinned jar set is not resolved (``make setup`` not run, or run before the lock changed)."""


class EntryFormatError(OffsetlakeError):
    """A commit's entry is offsetlake's but of a format this code cannot read (written by a newer
    offsetlake, or damaged); nothing is inferred from it."""


# ---- Kafka -----------------------------------------------------------------------------------
class StorageError(OffsetlakeError):
    """The lake's object store cannot be used (unknown bucket, credentials refused, unreachable
    endpoint) or cannot commit safely (no put-if-absent); raised before anything is read.

    Not transient: most of its causes (a refused credential, no put-if-absent) need a change."""


class CatalogManagedTableError(OffsetlakeError):
    """A table offsetlake would read and commit to by its folder is catalog-managed (Delta's
    ``catalogManaged`` table feature, Unity Catalog's managed tables): its commits go through the
    catalog that owns it, which offsetlake's writer (delta-rs) cannot do. Refused when the table is
    first opened, before anything is planned or written. Not transient: the table or the pipeline
    must change."""


class SchemaRegistryUnavailableError(OffsetlakeError):
    """The Schema Registry could not be reached or answered an error while a batch was planned or
    read; nothing was committed and no record became a dead letter for it. Run again later."""

    transient = True  # an outage: the registry answers again


class SchemaNotFound(Exception):
    """The registry answered that the schema (id, or subject/version) does not exist: an answer
    the formats act on (a schema that is not there yet, a subject to register), not a failure."""


class SparkServerUnavailableError(OffsetlakeError):
    """The Spark Connect server a run was told to attach to (--remote, $OFFSETLAKE_SPARK_REMOTE)
    cannot be reached; nothing was planned on it. Start it, or run without it."""

    transient = True  # the same run attaches once the server is up; nothing of the run is wrong


class KafkaUnavailableError(OffsetlakeError):
    """The broker cannot be reached or does not know the topic."""

    transient = True  # an outage (a broker restarting, a leader moving) that the same run waits out


class KafkaSinkAbortedError(OffsetlakeError):
    """A Kafka sink's transaction was aborted: none of its records and none of its source offsets
    are visible to a read_committed consumer, and the batch may run again."""

    transient = True  # a broker that timed out or lost a leader: the same batch commits once it answers


class KafkaSinkFencedError(OffsetlakeError):
    """A newer producer with the pipeline's transactional id took over (a second runner, or a
    zombie of this one); this runner's open transaction is aborted and it must stop."""


class KafkaSinkProgressError(OffsetlakeError):
    """A Kafka sink's records of progress disagree in a way offsetlake will not guess about (its
    group's offsets past its commit log, or a commit log that lacks batches the ledger recorded
    committed): nothing was produced. Not transient: an operator says which record is right."""


class ForeignCommitError(OffsetlakeError):
    """A commit offsetlake did not make changed the sink in a way that stops an operation: what it
    deleted cannot be read any more (its files were vacuumed), or a rewind would bring back rows it
    deleted. The message names its version, operation and engine, and the way forward."""


class KafkaSinkValueError(OffsetlakeError):
    """A row of a Kafka sink's batch cannot be written in the sink's value format (a value its
    schema cannot hold); the batch produced nothing. Not transient: the rows or the format must change."""


class OffsetsLostError(OffsetlakeError):
    """Invariant 7: a planned start is below the partition's log start offset."""


class TopicIdentityError(OffsetlakeError):
    """Invariant 16: a committed end is past its partition's log end, or the topic's Kafka id is not
    the one its committed offsets belong to: the topic was re-created (or the cluster changed, or
    an unclean leader election truncated the log). Nothing was read; only the operator action
    ``offsetlake topic reset-epoch`` moves the pipeline on. The message names topic, partition and
    both offsets (or both ids)."""


class TopicEpochError(OffsetlakeError):
    """``offsetlake topic reset-epoch`` cannot be done as asked (nothing to reset, unknown topic);
    nothing was written. The message says why."""


class ReadTimeoutError(OffsetlakeError):
    """A range could not be read to its end within the configured bound."""

    transient = True  # a stalled broker: the same range reads once it serves again


# ---- planning and committing -----------------------------------------------------------------
class StalePlanError(OffsetlakeError):
    """Invariant 3: another batch moved a partition's committed end past this plan's start.
    Not transient: only a new plan applies (``superseded``)."""


class CommitConflictError(OffsetlakeError):
    """Invariant 10: another writer committed the same range first.

    Not transient: this plan can never apply again; a new plan can (``superseded``, like
    StalePlanError)."""


class SinkOwnedError(OffsetlakeError):
    """Invariant 16: the sink table belongs to another pipeline (its history holds that
    pipeline's commits); nothing was committed. One pipeline with ``topics:`` merges topics."""


class StagedFilesError(OffsetlakeError):
    """A batch's staged data files disagree with what its tasks reported (a path twice, a file
    missing, other bytes or rows): something overwrote or cut a file after its task closed it.
    Nothing was committed; running again stages the batch anew."""

    def __init__(self, table: str, path: str, problem: str) -> None:
        super().__init__(
            f"sink {table}: staged data file {path} cannot be committed: {problem}; nothing committed, run again to stage the batch anew"
        )
        self.table, self.path, self.problem = table, path, problem


class TransformError(OffsetlakeError):
    """The pipeline's transform failed or dropped the Kafka coordinate columns."""


class SchemaChangeError(OffsetlakeError):
    """Invariant 12: the batch's rows change the sink's schema in a way Delta cannot take in place
    (a column's type changed); nothing was committed. The message names the field, both types and
    the ways forward."""


class ValidationFailedError(OffsetlakeError):
    """Invariant 9: the batch failed its expectations and nothing was committed."""

    exit_code = 3

    def __init__(self, message: str, summary: dict | None = None, **fields: Any) -> None:
        super().__init__(message, **fields)
        self.summary = summary or {}


class BackfillParamsError(OffsetlakeError):
    """The requested backfill range cannot be run as asked; the message says what to change."""


class RewindError(OffsetlakeError):
    """The rewind cannot be done as asked; nothing was written. The message says why."""


# ---- streams and their lease -----------------------------------------------------------------
class LeaseHeldError(OffsetlakeError):
    """Another stream holds the pipeline's lease and kept it alive while we waited."""


class LeaseLostError(OffsetlakeError):
    """This stream's lease expired or was taken over; it must not commit again."""


class StreamOwnsPipelineError(OffsetlakeError):
    """A batch run was asked to ingest while a live stream owns the pipeline."""

    exit_code = 0  # not a failure: the stream is ingesting


class StreamAbandoned(OffsetlakeError):
    """A second stop signal came while a batch was in flight: it commits nothing."""


# ---- checking ---------------------------------------------------------------------------------
class AuditFailedError(OffsetlakeError):
    """``offsetlake audit`` found a duplicate, an overlap, a gap or a stray row."""

    exit_code = 1


def describe_unexpected(err: BaseException) -> str:
    """One readable line for an error that is not offsetlake's own (a full disk inside a JVM
    stack, a library's exception), for the CLI and the spark-submit job, which exit 2 with it."""
    text = str(err)
    if "No space left on device" in text or getattr(err, "errno", None) == 28:
        return (
            "no space left on device; free space on the lake's disk (or the Spark temp folder), then run again: "
            "a batch that did not commit wrote nothing that counts, and the next run repairs the rest"
        )
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"unexpected {type(err).__name__}: {first[:500]} (run with --log-level DEBUG for the traceback)"
