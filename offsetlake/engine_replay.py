"""The merge engines' semantics replayed record by record, in plain Python: the oracle the audit
and the tests hold an engine sink to (invariant 14), sharing no code with the Spark fold
(``offsetlake.engines``).

``replay(config, rows)`` takes every committed row (a dict of the row's columns with its
coordinates, and ``_offsetlake_change`` = ``delete`` for a delete) and applies them one at a time
in the engines' order (the Kafka timestamp, then topic, partition, topic epoch, offset, row
index): the table a sink must hold, keyed by its group (key, then window start and end).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from offsetlake.config import PipelineConfig
from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TIMESTAMP, TOPIC, TOPIC_EPOCH
from offsetlake.formats import CHANGE, DELETE

_NOT_VALUES = {TOPIC, PARTITION, OFFSET, TIMESTAMP, TOPIC_EPOCH, ROW_INDEX, CHANGE}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def order_of(row: Mapping[str, Any]) -> tuple:
    """A row's place in the engines' total order (a missing time sorts first)."""
    time = row.get(TIMESTAMP)
    return (
        time is not None,
        time or _EPOCH,
        row[TOPIC],
        row[PARTITION],
        row.get(TOPIC_EPOCH) or 0,
        row[OFFSET],
        row.get(ROW_INDEX) or 0,
    )


def windows_of(config: PipelineConfig, row: Mapping[str, Any]) -> list[tuple[datetime, datetime]]:
    """The windows a row counts in: one, or size/slide of them; none without a window setting."""
    window = config.sink.window
    if window is None:
        return []
    at = row[window.on]
    micros = (at - _EPOCH) // timedelta(microseconds=1)
    size, slide = window.size_seconds * 1_000_000, window.slide_seconds * 1_000_000
    last_start = micros - micros % slide
    starts = [last_start - i * slide for i in range(size // slide)]
    return [(_EPOCH + timedelta(microseconds=s), _EPOCH + timedelta(microseconds=s + size)) for s in sorted(starts) if s + size > micros]


def replay(config: PipelineConfig, rows: Iterable[Mapping[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """The visible rows an engine sink must hold for ``rows`` (module docstring): group -> the
    row's output columns."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for row in sorted(rows, key=order_of):
        key = tuple(row[c] for c in config.sink.key)
        windows: list[tuple] = list(windows_of(config, row)) or [()]
        for window in windows:
            groups.setdefault(key + window, []).append(row)
    replayed = _REPLAYS[str(config.sink.engine)]
    out: dict[tuple, dict[str, Any]] = {}
    for group, ordered in groups.items():
        kept = replayed(config, ordered)
        if kept is not None:  # a partial_update key whose newest record deletes it has no row
            out[group] = kept
    return out


def _first_row(config: PipelineConfig, ordered: list[Mapping[str, Any]]) -> dict[str, Any]:
    first = _first_of_last_episode(config, ordered)
    return {c: v for c, v in first.items() if c not in _NOT_VALUES and c not in config.sink.key}


def _first_of_last_episode(config: PipelineConfig, ordered: list[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The first record of a key (no horizon); with ``within``, of the key's last episode: in the
    order of the horizon's time (``within_on``, else the record time; none: before all), a record
    at least ``within`` after its episode's first starts the next episode."""
    if config.sink.within is None:
        return ordered[0]
    from offsetlake.config.sink_settings import duration_seconds

    horizon = timedelta(seconds=duration_seconds(config.sink.within))
    on = config.sink.within_on or TIMESTAMP
    floor = datetime.min.replace(tzinfo=UTC)

    def at(row: Mapping[str, Any]) -> datetime:
        return row.get(on) or floor

    episode = None
    for row in sorted(ordered, key=lambda r: (at(r), order_of(r))):
        if episode is None or at(row) - at(episode) >= horizon:
            episode = row
    assert episode is not None
    return episode


def _aggregated(config: PipelineConfig, ordered: list[Mapping[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for m in config.sink.aggregates():
        values = [r.get(m.column) for r in ordered] if m.column != "*" else [True] * len(ordered)
        present = [v for v in values if v is not None]
        if m.function == "count":
            row[m.name] = len(present)
        elif m.function == "sum":
            row[m.name] = sum(present) if present else None
        elif m.function == "min":
            row[m.name] = min(present) if present else None
        elif m.function == "max":
            row[m.name] = max(present) if present else None
        elif m.function == "first":
            row[m.name] = values[0]
        elif m.function == "last":
            row[m.name] = values[-1]
        else:  # last_non_null
            row[m.name] = present[-1] if present else None
    return row


def _partially_updated(config: PipelineConfig, ordered: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Non-null fields overwrite, nulls keep; a delete forgets the key; None when deleted."""
    row: dict[str, Any] | None = None
    for record in ordered:
        if record.get(CHANGE) == DELETE:
            row = None
            continue
        row = dict(row or {})
        for column, value in record.items():
            if column in _NOT_VALUES or column in config.sink.key:
                continue
            if value is not None or column not in row:
                row[column] = value if value is not None else row.get(column)
    return row


# each engine's replay of a group's records (in order): the row it keeps, None for none
_REPLAYS: dict[str, Callable[[PipelineConfig, list[Mapping[str, Any]]], dict[str, Any] | None]] = {
    "aggregate": _aggregated,
    "first_row": _first_row,
    "partial_update": _partially_updated,
}
