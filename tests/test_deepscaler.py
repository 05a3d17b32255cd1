"""DeepScaleR's answer rules (deepscaler.py): cases worked out by hand from the rules, and every real
benchmark answer boxed as given (must grade right) and with its first number changed (must grade wrong)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import deepscaler  # noqa: E402
from machinery import grader  # noqa: E402

DATA = Path(os.environ.get("REMIX_DATA") or ROOT / "data")
RIGHT, WRONG, NO_BOX = (1.0, "ok"), (0.0, "ok"), (0.0, "no_boxed")

CASES = [  # (response, gold, expected grade): what the rules give, worked out by hand
    # the graded text: after </think> only when both tags are there, and only up to a second </think>
    (r"<think>maybe \boxed{3}</think> So \boxed{4}.", "4", RIGHT),
    (r"<think>maybe \boxed{3}</think> So \boxed{4}.", "3", WRONG),
    (r"no opening tag </think> \boxed{5}", "5", RIGHT),
    (r"<think>never closed \boxed{7}", "7", RIGHT),
    (r"<think>a</think> \boxed{1} </think> \boxed{2}", "1", RIGHT),
    (r"<think>a</think> \boxed{1} </think> \boxed{2}", "2", WRONG),
    # which box: the last \boxed{...}; \fbox and a brace-less \boxed give no answer
    (r"First \boxed{2}, then on reflection \boxed{3}.", "3", RIGHT),
    (r"First \boxed{2}, then on reflection \boxed{3}.", "2", WRONG),
    (r"\fbox{5}", "5", NO_BOX),
    (r"\boxed{4}, or rather \fbox{5}", "4", RIGHT),
    (r"\boxed 5", "5", NO_BOX),
    ("The answer is 12.", "12", NO_BOX),
    (r"\boxed{12}", r"The gold solution, boxed: \boxed{12}", RIGHT),
    # MATH's string normalisation
    (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", RIGHT),
    (r"\boxed{0.5}", r"\frac{1}{2}", RIGHT),
    (r"\boxed{1/2}", r"\frac12", RIGHT),
    (r"\boxed{5\text{ cm}}", "5", RIGHT),
    (r"\boxed{30^\circ}", "30", RIGHT),
    (r"\boxed{30 \text{ degrees}}", "30", RIGHT),
    (r"\boxed{50\%}", "50", RIGHT),
    (r"\boxed{\$5}", "5", RIGHT),
    (r"\boxed{x = 5}", "5", RIGHT),
    (r"\boxed{\sqrt2}", r"\sqrt{2}", RIGHT),
    # the sympy comparison: tuples and intervals element by element, same brackets, integers written as such
    (r"\boxed{(0.5, 2)}", r"\left(\frac{1}{2}, 2\right)", RIGHT),
    (r"\boxed{(-\infty, 3]}", r"(-\infty,3]", RIGHT),
    (r"\boxed{(1, 2]}", "(1,2)", WRONG),
    (r"\boxed{(2,1)}", "(1,2)", WRONG),
    (r"\boxed{1,000}", "1000", RIGHT),
    (r"\boxed{1,000,000}", "1000000", RIGHT),
    (r"\boxed{1\,000}", "1000", WRONG),  # a thin space reads as a mixed number 1+000
    (r"\boxed{3\frac{1}{2}}", r"\frac{7}{2}", RIGHT),  # a mixed number
    (r"\boxed{evelyn}", r"\text{Evelyn}", RIGHT),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", RIGHT),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", RIGHT),
    (r"\boxed{870000000}", r"8.7 \times 10^{8}", WRONG),  # the gold is no integer as written
    (r"\boxed{2\alpha}", "2", WRONG),
    (r"\boxed{13}", "12", WRONG),
]

# where DeepScaleR's rules and math-verify (report.grade_any's check) part ways
DISAGREE = [
    (r"\boxed{2/4}", r"\frac{1}{2}", WRONG),  # an unreduced fraction is refused
    (r"\boxed{\frac{8}{2}}", "4", WRONG),  # an integer gold wants an integer
    (r"\boxed{\sqrt[3]{2}}", r"\sqrt{2}", RIGHT),  # the root's degree is lost in their LaTeX-to-text step
]


@pytest.mark.parametrize("response, gold, expected", CASES + DISAGREE)
def test_hand_worked(response, gold, expected):
    assert deepscaler.grade_any(response, [gold]) == expected


@pytest.mark.parametrize("response, gold, expected", DISAGREE)
def test_math_verify_disagrees(response, gold, expected):
    math_verify = pytest.importorskip("math_verify")
    gold_parsed = math_verify.parse(gold if "\\boxed" in gold else "\\boxed{" + gold + "}")
    assert math_verify.verify(gold_parsed, math_verify.parse(response)) != (expected == RIGHT)


def test_any_gold_form_and_errors():
    assert deepscaler.grade_any(r"\boxed{9.60}", ["9.5", "9.6"]) == RIGHT
    assert deepscaler.grade_any(r"\boxed{1}", []) == WRONG
    assert deepscaler.grade_any(None, ["1"]) == (0.0, "error")  # raised inside: caught, never raised


def test_imports_without_torch():
    check = "import sys; import deepscaler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True)


def changed(answer: str) -> str:
    """The answer with its first number one larger (12 -> 13), or "+1" appended when it holds no digit."""
    m = re.search(r"\d+", answer)
    return answer[:m.start()] + str(int(m.group()) + 1) + answer[m.end():] if m else answer + "+1"


def test_real_benchmark_answers():
    paths = sorted((DATA / "benchmarks").glob("*.jsonl"))
    assert len(paths) == 6, f"expected six benchmark files under {DATA / 'benchmarks'}"
    rows = [(p.stem, json.loads(line)) for p in paths for line in p.open() if line.strip()]
    assert len(rows) == 1600
    say = "<think>\nSome working.\n</think>\nSo the final answer is $\\boxed{%s}$."
    items = [(say % row["answer"], row.get("answers") or [row["answer"]]) for _, row in rows]
    items += [(say % changed(row["answer"]), row.get("answers") or [row["answer"]]) for _, row in rows]
    start = time.monotonic()
    try:
        grades = grader.map_with_deadline(deepscaler.grade_any, items, 2, 10.0, (0.0, "timeout"))
    finally:
        grader.close_pool()
    n = len(rows)
    right_misses = [(name, row["answer"], g) for (name, row), g in zip(rows, grades[:n]) if g != RIGHT]
    wrong_misses = [(name, row["answer"], changed(row["answer"]), g)
                    for (name, row), g in zip(rows, grades[n:]) if g != WRONG]
    right, wrong = 1 - len(right_misses) / n, 1 - len(wrong_misses) / n
    print(f"\n{2 * n} items in {time.monotonic() - start:.1f}s; right {right:.2%}, wrong {wrong:.2%}")
    for miss in right_misses:
        print("gold graded wrong:", miss)
    for miss in wrong_misses:
        print("changed answer graded right:", miss)
    assert right >= 0.99, right_misses
    assert wrong >= 0.98, wrong_misses
