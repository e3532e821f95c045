"""One small hierarchy of errors, each saying what went wrong and what to do.

Messages name the pipeline, topic, partition and offsets involved, because the reader is a
data platform engineer looking at an Airflow task log or a terminal, not at a stack trace.
"""

from __future__ import annotations


class OffsetlakeError(Exception):
    """Base class; the CLI prints ``str(err)`` and exits non-zero."""

    exit_code = 2


class ConfigError(OffsetlakeError):
    """A pipeline file is missing, malformed or names something that does not exist."""


class KafkaUnavailableError(OffsetlakeError):
    """The broker cannot be reached or does not know the topic."""


class OffsetsLostError(OffsetlakeError):
    """Invariant 7: a planned start is below the partition's log start offset."""


class ReadTimeoutError(OffsetlakeError):
    """A range could not be read to its end within the configured bound."""


class StalePlanError(OffsetlakeError):
    """Invariant 3: another batch moved a partition's committed end past this plan's start."""


class CommitConflictError(OffsetlakeError):
    """Invariant 10: another writer committed the same range first."""


class TransformError(OffsetlakeError):
    """The pipeline's transform failed or dropped the Kafka coordinate columns."""


class AuditFailedError(OffsetlakeError):
    """``offsetlake audit`` found a duplicate, an overlap, a gap or a stray row."""

    exit_code = 1
