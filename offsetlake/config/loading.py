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
    """The file that defines ``name_or_path``: a .yaml path, ``<folder>/<name>.yaml``, or for one
    table of a routed pipeline (``<file>_<table>``) the routed pipeline's file."""
    return _pipeline_source(name_or_path, directory)[0]


def _pipeline_source(name_or_path: str, directory: Path | None) -> tuple[Path, str | None]:
    """The file defining a pipeline, and the table of its ``routes`` the name picks (None: the
    file's own pipeline)."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml"):
        if not candidate.exists():
            raise ConfigError(f"pipeline file {candidate} does not exist")
        return candidate, None
    if not PIPELINE_NAME.match(name_or_path):
        raise ConfigError(f"pipeline name '{name_or_path}' is not allowed: pipeline names are [a-z0-9_]+")
    folder = directory or pipelines_dir()
    for suffix in (".yaml", ".yml"):
        path = folder / f"{name_or_path}{suffix}"
        if path.exists():
            return path, None
    # one table of a routed file: only the files whose name is a prefix of ours are read
    parts = name_or_path.split("_")
    for cut in range(1, len(parts)):
        stem, table = "_".join(parts[:cut]), "_".join(parts[cut:])
        for suffix in (".yaml", ".yml"):
            path = folder / f"{stem}{suffix}"
            if path.exists() and table in _route_tables(path):
                return path, table
    known = pipeline_names(folder) if folder.is_dir() else []
    raise ConfigError(
        f"no pipeline '{name_or_path}' in {folder.resolve()} (known: {', '.join(known) or 'none'}); "
        "set OFFSETLAKE_PIPELINES_DIR or pass a .yaml path"
    )


def _route_tables(path: Path) -> list[str]:
    """The tables a pipeline file routes its rows to (none when it has no ``routes``), read
    without checking the rest of the file."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return []
    routes = raw.get("routes") if isinstance(raw, dict) else None
    tables = routes.get("tables") if isinstance(routes, dict) else None
    if not isinstance(tables, dict):
        return []
    unmapped = routes.get("unmapped") if isinstance(routes, dict) else None
    extra = [unmapped] if isinstance(unmapped, str) and unmapped not in tables and unmapped != "dead_letter" else []
    return [str(t) for t in tables] + extra  # as RouteSettings: an unmapped table not listed is one more


def pipeline_names(directory: Path | None = None) -> list[str]:
    """Every pipeline of the folder by name: a file's name, or for a routed file
    (``routes:``) one name per table, ``<file>_<table>``; what commands and DAGs iterate."""
    names: list[str] = []
    for path in all_pipeline_files(directory):
        tables = _route_tables(path)
        names += [f"{path.stem}_{t}" for t in tables] if tables else [path.stem]
    return names


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
    file come on top in ``config.settings.resolve_pipeline``, which commands use.

    A file with ``routes:`` defines one pipeline per table, ``<file>_<table>``: each is loaded by
    that name (``route`` says which table), and the file's own name is refused with those names.
    """
    path, route = _pipeline_source(name_or_path, directory)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of fields, got {type(raw).__name__}")
    if "route" in raw:
        raise ConfigError(f"{path}: route: is not a field of the file (offsetlake sets it for each table of routes:)")
    raw = _interpolate(raw, "", path)
    raw["source_file"] = str(path.resolve())
    declared = raw.get("name")
    try:
        config = PipelineConfig.model_validate(raw)  # the whole file first: its routes' rules see every topic
        if route is not None:
            config = PipelineConfig.model_validate(_one_route(raw, route))
    except ValidationError as err:
        raise ConfigError(f"{path}: {'; '.join(_problem(e) for e in err.errors())}") from None
    if declared != path.stem:
        raise ConfigError(f"{path}: name: '{declared}' must match the file name '{path.stem}'")
    if config.routes is not None:
        _check_route_names(path, config)
    return config


def _one_route(raw: dict, route: str) -> dict:
    """The raw file as one table of its routes: named ``<name>_<table>``, and for ``by: topic``
    reading only that table's topics (the unmapped table: also every listed topic no table maps)."""
    out = {**raw, "name": f"{raw.get('name')}_{route}", "route": route}
    routes = raw.get("routes")
    if isinstance(routes, dict) and routes.get("by") == "topic" and isinstance(routes.get("tables"), dict):
        listed = [raw["topic"]] if raw.get("topic") is not None else list(raw.get("topics") or [])
        mapped = {str(t) for topics in routes["tables"].values() for t in (topics or [])}
        mine = [str(t) for t in routes["tables"].get(route) or []]
        if routes.get("unmapped") == route:
            mine += [t for t in listed if t not in mapped and t not in mine]
        if mine and all(t in listed for t in mine):
            out.pop("topic", None)
            out["topics"] = mine
    return out


def _check_route_names(path: Path, config: PipelineConfig) -> None:
    """A routed file's table names must not be another file's pipeline: both would be one name."""
    assert config.routes is not None
    base = path.stem
    for table in config.routes.tables:
        for suffix in (".yaml", ".yml"):
            if (path.parent / f"{base}_{table}{suffix}").exists():
                other = path.parent / f"{base}_{table}{suffix}"
                raise ConfigError(
                    f"{path}: routes.tables.{table}: pipeline {base}_{table} is also the file {other}; rename the table or the file"
                )
    if config.route is None:
        names = ", ".join(f"{base}_{t}" for t in config.routes.tables)
        raise ConfigError(
            f"{path}: pipeline {base} routes its rows to the tables of pipelines {names} (routes:); "
            f"a command takes one of those names, e.g. offsetlake run {base}_{next(iter(config.routes.tables))}",
            pipeline=base,
        )


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
