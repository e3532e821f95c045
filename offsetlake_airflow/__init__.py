"""offsetlake's Airflow side: operators, task callables, connections -> settings, DAG factory,
and the Offset ledger view's FastAPI app.

The arrows point one way: this package imports ``offsetlake``; ``offsetlake`` imports nothing
from Airflow. ``dags/`` only calls the DAG factory and ``plugins/`` only registers the plugin.
"""

from __future__ import annotations

import os
from pathlib import Path


def project_dir() -> Path:
    """The offsetlake checkout or install: ``$OFFSETLAKE_HOME``, else the folder holding this
    package (an editable install, as in the Dockerfile), which has ``jobs/`` and ``pipelines/``."""
    return Path(os.environ.get("OFFSETLAKE_HOME") or Path(__file__).resolve().parent.parent)


def pipelines_folder() -> Path:
    """Where the pipeline YAML files are: ``$OFFSETLAKE_PIPELINES_DIR``, else ``<project>/pipelines``."""
    return Path(os.environ.get("OFFSETLAKE_PIPELINES_DIR") or project_dir() / "pipelines")
