"""Opening a sink's reading half: the implementation follows the pipeline's kind of sink
(``offsetlake.config.sink_kinds.sink_kind``, the one place that looks at ``sink.type``)."""

from __future__ import annotations

from deltalake import DeltaTable

from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import sink_kind
from offsetlake.sinks.delta_reader import DeltaSinkReader
from offsetlake.sinks.kafka_reader import KafkaSinkReader
from offsetlake.sinks.reading import SinkReader

_READERS: dict[str, type[SinkReader]] = {"delta": DeltaSinkReader, "kafka": KafkaSinkReader}


def open_sink(config: PipelineConfig, table: DeltaTable | None = None) -> SinkReader:
    """The sink's reading half at one snapshot (``table``: see ``SinkReader``)."""
    return _READERS[sink_kind(config).name](config, table)
