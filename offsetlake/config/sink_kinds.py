"""What each kind of sink can do and what it is called: the static half of the sink seam
(docs/design.md, "The sink seam"), read from the configuration alone (no Kafka, no Delta), so
the Airflow side may ask it at DAG parse time.

``sink_kind`` is the one place that looks at ``sink.type``; everything else asks the kind.
``offsetlake.sinks`` holds the reading half (history and committed ends), which needs I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any, ClassVar, Generic, TypeVar, cast

from offsetlake import storage
from offsetlake.config.models import PipelineConfig


class Capability(StrEnum):
    """What a sink may be asked to do beyond taking a batch."""

    REPLACE = "replace"  # a backfill replaces the rows of its range
    REPUBLISH = "republish"  # a backfill publishes its range again, beside what consumers read
    REWIND = "rewind"  # the sink returns to its state right after a batch
    EPOCH_RESET = "epoch reset"  # a re-created source topic starts a new epoch beside the old one
    FILES_WITHOUT_SPARK = "files without Spark"  # rows become files without a Spark session (data_path: direct)
    GROUP_OFFSETS_AFTER_COMMIT = "group offsets after commit"  # the publish step copies the ends to the group
    FOREIGN_COMMITS = "foreign commits"  # other writers may commit to it (a Delta table's SQL users)


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Role(Generic[T_co]):
    """A part a kind of sink provides (its reading half, writing half, audit), declared beside
    the part's interface: ``sinks.reading.READER``, ``sinks.writing.WRITER``, ``audit.report.AUDIT``."""

    def __init__(self, name: str) -> None:
        self.name = name


class SinkKind:
    """One kind of sink: its name, what it can do (and why not), how readers name it, and its
    implementations: each module that implements a part of a kind (its reading half, its writing
    half, its audit) registers it here when it is imported (``provides``), as the format modules
    register their formats, so the kind a pipeline has is looked at once (``sink_kind``) and every
    part follows from it (``implementation``)."""

    name: ClassVar[str]
    capabilities: ClassVar[frozenset[Capability]]
    _parts: ClassVar[dict[Role[Any], Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._parts = {}

    @classmethod
    def provides(cls, role: Role[T], implementation: T) -> None:
        """Called by an implementation's module when it is imported: ``implementation`` is this
        kind's ``role``."""
        cls._parts[role] = implementation

    def implementation(self, role: Role[T]) -> T:
        """This kind's implementation of ``role``; LookupError when no imported module provides it
        (the caller imports the modules that implement the role)."""
        if role not in self._parts:
            raise LookupError(f"no {role.name} of sink kind {self.name} is registered: its module was not imported")
        return cast(T, self._parts[role])

    def lacks(self, config: PipelineConfig, capability: Capability) -> str | None:
        """Why this sink cannot do ``capability`` and what to do instead; None when it can."""
        if capability in self.capabilities:
            return None
        return self._why_not(config, capability)

    def can(self, config: PipelineConfig, capability: Capability) -> bool:
        return self.lacks(config, capability) is None

    def refuse_unless(self, config: PipelineConfig, capability: Capability, error: Callable[[str], Exception]) -> None:
        """The one refusal of what a sink cannot do: raises ``error(reason)`` when it lacks
        ``capability``; the caller's error class says what was asked (a backfill, a rewind...)."""
        reason = self.lacks(config, capability)
        if reason is not None:
            raise error(reason)

    def _why_not(self, config: PipelineConfig, capability: Capability) -> str:
        return f"the sink ({self.output(config)}) cannot {capability}"

    def output(self, config: PipelineConfig) -> str:
        """The sink as its readers name it: a Delta table's path, a Kafka topic's name."""
        raise NotImplementedError

    def output_uri(self, config: PipelineConfig) -> str:
        """The sink's URI, as an Airflow Asset names it."""
        raise NotImplementedError


class DeltaSinkKind(SinkKind):
    name = "delta"
    capabilities = frozenset(
        {
            Capability.REPLACE,
            Capability.REWIND,
            Capability.EPOCH_RESET,
            Capability.FILES_WITHOUT_SPARK,
            Capability.GROUP_OFFSETS_AFTER_COMMIT,
            Capability.FOREIGN_COMMITS,
        }
    )

    def _why_not(self, config: PipelineConfig, capability: Capability) -> str:
        if capability == Capability.REPUBLISH:
            return "republish applies to a Kafka sink; a backfill of a Delta sink replaces the range's rows"
        return super()._why_not(config, capability)

    def output(self, config: PipelineConfig) -> str:
        return config.sink_path

    def output_uri(self, config: PipelineConfig) -> str:
        return storage.table_uri(config.sink_path)


class KafkaSinkKind(SinkKind):
    name = "kafka"
    capabilities = frozenset({Capability.REPUBLISH})

    def _why_not(self, config: PipelineConfig, capability: Capability) -> str:
        topic, name = config.kafka_sink.topic, config.name
        if capability == Capability.REPLACE:
            return (
                f"the sink is Kafka topic {topic}: a backfill cannot replace records there, it publishes the range "
                "again, each record marked offsetlake.kind=backfill, beside what consumers already read. Say so with "
                "--republish (Airflow: the Param republish) if consumers dedupe by the source coordinates in the headers"
            )
        if capability == Capability.REWIND:
            return (
                f"the sink is Kafka topic {topic}: read_committed consumers may already have read what the "
                "batches after it produced, and a Kafka log cannot take records back. To correct records, publish the range "
                "again with `offsetlake backfill --republish` (each record marked offsetlake.kind=backfill)"
            )
        if capability == Capability.EPOCH_RESET:
            return (
                f"the sink is Kafka topic {topic}, whose committed ends are what its commit log "
                f"offsetlake-commits-{name} records, and a Kafka log cannot start an epoch beside the old one. To start the "
                f"pipeline afresh on the new topic, while nothing runs: delete its commit log topic and its consumer group "
                f"offsetlake-{name}, run `offsetlake ledger rebuild {name}`, and point sink.topic at a new topic "
                "(or keep it, and its consumers see the new topic's records from its start)"
            )
        if capability == Capability.FILES_WITHOUT_SPARK:
            return "the sink is a Kafka topic: Spark hands the rows to the driver's transactional producer"
        if capability == Capability.GROUP_OFFSETS_AFTER_COMMIT:
            return "a Kafka sink's transaction committed its group's offsets with its records"
        if capability == Capability.FOREIGN_COMMITS:
            return "only offsetlake's transactions write a Kafka sink's commit log"
        return super()._why_not(config, capability)

    def output(self, config: PipelineConfig) -> str:
        """Its output topics: ``sink.topic``, then those of ``sink.routes``."""
        return ", ".join(config.kafka_sink.output_topics)

    def output_uri(self, config: PipelineConfig) -> str:
        """Named as Airflow's Kafka asset URIs do: ``kafka://<broker>/<topic>``."""
        broker = config.kafka.bootstrap_servers.split(",")[0].strip()
        return f"kafka://{broker}/{config.kafka_sink.topic}"


_KINDS: dict[str, SinkKind] = {kind.name: kind for kind in (DeltaSinkKind(), KafkaSinkKind())}


def sink_kind(config: PipelineConfig) -> SinkKind:
    """The pipeline's kind of sink: the one place that looks at ``sink.type``."""
    return _KINDS[config.sink.type]
