"""A Kafka sink's reading half: its history is its commit log (each committed transaction's ledger
entry), its committed ends what that log records (invariant 15). The group's offsets, which the
same transactions commit, are a copy for Kafka's own tools, shown by ``status`` beside the ends."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from offsetlake.config.sink_kinds import KafkaSinkKind
from offsetlake.history import SinkCommit
from offsetlake.kafka_commit import commit_log_ends, group_offsets, kafka_sink_commits
from offsetlake.sinks.reading import READER, SinkReader, TopicPartitionKey


class KafkaSinkReader(SinkReader):
    """The commit log, read once, on first use (raises KafkaUnavailableError when it cannot be)."""

    _commits: list[SinkCommit] | None = None

    def commits(self) -> list[SinkCommit]:
        if self._commits is None:
            self._commits = kafka_sink_commits(self.config)
        return self._commits

    def ends(self, keys: Iterable[TopicPartitionKey]) -> dict[TopicPartitionKey, int | None]:
        return commit_log_ends(self.commits(), keys)

    def status_columns(self, keys: Iterable[TopicPartitionKey]) -> dict[TopicPartitionKey, dict[str, Any]]:
        """The group's offset per partition: Kafka's copy of the ends (restored from the log when missing)."""
        found = group_offsets(self.config.kafka_client_config(), self.config.name, sorted(keys))
        return {key: {"group_offset": offset} for key, offset in found.items()}


KafkaSinkKind.provides(READER, KafkaSinkReader)
