"""An error's text is the raise site's sentence; where it happened (pipeline, topic, partition,
offsets) is passed as keyword fields and shown by the one formatter, ``errors.message`` (issue 36
item 5). This scans the library's source (no services) for error texts that spell the where in
by hand again: ``raise X(f"pipeline {name}: ...")``, a ``T[p]`` at the head of the text, or a
variable holding such a head (``where = f"pipeline {name} backfill"``) that an error's text uses.

What counts as an error's text: an argument of a call to a class whose name ends in ``Error``,
``Exception`` or ``Abandoned`` (raised or returned), an argument of any call inside a ``raise``,
and ``conflict=`` (what ``sink.commit_once`` raises on a lost race).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("offsetlake", "offsetlake_airflow")
# Being rewritten on other branches of issue 36 (loop, shapes) while this guard landed; the lead
# empties this set once those are merged and their raise sites pass fields too.
ERROR_CLASS_ENDINGS = ("Error", "Exception", "Abandoned")
ERROR_TEXT_KEYWORDS = frozenset({"conflict"})


def _head(node: ast.expr) -> ast.expr:
    """The expression a text starts with (the left end of ``a + b``)."""
    while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        node = node.left
    return node


def _literal(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def spells_the_where(text: ast.expr) -> bool:
    """True when ``text`` (an f-string) starts with ``pipeline {...}`` or ``{topic}[{partition}]``."""
    text = _head(text)
    if not isinstance(text, ast.JoinedStr) or len(text.values) < 2:
        return False
    first, second, *rest = text.values
    if _literal(first) == "pipeline " and isinstance(second, ast.FormattedValue):
        return True
    # {topic}[{partition}] at the head: FormattedValue, "[", FormattedValue, "]..."
    return (
        isinstance(first, ast.FormattedValue)
        and (_literal(second) or "") == "["
        and len(rest) >= 2
        and isinstance(rest[0], ast.FormattedValue)
        and (_literal(rest[1]) or "").startswith("]")
    )


def _name(node: ast.expr) -> str | None:
    """``where`` for ``where`` and ``self.where``: the variable a text is kept in."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _callee(call: ast.Call) -> str:
    return _name(call.func) or ""


def error_texts(tree: ast.Module) -> Iterator[ast.expr]:
    """Every expression used as an error's text in ``tree``."""
    raised: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            raised.update(id(call) for call in ast.walk(node.exc) if isinstance(call, ast.Call))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if id(node) in raised or _callee(node).endswith(ERROR_CLASS_ENDINGS):
            yield from node.args
        yield from (k.value for k in node.keywords if k.arg in ERROR_TEXT_KEYWORDS)


def names_used_as_text(text: ast.expr) -> Iterator[str]:
    """The variables an error's text is, or starts with (``where`` in ``f"{where}: ..."``)."""
    text = _head(text)
    if isinstance(text, ast.JoinedStr) and text.values and isinstance(text.values[0], ast.FormattedValue):
        text = text.values[0].value
    name = _name(text)
    if name is not None:
        yield name


def offences(source: str, path: str) -> list[str]:
    """``path:line`` of each error text in ``source`` that spells the where in by hand."""
    tree = ast.parse(source)
    found, used = [], set()
    for text in error_texts(tree):
        if spells_the_where(text):
            found.append(f"{path}:{text.lineno}")
        used.update(names_used_as_text(text))
    for node in ast.walk(tree):  # a variable holding such a head, used as (the head of) an error's text
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None and spells_the_where(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_name(t) in used for t in targets):
                found.append(f"{path}:{node.lineno}")
    return sorted(set(found))


def library_files() -> Iterator[tuple[str, str]]:
    for package in LIBRARY:
        for file in sorted((ROOT / package).rglob("*.py")):
            yield file.relative_to(ROOT).as_posix(), file.read_text()


def test_no_error_text_spells_pipeline_topic_or_partition_in_by_hand():
    found = [hit for path, source in library_files() for hit in offences(source, path)]
    assert not found, "pass pipeline=, topic=, partition=, start=, end= instead of writing them into the text:\n" + "\n".join(found)


def test_the_scan_finds_each_way_of_spelling_the_where_in():
    """The scan itself, on the shapes it must catch and the ones it must let through."""
    caught = """
def a(config):
    raise OffsetlakeError(f"pipeline {config.name}: batch {b} is gone")
def b(config):
    raise RewindError(f"{topic}[{partition}] is committed up to {end}")
def c(config):
    where = f"pipeline {config.name} backfill"
    raise BackfillParamsError(f"{where}: give from_offset")
def d(config):
    return commit_once(table, conflict=f"pipeline {config.name}: lost the race")
def e(self):
    self.lost = f"pipeline {self.name}: stream lost its lease"
    raise LeaseLostError(self.lost)
def f(self):
    raise HTTPException(404, f"pipeline {p}: no report")
def g(config):
    return SchemaChangeError(f"pipeline {config.name}: " + "a column changed")
"""
    assert sorted(int(hit.split(":")[1]) for hit in offences(caught, "x.py")) == [3, 5, 7, 10, 12, 15, 17]
    let_through = """
def a(config):
    raise OffsetlakeError(f"batch {b} is gone", pipeline=config.name, batch_id=b)
    raise SinkOwnedError(f"the sink belongs to pipeline {other}", pipeline=config.name)
    print(f"pipeline {config.name}  topic {config.topic}")
    log.info(f"pipeline {config.name}: done")
    raise AirflowException(message("the job exited with 2", {"pipeline": config.name}))
    label = f"pipeline {config.name}"
    raise OffsetlakeError("ok", pipeline=config.name)
"""
    assert offences(let_through, "y.py") == []
