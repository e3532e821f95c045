"""Durations as a user writes them: '5s', '500ms', '2m', '1h' or a plain number of seconds."""

from __future__ import annotations

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def seconds(text: str) -> float:
    """Seconds from ``text``; ValueError naming the problem when it is no duration or not above zero."""
    raw = text.strip().lower()
    unit = next((u for u in ("ms", "s", "m", "h") if raw.endswith(u)), "")
    try:
        value = float(raw[: len(raw) - len(unit)]) * _UNITS.get(unit, 1.0)
    except ValueError:
        raise ValueError(f"'{text}' is not a duration like 5s, 500ms, 2m or 1h") from None
    if value <= 0:
        raise ValueError(f"'{text}' must be more than zero")
    return value
