"""Where a pipeline's tables and files live in its lake, computed once from ``lake``,
``sink.table`` and ``storage``, and the Delta txn app ids of its topic-partitions.

Each place is a ``storage.Location``: the path with the pipeline's own object-store settings,
so whatever opens a table reaches it with this pipeline's credentials (no process-wide registry:
two pipelines on one bucket with different credentials each use their own).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from offsetlake import storage
from offsetlake.storage import Location


def app_id(pipeline: str, topic: str, partition: int) -> str:
    """Delta txn appId for one topic-partition of a pipeline (invariant 2)."""
    return f"{pipeline}:{topic}:{partition}"


@dataclass(frozen=True)
class LakeLayout:
    """A pipeline's places: its lake, its sink table, its dead-letter table, the lake's ledger
    table (invariant 4), its stream leases, its validation reports and the state table of a keyed
    sink (``offsetlake.state_table``)."""

    lake: Location
    sink: Location
    dead_letters: Location
    ledger: Location
    stream_leases: Location
    validation: Location
    state: Location

    @classmethod
    def of(cls, pipeline: str, lake: str, sink_table: str | None, options: Mapping[str, str], base_dir: Path) -> LakeLayout:
        """The layout of ``pipeline``: relative locations resolve against ``base_dir`` (the folder
        above ``pipelines/``), a relative ``sink_table`` under the lake (default ``<lake>/<pipeline>``)."""
        lake_path = storage.resolve_location(lake, base_dir)
        table = sink_table or pipeline
        if storage.is_uri(table) or Path(table).is_absolute():
            sink_path = storage.resolve_location(table, base_dir)
        elif storage.is_uri(lake_path):
            sink_path = storage.child(lake_path, table)
        else:
            sink_path = storage.resolve_location(table, Path(lake_path))
        root = Location.of(lake_path, options)
        return cls(
            lake=root,
            sink=Location.of(sink_path, options),
            dead_letters=root.child("_dead_letters", pipeline),
            ledger=root.child("_offset_ledger"),
            stream_leases=root.child("_stream_leases", pipeline),
            validation=root.child("_validation", pipeline),
            state=root.child("_state", pipeline),
        )
