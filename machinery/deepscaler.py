"""DeepScaleR's answer rules (the grader behind the paper's numbers), for eval.py --grader deepscaler.

DeepScaleR's answer rules, rewritten here for `eval.py --grader deepscaler`: the ReMix paper's numbers were
graded with DeepScaleR's reward (deepscaler/rewards/math_reward.py and deepscaler/rewards/math_utils/utils.py of
agentica-project/deepscaler, vendored in AnitaLeungxx/ReMix-Off-Policy-RFT), so this second checker lets those
numbers be compared with the math-verify grade. A response is right when the last \\boxed{} of its text after
</think> equals a gold form under the MATH dataset's string normalisation or under their sympy comparison; their
LaTeX-to-text step (pylatexenc) is replaced by the small converter _LatexText. A reader of the method may skip it.
"""

import contextlib
import re
import unicodedata
import warnings

import sympy
from sympy.parsing import sympy_parser


# --- the answer that is graded

def graded_text(response: str) -> str:
    """With both think tags, the piece between the first and the second </think> (their split(...)[1])."""
    return response.split("</think>")[1] if "<think>" in response and "</think>" in response else response


def boxed_answer(text: str) -> str | None:
    """The brace group right after the last `\\boxed`; None when there is no `\\boxed` or the last one is not
    followed at once by `{` (so `\\boxed 5` and `\\fbox{5}` give no answer, as in their code)."""
    start, depth = text.rfind("\\boxed"), 0
    if start < 0:
        return None
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if text[end] == "}" and depth == 0:
            chunk = text[start:end + 1]
            return chunk[len("\\boxed{"):-1] if chunk.startswith("\\boxed{") else None
    return None


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


# --- LaTeX to plain text, standing in for pylatexenc

_TOKEN = re.compile(r"\\[A-Za-z]+\s*|\\.|\\$|.", re.S)
_WORDS = dict(zip(  # what pylatexenc 2.x writes for these macros, one character each
    "pi infty cup cap cdot times div pm mp le leq leqslant ge geq geqslant neq approx equiv sim cong propto circ "
    "odot oplus otimes ominus in notin ni subset subseteq supset supseteq setminus emptyset varnothing to "
    "rightarrow leftarrow Rightarrow Leftrightarrow leftrightarrow mapsto ldots dots cdots vdots ddots prime mid "
    "vert lvert rvert Vert perp parallel angle measuredangle sum prod int partial nabla forall exists wedge vee "
    "ell hbar mho aleph ast star bullet dagger dag lfloor rfloor lceil rceil langle rangle lbrace rbrace "
    "backslash textdegree square gg ll lambda Lambda epsilon phi varepsilon varphi vartheta varpi varsigma "
    "varrho".split(),
    "π∞∪∩·×÷±∓≤≤⩽≥≥⩾≠≈≡∼≅∝∘⊙⊕⊗⊖∈∉∋⊂⊆⊃⊇∖∅∅→→←⇒⇔↔↦……⋯⋮⋱'||||‖⊥∥∠∡∑∏∫∂∇∀∃∧∨ℓħ℧ℵ∗⋆∙††⌊⌋⌈⌉⟨⟩{}\\°□≫≪λΛϵϕεφϑϖςϱ"))
_WORDS |= {w: w for w in "log ln exp sin cos tan arcsin arccos arctan sinh cosh tanh max min lim sup inf".split()}
_WORDS |= {c: c for c in "{}%$#&_"} | {"quad": "  ", "qquad": "    ", "\\": "\n"} | dict.fromkeys(" ,;:", " ")
_ACCENTS = {"hat": "\u0302", "tilde": "\u0303", "bar": "\u0305", "dot": "\u0307", "ddot": "\u0308", "vec": "\u20d7"}
_DROPPED = set("texttt textsf textup mbox hspace vspace hphantom vphantom xrightarrow end".split())
_MATRICES = set("array pmatrix bmatrix smallmatrix".split())
_CELL = "\0"  # a column break (&) while a matrix is read; a space in the text


def _name(tok: str) -> str:
    return tok[1:].rstrip() if tok[1:2].isalpha() else tok[1:]


class _LatexText:
    """LaTeX to text the way pylatexenc's LatexNodes2Text renders math answers: \\frac{a}{b} -> a/b (no
    parentheses), \\sqrt[n]{x} -> √(x), symbols -> their Unicode character, matrices -> [ a b; c d ], macros
    it does not know -> nothing (their braced arguments stay as text), braces dropped, spaces after a macro
    name eaten. A missing argument raises, as in pylatexenc."""

    def __init__(self, latex: str):
        self.tokens, self.i = _TOKEN.findall(latex), 0

    def text(self, until: str = "") -> str:
        """Up to the end, or past the "}" or `\\end{...}` named by until; a stray "}" is dropped."""
        out = []
        while self.i < len(self.tokens):
            tok = self.tokens[self.i]
            self.i += 1
            if until == "end" and _name(tok) == "end":
                self.arg()  # the environment's name
                break
            if tok == "}" and until == "}":
                break
            if tok == "{":
                out.append(self.text("}"))
            elif tok != "}":
                out.append(_CELL if tok == "&" else self.macro(_name(tok)) if tok[0] == "\\" else tok)
        return "".join(out)

    def arg(self) -> str:
        while self.i < len(self.tokens) and self.tokens[self.i].isspace():
            self.i += 1
        if self.i == len(self.tokens) or self.tokens[self.i] == "}":
            raise ValueError("a macro lacks its argument")
        tok = self.tokens[self.i]
        self.i += 1
        return self.text("}") if tok == "{" else self.macro(_name(tok)) if tok[0] == "\\" else tok

    def macro(self, name: str) -> str:
        if name == "frac":
            return f"{self.arg()}/{self.arg()}"
        if name == "sqrt":
            if self.tokens[self.i:self.i + 1] == ["["]:  # the root's degree is dropped
                self.i = self.tokens.index("]", self.i) + 1
            return f"√({self.arg()})"
        if name == "begin":
            env = self.arg()
            if env == "array":
                self.arg()  # its column layout
            body = self.text("end")
            rows = [" ".join(cell.strip() for cell in row.split(_CELL)) for row in body.split("\n")]
            return "[ " + "; ".join(rows) + " ]" if env in _MATRICES else body
        if name in _ACCENTS:
            return unicodedata.normalize("NFC", self.arg() + _ACCENTS[name])
        if name in _DROPPED:
            self.arg()
            return ""
        if name in _WORDS:
            return _WORDS[name]
        with contextlib.suppress(KeyError):  # a Greek letter; anything else is unknown and gives ""
            return unicodedata.lookup(f"GREEK {'CAPITAL' if name[:1].isupper() else 'SMALL'} LETTER {name}")
        return ""


def latex_text(expr: str) -> str:
    """Their _parse_latex: \\dfrac and \\tfrac read as \\frac, a space before each \\frac (mixed numbers)."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    text = _LatexText(expr).text().replace(_CELL, " ")
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
    except Exception:  # sympy may also run long: the caller's deadline per item (grader.py) stops that
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
