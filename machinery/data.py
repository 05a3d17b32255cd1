"""What a run reads from outside --out: dataset, tokenizer (its template guarded), the model's source; recorded."""

import contextlib
import glob
import hashlib
import io
import json
import math
import os
import re
import signal
import stat
import sys
import threading
import time
import traceback

from machinery import console, dist
from machinery.console import fail, say

LOCAL_FORMS = (".jsonl", ".json", ".parquet")  # the files read here; any other name is a hub id
OTHER_FILES = {".csv", ".tsv", ".txt", ".arrow", ".xlsx", ".xls", ".gz", ".zip", ".yaml", ".yml"}
HUB_ID = re.compile(r"^(?![.-])[\w.-]{1,96}(?<![.-])(/(?![.-])[\w.-]{1,96}(?<![.-]))?$")

def is_hub_id(name: str) -> bool:
    """org/name (or name) in the hub's alphabet that is no local path ('./x', 'a/b/c', 'runs/x' where ./runs exists)."""
    return not (os.path.exists(name) or "/" in name and os.path.exists(name.split("/")[0])) and \
        bool(HUB_ID.match(name)) and "--" not in name and ".." not in name

def check_model_path(model: str):
    """A model that is not a hub id is an existing local folder with no FIFO in it and weights in *.safetensors."""
    if os.path.isdir(model):
        check_regular_files(model, f"cannot load model {model!r}")
        check_weight_files(f"model folder {model!r}", os.listdir(model))
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError), open(
                os.path.join(model, "model.safetensors.index.json"), encoding="utf-8") as f:  # what transformers loads
            if pickled := [n for n in json.load(f)["weight_map"].values() if not str(n).endswith(".safetensors")]:
                fail(f"model folder {model!r}: its model.safetensors.index.json names {pickled[0]}, not a safetensors "
                     f"file; remix reads weights from safetensors only")
    elif not is_hub_id(model):
        fail(f"model folder {model!r} does not exist; pass an existing local folder or a hub id (org/name)")

def check_weight_files(what: str, files: list[str]):
    """Refuses a model without *.safetensors: weights that are pickles only (pytorch_model.bin) are never unpickled."""
    pickles = sorted(f for f in files if f.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl")))
    if not pickles and not any(f.endswith((".safetensors", ".safetensors.index.json")) for f in files):
        fail(f"{what} holds no model weights (*.safetensors)")
    if pickles and not any(f.endswith(".safetensors") for f in files):
        fail(f"{what} holds its weights as {pickles[0]}, a pickle (loading one can run code), and no *.safetensors: "
             f"remix never unpickles a model; convert it to safetensors where you trust its source (transformers' "
             f"from_pretrained, then save_pretrained, writes model.safetensors)")

def check_regular_files(folder: str, what: str):
    """One line where an entry of folder is no regular file, links followed (a FIFO, socket, device, broken link)."""
    root, _, files = next(os.walk(folder), (folder, [], []))
    if odd := [os.path.join(root, n) for n in files if not os.path.isfile(os.path.join(root, n))]:
        fail(f"{what}: {odd[0]} is not a regular file (a FIFO, socket, device or link that cannot be read safely); "
             f"remove it")

def check_hub(model: str, dataset: str | None = None, benchmarks: tuple = ()):
    """The hub ids given (eval.py --hub: the benchmarks'), before anything loads, one request each and no retry (the
    datasets library's look-ups retry for half a minute): a hub out of reach is one line; pickled weights refused."""
    import huggingface_hub.errors
    named = [(flag, name) for flag, name in (("--model", model), ("--dataset", dataset))
             if name and is_hub_id(name) and not name.endswith(LOCAL_FORMS)]
    for flag, name in named + [("--hub's benchmark", benchmark) for benchmark in benchmarks]:
        try:
            if console.offline_hint():
                folder = huggingface_hub.snapshot_download(name, local_files_only=True) if flag == "--model" else None
                files = os.listdir(folder) if folder else []
            else:
                api = huggingface_hub.HfApi()
                info = (api.model_info if flag == "--model" else api.dataset_info)(name, timeout=10)
                files = [s.rfilename for s in info.siblings or [] if "/" not in s.rfilename]
        except Exception as error:  # noqa: BLE001 the hub answered (not found, gated), or offline and not cached:
            if isinstance(error, huggingface_hub.errors.HfHubHTTPError) or console.offline_hint():  # loading says why
                continue
            fail(f"the Hugging Face hub ({huggingface_hub.constants.ENDPOINT}) cannot be reached ({error}), and "
                 f"{flag} {name} is a hub id: {'drop --hub' if 'hub' in flag else 'pass local paths'}, or set "
                 f"HF_HUB_OFFLINE=1 to use the files already in the local cache")
        if flag == "--model":
            check_weight_files(f"hub model {name!r}", files)

def answer_text(value, where: str = "the answer") -> str:
    """A gold answer as the grader's string (stripped; 27.0 -> '27', 0.5 -> '0.5'); else ValueError naming where."""
    if isinstance(value, str) and value.strip():
        return value.strip()
    if isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and math.isfinite(value):
        return str(value) if isinstance(value, int) else str(int(value)) if value.is_integer() else repr(value)
    shown = repr(value) if len(repr(value)) < 60 else repr(value)[:57] + "..."
    raise ValueError(f"{where} is {shown}: an answer must be a non-empty string or a number")

def problem_text(value, where: str = "the problem") -> str:
    if isinstance(value, str) and value.strip():
        return value
    raise ValueError(f"{where} is {value!r:.60}: a problem must be a non-empty string")

def check_dataset(path: str):
    """One line, before the hub is asked anything, for a --dataset that is no local .jsonl/.json/.parquet or hub id."""
    if not path.endswith(LOCAL_FORMS) and (os.path.lexists(path) or not is_hub_id(path)
                                           or os.path.splitext(path)[1].lower() in OTHER_FILES):
        what = "a folder" if os.path.isdir(path) else "a file of another form" if os.path.lexists(path) else \
            "neither a local file nor a hub id"
        fail(f"dataset {path!r} is {what}: pass a local .jsonl, .json or .parquet file, or a hub id (org/name)")

def read_dataset(path: str, revision: str | None = None) -> tuple[list[dict], dict]:
    """The rows of --dataset and what names them: {"sha256"} of the local bytes parsed, or a hub one's {"revision"}."""
    if not path.endswith(LOCAL_FORMS):
        rows, commit = hub_rows(path, revision=revision)
        return rows, {"revision": commit}
    try:
        if not stat.S_ISREG(mode := os.stat(path).st_mode):
            fail(f"dataset {path!r} is {'a folder, not a file' if stat.S_ISDIR(mode) else 'not a regular file'}")
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        fail(f"dataset file {path!r} does not exist; pass an existing .jsonl/.json/.parquet or a hub id")
    except OSError as error:
        fail(f"cannot read dataset file {path!r}: {error.strerror}")
    if not raw:
        fail(f"dataset file {path!r} is empty")
    if path.endswith(".parquet"):
        import pandas as pd
        try:
            rows = pd.read_parquet(io.BytesIO(raw)).to_dict("records")
        except Exception as error:  # pyarrow's errors for a damaged file have no common type
            fail(f"cannot read dataset {path!r} as parquet: {console.reason(error)}")
    else:
        rows = parse_rows(raw, path)
    return rows, {"sha256": hashlib.sha256(raw).hexdigest()}

def problems_of(rows: list[dict], path: str, problem_key: str, answer_key: str) -> list[tuple]:
    """(problem, answer) pairs of the rows; unusable ones are skipped and counted, no usable row is one line."""
    if not rows:
        fail(f"dataset {path!r} holds no rows")
    if missing := next((i for i, row in enumerate(rows, 1) if problem_key not in row or answer_key not in row), None):
        fail(f"dataset {path!r}: row {missing} lacks {problem_key!r} or {answer_key!r} (the first row has the columns "
             f"{sorted(rows[0])}); set --problem-key/--answer-key")
    problems, bad = [], []
    for number, row in enumerate(rows, 1):
        try:
            problems.append((problem_text(row[problem_key], repr(problem_key)),
                             answer_text(row[answer_key], repr(answer_key))))
        except ValueError as error:
            bad.append(f"row {number}: {error}")
    if not problems:
        fail(f"dataset {path!r} has no usable row ({bad[0]})")
    if bad:
        say(f"dataset {path!r}: skipped {len(bad)} of {len(rows)} rows with an unusable problem or answer "
            f"(first: {bad[0]})")
    return problems

def parse_rows(raw: bytes, path: str) -> list[dict]:
    """UTF-8 JSON lines, or a JSON list of objects (a text starting '['); one object over several lines is refused."""
    try:
        text = raw.decode("utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError as error:
        fail(f"dataset {path!r} is not UTF-8 text (byte {error.start}: {error.reason})")
    stripped = text.lstrip()
    if stripped.startswith("{") and _loads(stripped.split("\n", 1)[0], path, "", quiet=True) is None and \
            _loads(text, path, "", quiet=True) is not None:
        fail(f"dataset {path!r} holds one JSON object, not rows: write one object per line (JSONL) or a JSON list of "
             f"objects")
    rows = _loads(text, path, "") if stripped.startswith("[") else \
        [_loads(line, path, f"line {n}") for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            fail(f"dataset {path!r}: row {number} is a JSON {type(row).__name__}, not an object")
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            fail(f"dataset {path!r}: row {number} holds a lone surrogate (a \\ud800-\\udfff escape without its pair), "
                 f"which is not Unicode text and no tokenizer takes: fix or drop that row")
    return rows

def _loads(text: str, path: str, where: str, quiet: bool = False):
    """json.loads, with one line for each way Python refuses a text (where: 'line 3'); quiet: None instead."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        problem = f"is not valid JSON ({error})"
    except ValueError:  # since Python 3.11 int() refuses more digits than this (quadratic time), json too
        problem = f"holds an integer of over {sys.get_int_max_str_digits()} digits, more than Python reads: write " \
                  f"it as a string"
    except RecursionError:
        problem = f"nests lists or objects deeper than Python reads (about {sys.getrecursionlimit()} levels): " \
                  f"flatten it or drop that row"
    if not quiet:
        fail(f"dataset {path!r}{f': {where}' if where else ''} {problem}")

def hub_rows(name: str, config: str | None = None, split: str = "train",
             revision: str | None = None) -> tuple[list[dict], str | None]:
    """A hub dataset's rows and their revision: the builder's hash (the commit resolved, or the cached copy's)."""
    import datasets
    try:
        with console.quiet(datasets):
            builder = datasets.load_dataset_builder(name, config, revision=revision)
            builder.download_and_prepare()
            return list(builder.as_dataset(split=split)), builder.hash
    except Exception as error:  # offline, unknown id, no such split: one line either way
        fail(f"cannot load dataset {name!r} from the hub: {console.reason(error)}{console.offline_hint()}")

def load_tokenizer(source: str):
    """The model's tokenizer (never its folder's code), making tokens none past the embedding's rows; else one line."""
    import transformers
    what = "its config.json does not describe a model"
    try:
        with console.quiet(transformers):
            rows = transformers.AutoConfig.from_pretrained(source, trust_remote_code=False).get_text_config().vocab_size
            what = "its tokenizer cannot be read (tokenizer.json, tokenizer_config.json)"
            tokenizer = transformers.AutoTokenizer.from_pretrained(source, trust_remote_code=False)
            tokenizer("1 + 1 = 2", add_special_tokens=False)  # a value of its config that breaks encoding breaks here
    except Exception as error:  # noqa: BLE001
        fail(f"cannot load model {source!r}: {what} ({console.reason(error)})"
             f"{'' if os.path.isdir(source) else console.offline_hint()}")
    if not tokenizer("1 + 1 = 2", add_special_tokens=False).input_ids:  # its tokenizer files gone: an empty one
        fail(f"cannot load model {source!r}: it holds no usable tokenizer (it turns text into no tokens; are its "
             f"tokenizer.json and tokenizer_config.json missing?): copy them from where the model came from")
    largest = max(max(tokenizer.get_vocab().values(), default=-1) + 1, len(tokenizer))
    if rows is not None and largest > rows:
        fail(f"cannot load model {source!r}: its tokenizer has {largest} tokens and the model's embedding {rows} rows "
             f"(vocab_size in config.json): the tokenizer is not this model's")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer

TEMPLATE_SECONDS = 5.0  # one prompt renders in milliseconds; a chat template still rendering after this never ends

class _TemplateTimeout(BaseException):
    """Not an Exception: no `except Exception` between the alarm and template_guard keeps it."""

def template_guard(encode, model: str):
    """encode(problem) -> token ids; one line when the chat template raises or renders past TEMPLATE_SECONDS."""
    import jinja2
    fix = "fix or replace the chat_template in its tokenizer_config.json (or chat_template.jinja), or use another model"

    def guarded(problem: str) -> list[int]:
        with _deadline(TEMPLATE_SECONDS) as outer:
            try:
                return encode(problem)
            except _TemplateTimeout:
                fail(f"the chat template of {model!r} rendered one prompt for over {TEMPLATE_SECONDS:g} s (a loop "
                     f"without end?): {fix}")
            except Exception as error:
                if outer["outer"] or not isinstance(error, jinja2.TemplateError) and not any(
                        f.f_code.co_filename == "<template>" for f, _ in traceback.walk_tb(error.__traceback__)):
                    raise  # the outer timer's, or not the template's (jinja names its lines' frames '<template>')
                fail(f"the chat template of {model!r} fails ({console.reason(error)}): {fix}")
    return guarded

@contextlib.contextmanager
def _deadline(seconds: float):
    """_TemplateTimeout by SIGALRM in `seconds`, on the main thread. A timer the process had keeps its handler: due
    sooner, it stands in for ours (yields {"outer": True}: what it raises is its own); due later, it resumes after."""
    left, interval = signal.getitimer(signal.ITIMER_REAL)
    if threading.current_thread() is not threading.main_thread() or 0 < left <= seconds:
        yield {"outer": left > 0}
        return
    start, previous = time.monotonic(), signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield {"outer": False}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - start), 1e-6), interval)

def _raise_timeout(signum, frame):
    raise _TemplateTimeout

MOVABLE = {"model": "--model", "dataset": "--dataset", "eval_data_dir": "--eval-data-dir"}
VOLATILE = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache")  # a save may change them

def file_digest(path: str) -> str:
    """A file's SHA-256: what a run records of what it read, and what a checkpoint's manifest holds."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()

def problems_digest(problems: list[tuple]) -> str:
    """The SHA-256 of the (problem, answer) pairs a run trains on: the same data read from a file or the hub, one."""
    return hashlib.sha256(json.dumps(problems).encode()).hexdigest()

def model_record(model: str) -> dict | None:
    """{"revision", "files": {name: {"sha256", "size", "mtime_ns"}}} of the base model's safetensors; None uncached."""
    record = None
    if dist.rank() == 0:
        folder, revision = (model, None) if os.path.isdir(model) else cached_snapshot(model)
        if folder is not None:
            record = {"revision": revision, "files": {}}
            for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
                blob = os.path.realpath(path)
                hub_named = revision is not None and re.fullmatch(r"[0-9a-f]{64}", os.path.basename(blob))
                record["files"][os.path.basename(path)] = {
                    "sha256": os.path.basename(blob) if hub_named else file_digest(path),
                    "size": os.stat(blob).st_size, "mtime_ns": None if revision else os.stat(blob).st_mtime_ns}
    return dist.broadcast(record)

def cached_snapshot(model: str) -> tuple[str | None, str | None]:
    """(the folder of a hub model's snapshot in the local cache, its commit), or (None, None)."""
    from huggingface_hub import try_to_load_from_cache
    try:
        config = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a repository id the hub library accepts
        return None, None
    folder = os.path.dirname(config) if isinstance(config, str) else None
    return (folder, os.path.basename(folder)) if folder else (None, None)

def weights_differ(folder: str, recorded: dict, moved: bool) -> str | None:
    """Why a folder's weights are not the recorded ones, or None; unless moved, same size and mtime means unchanged."""
    files = {os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors"))}
    wanted = recorded.get("files") or {}
    missing, extra = sorted(set(wanted) - files), sorted(files - set(wanted))
    if missing or extra:
        return f"it has no {missing[0]}" if missing else f"it has {extra[0]}, which the run's model had not"
    for name, entry in sorted(wanted.items()):
        info = os.stat(os.path.join(folder, name))
        if info.st_size != entry.get("size", info.st_size):
            return f"its {name} differs (another size)"
        if (moved or info.st_mtime_ns != entry.get("mtime_ns")) and \
                file_digest(os.path.join(folder, name)) != entry.get("sha256"):
            return f"its {name} differs (another SHA-256)"
    return None

def model_changed(model: str, recorded: dict, checkpoint: str) -> str | None:
    """Why the run's base model in its saved place is not what the run began with (config, weights), or None."""
    if os.path.isdir(model):
        return None if recorded.get("revision") is not None else same_model(model, checkpoint, recorded, moved=False)
    revision = cached_snapshot(model)[1]
    return f"the local cache holds its revision {revision[:12]}, the run began on {recorded['revision'][:12]}" \
        if revision is not None and recorded.get("revision") not in (None, revision) else None

def check_resumed(args, saved: dict, recorded: dict, checkpoint: str):
    """A resumed run's inputs before anything loads: each in a new place the same, in its old place unchanged."""
    weights = recorded.get("model") if isinstance(recorded.get("model"), dict) else {}
    for key, flag in MOVABLE.items():
        new, old = getattr(args, key), saved.get(key)
        if new != old:
            problem = dist.broadcast(same_model(new, checkpoint, weights) if dist.rank() == 0 else None) \
                if key == "model" else \
                "a resume needs the place of the same files" if new is None else \
                "no such file" if key == "dataset" and not os.path.isfile(new) else \
                "no such folder" if key == "eval_data_dir" and not os.path.isdir(new) else None
            if problem:
                fail(f"--resume {args.resume}: {flag} {new} is not where the run's {key.replace('_', '-')} {old} moved "
                     f"to ({problem}); give the new place of the same one, or put it back at {old}")
        elif old is not None and (key == "eval_data_dir" and args.eval_every or key == "dataset" and old.endswith(
                LOCAL_FORMS) or key == "model" and not is_hub_id(old)) and not os.path.exists(old):
            fail(f"--resume {args.resume}: the run's {key.replace('_', '-')} {old} is no longer there; give its new "
                 f"place: --resume {args.resume} {flag} NEW_PLACE")
        elif key == "model" and weights:
            if problem := dist.broadcast(model_changed(old, weights, checkpoint) if dist.rank() == 0 else None):
                fail(f"--resume {args.resume}: the run's model {old} is not what the run began with ({problem}); put "
                     f"the original back, or give its place: --resume {args.resume} --model PLACE")

def same_model(new: str, checkpoint: str, weights: dict, moved: bool = True) -> str | None:
    """Why a folder is not the run's base model moved (config.json less VOLATILE, weight digests), or None."""
    if not os.path.isdir(new):
        return "no such folder"
    configs = []
    for folder in (new, checkpoint):
        try:
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                configs.append({k: v for k, v in json.load(f).items() if k not in VOLATILE})
        except (OSError, ValueError) as error:
            return f"{os.path.join(folder, 'config.json')} cannot be read ({error})"
    if differ := sorted(k for k in configs[0].keys() | configs[1].keys() if configs[0].get(k) != configs[1].get(k)):
        return f"its config.json differs from {os.path.basename(checkpoint)}'s in {differ[0]}"
    return weights_differ(new, weights, moved)

def check_data(args, saved: dict, recorded: dict, read: dict, accept: bool) -> dict:
    """A resumed run's data as read against what was recorded: a change is one line (a note with accept); the record."""
    changes, old = [], saved.get("dataset")
    who = "--dataset" if args.dataset != old else "the run's dataset"
    if isinstance(then := recorded.get("dataset"), str) and isinstance(now := read.get("dataset"), str) and then != now:
        changes.append(f"--dataset {args.dataset} is not where the run's dataset {old} moved to (its content differs "
                       f"(another SHA-256))" if args.dataset != old else f"the run's dataset {args.dataset} has "
                       f"changed since it began (another SHA-256 than it recorded)")
    then, now = recorded.get("dataset_revision"), read.get("dataset_revision")
    if isinstance(then, str) and isinstance(now, str) and then != now:
        changes.append(f"{who} {args.dataset} is at revision {now[:12]} (as the datasets library loads it here), the "
                       f"run began on {then[:12]} (with the hub in reach, a resume asks for that one)")
    then, now = recorded.get("problems"), read.get("problems")
    if not changes and isinstance(then, str) and then != now:  # whatever their source, a hub or a file
        changes.append(f"{who} {args.dataset} holds other problems than the run began on (another SHA-256 of its "
                       f"problems and answers as read)")
    then, now = recorded.get("eval_data_dir"), read.get("eval_data_dir") or {}
    old, folder = saved.get("eval_data_dir"), args.eval_data_dir or "the repository's data/benchmarks"
    for name, digest in sorted(then.items() if isinstance(then, dict) else []):
        if name in now and now[name] != digest:
            changes.append(f"--eval-data-dir {args.eval_data_dir} is not where the run's eval-data-dir {old} moved to "
                           f"(its {name} differs (another SHA-256))" if args.eval_data_dir != old else
                           f"the benchmark file {name} in {folder} has changed since the run began "
                           f"(another SHA-256 than it recorded)")
    if changes and not accept:
        fail(f"--resume {args.resume}: {changes[0]}; put back (or give the place of) the data the run began with, or "
             f"pass --resume-changed-data to go on with the data as it is now")
    if changes:
        say(f"--resume {args.resume}: {'; '.join(changes)}: going on with it as it is now (--resume-changed-data)")
    return {**recorded, **read}
