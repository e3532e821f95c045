"""One settings resolver for every command: the pipeline's YAML (with ``${ENV}``), then the
settings an orchestrator keeps as secrets on top.

An orchestrator hands a child process (a spark-submit job, a stream) the Kafka, storage and
Schema Registry settings it keeps in its connections as JSON in the environment, never on a
command line (which it logs): ``$OFFSETLAKE_KAFKA_OVERRIDES`` = {"bootstrap_servers": ...,
"options": {...}}, ``$OFFSETLAKE_STORAGE_OVERRIDES`` = {"AWS_ACCESS_KEY_ID": ..., ...},
``$OFFSETLAKE_SCHEMA_REGISTRY_OVERRIDES`` = {"url": ..., "basic.auth.user.info": ...}. Inside
the orchestrator its connections are read directly: ``offsetlake_airflow.connections`` passes
its own ``OverridesSource`` (the hook point) to ``resolve_pipeline``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from offsetlake.config.loading import load_pipeline
from offsetlake.config.models import PipelineConfig
from offsetlake.errors import ConfigError

KAFKA_OVERRIDES_ENV = "OFFSETLAKE_KAFKA_OVERRIDES"
STORAGE_OVERRIDES_ENV = "OFFSETLAKE_STORAGE_OVERRIDES"
REGISTRY_OVERRIDES_ENV = "OFFSETLAKE_SCHEMA_REGISTRY_OVERRIDES"


@dataclass(frozen=True)
class Overrides:
    """Settings for one pipeline kept outside its YAML; each given key wins over the file's."""

    bootstrap_servers: str | None = None
    kafka_options: dict[str, str] = field(default_factory=dict)
    storage: dict[str, str] = field(default_factory=dict)
    schema_registry: dict[str, str] = field(default_factory=dict)

    def applied_to(self, config: PipelineConfig) -> PipelineConfig:
        """``config`` with these settings on top (each checked as the YAML's would be)."""
        config = config.with_kafka_overrides(self.bootstrap_servers, self.kafka_options)
        return config.with_storage_overrides(self.storage).with_registry_overrides(self.schema_registry)

    def as_environment(self) -> dict[str, str]:
        """The environment variables that hand these settings to a child process."""
        env = {}
        if self.bootstrap_servers or self.kafka_options:
            env[KAFKA_OVERRIDES_ENV] = json.dumps({"bootstrap_servers": self.bootstrap_servers, "options": self.kafka_options})
        if self.storage:
            env[STORAGE_OVERRIDES_ENV] = json.dumps(self.storage)
        if self.schema_registry:
            env[REGISTRY_OVERRIDES_ENV] = json.dumps(self.schema_registry)
        return env


OverridesSource = Callable[[str], Overrides]  # pipeline name -> its overrides


def environment_overrides(pipeline: str, environ: Mapping[str, str] | None = None) -> Overrides:
    """The overrides an orchestrator handed this process in its environment (the same for
    every pipeline: a child process runs one); ConfigError when a variable is not JSON."""
    env = os.environ if environ is None else environ
    kafka = _json_from_env(env, KAFKA_OVERRIDES_ENV)
    return Overrides(
        bootstrap_servers=kafka.get("bootstrap_servers"),
        kafka_options={str(k): str(v) for k, v in (kafka.get("options") or {}).items()},
        storage={str(k): str(v) for k, v in _json_from_env(env, STORAGE_OVERRIDES_ENV).items()},
        schema_registry={str(k): str(v) for k, v in _json_from_env(env, REGISTRY_OVERRIDES_ENV).items()},
    )


def _json_from_env(env: Mapping[str, str], name: str) -> dict:
    """The JSON object in ``$name`` ({} when unset); ConfigError when it is not JSON."""
    raw = env.get(name)
    if not raw:
        return {}
    try:
        return json.loads(raw) or {}
    except ValueError:
        raise ConfigError(f"${name} is not JSON") from None


def resolve_pipeline(
    name_or_path: str, directory: Path | None = None, overrides: OverridesSource = environment_overrides
) -> PipelineConfig:
    """A pipeline's settings as every command uses them: ``load_pipeline`` (YAML, ``${ENV}``,
    every field and rule checked), then ``overrides`` for it on top (by default those in this
    process's environment). Raises ConfigError naming the file, field or variable."""
    config = load_pipeline(name_or_path, directory)
    return overrides(config.name).applied_to(config)


def with_orchestrator_settings(config: PipelineConfig) -> PipelineConfig:
    """``config`` with the settings an orchestrator handed over in the environment on top."""
    return environment_overrides(config.name).applied_to(config)
