"""The Schema Registry, as offsetlake uses it: the reader schema of a plan, writer schemas by id.

confluent-kafka's ``SchemaRegistryClient`` speaks the REST API; this module decides what its
answers mean for a batch. A schema id the registry does not know is a property of the record
that carries it (a dead letter, invariant 8); a registry that cannot be reached or answers an
error is an outage: the batch fails before anything is committed (``SchemaRegistryUnavailableError``)
and no good record ever becomes a dead letter because of it. Settings carry secrets
(``basic.auth.user.info``): messages show the URL only.

Clients and schemas are cached per process (a driver, or a Spark Python worker that decodes many
chunks): a schema id names one schema forever, so a fetched one never goes stale.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from offsetlake.errors import ConfigError, SchemaNotFound, SchemaRegistryUnavailableError
from offsetlake.plan import ReaderSchema

if TYPE_CHECKING:
    from offsetlake.config import PipelineConfig

# Numbers the client wants as numbers; YAML and connections hand them over as text.
_NUMERIC = {"timeout", "max.retries", "retries.wait.ms", "retries.max.wait.ms", "cache.latest.ttl.sec"}
# A batch should fail within seconds when the registry is down, not after the client's default
# backoff (3 retries, up to 20 s each); a user's own settings win.
_DEFAULTS = {"timeout": 10, "max.retries": 2, "retries.wait.ms": 200, "retries.max.wait.ms": 2000}

_lock = threading.Lock()
_clients: dict[tuple, Any] = {}
_by_id: dict[tuple, RegisteredText] = {}


@dataclass(frozen=True)
class RegisteredText:
    """A schema as the registry holds it: its type, text and references, and where it was found."""

    schema_id: int
    schema_type: str  # AVRO, PROTOBUF, JSON
    text: str
    references: tuple[tuple[str, str, int], ...] = ()  # (name, subject, version)
    subject: str | None = None
    version: int | None = None
    import_name: str | None = None  # as a reference: the name the referencing schema imports it by


def decoder_setting(config: PipelineConfig, reader: ReaderSchema) -> tuple[dict[str, str], int, str]:
    """A registry format's decoder of one reader schema: the registry's settings, the schema's id,
    and where its errors say they come from. Refuses a reader schema without an id."""
    if reader.id is None:
        raise ConfigError("a registry reader schema without an id", pipeline=config.name)
    return dict(config.format.schema_registry), reader.id, f"{config.source_file or config.name}: reader schema {reader.describe()}"  # type: ignore[union-attr]


def registry_url(settings: dict[str, str]) -> str:
    return settings.get("url", "(no url)")


def _client(settings: dict[str, str]) -> Any:
    # authlib (imported by the client for OAuth) warns on import that httpx is deprecated, in
    # every process and Spark worker; nothing offsetlake can act on. Its own "always" filter goes
    # first when authlib.deprecate is imported, so ours is added after that import.
    import authlib.deprecate

    warnings.filterwarnings("ignore", message="The httpx module is deprecated", category=authlib.deprecate.AuthlibDeprecationWarning)
    from confluent_kafka.schema_registry import SchemaRegistryClient

    key = tuple(sorted(settings.items()))
    with _lock:
        client = _clients.get(key)
        if client is None:
            conf: dict[str, Any] = dict(_DEFAULTS)
            for name, value in settings.items():
                conf[name] = float(value) if name in _NUMERIC and "." in value else int(value) if name in _NUMERIC else value
            client = _clients[key] = SchemaRegistryClient(conf)
        return client


def sdk_client(settings: dict[str, str]) -> Any:
    """confluent-kafka's ``SchemaRegistryClient`` for ``settings`` (one per process), for its serdes."""
    return _client(settings)


def _call(pipeline: str, settings: dict[str, str], what: str, call: Any) -> Any:
    """Run one registry request: its answer, SchemaNotFound for a 404 that means "no such
    schema/subject/version", SchemaRegistryUnavailableError for anything else."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    try:
        return call()
    except SchemaRegistryError as err:
        if err.http_status_code == 404 and err.error_code in (40401, 40402, 40403):
            raise SchemaNotFound(err.error_message) from None
        raise SchemaRegistryUnavailableError(
            f"the Schema Registry at {registry_url(settings)} answered HTTP {err.http_status_code} "
            f"(error {err.error_code}: {err.error_message}) while {what}; nothing was committed, run again once it "
            "answers",
            pipeline=pipeline,
        ) from None
    except Exception as err:
        raise SchemaRegistryUnavailableError(
            f"the Schema Registry at {registry_url(settings)} could not be reached while {what} "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); nothing was committed, run again "
            "once it answers",
            pipeline=pipeline,
        ) from None


def subject_version(pipeline: str, settings: dict[str, str], subject: str, version: int | str, fmt: str | None = None) -> RegisteredText:
    """The subject's ``version`` (a number, or ``latest``) with its global schema id; ``fmt``
    ``serialized`` asks for a Protobuf schema as a base64 ``FileDescriptorProto``."""
    client = _client(settings)
    what = f"looking up subject {subject} version {version}"
    found = _call(pipeline, settings, what, lambda: client.get_version(subject, version, fmt=fmt))
    schema = found.schema
    return RegisteredText(
        schema_id=found.schema_id,
        schema_type=schema.schema_type or "AVRO",
        text=schema.schema_str,
        references=tuple((r.name, r.subject, r.version) for r in schema.references or ()),
        subject=found.subject,
        version=found.version,
    )


def schema_by_id(pipeline: str, settings: dict[str, str], schema_id: int, fmt: str | None = None) -> RegisteredText:
    """The schema the registry holds under ``schema_id`` (cached for the life of the process);
    ``fmt`` as for ``subject_version``."""
    key = (tuple(sorted(settings.items())), schema_id, fmt)
    cached = _by_id.get(key)
    if cached is not None:
        return cached
    client = _client(settings)
    schema = _call(pipeline, settings, f"fetching schema id {schema_id}", lambda: client.get_schema(schema_id, fmt=fmt))
    found = RegisteredText(
        schema_id=schema_id,
        schema_type=schema.schema_type or "AVRO",
        text=schema.schema_str,
        references=tuple((r.name, r.subject, r.version) for r in schema.references or ()),
    )
    _by_id[key] = found
    return found


def referenced(pipeline: str, settings: dict[str, str], schema: RegisteredText, fmt: str | None = None) -> list[RegisteredText]:
    """The schemas ``schema`` references, depth first (each before the schemas that use it), each
    with the name the referencing schema imports it by in ``import_name``."""
    out: list[RegisteredText] = []
    seen: set[tuple[str, int]] = set()

    def visit(refs: tuple[tuple[str, str, int], ...]) -> None:
        for name, subject, version in refs:
            if (subject, version) in seen:
                continue
            seen.add((subject, version))
            try:
                found = subject_version(pipeline, settings, subject, version, fmt)
            except SchemaNotFound as err:
                raise SchemaRegistryUnavailableError(
                    f"schema id {schema.schema_id} references subject {subject} version {version}, "
                    f"which the Schema Registry at {registry_url(settings)} does not hold ({err})",
                    pipeline=pipeline,
                ) from None
            visit(found.references)
            out.append(replace(found, import_name=name))

    visit(schema.references)
    return out


def registry_reader_schema(
    config: PipelineConfig, schema_type: str, fingerprint: Callable[[str], str], alternative: str = "", field: str = "format"
) -> ReaderSchema:
    """The reader schema a new plan of a registry-backed format records: the subject's latest or
    pinned version, with its global id. Raises ConfigError (no registry set, no such subject or
    version, a schema of another type) and SchemaRegistryUnavailableError."""
    fmt: Any = config.format
    kind = fmt.type
    if not fmt.schema_registry.get("url"):
        raise ConfigError(
            f"{field} {kind} reads through a Schema Registry but none is set: "
            f"give {field}.schema_registry.url, an Airflow connection schema_registry_{config.name} "
            f"(or schema_registry_default){', ' + alternative if alternative else ''}",
            pipeline=config.name,
        )
    if not fmt.subject and config.topic is None:
        raise ConfigError(
            f"{field}.subject is needed: the pipeline reads {config.topic_label}, so there is no one <topic>-value subject to default to",
            pipeline=config.name,
        )
    subject = fmt.subject or f"{config.topic}-value"
    try:
        found = subject_version(config.name, fmt.schema_registry, subject, fmt.version)
    except SchemaNotFound as err:
        raise ConfigError(
            f"the Schema Registry at {registry_url(fmt.schema_registry)} has "
            f"no subject {subject} version {fmt.version} ({err}); set {field}.subject / {field}.version, "
            "or register the schema first",
            pipeline=config.name,
        ) from None
    if found.schema_type != schema_type:
        raise ConfigError(
            f"subject {subject} version {found.version} is a {found.schema_type} schema; {field}.type is {kind}", pipeline=config.name
        )
    return ReaderSchema(source="registry", fingerprint=fingerprint(found.text), subject=subject, version=found.version, id=found.schema_id)
