"""The project's home: ``$OFFSETLAKE_HOME``, else the working directory. offsetlake keeps the files
that are its own and no user's (the warm Spark server's, the embedded metastore, the warehouse,
the suites already checked against Great Expectations) under ``<home>/.offsetlake/``, which the
project's ``.gitignore`` leaves out."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("OFFSETLAKE_HOME") or os.getcwd())


def private(*parts: str, project: Path | None = None) -> Path:
    """``<home>/.offsetlake/<parts>`` (``project`` instead of the home when given)."""
    return (project or home()).joinpath(".offsetlake", *parts)
