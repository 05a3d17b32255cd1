"""The answer check's machinery: answers rewritten into notation math-verify reads, graded in deadline workers.

The workers are fresh interpreters (never forks of the trainer: no descriptor, lock, thread or memory of it), replaced
when one dies or outlives a deadline, and killed by the kernel when the trainer dies.

rewrite() decides which responses earn the reward (Decision 20): each rule, in order, maps every spelling of one value
onto one form math-verify reads as it, never two values onto one; text groups are left alone but by rules "whole".
"""

import atexit
import ctypes
import hashlib
import importlib.util
import inspect
import math
import os
import re
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait

# whole and math: degree signs with a temperature scale. math-verify reads `1950^\circ C` as 1950*C (and `°` not
# at all); the degree sign alone it reads as nothing, so the scale letter goes: `1950^\circ C`, `1950°C`,
# `1950^{\circ}\mathrm{C}`, `1950\text{°C}` -> `1950^{\circ}` (read as 1950, like `41.8^\circ`). The forms with
# a text group are rewritten first, over the whole answer; the others in math only.
_MARK = r"(?:\^\s*(?:\{\s*\\circ\s*\}|\\circ(?![A-Za-z]))|\\degree(?![A-Za-z])|°)"
_DEGREE_IN_TEXT = re.compile(r"\\(?:text|mathrm)\s*\{\s*(?:°|\\degree)\s*[CF]?\s*\}|"
                             + _MARK + r"\s*(?:\\(?:text|mathrm|rm)\s*\{\s*[CF]\s*\}|\{\s*\\rm\s+[CF]\s*\})")
_DEGREE = re.compile(_MARK + r"(?:\s*[CF](?![A-Za-z]))?")

def _degrees(s: str) -> str:
    return _DEGREE.sub(r"^{\\circ}", s)

# math: `\dfrac`, `\tfrac`, `\cfrac` are `\frac`: `\dfrac{1}{2}` -> `\frac{1}{2}`.
_FRAC = re.compile(r"\\[dtc]frac(?![A-Za-z])")

def _fractions(s: str) -> str:
    return _FRAC.sub(r"\\frac", s)

# math: spacing commands are spaces; math-verify cannot read `~` (`a~b`) and treats some of the others unlike a
# space. `2\,\pi`, `2\;\pi`, `2~\pi`, `2\quad\pi`, `2\hspace{1em}\pi` -> `2 \pi`; the negative space `\!` goes
# with the spaces after it, as math-verify drops it: `1\!000` -> `1000`, `11,\! 111` -> `11,111`.
_SPACE = re.compile(r"\\(?:,|:|;|>|(?:q?quad|enspace|thinspace|medspace|thickspace)(?![A-Za-z])"
                    r"|hspace\*?\{[^{}]*\})|(?<!\\)\\ |~(?!=)")
_NEGATIVE_SPACE = re.compile(r"(?:\\!|\\negthinspace(?![A-Za-z]))\s*")

def _spaces(s: str) -> str:
    return _SPACE.sub(" ", _NEGATIVE_SPACE.sub("", s))

# math: code notation. math-verify reads `arcsin(x)` as a*r*c*s*i*n*x and `2**3` not at all. A library prefix
# goes, a function name before `(` becomes its command, `**` becomes `^` with its exponent braced:
# `np.arcsin(10/13)` -> `\arcsin(10/13)`, `exp(2)` -> `\exp(2)`, `sqrt(2)` -> `\sqrt{2}`, `np.pi` -> `\pi`,
# `x**(1/2)` -> `x^{(1/2)}`.
_LIBRARY_CONSTANT = re.compile(r"(?<![\w.\\])(?:np|numpy|math|sympy|sp)\.(pi|e|inf)(?![A-Za-z])")
_LIBRARY = re.compile(r"(?<![\w.\\])(?:np|numpy|math|sympy|sp)\.(?=[A-Za-z])")
_FUNCTION = re.compile(r"(?<![\\A-Za-z])(arcsin|arccos|arctan|sinh|cosh|tanh|sin|cos|tan|cot|sec|csc|exp|ln|log)"
                       r"(?=\s*\()")
_SQRT_CALL = re.compile(r"(?<![A-Za-z])\\?sqrt\s*\(")
_EXPONENT = re.compile(r"-?(?:\d+(?:\.\d+)?|[A-Za-z])")

def balanced(s: str, i: int) -> int:
    """The index just past the bracket group that opens at s[i] ('(' or '{'), or -1."""
    pairs, depth = {"(": ")", "{": "}"}, 0
    opening, closing = s[i], pairs[s[i]]
    for j in range(i, len(s)):
        depth += (s[j] == opening) - (s[j] == closing)
        if depth == 0:
            return j + 1
    return -1

def _code(s: str) -> str:
    s = _LIBRARY_CONSTANT.sub(lambda m: {"pi": "\\pi", "e": "e", "inf": "\\infty"}[m[1]], s)
    s = _LIBRARY.sub("", s)
    s = _FUNCTION.sub(r"\\\1", s)
    while m := _SQRT_CALL.search(s):  # `sqrt(2)`, `\sqrt(2)` -> `\sqrt{2}`
        end = balanced(s, m.end() - 1)
        if end < 0:
            break
        s = s[:m.start()] + "\\sqrt{" + s[m.end():end - 1] + "}" + s[end:]
    while (k := s.find("**")) >= 0:
        rest = s[k + 2:].lstrip()
        if rest[:1] == "(" and (end := balanced(rest, 0)) > 0:
            exponent, tail = rest[:end], rest[end:]
        elif m := _EXPONENT.match(rest):
            exponent, tail = m.group(), rest[m.end():]
        else:
            break  # `**` before something else: left for math-verify
        s = s[:k] + "^{" + exponent + "}" + tail
    return s

# math: E notation. math-verify reads `1.39e9` as 1.39*e*9 (Euler's e): a number, `e` or `E`, an integer
# exponent, nothing attached on either side -> a power of ten: `1.39e9` -> `1.39\times 10^{9}`,
# `2.7778e-6` -> `2.7778\times 10^{-6}`. `2e^{x}` and `ce5` are left alone.
_E_NOTATION = re.compile(r"(?<![\w\\.])(\d+\.?\d*|\.\d+)[eE]([+-]?)(\d+)(?![\w.])")

def _e_notation(s: str) -> str:
    return _E_NOTATION.sub(lambda m: f"{m[1]}\\times 10^{{{'-' if m[2] == '-' else ''}{m[3]}}}", s)

# math: `x` and `×` as the times sign of scientific notation: `4.4 x 10^7`, `4.4×10^7` -> `4.4\times 10^7`.
_TIMES = re.compile(r"(\d)\s+x\s+(?=10\^)|×")

def _times(s: str) -> str:
    return _TIMES.sub(lambda m: (m[1] or "") + "\\times ", s)

# math: digit groups of a thousands separator (a space, or `\,` turned into one above). math-verify reads
# `1 000` as 1*000 = 0: `1 000 000` -> `1000000`, `12\,345.5` -> `12345.5`. Groups after the first have three
# digits, so `2 3` stays.
_GROUPS = re.compile(r"(?<![\d.])\d{1,3}(?:\s+\d{3})+(?!\d)")

def _digit_groups(s: str) -> str:
    return _GROUPS.sub(lambda m: re.sub(r"\s+", "", m.group()), s)

# math: a number's bare trailing point, and a full stop that ends the answer. math-verify cannot read `-3./2` or
# `3.`, and reads `(-\infty, 0) \cup \{1\}.` as 0: `-3./2` -> `-3/2`, `1./3` -> `1/3`, `3.\,` -> `3`,
# `\frac{1}{2}.` -> `\frac{1}{2}`. `0.\overline{3}` and `1...` keep theirs.
_POINT = re.compile(r"(\d)\.(?![\d.]|\s*\\(?:overline|dot|bar|ldots|cdots))")
_FULL_STOP = re.compile(r"(?<=[)\]}A-Za-z])\.\s*$")

def _trailing_point(s: str) -> str:
    return _FULL_STOP.sub("", _POINT.sub(r"\1", s))

# math: primes. math-verify drops `'` (so `x'` is read as x) but reads `x^{\prime}` as a power of a symbol
# `prime`; both become that one form, a distinct atom: `x'` -> `x^{\prime}`, `y''` and `y^{\prime \prime}` ->
# `y^{\prime\prime}`, `f'(x)` -> `f^{\prime}(x)`, `x_1'` -> `x_1^{\prime}`. On a number a prime is a unit
# (minutes, seconds, feet, inches) and goes, as math-verify drops other units: `0.003^{\prime \prime}` -> `0.003`,
# `5'` -> `5`.
_PRIME_MARKS = r"(?:'+|\^\s*\{\s*(?:\\prime\s*)+\}|\^\s*\\prime(?![A-Za-z]))"
_NUMBER_PRIME = re.compile(r"(?<![\w.^_])(\d+(?:\.\d*)?)\s*" + _PRIME_MARKS)
_PRIME = re.compile(r"(\\[A-Za-z]+|_[A-Za-z0-9]|[A-Za-z]|[)\]}])" + _PRIME_MARKS)

def _primes(s: str) -> str:
    s = _NUMBER_PRIME.sub(r"\1", s)
    return _PRIME.sub(lambda m: m[1] + "^{" + "\\prime" * (m[0].count("'") or m[0].count("\\prime")) + "}", s)

# math: a space between a number or a one-letter symbol and a following one-letter symbol goes. math-verify
# reads the two spellings differently: a lone `i` makes it treat every symbol as complex (so `3 i` is not `3i`,
# and `e^{i t}` is not `e^{it}`), and a one-letter word after a space at the end may be cut as a unit (`r c` is
# read as r). `\frac{4 A}{3+3 i} e^{i t}` -> `\frac{4A}{3+3i} e^{it}`, `x-r c` -> `x-rc`. A letter that ends a
# command (`\pi r`), words (`a or b`) and exponents written without braces (`x^2 y`) are left alone.
_AFTER_NUMBER = re.compile(r"(?<![\w.^_\\])(\d+(?:\.\d+)?)\s+(?=[A-Za-z](?![A-Za-z]))")
_AFTER_LETTER = re.compile(r"(?<![A-Za-z\\^_])([A-Za-z])\s+(?=[A-Za-z](?![A-Za-z]))")

def _letter_spacing(s: str) -> str:
    return _AFTER_LETTER.sub(r"\1", _AFTER_NUMBER.sub(r"\1", s))

# math: forms that math-verify compares as text (it cannot parse `E_1, E_2`: `E` is Euler's e) differ in spacing
# and braces alone: a one-character sub- or superscript is braced and a space beside a comma goes, except
# between digits (`1, 234` is a pair, `1,234` a number): `E_1, E_2` -> `E_{1},E_{2}`, `x^2` -> `x^{2}`.
_SCRIPT = re.compile(r"([_^])([A-Za-z0-9])(?![A-Za-z0-9])")
_COMMA = re.compile(r"\s*,\s*")

def _text_forms(s: str) -> str:
    s = _SCRIPT.sub(r"\1{\2}", s)
    return _COMMA.sub(lambda m: m[0] if _between_digits(m) else ",", s)

def _between_digits(m: re.Match) -> bool:
    s = m.string
    return m.start() > 0 and s[m.start() - 1].isdigit() and m.end() < len(s) and s[m.end()].isdigit()

_TEXT_GROUP = re.compile(r"\\(?:text|textrm|textbf|textit|textnormal|mathrm|mbox|operatorname)\s*\{")
_MATH_RULES = (_degrees, _fractions, _spaces, _code, _e_notation, _times, _digit_groups, _trailing_point,
               _primes, _letter_spacing, _text_forms)

def _math_parts(s: str, rule) -> str:
    """rule applied to the parts of s outside text groups."""
    out, done = [], 0
    for m in _TEXT_GROUP.finditer(s):
        if m.start() < done:
            continue  # inside a text group already kept
        end = balanced(s, m.end() - 1)
        if end < 0:
            break
        out += [rule(s[done:m.start()]), s[m.start():end]]
        done = end
    return "".join(out) + rule(s[done:])

def rewrite(expression: str) -> str:
    """The answer in notation math-verify parses as its writer meant."""
    s = _DEGREE_IN_TEXT.sub(r"^{\\circ}", expression)  # text groups included: the degree forms that hold one
    for rule in _MATH_RULES:
        s = _math_parts(s, rule)
    return re.sub(r"\s+", " ", s).strip()

def last_boxed(text: str) -> str | None:
    """The content of the last balanced \\boxed{...} (or \\fbox{...}, \\framebox{...}) in text, else None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"), text.rfind("\\framebox{"))
    if start < 0:
        return None
    begin = text.index("{", start)
    end = balanced(text, begin)
    return text[begin + 1 : end - 1] if end > 0 else None

# Workers: fresh interpreters fed over pipes (not forks of the caller: docs/bench/grader_workers.md measures why)
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder that holds machinery/
IMPORT_SECONDS = 300.0  # a worker's warm-up or first import of a task's module (seconds on a busy machine)
WARM = -1  # the task a new worker runs first, before any item
IN_WORKER = False  # True in a worker: a run started there (a method file without a main guard) is refused

def _serve(parent: int):
    """A worker's loop: each task (reference(fn), args) is imported, then announced ("go": its deadline starts), then
    run; its answer or its error goes back. It ends when its input closes, or with its parent (PR_SET_PDEATHSIG)."""
    global IN_WORKER
    IN_WORKER = True
    prctl = getattr(ctypes.CDLL(None), "prctl", None)  # Linux: the kernel kills this process when its parent dies
    if prctl is not None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        return
    tasks, answers = Connection(0, writable=False), Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # prints of a task go to stderr, never into the protocol
    resolved = {}
    while True:
        try:
            ref, args = tasks.recv()
        except EOFError:
            return
        try:
            fn = resolved[ref] = resolved.get(ref) or resolve(ref)
            answers.send("go")
            answers.send(("ok", fn(*args)))
        except BaseException as error:  # noqa: BLE001 the caller decides (a SystemExit of a module included)
            answers.send(("error", f"{type(error).__name__}: {error}"))

class Worker:
    """A fresh interpreter: no descriptor of the caller but its pipes and stderr, no thread, lock or device; a session
    of its own (a terminal's Ctrl-C and SIGHUP are the caller's to handle); machinery loaded from its own files, -P
    and the task's folder last on sys.path (a json.py or torch.py in the working directory or beside a fork never
    runs); one OpenMP thread (a reward may use torch or numpy), or what env says (--overlap's sampler: its own)."""

    def __init__(self, env: dict | None = None):
        # this machinery, whatever `machinery` PYTHONPATH holds; then its folder off sys.path
        start = (f"import sys; sys.path.insert(0, {HERE!r}); from machinery import grader; del sys.path[0]; "
                 f"grader._serve({os.getpid()})")
        (task_out, task_in), (answer_out, answer_in) = os.pipe(), os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", start], stdin=task_out, stdout=answer_in,
                                     start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        os.close(task_out)
        os.close(answer_in)
        self.tasks, self.answers = Connection(task_in, readable=False), Connection(answer_out, writable=False)
        self.todo, self.warmed, self.task, self.deadline = [], set(), None, math.inf

    def kill(self):
        self.proc.kill()  # Popen's: nothing where the process has ended
        self.proc.wait()
        self.tasks.close()
        self.answers.close()

_pool: list[Worker] = []

def map_with_deadline(fn, items: list[tuple], workers: int, timeout: float, on_timeout, warm=None, warm_args=()):
    """[fn(*item) for item in items] in worker processes kept between calls. An item whose call outlives `timeout`
    (math-verify's SIGALRM is a main thread's only; some answers hang in C) gets on_timeout, and so does one whose
    worker dies under it (SIGKILL, the OOM killer); the worker is replaced, as is one found dead between tasks. Every
    worker runs warm(*warm_args) once before its first item (no items: the workers started and warm); imports and
    warm-up never count against a deadline."""
    task, warmup = reference(fn), warm and (reference(warm), tuple(warm_args))
    while len(_pool) < workers:
        _pool.append(Worker())
    results, todo, done = [None] * len(items), list(range(len(items))), 0
    while True:
        for worker in _pool:  # a new worker, or one an earlier call started without this warm-up
            if warmup and warmup not in worker.warmed:
                worker.todo, worker.warmed = [warmup], worker.warmed | {warmup}
        if done == len(items) and (items or all(w.task is None and not w.todo for w in _pool)):
            return results  # a warm-up still running is the next call's to wait for
        for i, worker in enumerate(_pool):
            if worker.task is None and (worker.todo or todo):
                worker.task = WARM if worker.todo else todo.pop(0)
                try:
                    worker.tasks.send(worker.todo.pop() if worker.task == WARM else (task, items[worker.task]))
                    worker.deadline = time.monotonic() + IMPORT_SECONDS
                except OSError:  # it died between two tasks (killed): the item goes to its replacement
                    todo[:0] = [worker.task] if worker.task != WARM else []
                    worker.kill()
                    _pool[i] = Worker()
        left = min(w.deadline for w in _pool) - time.monotonic()
        readable = wait([w.answers for w in _pool], max(min(left, 1.0), 0.0))
        for i, worker in enumerate(_pool):
            if worker.answers in readable:
                try:
                    message = worker.answers.recv()
                except EOFError:
                    message = ("gone", None)
                if message == "go":  # imported: the task's own deadline starts
                    worker.deadline = time.monotonic() + (IMPORT_SECONDS if worker.task == WARM else timeout)
                    continue
                status, value = message
                if status == "error":  # the pool goes with it: no task of this call is left to answer the next
                    close_pool()
                    what = "the warm-up" if worker.task == WARM else fn.__name__
                    raise RuntimeError(f"{what} failed in a worker process: {value}")
            elif worker.task is not None and time.monotonic() >= worker.deadline:
                status = "late"
            else:
                continue
            if worker.task == WARM and status != "ok" and (status == "late" or worker.proc.wait() >= 0):
                close_pool()  # it ended by itself (a failing import) or hung: a replacement would too
                raise RuntimeError(f"a grader worker did not warm up ({status}); see its error above")
            if worker.task != WARM:
                results[worker.task], done = value if status == "ok" else on_timeout, done + 1
            worker.task, worker.deadline = None, math.inf
            if status != "ok":  # past its deadline, or killed (mid-task or warming up): a new worker takes its place
                worker.kill()
                _pool[i] = Worker()

def close_pool():
    """End the worker processes; the next call starts fresh ones."""
    while _pool:
        _pool.pop().kill()

atexit.register(close_pool)

def reference(fn) -> tuple[str, str, str, str | None]:
    """(folder, module, name, file) that a worker finds fn by: file is the module's own file for a module that is one
    file (a method: remix.py, remix_mine.py; __main__'s), None for a module of a package (imported by name)."""
    module = fn.__module__
    path = getattr(getattr(inspect.unwrap(fn), "__code__", None), "co_filename", None)  # the file it was made from
    if not path or not os.path.isfile(path):
        path = getattr(sys.modules.get(module), "__file__", None)
    if module == "__main__":
        if path is None:
            raise ValueError("the worker function must live in an importable file")
        module = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
    for _ in range(module.count(".")):  # a module of a package: the folder that holds the package
        folder = os.path.dirname(folder)
    one_file = path is not None and "." not in module and os.path.basename(path) != "__init__.py"
    return folder, module, fn.__name__, os.path.abspath(path) if one_file else None

def resolve(ref: tuple):
    """The function a reference() names, here: a package's module by name, a one-file module by its file (module_at)."""
    folder, module, name, path = ref
    last_on_path(folder)
    return getattr(importlib.import_module(module) if path is None else module_at(path), name)

def last_on_path(folder: str):
    """folder after the installed packages on sys.path, where Python put a script's own first: a fork's helpers are
    found there, and a math_verify.py or json.py beside it never stands in for the installed one."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != folder] + [folder]

def module_at(path: str):
    """The module of a one-file path: the one this process holds from that very file, else loaded from it under a name
    of its own (whatever else of its name sys.path or sys.modules holds). Its folder goes last on sys.path: a fork's
    helper beside it is found, and a torch.py or json.py there never shadows an installed package."""
    last_on_path(os.path.dirname(path))
    same = [m for m in list(sys.modules.values()) if os.path.abspath(getattr(m, "__file__", None) or "") == path]
    if same:
        return same[0]
    key = "_by_path_" + hashlib.sha256(path.encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(key, path)
    loaded = sys.modules[key] = importlib.util.module_from_spec(spec)  # before it runs: dataclasses look it up
    try:
        spec.loader.exec_module(loaded)
    except BaseException:
        del sys.modules[key]
        raise
    return loaded
