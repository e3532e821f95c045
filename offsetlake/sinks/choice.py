"""Opening a sink's reading half: the implementation follows the pipeline's kind of sink
(``offsetlake.config.sink_kinds.sink_kind``, the one place that looks at ``sink.type``), whose
reader each reader module registers when it is imported."""

from __future__ import annotations

from deltalake import DeltaTable

from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import sink_kind
from offsetlake.sinks import delta_reader, kafka_reader  # noqa: F401 - each provides its kind's reader
from offsetlake.sinks.reading import READER, SinkReader


def open_sink(config: PipelineConfig, table: DeltaTable | None = None) -> SinkReader:
    """The sink's reading half at one snapshot (``table``: see ``SinkReader``)."""
    return sink_kind(config).implementation(READER)(config, table)
