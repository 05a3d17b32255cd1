"""Training problems from a file or the hub, checked row by row, and the stream of prompts a run draws from.

Training problems from a local file or the hub, checked row by row where they come in, the chat template's guard
(one line for a template that raises or never ends), and the stream of prompts a run draws from. A reader of the
method may skip this module: a problem is (problem text, gold answer).
"""

import collections
import contextlib
import hashlib
import io
import json
import math
import os
import signal
import stat
import sys
import threading
import time

import numpy as np

from machinery import flags
from machinery.console import fail, say

Prompt = collections.namedtuple("Prompt", "ids answer position")  # position: problems consumed up to this one


def answer_text(value, where: str = "the answer") -> str:
    """A gold answer as the string the grader compares: a non-empty string as it is (stripped), an integer or a
    float as its decimal text (5 -> '5', 27.0 -> '27', 0.5 -> '0.5'). Anything else (None, an empty string, a
    bool, a list, NaN) raises ValueError naming `where`: a grade must never depend on how a value was stored."""
    if isinstance(value, str) and value.strip():
        return value.strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() else repr(value)
    shown = repr(value) if len(repr(value)) < 60 else repr(value)[:57] + "..."
    raise ValueError(f"{where} is {shown}: an answer must be a non-empty string or a number")


def problem_text(value, where: str = "the problem") -> str:
    if isinstance(value, str) and value.strip():
        return value
    raise ValueError(f"{where} is {value!r:.60}: a problem must be a non-empty string")


LOCAL_FORMS = (".jsonl", ".json", ".parquet")  # the files read here; any other name is a hub id
# names no hub id has: a file of a form not read here, never sent to the hub (or the datasets library, which reads a
# local folder of them and caches it under the home folder)
OTHER_FILES = {".csv", ".tsv", ".txt", ".arrow", ".xlsx", ".xls", ".gz", ".zip", ".jsonl.gz", ".yaml", ".yml"}


def check_dataset(path: str, prog: str = "remix"):
    """--dataset is a local .jsonl/.json/.parquet file or a hub id: a local folder, a file of another form (.csv)
    and a name no hub id has get one line naming the accepted forms, before the hub is asked anything."""
    if not path.endswith(LOCAL_FORMS) and (os.path.lexists(path) or not flags.is_hub_id(path)
                                           or os.path.splitext(path)[1].lower() in OTHER_FILES):
        what = "a folder" if os.path.isdir(path) else "a file of another form" if os.path.lexists(path) else \
            "neither a local file nor a hub id"
        fail(f"dataset {path!r} is {what}: pass a local .jsonl, .json or .parquet file, or a hub id (org/name)", prog)


def load_problems(path: str, problem_key: str, answer_key: str, prog: str = "remix") -> list[tuple[str, str]]:
    """(problem, answer) pairs from a hub dataset or a local .jsonl/.json/.parquet file (read_dataset, problems_of)."""
    return problems_of(read_dataset(path, prog)[0], path, problem_key, answer_key, prog)


def read_dataset(path: str, prog: str = "remix", revision: str | None = None) -> tuple[list[dict], dict]:
    """The rows of --dataset, and what names the data they came from, as a run records it: {"sha256": ...} of a
    local file's bytes (the very bytes parsed, read once: no window between hashing a file and reading it again),
    {"revision": commit} of a hub dataset (the one the datasets library loaded; `revision` asks for that one)."""
    check_dataset(path, prog)
    if path.endswith(LOCAL_FORMS):
        rows, digest = read_rows(path, prog)
        return rows, {"sha256": digest}
    rows, commit = hub_rows(path, revision=revision, prog=prog)
    return rows, {"revision": commit}


def problems_of(rows: list[dict], path: str, problem_key: str, answer_key: str,
                prog: str = "remix") -> list[tuple[str, str]]:
    """(problem, answer) pairs from a dataset's rows. A row whose problem or answer is missing, empty or of another
    type is skipped, and the count said in one line; a file with no usable row, or whose rows lack the columns,
    stops with one line."""
    if not rows:
        fail(f"dataset {path!r} holds no rows", prog)
    columns = sorted(rows[0])
    if any(key not in row for row in rows for key in (problem_key, answer_key)):
        missing = next(i for i, row in enumerate(rows, 1) if problem_key not in row or answer_key not in row)
        fail(f"dataset {path!r}: row {missing} lacks {problem_key!r} or {answer_key!r} (the first row has the "
             f"columns {columns}); set --problem-key/--answer-key", prog)
    problems, bad = [], []
    for number, row in enumerate(rows, 1):
        try:
            problems.append((problem_text(row[problem_key], f"{problem_key!r}"),
                             answer_text(row[answer_key], f"{answer_key!r}")))
        except ValueError as error:
            bad.append(f"row {number}: {error}")
    if not problems:
        fail(f"dataset {path!r} has no usable row ({bad[0]})", prog)
    if bad:
        say(f"dataset {path!r}: skipped {len(bad)} of {len(rows)} rows with an unusable problem or answer "
            f"(first: {bad[0]})", prog)
    return problems


def read_rows(path: str, prog: str = "remix") -> tuple[list[dict], str]:
    """The rows of a local .jsonl (one object per line), .json (a list of objects) or .parquet file, and the
    SHA-256 of the bytes they were parsed from (read once); every way such a file can be wrong gets one line that
    names it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        fail(f"dataset file {path!r} does not exist; pass an existing .jsonl/.json/.parquet or a hub id", prog)
    except OSError as error:
        fail(f"cannot read dataset file {path!r}: {error.strerror}", prog)
    if stat.S_ISDIR(mode):
        fail(f"dataset {path!r} is a folder, not a file", prog)
    if not stat.S_ISREG(mode):
        fail(f"dataset {path!r} is not a regular file", prog)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as error:
        fail(f"cannot read dataset file {path!r}: {error.strerror}", prog)
    if not raw:
        fail(f"dataset file {path!r} is empty", prog)
    digest = hashlib.sha256(raw).hexdigest()
    if path.endswith(".parquet"):
        try:
            import pandas as pd

            rows = pd.read_parquet(io.BytesIO(raw)).to_dict("records")
        except Exception as error:  # pyarrow's errors for a damaged file have no common type
            fail(f"cannot read dataset {path!r} as parquet: {str(error).splitlines()[0]}", prog)
        return rows, digest
    try:
        text = decode(raw)
    except UnicodeDecodeError as error:
        fail(f"dataset {path!r} is not UTF-8 text (byte {error.start}: {error.reason})", prog)
    return parse_rows(text, path, prog), digest


def decode(raw: bytes) -> str:
    """UTF-8 bytes as text, as open(path, encoding="utf-8").read() gives it (its newlines translated)."""
    return io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8").read()


def parse_rows(text: str, path: str, prog: str = "remix") -> list[dict]:
    """JSON lines, or one JSON document holding a list of objects."""
    stripped = text.lstrip()
    if stripped.startswith("[") or _one_document(stripped):
        whole = _loads(text, path, "", prog)
        if isinstance(whole, dict):
            fail(f"dataset {path!r} holds one JSON object, not rows: write one object per line (JSONL) or a "
                 f"JSON list of objects", prog)
        rows = whole
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                rows.append(_loads(line, path, f"line {number}", prog))
    if not isinstance(rows, list):
        fail(f"dataset {path!r} holds a JSON {type(rows).__name__}, not a list of rows", prog)
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            fail(f"dataset {path!r}: row {number} is a JSON {type(row).__name__}, not an object", prog)
        if _broken_text(row):
            fail(f"dataset {path!r}: row {number} holds a lone surrogate (a \\ud800-\\udfff escape without its "
                 f"pair), which is not Unicode text and no tokenizer takes: fix or drop that row", prog)
    return rows


def _loads(text: str, path: str, where: str, prog: str):
    """json.loads, with one line for each way Python refuses a text, `where` ('line 3') naming the place."""
    at = f": {where}" if where else ""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        fail(f"dataset {path!r}{at} is not valid JSON ({error})", prog)
    except ValueError:  # since Python 3.11 int() refuses more digits than this (quadratic time), json too
        fail(f"dataset {path!r}{at} holds an integer of over {sys.get_int_max_str_digits()} digits, "
             f"more than Python reads: write it as a string", prog)
    except RecursionError:
        fail(f"dataset {path!r}{at} nests lists or objects deeper than Python reads (about "
             f"{sys.getrecursionlimit()} levels): flatten it or drop that row", prog)


def _broken_text(row: dict) -> bool:
    """Whether a string anywhere in a row (keys too) holds half of a UTF-16 pair, which JSON's \\ud800 escape
    makes and UTF-8 cannot encode. A loop, not recursion: rows nest as deep as json.loads went."""
    todo = [row]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(value, dict):
            todo += [*value.keys(), *value.values()]
        elif isinstance(value, list):
            todo += value
    return False


def _one_document(text: str) -> bool:
    """Whether text that starts with '{' is a single (multi-line) JSON object rather than JSON lines."""
    if not text.startswith("{"):
        return False
    first = text.split("\n", 1)[0]
    try:
        json.loads(first)
        return False  # its first line is an object of its own: JSON lines
    except json.JSONDecodeError:
        pass  # an object over several lines, or broken JSON lines
    except (ValueError, RecursionError):
        return False  # a first line Python refuses (a huge integer, deep nesting): said with its line number
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    except (ValueError, RecursionError):
        pass  # one document, valid JSON that Python refuses: parse_rows says why
    return True


def load_hub_rows(name: str, config: str | None = None, split: str = "train", prog: str = "remix") -> list[dict]:
    return hub_rows(name, config, split, prog=prog)[0]


def hub_rows(name: str, config: str | None = None, split: str = "train", revision: str | None = None,
             prog: str = "remix") -> tuple[list[dict], str | None]:
    """A hub dataset's rows and the revision (commit) they are from: the builder's hash, which is the commit the
    hub resolved, or offline the one its cached copy was built from (datasets then loads the newest cached copy,
    whatever `revision` asks)."""
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()  # its notes on which cached copy it takes: the revision is the record
    try:
        builder = datasets.load_dataset_builder(name, config, revision=revision)
        builder.download_and_prepare()
        return list(builder.as_dataset(split=split)), builder.hash
    except Exception as error:  # offline, unknown id, no such split: one line either way
        first = str(error).splitlines()[0] if str(error) else repr(error)
        fail(f"cannot load dataset {name!r} from the hub: {first}{flags.offline_hint()}", prog)
    finally:
        datasets.logging.set_verbosity(verbosity)


TEMPLATE_SECONDS = 5.0  # one prompt renders in milliseconds; a chat template still rendering after this never ends


class _TemplateTimeout(BaseException):
    """Raised by the alarm inside a render: not an Exception, so no `except Exception` on its way out keeps it."""


def _raised_in_template(error: BaseException) -> bool:
    """Whether an error came out of a chat template's own code: jinja's errors (syntax, raise_exception, an
    undefined name, the sandbox refusing an attribute), or Python's raised in the template's lines ({{ 1/0 }},
    {{ 1 + 'a' }}, a macro calling itself), whose frames jinja names '<template>'."""
    import jinja2

    trace = error.__traceback__
    while trace is not None and trace.tb_frame.f_code.co_filename != "<template>":
        trace = trace.tb_next
    return isinstance(error, jinja2.TemplateError) or trace is not None


def template_guard(encode, model: str, prog: str = "remix"):
    """encode(problem) -> token ids, stopped with one line naming the model's chat template when the template
    raises or renders for over TEMPLATE_SECONDS (jinja's sandbox bounds each range() to 100,000 items, not two
    nested loops over them). The deadline is SIGALRM's, so it holds on the main thread only (where remix.py and
    eval.py render); a template spinning in Python code is stopped there between two of its steps. A timer the
    process already had (gpu_check's part limits) keeps its deadline and its handler (_deadline)."""
    fix = "fix or replace the chat_template in its tokenizer_config.json (or chat_template.jinja), or use another model"

    def guarded(problem: str) -> list[int]:
        with _deadline(TEMPLATE_SECONDS) as outer:
            try:
                return encode(problem)
            except _TemplateTimeout:
                fail(f"the chat template of {model!r} rendered one prompt for over {TEMPLATE_SECONDS:g} s (a loop "
                     f"without end?): {fix}", prog)
            except Exception as error:
                if outer["fired"] or not _raised_in_template(error):  # the outer timer's error is its own
                    raise
                first = str(error).splitlines()[0][:200] if str(error) else ""
                fail(f"the chat template of {model!r} fails ({type(error).__name__}: {first}): {fix}", prog)

    return guarded


@contextlib.contextmanager
def _deadline(seconds: float):
    """_TemplateTimeout raised by SIGALRM `seconds` from now, on the main thread (elsewhere: no deadline). The
    process's own real-time timer and SIGALRM handler, if it had them, come back afterwards with the time they had
    left; one due sooner fires in its own handler meanwhile (whatever that raises is not the template's: yields
    {"fired": True} then). Setting the timer to 0 at the end, as this once did, cancelled an outer timer."""
    if threading.current_thread() is not threading.main_thread():
        yield {"fired": False}
        return
    start, outer = time.monotonic(), {"fired": False}
    previous = signal.getsignal(signal.SIGALRM)
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    outer_first = 0 < outer_left < seconds

    def alarm(signum, frame):
        if not outer_first or outer["fired"]:
            raise _TemplateTimeout
        outer["fired"] = True
        signal.setitimer(signal.ITIMER_REAL, max(seconds - (time.monotonic() - start), 1e-3))  # then ours
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:  # the default action: the process ends, as it would have
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGALRM)

    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, outer_left if outer_first else seconds)
    try:
        yield outer
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        if outer_left > 0 and not outer["fired"]:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - start), 1e-6), outer_interval)
        elif outer["fired"] and outer_interval > 0:
            signal.setitimer(signal.ITIMER_REAL, outer_interval, outer_interval)


def char_bound(tokenizer, tokens: int) -> int:
    """The most characters a text of `tokens` tokens can hold: tokens times the longest entry of the tokenizer's
    vocabulary, added tokens included. Each token stands for at most that many characters (a byte-level entry has
    one character per byte, and every character is at least one byte; a byte-fallback entry such as <0x41> is
    longer than the byte it stands for), so no text longer than this tokenizes into `tokens` tokens or fewer, and a
    problem past it is skipped by its length alone, never rendered or tokenized (a 50 MB problem took minutes and
    10 GB to tokenize). Only a normalizer that deletes characters could shrink a text below it."""
    return tokens * max(map(len, tokenizer.get_vocab()), default=1)


def first_fitting_prompt(problems: list[tuple[str, str]], encode, max_prompt_tokens: int, max_chars=None) -> int:
    """The index of the first problem whose prompt fits max_prompt_tokens; stops the run with one line (before
    anything is written) when none does. A problem over max_chars characters (char_bound) cannot fit."""
    fits = [p for p, _ in problems if max_chars is None or len(p) <= max_chars]
    for index, (problem, _) in enumerate(problems):
        if (max_chars is None or len(problem) <= max_chars) and len(encode(problem)) <= max_prompt_tokens:
            return index
    shortest = f"has {min(len(encode(p)) for p in fits[:2000])} tokens" if fits else \
        f"has over {max_chars} characters, more than that many tokens can hold"
    fail(f"every prompt is longer than --max-prompt-tokens {max_prompt_tokens} (the shortest problem's prompt "
         f"{shortest}): raise --max-prompt-tokens")


def longest_prompt(problems: list[tuple[str, str]], encode, max_prompt_tokens: int, max_chars=None) -> int:
    """The most tokens a prompt the stream yields can have: the longest prompt within max_prompt_tokens. Every problem
    is encoded once (seconds for tens of thousands): the plan asks for it only where it can change its verdict."""
    longest = 0
    for problem, _ in problems:
        if max_chars is None or len(problem) <= max_chars:
            tokens = len(encode(problem))
            longest = max(longest, tokens if tokens <= max_prompt_tokens else 0)
            if longest == max_prompt_tokens:  # none can be longer
                break
    return longest


def prompt_stream(problems: list[tuple[str, str]], encode, max_prompt_tokens: int, seed: int, position: int = 0,
                  max_chars=None):
    """Prompt(ids, answer, position) from shuffled passes over the data, forever, starting at a position
    (problems consumed so far, kept for --resume). Prompts longer than the limit are skipped (Decision 9), and a
    problem over max_chars characters (char_bound) without being tokenized."""
    while True:
        epoch, offset = divmod(position, len(problems))
        order = np.random.RandomState(seed + epoch).permutation(len(problems))  # the same order on resume
        for index in order[offset:]:
            position += 1
            if max_chars is not None and len(problems[index][0]) > max_chars:
                continue
            ids = encode(problems[index][0])
            if len(ids) <= max_prompt_tokens:
                yield Prompt(ids, problems[index][1], position)
