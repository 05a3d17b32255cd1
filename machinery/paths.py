"""A run's paths, checked before it writes: what it reads from outside --out, and where it writes under it.

What a run reads from outside --out and a resume reads again: the base model (the reference before reincarnation, and
vLLM's start), the dataset and the benchmark files. A run records what names each at its start (the dataset's and
benchmark files' SHA-256 of the bytes it parsed, a hub dataset's revision, the base model's weight digests) with every
checkpoint; a resume checks each against it, in its old place or, where one has moved, in the new place --model,
--dataset or --eval-data-dir gives (a place that is gone is named with that fix). Nothing a run reads may lie where
it writes under --out. Where it writes: --out is not inside another run's folder, and each path a job will write is
free for it before it writes anything (machinery.runfolder writes them). A reader of the method may skip this module.
"""

import fnmatch
import glob
import hashlib
import json
import os
import re
import stat

from machinery import data, dist, flags, runfolder, safeload
from machinery.console import fail, say


MOVABLE = {"model": "--model", "dataset": "--dataset", "eval_data_dir": "--eval-data-dir"}
VOLATILE = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache")  # a save may change them
SHA256 = re.compile(r"[0-9a-f]{64}")


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


def fingerprints(dataset: dict, benchmarks: dict | None, model: dict | None) -> dict:
    """What a run records with each checkpoint of what it read: its dataset's SHA-256 (a local file) or revision (a
    hub dataset), as data.read_dataset names it, its benchmark files' SHA-256 by name (None without evaluations), and
    its base model's weights (model_record)."""
    return {"dataset": dataset.get("sha256"), "dataset_revision": dataset.get("revision"),
            "eval_data_dir": benchmarks or None, "model": model}


# ----------------------------------------------------------------------------------------------
# The base model's weights: hashed once, at the start
# ----------------------------------------------------------------------------------------------
def model_record(model: str) -> dict | None:
    """The base model's weights as a run records them: {"revision": the hub commit (None for a local folder),
    "files": {name: {"sha256", "size", "mtime_ns"}}} for each *.safetensors. A local folder's files are hashed here,
    once (a resume takes a file of the same size and modification time as unchanged, and hashes a changed or moved
    one); a hub model's come from the local cache: the commit its snapshot is, and each file's SHA-256 as the name
    of its blob (the hub names a large file's blob by it), hashed only where the blob is named otherwise. None for a
    hub id the cache does not hold. Rank 0 reads; every rank gets its record."""
    record = None
    if dist.rank() == 0:
        folder, revision = (model, None) if os.path.isdir(model) else cached_snapshot(model)
        if folder is not None:
            files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
            record = {"revision": revision,
                      "files": {os.path.basename(path): weight_entry(path, revision is None) for path in files}}
    return dist.broadcast(record)


def cached_snapshot(model: str) -> tuple[str | None, str | None]:
    """(the folder of a hub model's snapshot in the local cache, its commit), or (None, None) where none is cached:
    what transformers loads offline (the snapshot the cache's main ref names)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        config = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a repository id the hub library accepts
        return None, None
    if not isinstance(config, str):
        return None, None
    return os.path.dirname(config), os.path.basename(os.path.dirname(config))


def weight_entry(path: str, local: bool) -> dict:
    blob = os.path.realpath(path)
    named = os.path.basename(blob)
    info = os.stat(blob)
    return {"sha256": named if not local and SHA256.fullmatch(named) else file_digest(path), "size": info.st_size,
            "mtime_ns": info.st_mtime_ns if local else None}


def weights_differ(folder: str, recorded: dict, moved: bool) -> str | None:
    """Why a folder's weights are not the recorded ones, naming the file, or None. A file of the recorded size and
    modification time in the run's own place is taken as unchanged; any other is hashed."""
    files = {os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors"))}
    wanted = recorded.get("files") or {}
    missing, extra = sorted(set(wanted) - files), sorted(files - set(wanted))
    if missing or extra:
        return f"it has no {missing[0]}" if missing else f"it has {extra[0]}, which the run's model had not"
    for name, entry in sorted(wanted.items()):
        info = os.stat(os.path.join(folder, name))
        if info.st_size != entry.get("size", info.st_size):
            return f"its {name} differs (another size)"
        if not moved and info.st_mtime_ns == entry.get("mtime_ns"):
            continue
        if file_digest(os.path.join(folder, name)) != entry.get("sha256"):
            return f"its {name} differs (another SHA-256)"
    return None


def model_changed(model: str, recorded: dict) -> str | None:
    """Why the run's base model, in its saved place, is no longer what the run began with, or None: a local folder's
    weights against their digests; a hub id's cached snapshot against the recorded commit."""
    if os.path.isdir(model):
        return None if recorded.get("revision") is not None else weights_differ(model, recorded, moved=False)
    _, revision = cached_snapshot(model)
    if revision is not None and recorded.get("revision") not in (None, revision):
        return f"the local cache holds its revision {revision[:12]}, the run began on {recorded['revision'][:12]}"
    return None


# ----------------------------------------------------------------------------------------------
# On --resume: each input in its old place or its new one
# ----------------------------------------------------------------------------------------------
def check_resumed(args, saved: dict, recorded, checkpoint: str):
    """A resumed run's inputs before anything is loaded: a new place given for the model must hold the same one (the
    same config and weight shapes as the checkpoint's policy, its weights matching its config, and the weight digests
    the run recorded); the model in its old place must still be the one recorded; a new place given for the dataset
    or benchmark folder must be there (check_data compares what is read there); a saved place that is gone stops
    the resume with one line naming the flag that gives the new one."""
    recorded = recorded if isinstance(recorded, dict) else {}
    weights = recorded.get("model") if isinstance(recorded.get("model"), dict) else None
    for key, flag in MOVABLE.items():
        new, old = getattr(args, key), saved.get(key)
        if new != old:
            problem = same_model(new, checkpoint, weights) if key == "model" else place_problem(key, new)
            if problem:
                fail(f"--resume {args.resume}: {flag} {new} is not where the run's {flag.lstrip('-')} {old} moved to "
                     f"({problem}); give the new place of the same one, or put it back at {old}")
        elif needed(key, old, args) and not os.path.exists(old):
            fail(f"--resume {args.resume}: the run's {flag.lstrip('-')} {old} is no longer there; give its new place: "
                 f"--resume {args.resume} {flag} NEW_PLACE")
        elif key == "model" and weights is not None:
            problem = dist.broadcast(model_changed(old, weights) if dist.rank() == 0 else None)
            if problem:
                fail(f"--resume {args.resume}: the run's model {old} is not what the run began with ({problem}); put "
                     f"the original back, or give its place: --resume {args.resume} --model PLACE")


def needed(key: str, value, args) -> bool:
    """Whether a resume reads this saved input from a local place (a hub id is not moved)."""
    if value is None or (key == "eval_data_dir" and not args.eval_every):
        return False
    if key == "dataset" and value.endswith(data.LOCAL_FORMS):
        return True
    return key == "eval_data_dir" or not flags.is_hub_id(value)


def place_problem(key: str, new: str | None) -> str | None:
    if new is None:
        return "a resume needs the place of the same files"
    if key == "dataset" and not os.path.isfile(new):
        return "no such file"
    if key == "eval_data_dir" and not os.path.isdir(new):
        return "no such folder"
    return None


def same_model(new: str, checkpoint: str, weights: dict | None) -> str | None:
    """Why a folder is not the run's base model moved, or None: its weights must match its own config, its config
    (all but what a save rewrites) and weight shapes those of the checkpoint's policy, and its weights the digests
    the run recorded (a run from before they were recorded: config and shapes alone, said in a line)."""
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
    if differ:
        return f"its config.json has another {differ[0]}"
    if weights is None:
        say(f"{new}: the run recorded no digests of its model's weights (it predates them): checked by its config "
            f"and weight shapes only")
        return None
    return dist.broadcast(weights_differ(new, weights, moved=True) if dist.rank() == 0 else None)


def check_data(args, saved: dict, recorded, read: dict, accept: bool) -> dict:
    """A resumed run's dataset and benchmark files as just read (read: fingerprints of the bytes parsed, or the hub
    revision loaded) against what the run recorded: a change, in the old place or a new one, is one line saying
    what changed and how to go on deliberately (--resume-changed-data: the data as it is now); with that flag, one
    line says what changed and the run goes on. Returns what the run records from now on."""
    recorded = recorded if isinstance(recorded, dict) else {}
    changes = [change for change in (dataset_change(args, saved, recorded, read), *benchmark_changes(
        args, saved, recorded, read)) if change]
    if changes and not accept:
        fail(f"--resume {args.resume}: {changes[0]}; put back (or give the place of) the data the run began with, or "
             f"pass --resume-changed-data to go on with the data as it is now")
    if changes:
        say(f"--resume {args.resume}: {'; '.join(changes)}: going on with it as it is now (--resume-changed-data)")
    return {**recorded, **read}


def dataset_change(args, saved: dict, recorded: dict, read: dict) -> str | None:
    """What changed in the dataset since the run began (its bytes' SHA-256, or a hub dataset's revision), or None."""
    moved, old = args.dataset != saved.get("dataset"), saved.get("dataset")
    for key, what in (("dataset", "another SHA-256"), ("dataset_revision", "revision")):
        then, now = recorded.get(key), read.get(key)
        if not (isinstance(then, str) and isinstance(now, str)) or then == now:
            continue
        if key == "dataset_revision":
            what = (f"at revision {now[:12]} (as the datasets library loads it here), the run began on {then[:12]} "
                    f"(with the hub in reach, a resume asks for that one)")
            return f"--dataset {args.dataset} is {what}" if moved else f"the run's dataset {args.dataset} is {what}"
        return (f"--dataset {args.dataset} is not where the run's dataset {old} moved to (its content differs "
                f"({what}))" if moved else f"the run's dataset {args.dataset} has changed since it began ({what} "
                                           f"than it recorded)")
    return None


def benchmark_changes(args, saved: dict, recorded: dict, read: dict) -> list[str]:
    """What changed in the benchmark files the run's evaluations read since it began, one entry per file."""
    then = recorded.get("eval_data_dir") if isinstance(recorded.get("eval_data_dir"), dict) else {}
    now = read.get("eval_data_dir") or {}
    moved, old = args.eval_data_dir != saved.get("eval_data_dir"), saved.get("eval_data_dir")
    folder = args.eval_data_dir or "the repository's data/benchmarks"
    changes = []
    for name, digest in sorted(then.items()):
        if name in now and now[name] != digest:
            changes.append(f"--eval-data-dir {args.eval_data_dir} is not where the run's eval-data-dir {old} moved to "
                           f"(its {name} differs (another SHA-256))" if moved else
                           f"the benchmark file {name} in {folder} has changed since the run began (another SHA-256 "
                           f"than it recorded)")
    return changes


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
    """{flag: (its value, the local paths a run opens through it)}: the model folder and each file of it (a loader
    reads its top level), the dataset file, the benchmark folder and the files an evaluation reads there."""
    reads = {}
    if os.path.isdir(args.model):
        files = [os.path.join(args.model, name) for name in os.listdir(args.model)]
        reads["--model"] = (args.model, [args.model, *(path for path in files if os.path.isfile(path))])
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


# ----------------------------------------------------------------------------------------------
# Where a run writes: --out's place, and every path free before the first write
# ----------------------------------------------------------------------------------------------
def is_run_folder(path: str) -> bool:
    """A folder some run wrote into (its lock, its metrics, a complete checkpoint), or a checkpoint itself."""
    names = ("metrics.jsonl", runfolder.LOCK, "trainer_state.pt")
    return any(os.path.isfile(os.path.join(path, name)) for name in names) \
        or bool(glob.glob(os.path.join(path, "checkpoint-*", "trainer_state.pt")))


def check_out(out: str, resuming: bool, prog: str = "remix"):
    """--out can be written, and is not inside another run's folder or checkpoint (a parent's --keep-last rotation
    would delete a run nested there). Nothing is created here."""
    path = os.path.abspath(out)
    for parent in list(_parents(path))[1:]:
        if os.path.isdir(parent) and is_run_folder(parent):
            fail(f"--out {out} is inside the run folder {parent}: choose a folder outside it", prog)
    existing = next(p for p in _parents(path) if os.path.exists(p))
    if not os.path.isdir(existing):
        fail(f"--out {out} is under {existing}, which is a file, not a folder", prog)
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"--out {out}: {existing} is not writable", prog)


def _parents(path: str):
    """path, then each folder above it, up to the root."""
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def check_writes(out: str, planned: list[tuple], prog: str = "remix"):
    """Before a job writes anything (a resumed run: before its step 1), each path it will write under out is free
    for it, or one line names the first that is not. planned: (path relative to out, kind[, names a library's own
    links may have]), kind one of "folder" (written into), "tree" (a folder a library writes into by name:
    check_tree), "file" (written whole, aside and renamed over: a link there is replaced), "append" (appended to),
    "replaced" (a folder renamed over whatever is there: a link or an older folder). In the way: a link on the way
    or at a folder or appended file (Linked: never followed), a file or other non-folder where a folder goes, a
    folder where a file is written whole, anything but a regular file where one is appended to, a link inside a
    library's folder. Absent paths are free; nothing is created."""
    for path, kind, *allowed in planned:
        problem = _in_the_way(out, path, kind, *allowed)
        if problem:
            fail(problem, prog)


def _in_the_way(out: str, path: str, kind: str, allowed: tuple = ()) -> str | None:
    parts = path.split(os.sep)
    for depth in range(1, len(parts) + 1):
        place = os.path.join(out, *parts[:depth])
        try:
            mode = os.lstat(place).st_mode
        except FileNotFoundError:
            return None
        last = depth == len(parts)
        if stat.S_ISLNK(mode) and not (last and kind in ("file", "replaced")):
            return str(runfolder.Linked(place))
        folder_there = not last or kind in ("folder", "tree", "replaced")
        if folder_there and not stat.S_ISDIR(mode) and not stat.S_ISLNK(mode):
            what = "is a file, not a folder" if stat.S_ISREG(mode) else "is not a folder (a FIFO, socket or device)"
            return f"{place} {what}, and the run writes a folder there: move it away"
        if last and kind == "file" and stat.S_ISDIR(mode):
            return f"{place} is a folder, and the run writes a file there: move it away"
        if last and kind == "append" and not stat.S_ISREG(mode):
            return f"{place} is not a regular file, and the run appends to it: move it away"
    if kind == "tree":
        try:
            runfolder.no_links_inside(os.path.join(out, path), allowed)
        except runfolder.Linked as linked:
            return str(linked)
    return None
