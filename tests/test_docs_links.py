"""Every relative link in the project's Markdown docs points at a file that exists, and every
``#anchor`` at a heading of its target (GitHub's anchor rule).

The docs are a tree (README.md, CONTRIBUTING.md, docs/, BENCHMARKS.md, RELIABILITY.md) that link
into each other; a moved or renamed section breaks links silently unless something checks them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files() -> list[Path]:
    return sorted([*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md")])


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of ``path``'s headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated anchor suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(2).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of ``path`` (outside code) whose file or anchor does not exist."""
    problems = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not resolved.exists():
                problems.append(f"{where}: no such file")
            elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
                problems.append(f"{where}: no heading with anchor #{anchor}")
    return problems


def test_every_relative_link_and_anchor_in_the_docs_exists() -> None:
    files = doc_files()
    assert ROOT / "README.md" in files and len(files) > 10, files
    problems = [p for f in files for p in broken_links(f)]
    assert not problems, "\n".join(problems)


def test_the_link_check_sees_a_broken_link_and_a_broken_anchor(tmp_path: Path) -> None:
    """The checker itself: a missing file and a missing anchor are both reported, a good one is not."""
    (tmp_path / "b.md").write_text("# Some `code` title (x)\n\n## Again\n## Again\n", encoding="utf-8")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#some-code-title-x) [ok](b.md#again-1) [gone](c.md) [bad](b.md#nope)\n`[not a link](d.md)`\n```\n[in code](e.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == ["c.md: no such file", "b.md#nope: no heading with anchor #nope"]
