"""Pipeline configuration: the typed model with all its rules (``models``; the ``format:`` and
``key_format:`` settings in ``formats``, ``sink:`` and ``outbox:`` in ``sink_settings``), Spark DDL types
(``ddl``), Schema Registry client options (``registry_settings``), where a pipeline's tables live
(``layout``), reading pipeline files (``loading``) and the one settings resolver every command
uses (``settings``). ``from offsetlake.config import X`` reaches each public name."""

from __future__ import annotations

from offsetlake.config.ddl import PARTITION_COLUMN_TYPES, spark_type_problem
from offsetlake.config.formats import (
    KEY_COLUMN,
    KEY_TYPES,
    AvroFormat,
    JsonFormat,
    JsonSchemaFormat,
    KeyFormat,
    ProtobufFormat,
    key_columns,
)
from offsetlake.config.layout import LakeLayout, app_id
from offsetlake.config.loading import (
    FORMAT_TYPES,
    all_pipeline_files,
    find_pipeline_file,
    load_pipeline,
    pipeline_names,
    pipelines_dir,
)
from offsetlake.config.models import (
    DEFAULT_MAX_RECORD_BYTES,
    MAX_RECORD_BYTES_CEILING,
    PIPELINE_NAME,
    KafkaSettings,
    PipelineConfig,
    RouteSettings,
    ValidationSettings,
    spark_only_reason,
)
from offsetlake.config.registry_settings import (
    REGISTRY_OPTIONS,
    redacted_registry_settings,
    registry_options,
    registry_settings_problem,
)
from offsetlake.config.settings import (
    KAFKA_OVERRIDES_ENV,
    REGISTRY_OVERRIDES_ENV,
    STORAGE_OVERRIDES_ENV,
    Overrides,
    OverridesSource,
    environment_overrides,
    resolve_pipeline,
    with_orchestrator_settings,
)
from offsetlake.config.sink_settings import DeltaSinkSettings, KafkaSinkSettings, SinkSettings

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES",
    "FORMAT_TYPES",
    "KAFKA_OVERRIDES_ENV",
    "KEY_COLUMN",
    "KEY_TYPES",
    "MAX_RECORD_BYTES_CEILING",
    "PARTITION_COLUMN_TYPES",
    "PIPELINE_NAME",
    "REGISTRY_OPTIONS",
    "REGISTRY_OVERRIDES_ENV",
    "STORAGE_OVERRIDES_ENV",
    "AvroFormat",
    "JsonFormat",
    "JsonSchemaFormat",
    "KafkaSettings",
    "KeyFormat",
    "LakeLayout",
    "Overrides",
    "OverridesSource",
    "PipelineConfig",
    "ProtobufFormat",
    "RouteSettings",
    "DeltaSinkSettings",
    "KafkaSinkSettings",
    "SinkSettings",
    "ValidationSettings",
    "all_pipeline_files",
    "app_id",
    "environment_overrides",
    "find_pipeline_file",
    "key_columns",
    "spark_only_reason",
    "load_pipeline",
    "pipeline_names",
    "pipelines_dir",
    "redacted_registry_settings",
    "registry_options",
    "registry_settings_problem",
    "resolve_pipeline",
    "spark_type_problem",
    "with_orchestrator_settings",
]
