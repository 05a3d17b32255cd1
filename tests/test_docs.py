"""The documentation kept true: docs/tests.md's counts are what pytest collects (and every test file has a row),
every relative link of the Markdown pages reaches a file (and a heading, where it names one), and the README stays
a front page.

    pytest -q tests/test_docs.py
"""

import re
import subprocess
import sys

import pytest

from tests.common import ROOT
from tests.tests_table import rewrite

README_LINES = 250  # issue 45: the README is the newcomer's first page; the rest lives in docs/


@pytest.mark.slow  # one pytest collection in a subprocess: 9-13 s on 2 shared cores, most of it importing torch
def test_docs_tests_md_counts_are_what_pytest_collects():
    """`tests/tests_table.py --check` finds every count of docs/tests.md equal to pytest's own collection's, and a
    row for every test file."""
    checked = subprocess.run([sys.executable, str(ROOT / "tests" / "tests_table.py"), "--check"],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert checked.returncode == 0 and checked.stdout == "", (
        f"docs/tests.md is stale; run `python tests/tests_table.py`:\n{checked.stdout}{checked.stderr[-2000:]}")


HAND_MADE = """# Tests

    pytest -q                      # 7 fast tests: about 9 minutes
    pytest -q -m "slow and not long"  # 7 more CI runs
    pytest -q -m long              # the other 7, the longest
    pytest -q -m "not long"        # 7 tests, what CI runs
    pytest -q -m "long or not long"  # all 7
    pytest -q -m slow              # 7 a selection the script does not count

## What each file guards

| file | default (fast) | long | what |
|---|---|---|---|
| `test_a.py` | 9 (9) | 9 | the first file |
| `tests/test_empty.py` | ? (?) | ? | a file on disk whose tests are all gone |
| `tests/test_gone.py` | 1 (1) | 0 | a file deleted since |

## Elsewhere

| `tests/test_b.py` | 9 (9) | 9 | a table of another section, left as it is |
"""


def test_the_counts_script_rewrites_a_hand_made_page():
    """Four tests worked by hand: test_a.py holds a fast one, a slow one and a long (slow) one, tests/test_b.py one
    fast one, and tests/test_empty.py is on disk with none; so CI's set is 3 (2 fast, 1 slow), long 1, all 4, and
    test_a.py's row reads 2 (1) | 1."""
    tests = [("test_a.py", False, False), ("test_a.py", False, True), ("test_a.py", True, True),
             ("tests/test_b.py", False, False)]
    on_disk = {"test_a.py", "tests/test_b.py", "tests/test_empty.py"}
    text, problems = rewrite(HAND_MADE, tests, on_disk)
    expected = (HAND_MADE.replace("# 7 fast tests", "# 2 fast tests").replace("# 7 more CI", "# 1 more CI")
                .replace("the other 7", "the other 1").replace("# 7 tests, what CI", "# 3 tests, what CI")
                .replace("all 7", "all 4")
                .replace("| `test_a.py` | 9 (9) | 9 |", "| `test_a.py` | 2 (1) | 1 |")
                .replace("| `tests/test_empty.py` | ? (?) | ? |", "| `tests/test_empty.py` | 0 (0) | 0 |"))
    assert text == expected
    assert len(problems) == 3, problems
    assert "-m slow" in problems[0] and "does not count" in problems[0]
    assert "tests/test_gone.py" in problems[1] and "remove it" in problems[1]
    assert problems[2].startswith("tests/test_b.py has no row")  # its line outside the section is no row
    assert rewrite(text, tests, on_disk)[0] == text  # counts already fresh are left as they are


def markdown_pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "data" / "README.md"]


def heading_anchor(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page) -> list[str]:
    """The relative links of a Markdown page (outside code) whose file, or heading after `#`, does not exist."""
    broken, in_block, in_span = [], False, False
    for number, line in enumerate(page.read_text().split("\n"), 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
        if in_block:
            continue
        text = "`" + line if in_span else line  # a code span opened on the line before goes on here
        in_span = line.strip() != "" and text.count("`") % 2 == 1  # a blank line ends a paragraph and its spans
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", text)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:: another site's business
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path) if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}:{number}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
                if anchor not in {heading_anchor(h) for h in headings}:
                    broken.append(f"{page.relative_to(ROOT)}:{number}: {target} (no such heading)")
    return broken


def test_every_relative_link_of_the_markdown_pages_resolves():
    broken = [link for page in markdown_pages() for link in broken_links(page)]
    assert broken == [], "\n".join(broken)


def test_the_link_check_finds_a_planted_broken_link(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Bad input, at once\n")
    page = tmp_path / "README.md"
    page.write_text("[fine](docs/other.md) [fine too](docs/other.md#bad-input-at-once) [site](https://x.org/a)\n"
                    "[gone](docs/gone.md)\n"
                    "[no heading](docs/other.md#bad-output) [here](#other-page)\n"
                    "`[in code](docs/nothing.md)` and `a span that goes on\n[on the next line](docs/nothing.md)` ends\n"
                    "```\n[in a block](docs/nothing.md)\n```\n")
    assert broken_links(page) == ["README.md:2: docs/gone.md (no such file)",
                                  "README.md:3: docs/other.md#bad-output (no such heading)",
                                  "README.md:3: #other-page (no such heading)"]


def test_the_readme_is_a_front_page_of_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_LINES, f"README.md has {lines} lines; move the newest detail into a docs/ page"


GUARANTEES = "## Each guarantee and the test that holds it"


def unheld(page: str) -> list[str]:
    """The rows of docs/running.md's table of guarantees that name a test which is not there (no `def NAME(` at the
    top of the file named), or that name none and do not say "no test"; and the table itself where it is missing."""
    section = page.partition(GUARANTEES)[2].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| guarantee |")]
    problems = [] if rows else [f"docs/running.md has no table under {GUARANTEES!r}"]
    for row in rows:
        guarantee, held = [cell.strip() for cell in row.strip("|").split(" | ")]
        named = re.findall(r"`([\w/]+\.py)::(\w+)`", held)
        if not named and held != "no test":
            problems.append(f"{guarantee}: names no test (write `tests/test_x.py::test_name`, or no test)")
        for path, name in named:
            source = ROOT / path
            if not source.is_file() or not re.search(rf"^def {name}\(", source.read_text(), flags=re.M):
                problems.append(f"{guarantee}: {path}::{name} does not exist")
    return problems


def test_every_test_the_table_of_guarantees_names_exists():
    """docs/running.md's last section pairs each guarantee with the tests that hold it: every test named there is a
    function of that name in that file (a parametrized one too), and a row names a test or says "no test"; the check
    itself finds a planted renamed test, a planted missing file and a row that names nothing."""
    assert unheld((ROOT / "docs" / "running.md").read_text()) == []
    planted = (f"{GUARANTEES}\n\n| guarantee | held by |\n|---|---|\n"
               "| kept | `tests/test_docs.py::test_every_test_the_table_of_guarantees_names_exists` |\n"
               "| parametrized | `tests/test_eval.py::test_pass_at_k_against_enumeration` |\n"
               "| renamed | `tests/test_docs.py::test_the_readme_is_short` |\n"
               "| gone | `tests/test_nowhere.py::test_x` |\n| vague | the link tests |\n| honest | no test |\n"
               "\n## Next\n\n| outside | `tests/test_docs.py::test_nothing` |\n")
    assert unheld(planted) == ["renamed: tests/test_docs.py::test_the_readme_is_short does not exist",
                               "gone: tests/test_nowhere.py::test_x does not exist",
                               "vague: names no test (write `tests/test_x.py::test_name`, or no test)"]
    assert unheld("# A page\n") == [f"docs/running.md has no table under {GUARANTEES!r}"]
