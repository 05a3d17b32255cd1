"""Plumbing for remix.py that is not the method: clear errors, reading datasets, a process pool with a
hard deadline per task (for the grader), and checkpoints that survive a crash and resume a run exactly.
"""

import atexit
import glob
import json
import multiprocessing
import os
import random
import re
import shutil
import sys

import numpy as np
import torch


def fail(message: str, prog: str = "remix"):
    """Bad input: one clear line on stderr and a non-zero exit, no traceback."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_model_path(model: str, prog: str = "remix"):
    """A path that is clearly local (hub ids look like org/name) must exist."""
    if (model.startswith((".", "/", "~")) or model.count("/") > 1) and not os.path.isdir(model):
        fail(f"model folder {model!r} does not exist; pass a local folder or a hub id", prog)


def load_problems(path: str, problem_key: str, answer_key: str) -> list[tuple[str, str]]:
    """(problem, answer) pairs from a hub dataset or a local .jsonl/.json/.parquet file."""
    if path.endswith((".jsonl", ".json", ".parquet")):
        if not os.path.isfile(path):
            fail(f"dataset file {path!r} does not exist; pass an existing .jsonl/.json/.parquet or a hub id")
        if os.path.getsize(path) == 0:
            fail(f"dataset file {path!r} is empty")
        if path.endswith(".parquet"):
            import pandas as pd

            rows = pd.read_parquet(path).to_dict("records")
        else:
            rows = read_json_rows(path)
    else:
        import datasets

        try:
            rows = list(datasets.load_dataset(path, split="train"))
        except Exception as error:
            fail(f"cannot load dataset {path!r} from the hub: {str(error).splitlines()[0] if str(error) else error!r}")
    columns = sorted(rows[0]) if rows else []
    if not rows or any(key not in row for row in rows for key in (problem_key, answer_key)):
        fail(f"dataset {path!r} has {len(rows)} rows with the columns {columns}; every row needs {problem_key!r} and "
             f"{answer_key!r} (set --problem-key/--answer-key)")
    return [(str(row[problem_key]), str(row[answer_key])) for row in rows]


def read_json_rows(path: str) -> list[dict]:
    """A JSON list of objects, or JSONL; a broken line is named."""
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            fail(f"dataset file {path!r} is not valid JSON: {error}")
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                fail(f"cannot read dataset {path!r}: line {number} is not valid JSON ({error})")
    return rows


# ----------------------------------------------------------------------------------------------
# A process pool with a deadline per task
# ----------------------------------------------------------------------------------------------
_pool = None


def map_with_deadline(fn, items: list[tuple], workers: int, timeout: float, on_timeout, warm=None, warm_args=()):
    """[fn(*item) for item in items] in spawned worker processes. A task still running `timeout` seconds
    after its turn came gets `on_timeout`; the pool is then killed (the only way to stop code stuck in C)
    and the tasks not yet done go to a fresh one. The pool is kept between calls. warm(*warm_args) runs in
    each new worker before any deadline starts, so slow first imports never count as a timeout."""
    global _pool
    results: list = [None] * len(items)
    done = [False] * len(items)
    todo = list(range(len(items)))
    while todo:
        if _pool is None:  # spawn: never fork a process that holds vLLM's and torch's threads
            _pool = multiprocessing.get_context("spawn").Pool(workers, initializer=warm, initargs=warm_args)
            atexit.register(_pool.terminate)
            try:  # workers up before any deadline starts
                _pool.map_async(abs, range(4 * workers), chunksize=1).get(timeout=300)
            except multiprocessing.TimeoutError:
                fail("the grader's worker processes did not start; a script that calls remix must guard its "
                     "entry point with `if __name__ == \"__main__\":` (multiprocessing's spawn start method)")
        jobs = [(i, _pool.apply_async(fn, items[i])) for i in todo]
        todo = []
        for position, (i, job) in enumerate(jobs):
            try:
                results[i], done[i] = job.get(timeout=timeout), True
            except multiprocessing.TimeoutError:
                results[i], done[i] = on_timeout, True
                for j, other in jobs[position + 1 :]:
                    if other.ready():
                        results[j], done[j] = other.get(), True
                todo = [j for j, _ in jobs[position + 1 :] if not done[j]]
                close_pool()
                break
    return results


def close_pool():
    """Kill the worker processes (code stuck in C only stops this way); the next call starts fresh ones."""
    global _pool
    if _pool is not None:
        _pool.terminate()
        _pool = None


# ----------------------------------------------------------------------------------------------
# Checkpoints: written atomically, rotated, and holding everything a resumed run needs
# ----------------------------------------------------------------------------------------------
def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out: str, step: int, policy, tokenizer, critic, reference, trainer_state: dict,
                    keep_last: int) -> str:
    """OUT/checkpoint-STEP: the policy and tokenizer at the top (a plain transformers/vLLM model folder),
    critic/ (PPO), reference/ (after reincarnation) and trainer_state.pt. Written into a temporary folder
    and renamed, so a crash never leaves half a checkpoint; only the newest `keep_last` are kept."""
    final = os.path.join(out, f"checkpoint-{step}")
    tmp = os.path.join(out, f".tmp-checkpoint-{step}")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name, model in (("critic", critic), ("reference", reference)):
        if model is not None:
            model.save_pretrained(os.path.join(tmp, name))
    torch.save({**trainer_state, "rng": rng_state()}, os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if keep_last > 0:
        for old in checkpoints(out)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoints(out: str) -> list[str]:
    """Complete checkpoints of a run folder, oldest first."""
    found = [p for p in glob.glob(os.path.join(out, "checkpoint-*")) if re.fullmatch(r"checkpoint-\d+", os.path.basename(p))
             and os.path.isfile(os.path.join(p, "trainer_state.pt"))]
    return sorted(found, key=lambda p: int(p.rsplit("-", 1)[1]))


def load_trainer_state(out: str) -> tuple[str, dict]:
    """The newest checkpoint of a run folder and its trainer state, for --resume."""
    if not os.path.isdir(out):
        fail(f"--resume {out!r}: no such run folder")
    found = checkpoints(out)
    if not found:
        fail(f"--resume {out!r}: the folder holds no complete checkpoint-STEP/ with a trainer_state.pt")
    return found[-1], torch.load(os.path.join(found[-1], "trainer_state.pt"), weights_only=False)
