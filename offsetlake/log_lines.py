"""The one shape of offsetlake's log lines: ``step=<step> [message] key=value ...``.

One structured line per batch step with pipeline, batch id, ranges, counts and durations, so a
person (or a log search) can follow a batch through plan -> read -> validate -> write -> commit.
Values are quoted when they hold a space, a quote, an ``=`` or a newline, so a lake path or an
error message can never break a line into fields that were not there.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offsetlake.plan import BatchPlan

_NEEDS_QUOTES = (" ", '"', "=", "\n", "\t", "\\")


def quote(value: object) -> str:
    """``value`` as one logfmt field value: quoted and escaped only when needed."""
    text = "" if value is None else str(value)
    if text and not any(c in text for c in _NEEDS_QUOTES):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def format_line(step: str, message: str | None = None, plan: BatchPlan | None = None, **fields: object) -> str:
    """``step=<step> [message] [pipeline= batch= ranges=] key=value ...``; None values are left out."""
    parts = [f"step={step}"]
    if message:
        parts.append(message)
    if plan is not None:
        parts += [f"pipeline={quote(plan.pipeline)}", f"batch={quote(plan.batch_id)}", f"ranges={quote(plan.describe())}"]
    parts += [f"{key}={quote(value)}" for key, value in fields.items() if value is not None]
    return " ".join(parts)


def log_line(
    logger: logging.Logger,
    step: str,
    message: str | None = None,
    *,
    plan: BatchPlan | None = None,
    level: int = logging.INFO,
    **fields: object,
) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, format_line(step, message, plan, **fields))


_STEPS = logging.getLogger("offsetlake.batch")


def log_step(step: str, plan: BatchPlan | None, started: float, **fields: object) -> int:
    """Log one batch step with its duration since ``started`` (``time.monotonic()``); returns the ms."""
    elapsed = int((time.monotonic() - started) * 1000)
    if _STEPS.isEnabledFor(logging.INFO):
        _STEPS.info(format_line(step, None, plan, **fields, duration_ms=elapsed))
    return elapsed
