"""What a run reads from outside --out and a resume reads again: the base model (the reference before
reincarnation, and vLLM's start), the dataset and the benchmark folder. Each checkpoint records the digests of the
local files; on --resume, where one has moved, --model, --dataset or --eval-data-dir gives its new place, which
is checked to hold the same thing, and a place that is gone is named with that fix. A reader of the method may skip
this module."""

import fnmatch
import hashlib
import json
import os

from machinery import data, flags, safeload
from machinery.messages import fail

MOVABLE = {"model": "--model", "dataset": "--dataset", "eval_data_dir": "--eval-data-dir"}
VOLATILE = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache")  # a save may change them


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def benchmark_files(args) -> list[str]:
    """The files of --eval-data-dir the run's evaluations read."""
    from machinery import evaluation

    return [evaluation.BENCHMARKS[name][0] for name in evaluation.resolve(args.eval_benchmarks)]


def fingerprints(args) -> dict:
    """The digests of a run's local dataset file and benchmark files, recorded with each checkpoint (None for a hub
    dataset, or without --eval-data-dir or evaluations)."""
    folder = args.eval_data_dir
    return {"dataset": file_digest(args.dataset) if os.path.isfile(args.dataset) else None,
            "eval_data_dir": {name: file_digest(os.path.join(folder, name)) for name in benchmark_files(args)
                              if os.path.isfile(os.path.join(folder, name))} if folder and args.eval_every else None}


def needed(key: str, value, args) -> bool:
    """Whether a resume reads this saved input from a local place (a hub id is not moved)."""
    if value is None or (key == "eval_data_dir" and not args.eval_every):
        return False
    if key == "dataset" and value.endswith(data.LOCAL_FORMS):
        return True
    return key == "eval_data_dir" or not flags.is_hub_id(value)


def check_resumed(args, saved: dict, recorded, checkpoint: str):
    """A resumed run's inputs: a new place given for one must hold the same thing (the model: the same config and
    weight shapes as the checkpoint's policy, its weights matching its config; the dataset and benchmark files:
    the digests the run recorded); a saved place that is gone stops the resume with one line naming the flag
    that gives the new one."""
    recorded = recorded if isinstance(recorded, dict) else {}
    for key, flag in MOVABLE.items():
        new, old = getattr(args, key), saved.get(key)
        if new != old:
            problem = same_model(new, checkpoint) if key == "model" else same_files(key, new, recorded.get(key))
            if problem:
                fail(f"--resume {args.resume}: {flag} {new} is not where the run's {flag.lstrip('-')} {old} moved to "
                     f"({problem}); give the new place of the same one, or put it back at {old}")
        elif needed(key, old, args) and not os.path.exists(old):
            fail(f"--resume {args.resume}: the run's {flag.lstrip('-')} {old} is no longer there; give its new place: "
                 f"--resume {args.resume} {flag} NEW_PLACE")


def same_model(new: str, checkpoint: str) -> str | None:
    """Why a folder is not the run's base model moved, or None: its weights must match its own config, and its
    config (all but what a save rewrites) and weight shapes those of the checkpoint's policy."""
    if not os.path.isdir(new):
        return "no such folder"
    try:
        if safeload.check_model_folder(new) != safeload.model_parameters(checkpoint)[:2]:  # (params, vocab) both
            return "its weights have other names or shapes than the run's model"
        configs = []
        for folder in (new, checkpoint):
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                configs.append({k: v for k, v in json.load(f).items() if k not in VOLATILE})
    except (OSError, ValueError) as error:
        return str(error)
    differ = sorted(k for k in configs[0].keys() | configs[1].keys() if configs[0].get(k) != configs[1].get(k))
    return f"its config.json has another {differ[0]}" if differ else None


def same_files(key: str, new: str | None, digests) -> str | None:
    """Why a dataset file or benchmark folder is not the run's moved, or None: each file's digest must be the one
    the run recorded."""
    if new is None:
        return "a resume needs the place of the same files"
    if not digests:
        return "the run's checkpoint records no digest to check it against"
    if key == "dataset":
        if not os.path.isfile(new):
            return "no such file"
        return None if file_digest(new) == digests else "its content differs (another SHA-256)"
    for name, digest in digests.items():
        path = os.path.join(new, name)
        if not os.path.isfile(path):
            return f"it holds no {name}"
        if file_digest(path) != digest:
            return f"its {name} differs (another SHA-256)"
    return None


# ----------------------------------------------------------------------------------------------
# Nothing a run reads lies where it writes
# ----------------------------------------------------------------------------------------------
def opened_through(path: str, hops: int = 0) -> list[str]:
    """Every directory entry the kernel passes through to open path, each as its real folder joined with its name:
    path's own components and, where one is a symbolic link, those of what it points to (os.path.realpath's walk,
    kept). 'x/link/../y' goes up from where the link leads, as the kernel does."""
    if hops > 40:  # a loop of links: opening it fails anyway
        return []
    folder, entries = os.sep, []
    for part in os.path.join(os.getcwd(), path).split(os.sep):
        if part in ("", "."):
            continue
        if part == "..":
            folder = os.path.dirname(folder)
            continue
        entry = os.path.join(folder, part)
        entries.append(entry)
        if os.path.islink(entry):
            entries += opened_through(os.path.join(folder, os.readlink(entry)), hops + 1)
            folder = os.path.realpath(entry)
        else:
            folder = entry
    return entries


def reads_of(args) -> dict[str, tuple[str, list[str]]]:
    """{flag: (its value, the local paths a run opens through it)}: the model folder and each entry of it, the
    dataset file, the benchmark folder and the files an evaluation reads there."""
    reads = {}
    if os.path.isdir(args.model):
        reads["--model"] = (args.model, [args.model, *(os.path.join(args.model, name)
                                                       for name in os.listdir(args.model))])
    if os.path.lexists(args.dataset):
        reads["--dataset"] = (args.dataset, [args.dataset])
    if args.eval_every and args.eval_data_dir and os.path.lexists(args.eval_data_dir):
        reads["--eval-data-dir"] = (args.eval_data_dir, [args.eval_data_dir, *(os.path.join(args.eval_data_dir, name)
                                                                              for name in benchmark_files(args))])
    return reads


def read_where_written(out: str, reads: dict, names: tuple) -> tuple[str, str, str] | None:
    """(flag, its value, the entry under out) of the first path a job reads that passes through an entry of out's
    top level named by one of names (patterns: what the job writes, replaces or deletes there), or None."""
    real_out = os.path.realpath(out)
    for flag, (value, paths) in reads.items():
        for path in paths:
            for entry in opened_through(path):
                if os.path.dirname(entry) == real_out and any(fnmatch.fnmatch(os.path.basename(entry), name)
                                                              for name in names):
                    return flag, value, entry
    return None


def check_kept(args, names: tuple):
    """Nothing the run reads (reads_of) lies in what it writes, replaces or deletes under --out (names): --overwrite
    would delete it before it is loaded, and a checkpoint's rotation later; one line names the path and the way out,
    before anything is touched."""
    found = read_where_written(args.out, reads_of(args), names)
    if found:
        flag, value, entry = found
        way = (f"copy it out of {args.out} and give that place: --resume {args.resume} {flag} NEW_PLACE" if args.resume
               else "choose another --out")
        fail(f"{flag} {value} is read from {entry}, inside --out {args.out}, where this run writes and deletes "
             f"(--overwrite, a checkpoint's rotation): nothing a run reads is deleted by it; {way}")
