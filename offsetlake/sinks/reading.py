"""The reading half of a sink: what the planner, the ledger view, backfill, rewind, the audit and
``offsetlake status`` ask a sink, whatever it is (docs/design.md, "The sink seam").

Two questions that need I/O, one answer each, and no reader branches on the sink's kind:

- **history**: ``commits()``, the batches committed to it, oldest first, each with its ledger
  entry (invariant 4): a Delta sink's commits, a Kafka sink's commit log;
- **committed ends**: ``ends(keys)``, the exclusive end committed per source partition, None
  where nothing was, from the sink's own record (invariant 15), never from a copy such as the
  group's offsets.

What a sink can do and what it is called needs no I/O: ``offsetlake.config.sink_kinds``.

A reader is one snapshot, opened once (``offsetlake.sinks.choice.open_sink``): a Delta sink reads
its table once and every answer comes from that version; a Kafka sink reads its commit log once.
Writers keep their own rule (re-read right before every commit attempt).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from deltalake import DeltaTable

from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import Role
from offsetlake.history import SinkCommit

TopicPartitionKey = tuple[str, int]


class SinkReader(ABC):
    """What every reader asks a sink; one implementation per kind of sink."""

    def __init__(self, config: PipelineConfig, table: DeltaTable | None = None) -> None:
        """``table``: a Delta snapshot the caller already holds, so that its answers and the
        reader's come from one version (a sink that is no Delta table ignores it)."""
        self.config = config

    @property
    def table(self) -> DeltaTable | None:
        """The Delta snapshot the answers come from (None: no Delta table, or none created yet)."""
        return None

    @abstractmethod
    def commits(self) -> list[SinkCommit]:
        """Every batch committed to the sink, oldest first, with its ledger entry (invariant 4)."""

    @abstractmethod
    def ends(self, keys: Iterable[TopicPartitionKey]) -> dict[TopicPartitionKey, int | None]:
        """The committed end per source partition (None: never committed), from the sink's own record."""

    def status_columns(self, keys: Iterable[TopicPartitionKey]) -> dict[TopicPartitionKey, dict[str, Any]]:
        """Columns ``offsetlake status`` adds per partition for this kind of sink (none by default)."""
        return {}

    def foreign_changes(self) -> list[dict[str, Any]]:
        """What commits offsetlake did not make changed (``offsetlake.foreign.summaries``): none by default."""
        return []


READER: Role[type[SinkReader]] = Role("reader")  # what each kind of sink provides (``config.sink_kinds.SinkKind``)
