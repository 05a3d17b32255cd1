"""Training problems from a local file or the hub, checked row by row where they come in, and the stream of prompts
a run draws from. A reader of the method may skip this module: a problem is (problem text, gold answer).
"""

import collections
import json
import math
import os
import stat

import numpy as np

from machinery import run

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


def load_problems(path: str, problem_key: str, answer_key: str, prog: str = "remix") -> list[tuple[str, str]]:
    """(problem, answer) pairs from a hub dataset or a local .jsonl/.json/.parquet file. A row whose problem or
    answer is missing, empty or of another type is skipped, and the count said in one line; a file with no usable
    row, or whose rows lack the columns, stops with one line."""
    rows = read_rows(path, prog) if path.endswith((".jsonl", ".json", ".parquet")) else load_hub_rows(path, prog=prog)
    if not rows:
        run.fail(f"dataset {path!r} holds no rows", prog)
    columns = sorted(rows[0])
    if any(key not in row for row in rows for key in (problem_key, answer_key)):
        missing = next(i for i, row in enumerate(rows, 1) if problem_key not in row or answer_key not in row)
        run.fail(f"dataset {path!r}: row {missing} lacks {problem_key!r} or {answer_key!r} (the first row has the "
                 f"columns {columns}); set --problem-key/--answer-key", prog)
    problems, bad = [], []
    for number, row in enumerate(rows, 1):
        try:
            problems.append((problem_text(row[problem_key], f"{problem_key!r}"),
                             answer_text(row[answer_key], f"{answer_key!r}")))
        except ValueError as error:
            bad.append(f"row {number}: {error}")
    if not problems:
        run.fail(f"dataset {path!r} has no usable row ({bad[0]})", prog)
    if bad:
        run.say(f"dataset {path!r}: skipped {len(bad)} of {len(rows)} rows with an unusable problem or answer "
                f"(first: {bad[0]})", prog)
    return problems


def read_rows(path: str, prog: str = "remix") -> list[dict]:
    """The rows of a local .jsonl (one object per line), .json (a list of objects) or .parquet file; every way
    such a file can be wrong gets one line that names it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        run.fail(f"dataset file {path!r} does not exist; pass an existing .jsonl/.json/.parquet or a hub id", prog)
    except OSError as error:
        run.fail(f"cannot read dataset file {path!r}: {error.strerror}", prog)
    if stat.S_ISDIR(mode):
        run.fail(f"dataset {path!r} is a folder, not a file", prog)
    if not stat.S_ISREG(mode):
        run.fail(f"dataset {path!r} is not a regular file", prog)
    if os.path.getsize(path) == 0:
        run.fail(f"dataset file {path!r} is empty", prog)
    if path.endswith(".parquet"):
        try:
            import pandas as pd

            rows = pd.read_parquet(path).to_dict("records")
        except Exception as error:  # pyarrow's errors for a damaged file have no common type
            run.fail(f"cannot read dataset {path!r} as parquet: {str(error).splitlines()[0]}", prog)
        return rows
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as error:
        run.fail(f"dataset {path!r} is not UTF-8 text (byte {error.start}: {error.reason})", prog)
    except OSError as error:
        run.fail(f"cannot read dataset file {path!r}: {error.strerror}", prog)
    return parse_rows(text, path, prog)


def parse_rows(text: str, path: str, prog: str = "remix") -> list[dict]:
    """JSON lines, or one JSON document holding a list of objects."""
    stripped = text.lstrip()
    if stripped.startswith("[") or _one_document(stripped):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as error:
            run.fail(f"dataset file {path!r} is not valid JSON: {error}", prog)
        if isinstance(whole, dict):
            run.fail(f"dataset {path!r} holds one JSON object, not rows: write one object per line (JSONL) or a "
                     f"JSON list of objects", prog)
        rows = whole
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    run.fail(f"cannot read dataset {path!r}: line {number} is not valid JSON ({error})", prog)
    if not isinstance(rows, list):
        run.fail(f"dataset {path!r} holds a JSON {type(rows).__name__}, not a list of rows", prog)
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            run.fail(f"dataset {path!r}: row {number} is a JSON {type(row).__name__}, not an object", prog)
    return rows


def _one_document(text: str) -> bool:
    """Whether text that starts with '{' is a single (multi-line) JSON object rather than JSON lines."""
    if not text.startswith("{"):
        return False
    first = text.split("\n", 1)[0]
    try:
        json.loads(first)
        return False  # its first line is an object of its own: JSON lines
    except json.JSONDecodeError:
        try:
            json.loads(text)
            return True
        except json.JSONDecodeError:
            return False


def load_hub_rows(name: str, config: str | None = None, split: str = "train", prog: str = "remix") -> list[dict]:
    import datasets

    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as error:  # offline, unknown id, no such split: one line either way
        first = str(error).splitlines()[0] if str(error) else repr(error)
        run.fail(f"cannot load dataset {name!r} from the hub: {first}{run.offline_hint()}", prog)


def first_fitting_prompt(problems: list[tuple[str, str]], encode, max_prompt_tokens: int) -> int:
    """The index of the first problem whose prompt fits max_prompt_tokens; stops the run with one line (before
    anything is written) when none does."""
    for index, (problem, _) in enumerate(problems):
        if len(encode(problem)) <= max_prompt_tokens:
            return index
    run.fail(f"every prompt is longer than --max-prompt-tokens {max_prompt_tokens} (the shortest problem's prompt "
             f"has {min(len(encode(p)) for p, _ in problems[:2000])} tokens): raise --max-prompt-tokens")


def prompt_stream(problems: list[tuple[str, str]], encode, max_prompt_tokens: int, seed: int, position: int = 0):
    """Prompt(ids, answer, position) from shuffled passes over the data, forever, starting at a position
    (problems consumed so far, kept for --resume). Prompts longer than the limit are skipped."""
    while True:
        epoch, offset = divmod(position, len(problems))
        order = np.random.RandomState(seed + epoch).permutation(len(problems))  # the same order on resume
        for index in order[offset:]:
            position += 1
            ids = encode(problems[index][0])
            if len(ids) <= max_prompt_tokens:
                yield Prompt(ids, problems[index][1], position)
