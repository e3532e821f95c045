"""Where the suite's time goes, by test file: reads the ``--durations=0`` lines of one or more
pytest outputs and prints a Markdown table (seconds per file, tests, the slowest test) and the
N slowest tests.

    .venv/bin/python -m pytest tests ... --durations=0 > run.log
    .venv/bin/python scripts/test_durations.py run.log [--slowest 20]

Used for the table in CONTRIBUTING.md ("Test budget").
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*(?P<seconds>[0-9.]+)s (?P<phase>call|setup|teardown)\s+(?P<test>tests/\S+)")


def durations(paths: list[Path]) -> dict[str, float]:
    """Seconds per test (setup, call and teardown added up)."""
    per_test: dict[str, float] = defaultdict(float)
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            found = LINE.match(line)
            if found:
                per_test[found["test"]] += float(found["seconds"])
    return dict(per_test)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", type=Path, help="pytest outputs with --durations=0")
    parser.add_argument("--slowest", type=int, default=20, help="how many of the slowest tests to list (default 20)")
    args = parser.parse_args()
    per_test = durations(args.logs)
    per_file: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for test, seconds in per_test.items():
        per_file[test.split("::")[0]].append((seconds, test))
    total = sum(per_test.values())
    print(f"{len(per_test)} tests, {total / 60:.1f} min in tests (setup + call + teardown)\n")
    print("| file | tests | minutes | share | slowest test (s) |")
    print("| --- | ---: | ---: | ---: | --- |")
    for file, tests in sorted(per_file.items(), key=lambda item: -sum(s for s, _ in item[1])):
        seconds = sum(s for s, _ in tests)
        slowest, name = max(tests)
        shown = f"{name.split('::', 1)[1]} ({slowest:.0f})"
        print(f"| `{file.removeprefix('tests/')}` | {len(tests)} | {seconds / 60:.1f} | {seconds / total:.0%} | {shown} |")
    print(f"\nThe {args.slowest} slowest tests:\n")
    for seconds, test in sorted(((s, t) for t, s in per_test.items()), reverse=True)[: args.slowest]:
        print(f"- {seconds:.0f} s `{test.removeprefix('tests/')}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
