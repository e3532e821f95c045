"""Format dispatch goes through a registry (issue 36 item 5): each format module registers its
``format.type`` name, and every name the pipeline YAML admits finds its format there."""

from __future__ import annotations

import typing

import pytest

from offsetlake.config import models
from offsetlake.formats.base import FORMAT_MODULES, FORMATS, format_named


def _admitted_types() -> set[str]:
    """Every ``format.type`` the config models admit (their ``type`` Literals)."""
    names = set()
    for model in (models.JsonFormat, models.AvroFormat, models.JsonSchemaFormat, models.ProtobufFormat):
        names.update(typing.get_args(model.model_fields["type"].annotation))
    return names


def test_every_admitted_format_type_is_registered_by_its_module():
    admitted = _admitted_types()
    assert admitted == {"json", "avro", "json_schema", "protobuf"}
    for name in admitted:
        fmt = format_named(name)
        assert fmt.name == name and callable(fmt.decoder) and callable(fmt.reader_schema)
    assert set(FORMATS) == admitted, f"registered {sorted(FORMATS)} from {FORMAT_MODULES}"
    assert format_named("json").envelope is not None, "JSON envelopes carry their own JSON schema"


def test_an_unregistered_name_is_not_guessed():
    with pytest.raises(KeyError):
        format_named("csv")
