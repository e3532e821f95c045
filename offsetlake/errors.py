"""Every offsetlake error: one small hierarchy, each class saying what went wrong and what to do.

Messages name the pipeline, topic, partition and offsets involved, because the reader is a
data platform engineer looking at an Airflow task log or a terminal, not at a stack trace.
All classes live here so that an error raised inside a Spark task can be re-raised by name in
the driver (``offsetlake.reader.errors_from_spark_tasks``). ``exit_code`` is what the CLI exits
with: 2 for errors, 1 for an audit that found problems, 3 for a failed validation.
"""

from __future__ import annotations


class OffsetlakeError(Exception):
    """Base class; the CLI prints ``str(err)`` and exits with ``exit_code``."""

    exit_code = 2


# ---- configuration ----------------------------------------------------------------------------
class ConfigError(OffsetlakeError):
    """A pipeline file is missing, malformed or names something that does not exist."""


class SuiteError(ConfigError):
    """The expectation suite file cannot be turned into Great Expectations expectations."""


# ---- Kafka -----------------------------------------------------------------------------------
class StorageError(OffsetlakeError):
    """The lake's object store cannot be used (unknown bucket, credentials refused, unreachable
    endpoint) or cannot commit safely (no put-if-absent); raised before anything is read."""


class SchemaRegistryUnavailableError(OffsetlakeError):
    """The Schema Registry could not be reached or answered an error while a batch was planned or
    read; nothing was committed and no record became a dead letter for it. Run again later."""


class SparkServerUnavailableError(OffsetlakeError):
    """The Spark Connect server a run was told to attach to (--remote, $OFFSETLAKE_SPARK_REMOTE)
    cannot be reached; nothing was planned on it. Start it, or run without it."""


class KafkaUnavailableError(OffsetlakeError):
    """The broker cannot be reached or does not know the topic."""


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


# ---- planning and committing -----------------------------------------------------------------
class StalePlanError(OffsetlakeError):
    """Invariant 3: another batch moved a partition's committed end past this plan's start."""


class CommitConflictError(OffsetlakeError):
    """Invariant 10: another writer committed the same range first."""


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

    def __init__(self, message: str, summary: dict | None = None) -> None:
        super().__init__(message)
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
