"""The seams hold: every kind of sink provides every part, every write mode has its class, and no
library module outside the seams' own decides by the sink's kind or mode (docs/design.md, "The
sink seam", "The write-mode seam")."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

import offsetlake.audit
import offsetlake.runs
import offsetlake.sinks.choice  # noqa: F401 - provides the readers
from offsetlake.audit.report import AUDIT
from offsetlake.config import DeltaSinkSettings, PipelineConfig
from offsetlake.config.sink_kinds import _KINDS, sink_kind
from offsetlake.sinks.reading import READER, SinkReader
from offsetlake.sinks.writing import WRITER, SinkWriter
from offsetlake.write_modes import WriteMode, write_mode

LIBRARY = Path(__file__).resolve().parent.parent / "offsetlake"
# where the sink's kind and mode may be read: the settings themselves, the kinds, the write modes
# and the merge engines (one class per engine, picked by its mode)
SEAMS = ("config/", "write_modes/", "engines.py", "engine_replay.py")
DECIDING = {"type", "mode", "engine", "is_kafka"}


def _config(sink: dict) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {"name": "p", "kafka": {"bootstrap_servers": "localhost:9092"}, "topic": "t", "format": {"schema": {"a": "string"}}, "sink": sink}
    )


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_every_kind_of_sink_provides_its_reader_writer_and_audit(kind):
    config = _config({"type": kind, "topic": "out"} if kind == "kafka" else {"type": kind})
    found = sink_kind(config)
    assert found.name == kind
    assert issubclass(found.implementation(READER), SinkReader)
    assert issubclass(found.implementation(WRITER), SinkWriter)
    assert callable(found.implementation(AUDIT).run)
    assert len({_KINDS[k].implementation(WRITER) for k in _KINDS}) == len(_KINDS), "each kind its own writer"


@pytest.mark.parametrize("mode", typing.get_args(DeltaSinkSettings.model_fields["mode"].annotation))
def test_every_write_mode_has_its_class(mode):
    sink: dict = {"mode": mode}
    if mode != "append":
        sink["key"] = ["a"]
    if mode == "aggregate":
        sink["measures"] = {"n": {"count": "*"}}
    chosen = write_mode(_config(sink))
    assert isinstance(chosen, WriteMode) and chosen.name == mode
    assert chosen.replay is not None


def _decisions(path: Path) -> list[str]:
    """``<expr>.sink.<type|mode|engine|is_kafka>`` compared or tested in ``path``: a decision by kind or mode."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        tests = []
        if isinstance(node, ast.Compare):
            tests = [node.left, *node.comparators]
        elif isinstance(node, ast.If | ast.IfExp | ast.While):
            tests = [node.test]
        elif isinstance(node, ast.BoolOp):
            tests = list(node.values)
        for test in tests:
            for inner in ast.walk(test):
                if (
                    isinstance(inner, ast.Attribute)
                    and inner.attr in DECIDING
                    and isinstance(inner.value, ast.Attribute)
                    and inner.value.attr == "sink"
                ):
                    found.append(f"{path.relative_to(LIBRARY)}:{inner.lineno} sink.{inner.attr}")
    return found


def test_no_library_module_outside_the_seams_decides_by_the_sinks_kind_or_mode():
    found = sorted({d for path in LIBRARY.rglob("*.py") if not str(path.relative_to(LIBRARY)).startswith(SEAMS) for d in _decisions(path)})
    assert found == [], f"ask the sink's kind (config.sink_kinds) or its write mode (write_modes) instead: {found}"
