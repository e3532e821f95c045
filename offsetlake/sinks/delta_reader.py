"""A Delta sink's reading half: its history is the table's commits, its committed ends the txn
versions of one snapshot (``offsetlake.sink.committed_end``, invariant 2)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deltalake import DeltaTable

from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import DeltaSinkKind
from offsetlake.foreign import summaries
from offsetlake.history import SinkCommit, sink_commits
from offsetlake.sink import committed_end
from offsetlake.sinks.reading import READER, SinkReader, TopicPartitionKey
from offsetlake.storage import open_table


class DeltaSinkReader(SinkReader):
    """One snapshot of the sink table, read when the reader opens (or the one given)."""

    def __init__(self, config: PipelineConfig, table: DeltaTable | None = None) -> None:
        super().__init__(config)
        self._table = table if table is not None else open_table(config.layout.sink)
        self._commits: list[SinkCommit] | None = None

    @property
    def table(self) -> DeltaTable | None:
        return self._table

    def commits(self) -> list[SinkCommit]:
        if self._commits is None:
            self._commits = sink_commits(self._table, self.config.name)
        return self._commits

    def ends(self, keys: Iterable[TopicPartitionKey]) -> dict[TopicPartitionKey, int | None]:
        return {key: committed_end(self._table, self.config, *key) for key in keys}

    def foreign_changes(self) -> list[dict[str, Any]]:
        return summaries(self._table, self.config.name)


DeltaSinkKind.provides(READER, DeltaSinkReader)
