"""JSON text that every reader can parse: what offsetlake writes where others read it (Delta file
statistics, ledger entries, a Kafka sink's JSON values).

Python's ``json.dumps`` writes a non-finite float as the bare tokens ``NaN``, ``Infinity`` and
``-Infinity`` by default. They are not JSON (RFC 8259 has no such numbers): one ``Infinity`` in a
commit's file statistics made the Delta log unreadable for delta-rs ("Json error: Encountered
unexpected 'I'") and every later commit failed (issue 48, finding 1). So nothing here ever writes
them: ``dumps`` refuses them (``allow_nan=False``), and the callers decide what a non-finite value
becomes. Two rules are in use:

* a **bound** that is not finite (a file statistic) says nothing and is left out
  (``file_stats.delta_stats``), as delta-rs writes null for it;
* a **value** that is not finite (a row's double in a JSON record, an observed value in a
  validation summary) is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``: the
  spelling of Protobuf's JSON mapping, which Jackson's ``WRITE_NAN_AS_STRINGS`` also writes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

NON_FINITE_TEXT = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def is_finite_number(value: Any) -> bool:
    """False only for a float NaN or infinity (every other value, numbers or not, is True)."""
    return not isinstance(value, float) or math.isfinite(value)


def finite_text(value: float) -> str:
    """A non-finite float as a JSON value's text: ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``."""
    return NON_FINITE_TEXT[repr(value)]


def strings_for_non_finite(value: Any) -> Any:
    """``value`` (dicts, lists and tuples walked) with every non-finite float replaced by its
    ``finite_text``: what a JSON value holds for a number JSON cannot write."""
    if isinstance(value, float):
        return value if math.isfinite(value) else finite_text(value)
    if isinstance(value, dict):
        return {k: strings_for_non_finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strings_for_non_finite(v) for v in value]
    return value


def dumps(value: Any, *, default: Callable[[Any], Any] | None = None, **options: Any) -> str:
    """``json.dumps`` that never writes a bare ``NaN`` or ``Infinity``: a non-finite float is
    written as a string (``strings_for_non_finite``). The common case (no such float) costs one
    ``json.dumps``."""
    try:
        return json.dumps(value, default=default, allow_nan=False, **options)
    except ValueError as err:
        if "Out of range float values" not in str(err):
            raise
    return json.dumps(strings_for_non_finite(value), default=default, allow_nan=False, **options)
