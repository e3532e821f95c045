"""The ``sink:`` and ``outbox:`` settings of a pipeline: where its rows go (a Delta table or a Kafka
topic) and how (``mode``, with the merge engines' measures, windows and horizons)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from offsetlake.config.registry_settings import RegistryOptions
from offsetlake.config.strict import Strict as _Strict

_DURATION = re.compile(r"^([1-9][0-9]*)(s|m|h|d)$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3_600, "d": 86_400}
# the merge engines that keep state per key beside the rows (``offsetlake.engines``)
ENGINE_MODES = ("first_row", "partial_update", "aggregate")
MEASURE_FUNCTIONS = ("sum", "count", "min", "max", "first", "last", "last_non_null")


DEFAULT_FOLD_AFTER = "7d"  # Kafka's default retention (log.retention.hours=168): what a backfill can read back


def duration_seconds(text: str) -> int:
    """Seconds of a duration written ``<n>s``, ``<n>m``, ``<n>h`` or ``<n>d`` (ValueError else)."""
    found = _DURATION.match(text.strip()) if isinstance(text, str) else None
    if found is None:
        raise ValueError(f"{text!r} is not a duration: write a whole number with s, m, h or d (30s, 5m, 1h, 7d)")
    return int(found.group(1)) * _DURATION_UNITS[found.group(2)]


class WindowSettings(_Strict):
    """An event-time window of an aggregate: ``on`` is a timestamp column of the rows; a record
    counts in the window ``[start, start + size)`` holding its ``on`` value, or, with ``slide``,
    in each of the ``size / slide`` windows starting every ``slide`` that hold it. The window's
    ``window_start`` and ``window_end`` are part of the row's key."""

    on: str = Field(min_length=1)
    size: str
    slide: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _yaml_on(cls, data: Any) -> Any:
        """YAML 1.1 reads an unquoted ``on:`` key as the boolean true: take it as ``on``."""
        if isinstance(data, dict) and True in data and "on" not in data:
            data = {("on" if k is True else k): v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _sizes(self) -> WindowSettings:
        size = duration_seconds(self.size)
        if self.slide is not None:
            slide = duration_seconds(self.slide)
            if slide > size or size % slide:
                raise ValueError(f"window slide {self.slide} must divide size {self.size} (a record is in size/slide windows)")
        return self

    @property
    def size_seconds(self) -> int:
        return duration_seconds(self.size)

    @property
    def slide_seconds(self) -> int:
        return duration_seconds(self.slide) if self.slide is not None else self.size_seconds


class Measure(_Strict):
    """One output column of an aggregate: ``function`` over the rows' ``column`` (``*`` for
    ``count``: every record)."""

    name: str
    function: Literal["sum", "count", "min", "max", "first", "last", "last_non_null"]
    column: str


_COORDINATE_COLUMNS = ("_kafka_topic", "_kafka_partition", "_kafka_offset", "_kafka_timestamp", "_kafka_row")
_KAFKA_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


def _doubled_key(key: list[str]) -> None:
    doubled = sorted({c for c in key if key.count(c) > 1})
    if doubled:
        raise ValueError(f"key: {', '.join(doubled)} listed more than once")


class DeltaSinkSettings(_Strict):
    """``sink:`` of a Delta table in the lake (``type: delta``, the default). Its write mode's
    settings are its own: a Kafka sink's fields cannot be written here."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: Literal["delta"] = "delta"
    table: str | None = None  # path; relative paths are under the lake; default <lake>/<name>
    partition_by: list[str] = Field(default_factory=list)
    # append: every record's rows are added. upsert: one row per key (``offsetlake.keyed``): the
    # newest record of each key replaces its row, a delete (tombstone, Debezium op d) removes it.
    # first_row, partial_update, aggregate: merge engines keeping each key's state beside its row
    # (``offsetlake.engines``): the first record per key; the non-null fields of every record;
    # declared measures per key (and window).
    mode: Literal["append", "upsert", "first_row", "partial_update", "aggregate"] = "append"
    key: list[str] = Field(default_factory=list)  # keyed modes: the columns that identify a row
    # upsert, partial_update: a record with a null value deletes its key's row (default); false:
    # a dead letter. first_row and aggregate take no deletes: a tombstone is a dead letter.
    delete_on_tombstone: bool = True
    # keyed modes: about how many rows each file a merge writes holds (files sorted by key; a
    # merge rewrites the files holding the keys its batch touches, so smaller files rewrite less)
    file_rows: int = Field(default=500_000, gt=0)
    # aggregate: output column -> {function: column}, e.g. revenue: {sum: amount}, orders: {count: "*"}
    measures: dict[str, dict[str, str]] = Field(default_factory=dict)
    window: WindowSettings | None = None  # aggregate: an event-time window, part of the key
    # aggregate with a window: a record whose Kafka timestamp is more than this after its
    # window's ``on`` value is a dead letter (``late_record``) instead of updating its window
    allowed_lateness: str | None = None
    # first_row: a horizon after which a key may be inserted again: a record at least this long
    # after the first record of its key's current episode starts a new episode, whose first
    # record becomes the key's row; measured on ``within_on`` (a timestamp column; default the
    # record's Kafka timestamp)
    within: str | None = None
    within_on: str | None = None
    # merge engines: a record's contribution of its own (what a backfill replaces) is folded into
    # its group's state once its Kafka timestamp is this much older than the batch; a backfill
    # below the folded offsets is refused (docs/design.md, "Bounded state"). Default 7d, Kafka's
    # own default retention; "never" keeps every contribution. first_row with within keeps them all.
    fold_after: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_kafka_fields(cls, data: Any) -> Any:
        """A Kafka sink's field here cannot be written (``extra: forbid``); this says where it belongs."""
        if isinstance(data, dict):
            _refuse_given(data, ("topic", "dead_letter_topic", "subject"), "a Kafka sink (type: kafka), not to a Delta table", _set)
            registry = ("format", "schema_registry", "register", "register_schema")
            _refuse_given(data, registry, "a Kafka sink (type: kafka); a Delta sink keeps the rows' own columns")
            where = "a Kafka sink (type: kafka), to topics; rows go to several Delta tables with routes: at the top of the file"
            _refuse_given(data, ("routes",), where, _set)
        return data

    @model_validator(mode="after")
    def _keyed(self) -> DeltaSinkSettings:
        if self.mode != "append" and not self.key:
            raise ValueError(f"mode {self.mode} needs key: [columns] (e.g. key: [_kafka_key], or the fields that identify a row)")
        if self.mode == "append" and self.key:
            raise ValueError(
                "key applies to the keyed modes (upsert, first_row, partial_update, aggregate); an append sink keeps every record's rows"
            )
        _doubled_key(self.key)
        coordinates = [c for c in self.key if c in _COORDINATE_COLUMNS]
        if coordinates:
            raise ValueError(f"key: {coordinates[0]} is a record coordinate, not a key column (every record has its own)")
        self._engine_fields()
        return self

    def _fold_after(self) -> None:
        if self.fold_after is None:
            return
        if self.engine is None:
            raise ValueError(f"fold_after applies to the merge engines (first_row, partial_update, aggregate), not {self.mode}")
        if self.within is not None:
            raise ValueError("fold_after does not apply to first_row with within: its episodes fold in order: it keeps every contribution")
        if self.fold_after != "never":
            duration_seconds(self.fold_after)

    def _engine_fields(self) -> None:
        self._fold_after()
        if self.mode != "first_row":
            for name in ("within", "within_on"):
                if getattr(self, name):
                    raise ValueError(f"{name} applies to mode: first_row, not {self.mode}")
        elif self.within is not None:
            duration_seconds(self.within)
        elif self.within_on is not None:
            raise ValueError("within_on needs within: the horizon it measures")
        if self.mode != "aggregate":
            for name in ("measures", "window", "allowed_lateness"):
                if getattr(self, name):
                    raise ValueError(f"{name} applies to mode: aggregate, not {self.mode}")
            return
        if not self.measures:
            raise ValueError("mode aggregate needs measures: {output column: {function: column}}, e.g. revenue: {sum: amount}")
        self.aggregates()  # each measure well-formed
        if self.partition_by:
            raise ValueError("partition_by does not apply to mode: aggregate (its files are sorted by window and key instead)")
        if self.allowed_lateness is not None:
            if self.window is None:
                raise ValueError("allowed_lateness needs a window: it is measured from the window's `on` column")
            duration_seconds(self.allowed_lateness)
        taken = set(self.key) | ({"window_start", "window_end"} if self.window else set())
        clash = sorted(taken & set(self.measures))
        if clash:
            raise ValueError(f"measure {clash[0]} has the name of a key column")
        if self.delete_on_tombstone and "delete_on_tombstone" in self.model_fields_set:
            raise ValueError("mode aggregate takes no deletes: leave out delete_on_tombstone (a tombstone is a dead letter)")

    def aggregates(self) -> list[Measure]:
        """The declared measures, in order (ValueError naming a bad one)."""
        out = []
        for name, spec in self.measures.items():
            if not isinstance(spec, dict) or len(spec) != 1:
                raise ValueError(f"measure {name}: write one function and its column, e.g. {name}: {{sum: amount}}")
            [(function, column)] = spec.items()
            if name.startswith("__"):
                raise ValueError(f"measure {name}: names starting with __ are offsetlake's own")
            if function not in MEASURE_FUNCTIONS:
                raise ValueError(f"measure {name}: unknown function {function!r}; use one of {', '.join(MEASURE_FUNCTIONS)}")
            if column == "*" and function != "count":
                raise ValueError(f"measure {name}: only count takes '*' (every record)")
            out.append(Measure.model_validate({"name": name, "function": function, "column": str(column)}))
        return out

    @property
    def keyed(self) -> bool:
        """One row per key (and window): every mode but append."""
        return self.mode != "append"

    @property
    def engine(self) -> str | None:
        """The merge engine (``ENGINE_MODES``) or None (append, upsert)."""
        return self.mode if self.mode in ENGINE_MODES else None

    @property
    def folds_in_read(self) -> bool:
        """Whether the read tasks may fold this engine's contributions (the direct path,
        ``offsetlake.engine_arrow``): an aggregate, or first_row without ``within`` (a fold in order)."""
        return self.engine in ("aggregate", "first_row") and self.within is None

    @property
    def fold_after_seconds(self) -> int | None:
        """How old (Kafka timestamp, seconds before the batch) a record's contribution must be to
        be folded into its group's state; None: never folded (not an engine, ``within``, "never")."""
        if self.engine is None or self.within is not None or self.fold_after == "never":
            return None
        return duration_seconds(self.fold_after or DEFAULT_FOLD_AFTER)

    @property
    def removes_keys(self) -> bool:
        """Whether a delete removes its key's row (upsert and partial_update): a Debezium delete
        keyed by the record key needs no ``before``."""
        return self.mode in ("upsert", "partial_update")

    @property
    def deletes(self) -> bool:
        """Whether a tombstone deletes its key's row (upsert and partial_update)."""
        return self.removes_keys and self.delete_on_tombstone

    # ---- what a pipeline asks of its sink, answered per kind ------------------------------------
    @property
    def is_kafka(self) -> bool:
        """False: a Delta table. For code outside the library (a user's DAG, a test); the library
        asks ``config.sink_kinds.sink_kind`` what a sink can do instead of testing its kind."""
        return False

    def label(self, sink_path: str) -> str:
        """The sink as messages and DAG descriptions name it."""
        return f"Delta {sink_path}"

    # the pipeline's Delta tables a catalog names (``offsetlake.catalog``): sink, dead letters, ledger
    delta_tables: ClassVar[tuple[str, ...]] = ("sink", "dead_letters", "ledger")

    def registry_merged(self, options: dict[str, str]) -> dict[str, str] | None:
        """The sink's Schema Registry settings with a connection's ``options`` (None: it uses none)."""
        return None

    def outbox_refusal(self) -> str | None:
        """Why the outbox cannot publish this sink's rows, or None."""
        return None if self.mode == "append" else f"sink.mode {self.mode}"

    def sources_problem(self, data_path: str, is_source: Callable[[str], bool], pipeline: str) -> tuple[str, str] | None:
        """A setting of this sink that the pipeline's data path or sources rule out: (field, problem)."""
        return None


def route_values_as_text(mapping: dict[Any, Any]) -> dict[Any, Any]:
    """A route's values (table or topic -> values) as the text they are compared as: Spark's cast
    of the column to string, so YAML's true is "true" and 3 is "3"; one value may stand alone."""
    out: dict[Any, Any] = {}
    for name, values in mapping.items():
        items = values if isinstance(values, list) else [values]
        out[name] = [str(v).lower() if isinstance(v, bool) else v if isinstance(v, str) else str(v) for v in items]
    return out


def route_values_apart(mapping: dict[str, list[str]], field: str, what: str) -> None:
    """ValueError when one value is under two names of ``mapping``: a row goes to one ``what``."""
    seen: dict[str, str] = {}
    for name, values in mapping.items():
        for v in values:
            if v in seen and seen[v] != name:
                raise ValueError(f"{field}: value '{v}' is mapped to both {seen[v]} and {name}; a row goes to one {what}")
            seen[v] = name


class KafkaRoutes(_Strict):
    """``sink.routes`` of a Kafka sink: each row goes to the topic its value maps, and a row whose
    value no topic maps (null included) to ``sink.topic``. All of a batch's topics are written in
    its ONE transaction, with its source ends and ledger entry, so a read_committed consumer of any
    of them sees the batch whole or not at all (``offsetlake.kafka_sink``)."""

    # a column of the rows (after the transform), compared as text (Spark's cast to string, as a
    # table route compares), or ``topic``: the record's source topic
    by: str = Field(min_length=1)
    # output topic -> the values (or source topics) whose rows it takes; a value in one topic
    topics: dict[str, list[str]]

    @model_validator(mode="before")
    @classmethod
    def _values_as_text(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("topics"), dict):
            return data
        return {**data, "topics": route_values_as_text(data["topics"])}

    @model_validator(mode="after")
    def _topics_apart(self) -> KafkaRoutes:
        if not self.topics:
            raise ValueError("topics: name one or more output topics, each with the values it takes")
        for name, values in self.topics.items():
            if not _KAFKA_TOPIC_NAME.fullmatch(name):
                raise ValueError(f"topics: '{name}' is not a Kafka topic name (letters, digits, '.', '_', '-')")
            if not values:
                raise ValueError(f"topics.{name}: give the values it takes (rows no topic maps go to sink.topic)")
        route_values_apart(self.topics, "topics", "topic")
        return self

    @property
    def by_topic(self) -> bool:
        return self.by == "topic"

    def mapping(self) -> dict[str, str]:
        """Each value (as text) to its output topic."""
        return {v: name for name, values in self.topics.items() for v in values}


class KafkaSinkSettings(_Strict):
    """``sink:`` of a Kafka topic (``type: kafka``, ``offsetlake.kafka_sink``): each batch's rows are
    produced in ONE Kafka transaction with the source end offsets committed for the pipeline's
    group; the transaction is the commit point, the ledger follows. Only ``mode: append`` (a log
    cannot replace or fold rows); a Delta table's fields cannot be written here. What generic row
    code asks of a Delta sink's settings (``partition_by``, ``window``...) it answers as an append
    sink without them."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: Literal["kafka"]
    # the output topic (it must exist: its partitions are yours to choose)
    topic: str = Field(min_length=1)
    mode: Literal["append"] = "append"
    # the columns that become the record key (one: its value as text; several: a JSON array;
    # none: no key)
    key: list[str] = Field(default_factory=list)
    # how a row becomes the record value: json, an object of the row's columns without the
    # _kafka_* coordinates; avro, json_schema, protobuf: the Confluent wire format through the
    # Schema Registry (``offsetlake.sink_values``): the schema derived from the output columns is
    # registered under ``subject`` (default <topic>-value), or with register: false only looked up
    format: Literal["json", "avro", "json_schema", "protobuf"] = "json"
    schema_registry: RegistryOptions = Field(default_factory=dict)  # default: format.schema_registry
    subject: str | None = Field(default=None, min_length=1)
    register_schema: bool = Field(default=True, alias="register")  # YAML: register
    # where records that became no row go, in the same transaction, with the reason in headers
    # (default <topic>.dead-letters)
    dead_letter_topic: str | None = Field(default=None, min_length=1)
    # each row to a topic chosen by a column's value or its source topic (``KafkaRoutes``);
    # ``topic`` takes the rows no route maps
    routes: KafkaRoutes | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_delta_fields(cls, data: Any) -> Any:
        """A topic, the append mode and none of a Delta table's settings (they cannot be written
        here, ``extra: forbid``; this says where they belong)."""
        if not isinstance(data, dict):
            return data
        if data.get("topic") is None:
            raise ValueError("a Kafka sink (type: kafka) needs topic: the topic its rows are produced to")
        if data.get("mode", "append") != "append":
            raise ValueError(
                f"a Kafka sink takes mode append only, not {data['mode']}: a topic cannot replace or delete a key's row "
                "(produce to a compacted topic keyed by key: [columns] for newest-per-key, or use a Delta sink)"
            )
        _refuse_given(data, ("table", "partition_by"), f"a Delta sink; a Kafka sink writes to topic {data['topic']}", bool)
        engines = ("measures", "window", "allowed_lateness", "within", "within_on", "fold_after")
        _refuse_given(data, engines, "a Delta sink's merge engines, not to a Kafka sink", bool)
        if data.get("format", "json") == "json":
            registry = ("schema_registry", "subject", "register", "register_schema")
            _refuse_given(data, registry, "the registry formats (avro, json_schema, protobuf), not to format json")
        return data

    @model_validator(mode="after")
    def _names(self) -> KafkaSinkSettings:
        _doubled_key(self.key)
        for name in ("topic", "dead_letter_topic"):
            value = getattr(self, name)
            if value is not None and not _KAFKA_TOPIC_NAME.fullmatch(value):
                raise ValueError(f"{name}: '{value}' is not a Kafka topic name (letters, digits, '.', '_', '-')")
        return self

    @property
    def dead_letters_to(self) -> str:
        """The dead-letter topic."""
        return self.dead_letter_topic or f"{self.topic}.dead-letters"

    @property
    def output_topics(self) -> list[str]:
        """Every topic rows go to: ``topic`` (the rows no route maps), then the routes' topics."""
        routed = list(self.routes.topics) if self.routes is not None else []
        return [self.topic, *(t for t in routed if t != self.topic)]

    # ---- a Delta table's settings, as an append sink without them -------------------------------
    table: ClassVar[None] = None
    partition_by: ClassVar[list[str]] = []
    window: ClassVar[None] = None
    allowed_lateness: ClassVar[None] = None
    within: ClassVar[None] = None
    within_on: ClassVar[None] = None
    fold_after: ClassVar[None] = None
    fold_after_seconds: ClassVar[None] = None
    delete_on_tombstone: ClassVar[bool] = False
    file_rows: ClassVar[int] = 500_000
    measures: ClassVar[dict[str, dict[str, str]]] = {}
    keyed: ClassVar[bool] = False
    engine: ClassVar[str | None] = None
    folds_in_read: ClassVar[bool] = False
    removes_keys: ClassVar[bool] = False
    deletes: ClassVar[bool] = False

    def aggregates(self) -> list[Measure]:
        return []

    # ---- what a pipeline asks of its sink, answered per kind ------------------------------------
    # True: a Kafka topic (see ``DeltaSinkSettings.is_kafka``)
    is_kafka: ClassVar[bool] = True

    def label(self, sink_path: str) -> str:
        topics = self.output_topics
        return f"Kafka topic {self.topic}" if len(topics) == 1 else f"Kafka topics {', '.join(topics)}"

    # its rows and dead letters are topics: the ledger is its one Delta table
    delta_tables: ClassVar[tuple[str, ...]] = ("ledger",)

    def registry_merged(self, options: dict[str, str]) -> dict[str, str] | None:
        return None if self.format == "json" else {**self.schema_registry, **options}

    def outbox_refusal(self) -> str | None:
        return "a Kafka sink (its topic is already the output)"

    def sources_problem(self, data_path: str, is_source: Callable[[str], bool], pipeline: str) -> tuple[str, str] | None:
        if data_path in ("direct", "jvm"):
            return "data_path", f"a Kafka sink takes auto or spark (Spark hands the rows to the driver's producer), not {data_path}"
        named = [("sink.topic", self.topic), ("sink.dead_letter_topic", self.dead_letters_to)]
        named += [(f"sink.routes.topics.{t}", t) for t in self.output_topics[1:]]
        for name, topic in named:
            if is_source(topic):
                return name, f"{topic} is also a source of pipeline {pipeline}: it would read its own output"
        if self.dead_letters_to in self.output_topics[1:]:
            return f"sink.routes.topics.{self.dead_letters_to}", "is the dead-letter topic: rows and dead letters go to different topics"
        return None


def _sink_type(data: Any) -> str:
    """The tag of a ``sink:`` mapping (``delta`` when it names none), or of a settings object."""
    if isinstance(data, dict):
        return str(data.get("type", "delta"))
    return str(getattr(data, "type", "delta"))


# ``sink:``: a Delta table or a Kafka topic, told apart by ``type`` (pydantic's discriminator, the
# one place that reads it while loading); each kind has only its own fields
SinkSettings = Annotated[
    Annotated[DeltaSinkSettings, Tag("delta")] | Annotated[KafkaSinkSettings, Tag("kafka")],
    Discriminator(_sink_type, custom_error_type="sink_type", custom_error_message="type: delta or kafka"),
]


class OutboxSettings(_Strict):
    """``outbox:``: the Airflow DAG ``<name>_outbox`` publishes the Delta sink's committed batches to
    ``topic`` after each commit, exactly as ``offsetlake publish <name> --to <topic> --key ...``."""

    topic: str = Field(min_length=1)
    key: list[str] = Field(default_factory=list)


def _set(value: Any) -> bool:
    return value is not None


def _refuse_given(data: dict[str, Any], names: tuple[str, ...], belongs: str, given: Callable[[Any], bool] | None = None) -> None:
    """A field of ``names`` given is refused: it applies to ``belongs``, not here. Given: present
    (even empty), or, with ``given``, a value it holds true (``register_schema`` is named as YAML
    writes it, ``register``)."""
    for name in names:
        if name in data and (given is None or given(data[name])):
            raise ValueError(f"{name.removesuffix('_schema')} applies to {belongs}")
