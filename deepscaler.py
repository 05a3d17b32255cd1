"""DeepScaleR's answer rules (the grader behind the ReMix paper's numbers), for eval.py --grader deepscaler.

It lives beside eval.py, not in machinery/, because only eval.py uses it. The paper's numbers were graded with
DeepScaleR's reward (deepscaler/rewards/math_reward.py and deepscaler/rewards/math_utils/utils.py of
agentica-project/deepscaler, vendored in AnitaLeungxx/ReMix-Off-Policy-RFT), so this second checker lets those
numbers be compared with the math-verify grade. A response is right when the last \\boxed{} of its text after
</think> equals a gold form under the MATH dataset's string normalisation or under their sympy comparison, which
reads LaTeX through pylatexenc as theirs does. A reader of the method may skip it.
"""

import contextlib
import re
import warnings

import sympy
from pylatexenc import latex2text
from sympy.parsing import sympy_parser

from machinery import grader


# --- the answer that is graded

def graded_text(response: str) -> str:
    """With both think tags, the piece between the first and the second </think> (their split(...)[1])."""
    return response.split("</think>")[1] if "<think>" in response and "</think>" in response else response


def boxed_answer(text: str) -> str | None:
    """The brace group right after the last `\\boxed`; None when there is no `\\boxed` or the last one is not
    followed at once by `{` (so `\\boxed 5` and `\\fbox{5}` give no answer, as in their code)."""
    start = text.rfind("\\boxed")
    if start < 0 or not text.startswith("\\boxed{", start):
        return None
    end = grader.balanced(text, start + len("\\boxed"))
    return text[start + len("\\boxed{") : end - 1] if end > 0 else None


# --- rule (a): the MATH dataset's string normalisation (their grade_answer_mathd)

_TEXT_ONLY = re.compile(r"^\\text\{(?P<inner>.+?)\}$")
_INT_SLASH_INT = re.compile(r"(-?[1-9][0-9]*|0)/(-?[1-9][0-9]*|0)")


def _brace_sqrt(s: str) -> str:
    head, *parts = s.split("\\sqrt")  # an empty part (\sqrt at the end) raises, and the caller gives up
    return head + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts)


def _brace_frac(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}; a one-character tail leaves s as it was."""
    head, *parts = s.split("\\frac")
    out = [head]
    for p in parts:
        if p[0] != "{":
            if len(p) < 2:
                return s
            p = "{" + p[0] + "}" + (p[1:] if p[1] == "{" else "{" + p[1] + "}" + p[2:])
        out.append("\\frac" + p)
    return "".join(out)


def mathd_normal(s: str) -> str:
    s = s.strip()
    if m := _TEXT_ONLY.search(s):
        s = m.group("inner").strip()
    t = s
    try:
        for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                         ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
            t = t.replace(old, new)
        if "\\text{ " in t:  # a unit: keep what stands before the one `\text{ `; two of them give up
            t, _ = t.split("\\text{ ")
        t = t.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
        t = "0" + t if t[:1] == "." else t
        if len(sides := t.split("=")) == 2 and len(sides[0]) <= 2:  # "x = 5" -> "5"
            t = sides[1]
        t = _brace_frac(_brace_sqrt(t).replace(" ", "")) if t else t
        t = "\\frac{1}{2}" if t == "0.5" else t
        return "\\frac{%s}{%s}" % m.groups() if (m := _INT_SLASH_INT.fullmatch(t)) else t
    except Exception:  # where their code gives up too: the answer as read
        return s


# --- LaTeX to plain text (their _parse_latex, with pylatexenc)

def latex_text(expr: str) -> str:
    """\\dfrac and \\tfrac read as \\frac, a space before each \\frac (mixed numbers), pylatexenc's text, and
    the characters sympy cannot read spelled out."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    text = latex2text.LatexNodes2Text().latex_to_text(expr)
    for char, word in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        text = text.replace(char, word)
    return text.strip()


# --- rule (b): their sympy comparison (grade_answer_sympy)

_UNITS = [re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in (
    "degree cm centimeter meter mile second minute hour day week month year foot feet inch yard".split())]
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")  # their test for a written a/b (any char may follow)
_THOUSANDS = re.compile(r"(\d)(,)(\d\d\d)($|\D)")


def _near_int(text: str, drop_commas: bool = False) -> bool:
    """Whether text reads as a float within 1e-7 of an integer (inf, nan and non-numbers do not)."""
    try:
        x = float(_drop_thousands_commas(text) if drop_commas else text)
        return abs(x - int(round(x))) <= 1e-7
    except (ValueError, OverflowError):
        return False


def _drop_thousands_commas(s: str) -> str:
    while (n := _THOUSANDS.subn(r"\1\3\4", s))[1]:
        s = n[0]
    return s


def sympy_normal(s: str) -> str:
    if m := _TEXT_ONLY.search(s):
        s = m.group("inner")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        s = s.replace(old, new)
    for unit in _UNITS:
        s = unit.sub("", s)
    s = re.sub(r"\^ *\\circ", "", s)
    s = s[1:-1] if s[:1] == "{" and s[-1:] == "}" else s
    s = re.sub(r",\\! *", "", s)
    s = str(int(round(float(s)))) if _near_int(s) else s
    if "\\" in s:
        with contextlib.suppress(Exception):  # their parser's failures leave the text as it was
            s = latex_text(s)
    s = re.sub(r"([0-9]) +([0-9])", r"\1+\2", re.sub(r"- *", "-", s))  # a mixed number 7 3/4 -> 7+3/4
    s = s.replace(" ", "").replace("{", "").replace("}", "").lower()
    return str(int(float(s.replace(",", "")))) if _near_int(s, drop_commas=True) else s


def _elements(s: str) -> list[str]:
    """The elements of a flat tuple or interval, else s alone."""
    s = _drop_thousands_commas(s)
    if len(s) > 2 and s[0] in "()[]" and s[-1] in "()[]" and not any(c in s[1:-1] for c in "()[]"):
        return [e.strip() for e in s[1:-1].split(",")]
    return [s] if s else []


def sympy_same(gold: str, given: str) -> bool:
    expr = f"({gold})-({given})"
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr or re.search(r"\^[0-9]+\^|\^[0-9][0-9]+", expr):
        return False  # unknown text, or powers that could make sympy hang
    transforms = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sympy's deprecation notices on odd inputs
            return sympy.simplify(sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transforms)) == 0
    except Exception:  # sympy may also run long: the deadline per item (grader.map_with_deadline) stops that
        return False


def sympy_grade(given: str, gold: str) -> bool:
    gold_n, given_n = sympy_normal(gold), sympy_normal(given)
    if gold_n == given_n or not given_n:
        return gold_n == given_n
    golds, givens = _elements(gold_n), _elements(given_n)
    if len(golds) > 1 and (gold_n[0] != given_n[0] or gold_n[-1] != given_n[-1]) or len(golds) != len(givens):
        return False  # a tuple or interval needs the same brackets and length
    for g, a in zip(golds, givens):
        if _FRACTION.match(g) and _FRACTION.match(a):
            if g != a:  # an unreduced fraction is not accepted for a reduced one
                return False
        elif _near_int(g, True) != _near_int(a, True) or not sympy_same(g, a):
            return False  # an integer must be written as one
    return True


# --- the contract

def grade_any(response: str, answers: list[str]) -> tuple[float, str]:
    """(1.0 or 0.0, status): right for any gold form; "no_boxed" without a final \\boxed{}, "error" if it raised."""
    try:
        given = boxed_answer(graded_text(response))
        if given is None:
            return 0.0, "no_boxed"
        golds = [boxed_answer(str(a)) if "\\boxed" in str(a) else str(a) for a in answers]
        for gold in golds:
            if gold is not None and (mathd_normal(given) == mathd_normal(gold) or sympy_grade(given, gold)):
                return 1.0, "ok"
        return 0.0, "ok"
    except Exception:
        return 0.0, "error"
