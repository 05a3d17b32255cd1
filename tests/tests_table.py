"""docs/tests.md's counts, taken from pytest's own collection: the totals of its top lines and the per-file columns
of its table. A test file without a row is an error: its row says what the file guards, which only a person writes.

    python tests/tests_table.py           # rewrite the counts of docs/tests.md in place
    python tests/tests_table.py --check   # change nothing; say which counts are stale, exit 1 if any

Add a row for a new test file by hand (its description, any counts) and run the first command to fill its counts.
"""

import argparse
import collections
import contextlib
import io
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
DOC = ROOT / "docs" / "tests.md"
TEST_PATHS = ("test_remix.py", "tests")  # pytest.ini's testpaths
SECTION = "## What each file guards"

# Each -m expression the top lines run, as a test's (long, slow) markers select it; `pytest -q` alone is pytest.ini's
# "not slow and not long"; CI runs "not long" as its two commands
SELECTIONS = {
    "not slow and not long": lambda long, slow: not slow and not long,
    "slow and not long": lambda long, slow: slow and not long,
    "not long": lambda long, slow: not long,
    "long": lambda long, slow: long,
    "long or not long": lambda long, slow: True,
}
TOP_LINE = re.compile(r'^(    pytest -q(?: -m (?P<expr>\w+|"[^"]+"))?\s+#\D*)(?P<count>\d+)')
ROW = re.compile(r"^(\| `(?P<file>[^`]+\.py)` \| )(?P<default>[^|]*?)( \| )(?P<long>[^|]*?)( \| )")


def collect() -> list[tuple[str, bool, bool]]:
    """Every test pytest collects from the repository, as (file, marked long, marked slow): one collection in this
    process, with every marker selected, so that long and default tests are counted from the same pass."""
    import pytest

    class Recorder:
        def __init__(self):
            self.tests: list[tuple[str, bool, bool]] = []

        def pytest_collection_finish(self, session):
            for item in session.items:
                file = item.nodeid.split("::")[0]
                marked = {mark.name for mark in item.iter_markers()}
                self.tests.append((file, "long" in marked, "slow" in marked))

    recorder, said = Recorder(), io.StringIO()
    os.chdir(ROOT)  # pytest.ini's testpaths and node ids are relative to the repository
    with contextlib.redirect_stdout(said):
        code = pytest.main(["--collect-only", "-q", "-m", "long or not long"], plugins=[recorder])
    if code != 0:
        sys.exit(f"pytest's collection failed (exit {code}):\n{said.getvalue()}")
    return recorder.tests


def files_pytest_reads() -> set[str]:
    """The files pytest would collect tests from, whether or not any test in them is collected."""
    found = {path for path in TEST_PATHS if path.endswith(".py")}
    for folder in (path for path in TEST_PATHS if not path.endswith(".py")):
        found |= {str(path.relative_to(ROOT)) for path in (ROOT / folder).rglob("test_*.py")}
    return found


def per_file(tests) -> dict[str, dict[str, int]]:
    """{file: {"default": n, "fast": n, "long": n}}: the tests CI runs (not long), those of them not slow (`pytest -q`),
    and the long ones."""
    counts = collections.defaultdict(lambda: {"default": 0, "fast": 0, "long": 0})
    for file, long, slow in tests:
        counts[file]["long" if long else "default"] += 1
        counts[file]["fast"] += int(not long and not slow)
    return dict(counts)


def totals(tests) -> dict[str, int]:
    """How many tests each selection of the top lines holds."""
    return {expr: sum(selects(long, slow) for _, long, slow in tests) for expr, selects in SELECTIONS.items()}


def rewrite(text: str, tests, files: set[str]) -> tuple[str, list[str]]:
    """docs/tests.md's text with its counts made those of `tests`, and what a person must fix (a test file without
    a row, a row of a file with no tests, a top line whose selection this script does not know)."""
    counts, sums = per_file(tests), totals(tests)
    files = files | set(counts)
    problems, rows, in_section = [], set(), False
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("## "):
            in_section = line == SECTION
        top, row = TOP_LINE.match(line), ROW.match(line)
        if top:
            expr = (top["expr"] or "not slow and not long").strip('"')
            if expr not in SELECTIONS:
                problems.append(f"the top line `{line.strip()}` runs -m {expr}, which tests_table.py does not count")
                continue
            lines[i] = top.group(1) + str(sums[expr]) + line[top.end():]
        elif row and in_section:
            file = row["file"]
            rows.add(file)
            if file not in files:
                problems.append(f"docs/tests.md has a row for {file}, which holds no test pytest collects: remove it")
                continue
            n = counts.get(file, {"default": 0, "fast": 0, "long": 0})
            lines[i] = (row.group(1) + f"{n['default']} ({n['fast']})" + row.group(4) + str(n["long"])
                        + row.group(6) + line[row.end():])
    problems += [f"{file} has no row in docs/tests.md's table: add one saying what it guards, then run "
                 "python tests/tests_table.py" for file in sorted(files - rows)]
    return "\n".join(lines), problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a count is stale")
    check = parser.parse_args(argv).check
    text = DOC.read_text()
    fresh, problems = rewrite(text, collect(), files_pytest_reads())
    stale = [f"stale: {old.strip()[:60]}...  now: {new.strip()[:60]}..."
             for old, new in zip(text.split("\n"), fresh.split("\n")) if old != new]
    if check:
        problems = stale + problems
    elif fresh != text:
        DOC.write_text(fresh)
        print(f"docs/tests.md: {len(stale)} lines of counts rewritten")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
