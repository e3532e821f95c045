"""docs/reference/cli.md is generated from the ``offsetlake`` parser and must agree with it.

The reference is rendered by ``scripts/cli_reference.py`` from ``offsetlake.cli.build_parser``;
a new option, a changed help text or a removed command without regenerating the file fails here.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_is_what_the_parser_says() -> None:
    generator = _generator()
    committed = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    rendered = generator.render()
    diff = "".join(
        difflib.unified_diff(
            committed.splitlines(True), rendered.splitlines(True), "docs/reference/cli.md (committed)", "rendered from build_parser", n=1
        )
    )
    assert committed == rendered, f"run `.venv/bin/python scripts/cli_reference.py`:\n{diff[:4000]}"


def test_every_command_and_option_of_the_parser_is_in_the_reference() -> None:
    """Independent of the renderer's layout: each command path and each visible option string."""
    generator = _generator()
    committed = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        if f"## `{path}`" not in committed:
            missing.append(path)
        for action in generator._visible_options(parser):
            missing.extend(f"{path} {flag}" for flag in action.option_strings if f"`{flag}" not in committed)
        for name, _, sub in generator._subcommands(parser):
            walk(sub, f"{path} {name}")

    walk(generator.build_parser(), "offsetlake")
    assert not missing, f"in the parser but not in docs/reference/cli.md: {missing}"
