"""The pipeline definition as a typed model: every field and every cross-field rule.

``PipelineConfig.model_validate`` enforces all of it, the rules between fields included (a
partition column the rows cannot have, a suite or transform file that is not there, storage
settings for a local lake), so a config built anywhere is as checked as one ``load_pipeline``
read. Kafka client options are passed to librdkafka unchanged and are never logged:
``PipelineConfig.redacted_kafka_options`` is the only view of them meant for humans.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from offsetlake import storage
from offsetlake.config.ddl import PARTITION_COLUMN_TYPES
from offsetlake.config.formats import AvroFormat, JsonFormat, JsonSchemaFormat, KeyFormat, ProtobufFormat, key_columns
from offsetlake.config.layout import LakeLayout, app_id
from offsetlake.config.registry_settings import registry_settings_problem
from offsetlake.config.sink_settings import (
    DeltaSinkSettings,
    KafkaRoutes,
    KafkaSinkSettings,
    OutboxSettings,
    SinkSettings,
    route_values_apart,
    route_values_as_text,
)
from offsetlake.config.strict import Strict as _Strict
from offsetlake.errors import ConfigError

PIPELINE_NAME = re.compile(r"^[a-z0-9_]+$")
CATALOG_DATABASE = re.compile(r"^[a-z0-9_]+$")
_SECRET_KEY = re.compile(r"(password|secret|jaas|token|key\.pem|keystore|truststore|credential)", re.I)
# ``max_record_bytes``: the default lets the issue-35 records (a 95 MB JSON value beside a 50 MB
# one in one consume call) through on both data paths with the 2g driver; the ceiling is
# librdkafka's own largest message (message.max.bytes, 1,000,000,000).
DEFAULT_MAX_RECORD_BYTES = 128 * 1024 * 1024
MAX_RECORD_BYTES_CEILING = 1_000_000_000


class KafkaSettings(_Strict):
    bootstrap_servers: str = Field(min_length=1)
    # librdkafka properties, e.g. security.protocol, sasl.mechanism, sasl.password, ssl.ca.location.
    options: dict[str, str] = Field(default_factory=dict)

    @field_validator("options", mode="before")
    @classmethod
    def _stringify(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}
        return value

    @field_validator("options")
    @classmethod
    def _no_managed_keys(cls, value: dict[str, str]) -> dict[str, str]:
        managed = {"bootstrap.servers", "isolation.level", "enable.auto.commit", "group.id"}
        clash = sorted(managed & value.keys())
        if clash:
            raise ValueError(f"{', '.join(clash)} are set by offsetlake and may not be overridden")
        return value


class ValidationSettings(_Strict):
    # Great Expectations suite next to the YAML (a YAML list or a GX 1.x suite JSON); default
    # <name>.expectations.yaml in the pipeline's folder, used when that file exists.
    suite: str | None = None
    # fail: nothing is committed when any expectation fails. quarantine: records whose rows fail
    # a row-level expectation go to the dead-letter table, the rest commits; a failing
    # table-level expectation still fails the batch.
    on_failure: Literal["fail", "quarantine"] = "fail"
    examples: int = Field(default=5, ge=0, le=50)  # unexpected values shown per expectation


class CatalogSettings(_Strict):
    # The catalog database (Spark's namespace) the pipeline's tables are named in by `offsetlake
    # catalog register` and `offsetlake sql` (``offsetlake.catalog``): <database>.<name>,
    # <database>.<name>_dead_letters, <database>.<name>_ledger. Created when missing.
    database: str = "default"

    @field_validator("database")
    @classmethod
    def _plain_identifier(cls, value: str) -> str:
        if not CATALOG_DATABASE.match(value):
            raise ValueError(
                f"'{value}' is not allowed: a catalog database is [a-z0-9_]+ (Spark and the Hive Metastore keep names in lower case)"
            )
        return value


UNMAPPED_DEAD_LETTER = "dead_letter"


class RouteSettings(_Strict):
    """``routes:``: one pipeline's rows into several sink tables, chosen per row
    (``offsetlake.routing``). Each table is a pipeline of its own, ``<name>_<table>``, with its
    own txns, ledger entries, dead letters and leases (invariants 2-4 per table)."""

    # A column of the rows (after the transform) whose value chooses the table, or ``topic``:
    # the record's source topic (then each table reads only its own topics).
    by: str = Field(min_length=1)
    # table name -> the values (or topics) whose rows it takes; a value in at most one table
    tables: dict[str, list[str]]
    # What a row whose value no table maps becomes: dead_letter (reason code ``unrouted``, in the
    # first table's dead letters) or a table's name (it takes every such row; a name not in
    # ``tables`` is a table of its own that takes only those).
    unmapped: str = UNMAPPED_DEAD_LETTER

    @model_validator(mode="before")
    @classmethod
    def _unmapped_is_a_table(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("tables"), dict):
            unmapped = value.get("unmapped", UNMAPPED_DEAD_LETTER)
            if isinstance(unmapped, str) and unmapped != UNMAPPED_DEAD_LETTER and unmapped not in value["tables"]:
                return {**value, "tables": {**value["tables"], unmapped: []}}
        return value

    @field_validator("tables", mode="before")
    @classmethod
    def _values_as_text(cls, value: Any) -> Any:
        return route_values_as_text(value) if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _tables_apart(self) -> RouteSettings:
        if not self.tables:
            raise ValueError("tables: name one or more tables, each with the values it takes")
        for name, values in self.tables.items():
            if not PIPELINE_NAME.match(name):
                raise ValueError(f"tables: '{name}' is not allowed: a table's name is [a-z0-9_]+ (it ends its pipeline's name)")
            if not values and self.unmapped != name:
                raise ValueError(f"tables.{name}: give the values it takes (or make it the unmapped table)")
        route_values_apart(self.tables, "tables", "table")
        return self

    @property
    def by_topic(self) -> bool:
        return self.by == "topic"

    @property
    def owner(self) -> str:
        """The table whose pipeline dead-letters what no table takes (records that do not decode,
        rows whose value no table maps): the unmapped table, else the first one listed."""
        return self.unmapped if self.unmapped != UNMAPPED_DEAD_LETTER else next(iter(self.tables))


class PipelineConfig(_Strict):
    name: str
    # Exactly one of: one topic, a list, or a pattern (a regular expression a topic name must
    # match in full, as Kafka Connect's topics.regex; topics created later are picked up).
    topic: str | None = Field(default=None, min_length=1)
    topics: list[str] | None = None
    topic_pattern: str | None = None
    kafka: KafkaSettings
    lake: str = "lake"
    # Object-store settings for a lake (or sink.table) on s3:// (or gs://, az://), passed to
    # delta-rs and pyarrow: AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID,
    # AWS_SECRET_ACCESS_KEY, AWS_ALLOW_HTTP, ... (``offsetlake.storage``). Never logged.
    storage: dict[str, str] = Field(default_factory=dict)
    start: Literal["earliest", "latest"] = "earliest"
    max_records_per_batch: int = Field(default=500_000, gt=0)
    # A record whose key and value together hold more bytes is a dead letter (record_too_large),
    # whatever the records around it; every smaller one is decoded (``reader.record_size_problems``).
    max_record_bytes: int = Field(default=DEFAULT_MAX_RECORD_BYTES, gt=0, le=MAX_RECORD_BYTES_CEILING)
    read_timeout_seconds: float = Field(default=120.0, gt=0)
    on_offsets_lost: Literal["fail", "skip"] = "fail"
    # Airflow schedule of <name>_ingest: cron or preset, "on_new_data" (woken by records arriving,
    # offsetlake_airflow.wake), or null (manual runs only)
    schedule: str | None = "@hourly"
    format: JsonFormat | AvroFormat | JsonSchemaFormat | ProtobufFormat = Field(discriminator="type")
    # What the record key becomes; unset: string, or none for a sink from before key_format
    # (offsetlake.formats.keys.effective_key_format).
    key_format: KeyFormat | None = None
    # A batch whose records bring a new field: evolve (the sink gains a nullable column in that
    # batch's commit) or fail (the batch fails naming the change; nothing is committed).
    on_schema_change: Literal["evolve", "fail"] = "evolve"
    transform: str | None = None  # "module:function" found next to the YAML file
    # Which data path reads a batch and writes its rows (``offsetlake.process.choose_data_path``):
    # auto (the rule there), spark (read tasks read, Spark decodes and writes), direct (the read
    # tasks write the rows of an ingest or stream batch; refused here when the pipeline needs
    # Spark, ``spark_only_reason``) or jvm (Spark's Kafka source reads and Spark decodes a JSON
    # pipeline's batches, ``offsetlake.kafka_source``; refused here for what it cannot read).
    data_path: Literal["auto", "spark", "direct", "jvm"] = "auto"
    sink: SinkSettings = Field(default_factory=DeltaSinkSettings)
    validation: ValidationSettings = Field(default_factory=ValidationSettings)
    outbox: OutboxSettings | None = None  # lake -> Kafka after each commit (append Delta sinks)
    catalog: CatalogSettings = Field(default_factory=CatalogSettings)  # where its tables are named (``offsetlake.catalog``)
    routes: RouteSettings | None = None  # rows into several tables, each its own pipeline ``<name>_<table>``
    source_file: str = ""  # filled in by load_pipeline
    # filled in by load_pipeline for one table of a routed file: that table's name in ``routes``
    # (the config's name is then ``<file's name>_<route>``); never written in the YAML
    route: str | None = None
    _layout: LakeLayout | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_topic_source(self) -> PipelineConfig:
        given = [n for n in ("topic", "topics", "topic_pattern") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of topic, topics, topic_pattern (given: {', '.join(given) or 'none'})")
        if self.topics is not None:
            if not self.topics or any(not t for t in self.topics):
                raise ValueError("topics: a list of one or more topic names")
            doubled = sorted({t for t in self.topics if self.topics.count(t) > 1})
            if doubled:
                raise ValueError(f"topics: {', '.join(doubled)} listed more than once")
        if self.topic_pattern is not None:
            try:
                re.compile(self.topic_pattern)
            except re.error as err:
                raise ValueError(f"topic_pattern: {self.topic_pattern!r} is not a regular expression: {err}") from None
        return self

    @model_validator(mode="after")
    def _fields_agree(self) -> PipelineConfig:
        """The rules between fields and the files beside the YAML, in the order a user fixes them;
        the first broken one is reported as ``<field>: <problem>``."""
        for check in (
            _locations_problem,
            _files_problem,
            _partition_columns_problem,
            _data_path_problem,
            _engine_problem,
            _kafka_sink_problem,
            _routes_problem,
        ):
            found = check(self)
            if found:
                raise PydanticCustomError(FIELD_PROBLEM, "{field}: {problem}", {"field": found[0], "problem": found[1]})
        return self

    @property
    def routed_by_column(self) -> bool:
        """This config is one table of a pipeline that routes its rows by a column's value."""
        return self.route is not None and self.routes is not None and not self.routes.by_topic

    @property
    def topic_label(self) -> str:
        """The pipeline's source as messages name it: a topic, a list, or the pattern."""
        if self.topic is not None:
            return self.topic
        if self.topics is not None:
            return ", ".join(self.topics)
        return f"topics matching {self.topic_pattern}"

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not PIPELINE_NAME.match(value):
            raise ValueError(f"'{value}' is not allowed: pipeline names are [a-z0-9_]+")
        return value

    @field_validator("format", mode="before")
    @classmethod
    def _json_by_default(cls, value: Any) -> Any:
        if isinstance(value, dict) and "type" not in value:
            return {**value, "type": "json"}
        return value

    @field_validator("storage", mode="before")
    @classmethod
    def _storage_options(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError("expected a mapping of object-store settings (AWS_ENDPOINT_URL: ..., AWS_REGION: ...)")
        for key, item in value.items():
            if isinstance(item, (dict, list)) or item is None:
                raise ValueError(f"{key}: expected a plain value")
            problem = storage.option_problem(str(key), str(item))
            if problem:
                raise ValueError(f"{key}: {problem}")
        # an empty value (e.g. ${AWS_ENDPOINT_URL:-}) means the setting is not set
        return {str(k): (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in value.items() if str(v) != ""}

    @field_validator("transform")
    @classmethod
    def _transform_ref(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if re.match(r"^[A-Za-z_][\w]*\.[\w.]*:", value):
            raise ValueError(
                f"'{value}' names a module in a package; a transform is one module file next to the "
                "YAML (module:function, the module without dots), which Spark ships to its tasks"
            )
        if not re.match(r"^[A-Za-z_]\w*:[A-Za-z_]\w*$", value):
            raise ValueError(f"'{value}' must look like module:function")
        return value

    @property
    def base_dir(self) -> Path:
        """Relative paths in the file resolve against the folder above ``pipelines/``."""
        return Path(self.source_file).resolve().parent.parent if self.source_file else Path.cwd()

    # Locations (``offsetlake.config.layout``): a local path, or a URI for a lake elsewhere.
    @property
    def layout(self) -> LakeLayout:
        """Where this pipeline's tables live, each with the storage settings that reach it;
        computed once per config value."""
        if self._layout is None:
            self._layout = LakeLayout.of(self.name, self.lake, self.sink.table, self.storage, self.base_dir)
        return self._layout

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> PipelineConfig:
        copied = super().model_copy(update=update, deep=deep)
        copied._layout = None  # an update may change the lake, the sink table or the storage settings
        return copied

    @property
    def lake_path(self) -> str:
        return self.layout.lake.path

    @property
    def sink_label(self) -> str:
        """The sink as messages and DAG descriptions name it."""
        return self.sink.label(self.sink_path)

    @property
    def kafka_sink(self) -> KafkaSinkSettings:
        """The settings of a Kafka sink (``sink.type: kafka``), for the Kafka sink's own modules;
        ConfigError for a Delta sink (the caller took the wrong sink's implementation)."""
        if not isinstance(self.sink, KafkaSinkSettings):
            raise ConfigError(
                f"the sink of pipeline {self.name} is a Delta table, not a Kafka topic", pipeline=self.name, field="sink.type"
            )
        return self.sink

    @property
    def sink_path(self) -> str:
        return self.layout.sink.path

    @property
    def dead_letter_path(self) -> str:
        return self.layout.dead_letters.path

    @property
    def ledger_path(self) -> str:
        return self.layout.ledger.path

    @property
    def stream_lease_path(self) -> str:
        """Who owns the pipeline as a stream (``offsetlake.lease``)."""
        return self.layout.stream_leases.path

    @property
    def stream_log_path(self) -> str:
        """Where the Airflow stream task keeps the output of its ``offsetlake stream`` process: a
        local folder (process logs stay on the machine): in the lake when the lake is a local
        folder, else under ``$OFFSETLAKE_LOG_DIR`` (default ``~/.offsetlake/logs``)."""
        if not storage.is_uri(self.lake_path):
            return storage.child(self.lake_path, "_stream_logs", self.name)
        base = os.environ.get("OFFSETLAKE_LOG_DIR") or str(Path.home() / ".offsetlake" / "logs")
        return str(Path(base) / "_stream_logs" / self.name)

    @property
    def validation_path(self) -> str:
        """Where each validation's HTML report and JSON summary go."""
        return self.layout.validation.path

    @property
    def transform_dir(self) -> Path:
        return Path(self.source_file).resolve().parent if self.source_file else Path.cwd()

    @property
    def suite_file(self) -> Path | None:
        """The expectation suite file, or None when the pipeline has none (no validation). One
        table of a routed file takes ``<name>_<table>.expectations.yaml`` when it has one, else
        the file's ``<file>.expectations.yaml``."""
        if self.validation.suite:
            return self.transform_dir / self.validation.suite
        names = [self.name] + ([Path(self.source_file).stem] if self.route is not None and self.source_file else [])
        return next((p for n in names if (p := self.transform_dir / f"{n}.expectations.yaml").exists()), None)

    def kafka_client_config(self) -> dict[str, str]:
        """Full librdkafka config, secrets included: hand it to clients, never to a logger."""
        return {"bootstrap.servers": self.kafka.bootstrap_servers, **self.kafka.options}

    def redacted_kafka_options(self) -> dict[str, str]:
        return {k: ("***" if _SECRET_KEY.search(k) else v) for k, v in self.kafka.options.items()}

    def app_id(self, topic: str, partition: int) -> str:
        """Delta txn appId for one topic-partition of this pipeline (invariant 2)."""
        return app_id(self.name, topic, partition)

    def with_kafka_overrides(self, bootstrap_servers: str | None, options: dict[str, str]) -> PipelineConfig:
        """This config with Kafka settings from elsewhere (e.g. an Airflow connection) on top."""
        if not bootstrap_servers and not options:
            return self
        kafka = KafkaSettings.model_validate(
            {
                "bootstrap_servers": bootstrap_servers or self.kafka.bootstrap_servers,
                "options": {**self.kafka.options, **options},
            }
        )
        return self.model_copy(update={"kafka": kafka})

    def with_storage_overrides(self, options: dict[str, str]) -> PipelineConfig:
        """This config with storage settings from elsewhere (an Airflow connection) on top."""
        if not options:
            return self
        try:
            checked = PipelineConfig._storage_options({**self.storage, **options})
        except ValueError as err:
            raise ConfigError(f"storage connection: {err}", pipeline=self.name) from None
        return self.model_copy(update={"storage": checked})

    def with_registry_overrides(self, options: dict[str, str]) -> PipelineConfig:
        """This config with Schema Registry settings from elsewhere (an Airflow connection) on top,
        for the value format and the key format that read through a registry."""
        options = {k: v for k, v in options.items() if v != ""}
        if not options:
            return self
        update: dict[str, Any] = {}
        for field_name, fmt in (("format", self.format), ("key_format", self.key_format)):
            if fmt is None or isinstance(fmt, JsonFormat) or not fmt.uses_registry:
                continue
            merged = {**fmt.schema_registry, **options}
            problem = registry_settings_problem(merged)
            if problem:
                raise ConfigError(f"schema registry connection: {problem}", pipeline=self.name)
            update[field_name] = fmt.model_copy(update={"schema_registry": merged})
        sink_registry = self.sink.registry_merged(options)
        if sink_registry is not None:
            problem = registry_settings_problem(sink_registry)
            if problem:
                raise ConfigError(f"schema registry connection: {problem}", pipeline=self.name)
            update["sink"] = self.sink.model_copy(update={"schema_registry": sink_registry})
        return self.model_copy(update=update) if update else self

    def check_storage(self) -> None:
        """Refuse an object store that cannot be used or cannot commit safely (``storage.check_store``),
        before anything is read from Kafka; nothing to do for a local lake."""
        lake, sink = self.layout.lake, self.layout.sink
        for location in dict.fromkeys([lake, sink]):
            if not any(location.path.startswith(root.path + "/") for root in {lake} - {location}):
                storage.check_store(location, self.name)

    def redacted_storage_options(self) -> dict[str, str]:
        return storage.shown_options(self.storage)

    def __repr__(self) -> str:  # keep secrets out of tracebacks and debug logs
        return f"PipelineConfig(name={self.name!r}, topic={self.topic!r}, file={self.source_file!r})"

    __str__ = __repr__


FIELD_PROBLEM = "field_problem"  # a cross-field rule's error: its message names the field itself


def _locations_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """A lake or sink location delta-rs cannot address, or storage settings for a local lake."""
    for field_name, location in (("lake", config.lake_path), ("sink.table", config.sink_path)):
        problem = storage.location_problem(location)
        if problem:
            return field_name, f"{location} {problem}"
    if config.storage and not any(storage.is_uri(loc) and not loc.startswith("file://") for loc in (config.lake_path, config.sink_path)):
        return "storage", (f"settings for object storage, but lake {config.lake_path} is a local folder (use lake: s3://bucket/prefix)")
    return None


def _files_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """A suite, transform module or .avsc the YAML names that is not next to it; without a
    transform, a partition column that is neither a schema field nor a key column."""
    if config.validation.suite and not (config.transform_dir / config.validation.suite).is_file():
        return "validation.suite", f"{config.transform_dir / config.validation.suite} does not exist"
    if config.transform:
        module = config.transform_dir / f"{config.transform.split(':')[0]}.py"
        if not module.is_file():
            return "transform", f"{module} does not exist (the module goes next to the YAML)"
    elif isinstance(config.format, JsonFormat) and not (config.key_format and config.key_format.uses_registry):
        # a registry schema's fields are known when a batch is planned
        fields = set(config.format.schema_) | set(key_columns(config.key_format or KeyFormat()))
        missing = [c for c in config.sink.partition_by if c not in fields]
        if missing:
            return "sink.partition_by", (
                f"column '{missing[0]}' is not a field of format.schema or a key column (without a transform the rows have only those)"
            )
    if isinstance(config.format, AvroFormat) and config.format.schema_file:
        avsc = config.transform_dir / config.format.schema_file
        if not avsc.is_file():
            return "format.schema_file", f"{avsc} does not exist (the .avsc goes next to the YAML)"
    return None


def _partition_columns_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """A partition column whose declared type Delta cannot partition by."""
    for column in config.sink.partition_by:
        declared = config.format.schema_.get(column) if isinstance(config.format, JsonFormat) else None
        declared = declared or key_columns(config.key_format or KeyFormat()).get(column)
        if declared is not None and declared.lower() not in PARTITION_COLUMN_TYPES:
            return "sink.partition_by", (
                f"column '{column}' has type {declared}; partition columns must be one of {', '.join(sorted(PARTITION_COLUMN_TYPES))}"
            )
    return None


def spark_only_reason(config: PipelineConfig) -> str | None:
    """Why every batch of this pipeline takes the Spark path, known from its configuration alone
    (a step after the read runs in Spark), or None. ``offsetlake.direct.problem`` adds what only a
    batch's plan and decoder tell; this is the part ``data_path: direct`` is checked against."""
    if config.sink.keyed and not config.sink.folds_in_read:  # an aggregate and first_row fold in the read tasks
        return "a keyed sink merges in Spark"
    if config.transform:
        return "a transform runs in Spark"
    if config.suite_file is not None:
        return "the suite validates the rows in Spark"
    if getattr(config.format, "envelope", None) == "debezium":
        return "the format finishes decoding in Spark"
    return None


def jvm_refusal(config: PipelineConfig) -> str | None:
    """Why no batch of this pipeline can take the ``jvm`` path, known from its configuration
    alone, or None (``offsetlake.kafka_source.problem`` checks the batch's decoder too)."""
    if config.format.type != "json" or getattr(config.format, "envelope", None) is not None:
        return "the JVM path decodes plain JSON values; this format decodes in the read tasks"
    if config.key_format is not None and config.key_format.type not in ("string", "bytes", "json", "none"):
        return f"key_format {config.key_format.type} decodes in the read tasks"
    return None


def _data_path_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """``data_path: direct`` for a pipeline whose batches need Spark; ``jvm`` for one whose
    records the JVM path cannot read."""
    if config.data_path == "direct" and (reason := spark_only_reason(config)) is not None:
        return "data_path", f"pipeline {config.name} cannot take the direct path: {reason} (use auto or spark)"
    if config.data_path == "jvm" and (reason := jvm_refusal(config)) is not None:
        return "data_path", f"pipeline {config.name} cannot take the jvm path: {reason} (use auto or spark)"
    return None


def _engine_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """A merge engine that cannot take this pipeline's records: Debezium deletes for the engines
    that take no deletes."""
    if config.sink.mode in ("first_row", "aggregate") and getattr(config.format, "envelope", None) == "debezium":
        return "sink.mode", (
            f"mode {config.sink.mode} takes no deletes, and a Debezium envelope carries them; "
            "use partial_update or upsert for a change stream"
        )
    return None


def _kafka_sink_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """An outbox of a sink it cannot publish; a Kafka sink that would read its own output (its
    topic or dead-letter topic is a source) or takes a data path it cannot."""
    if config.outbox is not None and (refusal := config.sink.outbox_refusal()) is not None:
        return "outbox", f"publishes an append Delta sink's rows, not {refusal}"

    def is_source(topic: str) -> bool:
        return (
            topic == config.topic
            or topic in (config.topics or ())
            or bool(config.topic_pattern and re.fullmatch(config.topic_pattern, topic))
        )

    return config.sink.sources_problem(config.data_path, is_source, config.name)


def _routes_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """Routes the pipeline cannot take: table ``routes:`` of a Kafka sink (it routes to topics with
    ``sink.routes``), one named sink table or an outbox (several tables), a column the rows cannot
    have, topics a topic route does not list."""
    if isinstance(config.sink, KafkaSinkSettings) and config.sink.routes is not None:
        return _kafka_routes_problem(config, config.sink.routes)
    routes = config.routes
    if routes is None:
        return None
    if isinstance(config.sink, KafkaSinkSettings):
        return (
            "routes",
            "makes one pipeline per Delta table; a Kafka sink routes its rows to several topics in its one "
            "transaction with sink.routes: {by: <column or topic>, topics: {<topic>: [<values>]}}",
        )
    if isinstance(config.sink, DeltaSinkSettings) and config.sink.table is not None:
        return "sink.table", "names one table, and a routed pipeline writes several: <lake>/<name>_<table> each (leave sink.table out)"
    if config.outbox is not None:
        return "outbox", "publishes one sink table, and a routed pipeline writes several"
    if routes.by_topic:
        if config.route is not None:  # one table reads its own topics: the file was checked whole
            return None
        if config.topic_pattern is not None:
            return "routes.by", "topic routes the topics the pipeline lists; give topic or topics, not topic_pattern"
        listed = [config.topic] if config.topic is not None else list(config.topics or ())
        for name, topics in routes.tables.items():
            stray = [t for t in topics if t not in listed]
            if stray:
                return f"routes.tables.{name}", f"topic '{stray[0]}' is not one the pipeline reads ({', '.join(listed)})"
        mapped = {t for topics in routes.tables.values() for t in topics}
        unmapped = [t for t in listed if t not in mapped]
        if unmapped and routes.unmapped == UNMAPPED_DEAD_LETTER:
            return "routes.tables", f"topic '{unmapped[0]}' goes to no table: map it, or name a table in routes.unmapped"
        return None
    return _route_column_problem(config, routes.by, "routes.by")


def _route_column_problem(config: PipelineConfig, by: str, field: str) -> tuple[str, str] | None:
    """A route's column that rows without a transform cannot have (a JSON pipeline's rows are its
    schema's fields and key columns; other formats are checked when a batch has its columns)."""
    if not config.transform and isinstance(config.format, JsonFormat) and not (config.key_format and config.key_format.uses_registry):
        fields = set(config.format.schema_) | set(key_columns(config.key_format or KeyFormat()))
        if by not in fields:
            return (
                field,
                f"column '{by}' is not a field of format.schema or a key column (without a transform the rows have only those)",
            )
    return None


def _kafka_routes_problem(config: PipelineConfig, routes: KafkaRoutes) -> tuple[str, str] | None:
    """``sink.routes`` of a Kafka sink: beside table ``routes:``, a source topic a topic route does
    not read, or a column the rows cannot have."""
    if config.routes is not None:
        return "routes", "a Kafka sink routes with sink.routes alone (its topics, in one transaction)"
    if routes.by_topic:
        if config.topic_pattern is not None:
            return None  # the pattern's topics are not known at load: one no route maps goes to sink.topic
        listed = [config.topic] if config.topic is not None else list(config.topics or ())
        for name, topics in routes.topics.items():
            stray = [t for t in topics if t not in listed]
            if stray:
                return f"sink.routes.topics.{name}", f"topic '{stray[0]}' is not one the pipeline reads ({', '.join(listed)})"
        return None
    return _route_column_problem(config, routes.by, "sink.routes.by")
