"""Write modes of a Delta sink, one class per mode behind one interface (``WriteMode``; docs/design.md,
"The write-mode seam"). ``write_mode`` is the one place a pipeline's ``sink.mode`` picks its
implementation; every caller asks the mode instead of branching on it."""

from __future__ import annotations

from offsetlake.config import PipelineConfig
from offsetlake.config.sink_settings import ENGINE_MODES
from offsetlake.write_modes.append import AppendMode
from offsetlake.write_modes.engine import EngineMode
from offsetlake.write_modes.mode import BackfillStaging, Compaction, Replay, Staged, StagedMerge, WriteMode
from offsetlake.write_modes.upsert import UpsertMode

_MODES: dict[str, type[WriteMode]] = {
    "append": AppendMode,
    "upsert": UpsertMode,
    **dict.fromkeys(ENGINE_MODES, EngineMode),
}


def write_mode(config: PipelineConfig) -> WriteMode:
    """The write mode of ``config``'s sink (``sink.mode``)."""
    return _MODES[config.sink.mode](config)


__all__ = [
    "AppendMode",
    "BackfillStaging",
    "Compaction",
    "EngineMode",
    "Replay",
    "Staged",
    "StagedMerge",
    "UpsertMode",
    "WriteMode",
    "write_mode",
]
