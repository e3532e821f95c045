"""Reading pipeline files: one YAML file per pipeline under ``pipelines/``.

Loading validates every field (``config.models``) and reports errors as
``<file>: <field>: <problem>`` so a typo is found before anything touches Kafka or Delta.
``${VAR}`` and ``${VAR:-default}`` are replaced from the environment. Settings an orchestrator
hands over come on top in ``config.settings``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from offsetlake.config.models import FIELD_PROBLEM, PIPELINE_NAME, PipelineConfig
from offsetlake.errors import ConfigError

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _interpolate(value: Any, where: str, source: Path) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, f"{where}.{k}" if where else str(k), source) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, f"{where}[{i}]", source) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise ConfigError(f"{source}: {where}: environment variable {name} is not set (use ${{{name}:-default}} for a default)")

    return _ENV_REF.sub(replace, value)


def pipelines_dir() -> Path:
    return Path(os.environ.get("OFFSETLAKE_PIPELINES_DIR", "pipelines"))


def find_pipeline_file(name_or_path: str, directory: Path | None = None) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml"):
        if not candidate.exists():
            raise ConfigError(f"pipeline file {candidate} does not exist")
        return candidate
    if not PIPELINE_NAME.match(name_or_path):
        raise ConfigError(f"pipeline name '{name_or_path}' is not allowed: pipeline names are [a-z0-9_]+")
    folder = directory or pipelines_dir()
    for suffix in (".yaml", ".yml"):
        path = folder / f"{name_or_path}{suffix}"
        if path.exists():
            return path
    known = [p.stem for p in all_pipeline_files(folder)] if folder.is_dir() else []
    raise ConfigError(
        f"no pipeline '{name_or_path}' in {folder.resolve()} (known: {', '.join(known) or 'none'}); "
        "set OFFSETLAKE_PIPELINES_DIR or pass a .yaml path"
    )


FORMAT_TYPES = ("json", "avro", "json_schema", "protobuf")
SINK_TYPES = ("delta", "kafka")


def _field_path(loc: tuple) -> tuple:
    """A validation error's location as the YAML names it: pydantic puts the format's type and
    the sink's (the unions' tags) after ``format`` and ``sink``, where the file has none."""
    if len(loc) > 1 and ((loc[0] == "format" and loc[1] in FORMAT_TYPES) or (loc[0] == "sink" and loc[1] in SINK_TYPES)):
        return (loc[0], *loc[2:])
    return loc


def load_pipeline(name_or_path: str, directory: Path | None = None) -> PipelineConfig:
    """Load and validate one pipeline file (YAML with ``${ENV}``, every field and every rule
    between fields); raises ConfigError naming the file and field. Settings kept outside the
    file come on top in ``config.settings.resolve_pipeline``, which commands use."""
    path = find_pipeline_file(name_or_path, directory)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of fields, got {type(raw).__name__}")
    raw = _interpolate(raw, "", path)
    raw["source_file"] = str(path.resolve())
    try:
        config = PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{path}: {'; '.join(_problem(e) for e in err.errors())}") from None
    if path.stem != config.name:
        raise ConfigError(f"{path}: name: '{config.name}' must match the file name '{path.stem}'")
    return config


def _problem(error: Any) -> str:
    """One validation error as ``<field>: <problem>``, the field as the YAML names it."""
    if error["type"] == FIELD_PROBLEM:
        return str(error["msg"])
    where = ".".join(str(p) for p in _field_path(error["loc"])) or "(top level)"
    return f"{where}: {error['msg'].removeprefix('Value error, ')}"


def all_pipeline_files(directory: Path | None = None) -> list[Path]:
    folder = directory or pipelines_dir()
    # orders.expectations.yaml (a suite) sits beside orders.yaml; only [a-z0-9_]+ stems are pipelines
    return sorted(p for p in folder.glob("*.y*ml") if PIPELINE_NAME.match(p.stem))
