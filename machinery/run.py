"""The run: every flag checked up front, the hub and the output folder (and its lock), the logs and metrics, the
interrupts, the guard against non-finite updates, and the Session that ties them to remix.train(). A reader of the
method may skip this module: it decides nothing about what is computed.
"""

import collections
import dataclasses
import fcntl
import glob
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import time
from urllib.parse import urlparse

import numpy as np
import torch

from machinery import dist, startup


# ----------------------------------------------------------------------------------------------
# One clear line
# ----------------------------------------------------------------------------------------------
def fail(message: str, prog: str = "remix"):
    """Bad input: one clear line on stderr (from the first process only) and exit code 2, no traceback."""
    say(f"error: {message}", prog, sys.stderr)
    raise SystemExit(2)


def say(message: str, prog: str = "remix", stream=None):
    """One line on stdout (or stream), from the first process only, on a line of its own beside a progress bar."""
    if dist.rank() == 0:
        from tqdm.auto import tqdm

        tqdm.write(f"{prog}: {message}", file=stream or sys.stdout)
        (stream or sys.stdout).flush()


# ----------------------------------------------------------------------------------------------
# Flags: one table of ranges, the combinations, the hub
# ----------------------------------------------------------------------------------------------
# Each numeric flag's range, as its --help says it (a test checks that every numeric field of Args has one, and
# that its docstring states it). Floats must also be finite.
RANGES = {
    "steps": ">= 1", "prompts_per_step": ">= 1", "group_size": ">= 1", "off_policy_p": "in [0, 1)", "window": ">= 1",
    "utd": ">= 1", "reincarnate_step": ">= 0", "kl_convex_start": ">= 0", "kl_convex_every": ">= 1",
    "kl_beta": ">= 0", "ent_coef": ">= 0", "clip_eps": "in (0, 1)", "value_clip": "> 0", "vtrace_c_bar": "> 0",
    "gamma": "in (0, 1]", "gae_lambda": "in [0, 1]", "actor_lr": "> 0", "critic_lr": "> 0", "weight_decay": ">= 0",
    "max_grad_norm": "> 0", "mini_batch_prompts": ">= 1", "temperature": "> 0", "top_p": "in (0, 1]",
    "max_prompt_tokens": ">= 1", "max_response_tokens": ">= 1", "sampler_is_cap": "> 0",
    "max_tokens_per_micro_batch": ">= 1", "vllm_gpu_memory_utilization": "in (0, 1)", "vllm_tp": ">= 1",
    "grader_workers": ">= 1", "grade_timeout": "> 0", "seed": "in [0, 2147483647]", "dist_timeout": "> 0",
    "save_every": ">= 0", "keep_last": ">= 0", "eval_every": ">= 0", "eval_limit": ">= 1", "eval_max_tokens": ">= 1",
    "log_completions": ">= 0",
}


def within(value, bound: str) -> bool:
    """Whether value satisfies a range written as '>= 1', '> 0', 'in [0, 1)', 'in (0, 1]', ..."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if bound.startswith(">="):
        return value >= float(bound[2:])
    if bound.startswith(">"):
        return value > float(bound[1:])
    lo, hi = (float(x) for x in bound[4:-1].split(","))
    return (lo <= value if bound[3] == "[" else lo < value) and (value <= hi if bound[-1] == "]" else value < hi)


def check_ranges(args, ranges: dict, prog: str = "remix"):
    """Every numeric flag in its range: the first that is not gets one line."""
    for name, bound in ranges.items():
        value = getattr(args, name)
        if value is not None and not within(value, bound):
            fail(f"--{name.replace('_', '-')} must be {bound}, got {value}", prog)


def check_args(args):
    """Every flag's range, then every impossible combination, each with one line saying what to change."""
    check_ranges(args, RANGES)
    n_fresh = round((1.0 - args.off_policy_p) * args.prompts_per_step)
    n_history, ranks = args.prompts_per_step - n_fresh, dist.world()
    checks = [(args.off_policy_p == 0 or 1 <= n_history < args.prompts_per_step,
               f"--prompts-per-step {args.prompts_per_step} cannot split into whole fresh and historical groups at "
               f"--off-policy-p {args.off_policy_p}: raise --prompts-per-step"),
              (args.algo == "ppo" or args.group_size >= 2, "--algo grpo needs --group-size >= 2 (a group of one "
                                                           "always has advantage 0)"),
              (n_fresh % ranks == 0 and n_history % ranks == 0 and args.prompts_per_step % ranks == 0,
               f"--prompts-per-step {args.prompts_per_step} ({n_fresh} fresh + {n_history} historical at p = "
               f"{args.off_policy_p}) cannot split into whole groups over {ranks} processes: make each a multiple "
               f"of {ranks}"),
              (ranks % args.vllm_tp == 0, f"--vllm-tp {args.vllm_tp} must divide the {ranks} processes"),
              (args.sampler_is_cap is None or args.sampler == "vllm",
               "--sampler-is-cap needs --sampler vllm (the sampler's log-probs come from vLLM)"),
              (not args.track or importlib.util.find_spec("wandb") is not None,
               "--track logs to wandb, which is not installed (it is no dependency): pip install wandb")]
    for ok, message in checks:
        if not ok:
            fail(message)


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


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def offline_hint() -> str:
    return " (HF_HUB_OFFLINE is set: only the local cache is read; pass a local path)" if offline() else ""


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


# ----------------------------------------------------------------------------------------------
# The run folder: where it may be, its lock, refusing to clobber a run
# ----------------------------------------------------------------------------------------------
LOCK = ".remix.lock"  # held by the run in the folder (fcntl), released when its process ends
RUN_FILES = ("metrics.jsonl", "completions.jsonl", "tb", "eval", "checkpoint-*", ".tmp-checkpoint-*")


def is_run_folder(path: str) -> bool:
    """A folder some run wrote into (its lock, its metrics, a complete checkpoint), or a checkpoint itself."""
    return any(os.path.isfile(os.path.join(path, name)) for name in ("metrics.jsonl", LOCK, "trainer_state.pt")) \
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


_locks: list = []  # open lock files: a lock lasts as long as the process, however it ends


def lock(out: str, prog: str = "remix"):
    """Create --out and hold an exclusive lock on OUT/.remix.lock for the whole run (the kernel releases it when the
    process dies, however it dies): a second run, or a resume, of a folder in use is refused with one line."""
    error = None
    held = os.path.isdir(out) and any(os.path.samefile(os.path.dirname(h.name), out) for h in _locks)
    if dist.rank() == 0 and not held:
        try:
            os.makedirs(out, exist_ok=True)
            handle = open(os.path.join(out, LOCK), "a+")
        except OSError as caught:
            error = f"cannot create --out {out}: {caught.strerror}"
        else:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                handle.seek(0)
                handle.truncate()
                handle.write(f"{socket.gethostname()} {os.getpid()}\n")
                handle.flush()
                _locks.append(handle)
            except OSError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                error = f"--out {out} is in use by a running job ({holder}); wait for it to end, or choose another --out"
    error = dist.broadcast(error)
    if error:
        fail(error, prog)


def unlock():
    while _locks:
        _locks.pop().close()


def prepare_out(out: str, overwrite: bool):
    """A new run never silently replaces an old one's logs and checkpoints (--overwrite removes them first)."""
    found = [p for pattern in RUN_FILES for p in glob.glob(os.path.join(out, pattern))]
    if found and not overwrite:
        fail(f"--out {out} already holds a run ({os.path.basename(sorted(found)[0])}, ...): continue it with "
             f"--resume {out}, choose a new --out, or pass --overwrite to replace it")
    dist.barrier()
    if dist.rank() == 0:
        for path in found:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    dist.barrier()


# ----------------------------------------------------------------------------------------------
# Logs: metrics.jsonl, TensorBoard, wandb; completions.jsonl
# ----------------------------------------------------------------------------------------------
def read_jsonl_upto(path: str, done: int) -> list[str]:
    """The lines of a log whose step is at most done; a partial last line (a crash mid-write) is dropped."""
    kept = []
    if not os.path.exists(path):
        return kept
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= done:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (json.JSONDecodeError, KeyError, TypeError):
                say(f"{path}: dropped an unreadable line (a write cut short)")
    return kept


class RunLog:
    """metrics.jsonl (one JSON object per step), completions.jsonl, TensorBoard and, with --track, wandb; on the
    first process only. A resumed run keeps the steps up to its checkpoint and drops any logged after it."""

    def __init__(self, out: str, config: dict, done: int, track: bool):
        self.active, self.out = dist.rank() == 0, out
        if not self.active:
            return
        self.files = {}
        for name in ("metrics", "completions"):
            path = os.path.join(out, f"{name}.jsonl")
            kept = read_jsonl_upto(path, done) if done else []
            self.files[name] = open(path, "w")
            self.files[name].writelines(kept)
            self.files[name].flush()
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
        self.files["metrics"].write(json.dumps(record) + "\n")
        self.files["metrics"].flush()
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step":
                self.writer.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])

    def completions(self, step: int, rows: list[dict]):
        if not self.active or not rows:
            return
        self.files["completions"].writelines(json.dumps(row) + "\n" for row in rows)
        self.files["completions"].flush()
        self.writer.add_text("completions", "\n\n".join(
            f"**step {r['step']}, reward {r['reward']}, age {r['age']}**\n\n    {r['response'][:2000]}" for r in rows), step)
        if self.wandb is not None:
            columns = list(rows[0])
            self.wandb.log({"completions": self.wandb.Table(columns=columns, data=[[json.dumps(r[c]) if isinstance(
                r[c], (dict, list)) else r[c] for c in columns] for r in rows])}, step=step)

    def close(self):
        if self.active:
            for f in self.files.values():
                f.close()
            self.writer.close()


def completion_rows(step: int, batch: list[dict], tokenizer, n: int, final_answer) -> list[dict]:
    """n of the step's responses, spread over the batch (fresh ones first, then historical), as records to read:
    the text, its reward and parts, the grader's status and the answer it extracted, the policy version that
    sampled it and its age (0 when fresh), its length and whether it was cut at the limit."""
    if n <= 0 or not batch:
        return []
    picked = [batch[round(i * (len(batch) - 1) / max(n - 1, 1))] for i in range(min(n, len(batch)))]
    rows = []
    for s in {id(s): s for s in picked}.values():  # each once
        response = tokenizer.decode(s["response_ids"], skip_special_tokens=True)
        rows.append({"step": step, "historical": s["version"] < step, "version": s["version"],
                     "age": step - s["version"], "prompt": tokenizer.decode(s["prompt_ids"], skip_special_tokens=True),
                     "response": response, "answer": s["answer"], "extracted": final_answer(response),
                     "reward": s["reward"], "reward_parts": s.get("reward_parts", {}), "status": s.get("status"),
                     "length": len(s["response_ids"]), "truncated": s["truncated"]})
    return rows


# ----------------------------------------------------------------------------------------------
# The step's metrics record, over the samples of every rank (docs/metrics.md)
# ----------------------------------------------------------------------------------------------
def step_metrics(step: int, fresh: list[dict], history: list[dict], adv: dict, stats: dict, args) -> dict:
    """Each rank condenses its samples into sums and lists; rank-order concatenation and sums combine them."""
    n, mask, group_size, c_bar = len(fresh), adv["mask"], args.group_size, args.vtrace_c_bar
    log_ratio = adv["log_ratio"][n:][mask[n:]]  # [historical tokens] log(pi_k / mu)
    abs_adv = adv["advantages"].abs()
    raw = {"reward": [s["reward"] for s in fresh], "reward_parts": [s.get("reward_parts", {}) for s in fresh],
           "length": [len(s["response_ids"]) for s in fresh],
           "truncated": [s["truncated"] for s in fresh], "reflects": [s["reflects"] for s in fresh],
           "group_std": [float(np.std([s["reward"] for s in fresh[i : i + group_size]], ddof=1))
                         for i in range(0, n, group_size)] if group_size > 1 else [],
           "grader": [s.get("status", "ok") for s in fresh], "age": [step - s["version"] for s in history],
           "ratio_min": [log_ratio.min().exp().item()] if len(log_ratio) else [],
           "ratio_max": [log_ratio.max().exp().item()] if len(log_ratio) else [],
           "trace_prod": adv["trace_c"][n:].log().sum(-1).exp().tolist()}  # prod of c over each historical response
    sums = {"log_ratio": [log_ratio.sum().item(), (log_ratio ** 2).sum().item(), log_ratio.exp().sum().item(),
                          (log_ratio.exp() > c_bar).sum().item(), len(log_ratio)],
            "adv": [abs_adv[n:][mask[n:]].sum().item(), mask[n:].sum().item(), abs_adv[:n][mask[:n]].sum().item(),
                    mask[:n].sum().item()],
            "work": [dist.padding["tokens"], dist.padding["slots"]]}
    mismatch = sampler_mismatch(fresh)
    sums["mismatch"], raw["mismatch_max"] = mismatch[:-1], [mismatch[-1]]
    dist.padding.clear()
    every = dist.all_gather((raw, sums))
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
        "offpolicy/log_ratio_mean": lr_mean,
        "offpolicy/log_ratio_std": math.sqrt(max(lr_sq / max(count, 1) - lr_mean ** 2, 0.0)),
        "offpolicy/trace_truncated": cut / count if count else 0.0,
        "offpolicy/adv_scale": (hist_adv / hist_tokens) / max(fresh_adv / fresh_tokens, 1e-12) if hist_tokens else 1.0,
        "offpolicy/trace_prod_mean": mean(merged["trace_prod"], 1.0),
        "replay/mean_age": mean(merged["age"]),
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
    of the correction weights, the token count, and the largest |log r|, last (not summed over ranks)."""
    pairs = [(s["behaviour_logp"], s["sampler_logp"], s.get("sampler_weight")) for s in fresh
             if s.get("sampler_logp") is not None]
    if not pairs:
        return [0.0] * 6
    log_r = torch.cat([trainer - sampler for trainer, sampler, _ in pairs]).double()  # [fresh tokens], fp64 for r-1-log r
    weights = torch.cat([w if w is not None else torch.ones_like(t) for t, _, w in pairs])  # [fresh tokens]
    return [log_r.abs().sum().item(), (log_r.exp() - 1 - log_r).sum().item(),
            (log_r.abs() > math.log(2)).sum().item(), weights.sum().item(), float(len(log_r)), log_r.abs().max().item()]


# ----------------------------------------------------------------------------------------------
# The guard against non-finite updates
# ----------------------------------------------------------------------------------------------
_guard = {"in_a_row": 0, "out": ""}


def finite_update(terms: dict, norms: list[float], stats: dict, step: int) -> bool:
    """The end of a mini-batch: its logged terms summed over the ranks and kept in stats with the gradient norm,
    if the loss and every gradient are finite. Otherwise the optimizer step is skipped (one line on stderr,
    train/skipped_updates), and three skipped in a row stop the run."""
    values = dist.all_reduce(torch.tensor(list(terms.values()), dtype=torch.float64))
    if not torch.isfinite(values).all() or not all(map(math.isfinite, norms)):
        _guard["in_a_row"] += 1
        stats["train/skipped_updates"].append(1)
        say(f"step {step}: non-finite loss or gradient, update skipped", stream=sys.stderr)
        if _guard["in_a_row"] >= 3:
            fail(f"3 non-finite updates in a row at step {step}; stopping. The last good checkpoint is the newest "
                 f"checkpoint-* in {_guard['out']}")
        return False
    _guard["in_a_row"] = 0
    for name, value in zip(terms, values.tolist()):
        stats[name].append(value)
    stats["losses/grad_norm"].append(norms[0])
    stats["train/optimizer_steps"].append(1)
    return True


# ----------------------------------------------------------------------------------------------
# Interrupts: Ctrl-C, SIGTERM (a scheduler's preemption), SIGHUP (a closed terminal)
# ----------------------------------------------------------------------------------------------
_interrupt = {"seen": None}


def catch_interrupts():
    """Each of the three signals raises KeyboardInterrupt as Ctrl-C does, and is remembered: Python drops an
    exception raised inside a __del__ (a garbage-collected object's finaliser), so the loop checks between steps."""
    def handler(signum, frame):
        _interrupt["seen"] = signum
        raise KeyboardInterrupt

    def unraisable(report, default=sys.unraisablehook):  # "Exception ignored in ...": remembered, not printed
        if not isinstance(report.exc_value, KeyboardInterrupt):
            default(report)

    for signum in startup.EXIT_CODES:
        signal.signal(signum, handler)
    sys.unraisablehook = unraisable


def interrupted() -> bool:
    return _interrupt["seen"] is not None


def from_signal(error: BaseException) -> bool:
    """Whether an error is a signal's: Ctrl-C itself, or what the code the signal landed in made of it."""
    return isinstance(error, KeyboardInterrupt) or interrupted()


def check_interrupted():
    if _interrupt["seen"] is not None:
        raise KeyboardInterrupt


class Stopped(KeyboardInterrupt):
    """A signal that ended a program, with the one line that says what is kept and how to continue."""

    def __init__(self, line: str):
        self.line = line
        super().__init__(line)


class Interrupted(Stopped):
    """A signal during a training run: the step, the last checkpoint, and how to continue."""

    def __init__(self, step: int, out: str):
        from machinery import checkpoints

        found = checkpoints.complete(out)
        what = startup.NAMES[_interrupt["seen"] or signal.SIGINT]
        super().__init__(f"{what} at step {step}; the last checkpoint is {found[-1] if found else 'none yet'}; "
                         + (f"continue with --resume {out}" if found else "nothing to resume"))


def main(program, prog: str = "remix"):
    """A program's entry (remix.py, eval.py): program(), then a clean exit; a signal ends it with one line and the
    signal's exit code (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP), with no traceback and no worker left."""
    from machinery import grader

    try:
        result = program()
    except BaseException as interrupt:  # what breaks after a signal (code that wraps it in its own error) is the signal
        if not from_signal(interrupt):
            raise
        grader.close_pool()
        signum = _interrupt["seen"] or signal.SIGINT
        if dist.rank() == 0:
            line = getattr(interrupt, "line", None) or f"{startup.NAMES[signum]} while starting; nothing to resume"
            print(f"\n{prog}: {line}", file=sys.stderr, flush=True)
        os._exit(startup.EXIT_CODES[signum])
    grader.close_pool()
    dist.finish(result.get("llm") if isinstance(result, dict) else None)


# ----------------------------------------------------------------------------------------------
# The session: everything train() does around the method
# ----------------------------------------------------------------------------------------------
class Session:
    """train()'s companion. Construction checks everything that can be checked before a file is written (flags,
    model path and hub, data, prompt lengths, benchmarks, --out) and then locks --out; restore() puts a resumed
    run's state back; `with session:` turns a signal into one line; steps() yields the steps to run, and
    end_step() logs, evaluates and saves."""

    def __init__(self, args, finalize):
        from machinery import checkpoints, data, evaluation

        catch_interrupts()
        if not within(args.dist_timeout, RANGES["dist_timeout"]):
            fail(f"--dist-timeout must be {RANGES['dist_timeout']}, got {args.dist_timeout}")
        dist.init(args.dist_timeout)
        if "LOCAL_RANK" in os.environ and "RANK" not in os.environ and torch.cuda.is_available():
            say("LOCAL_RANK is set without RANK (not torchrun): this one process uses GPU 0; pick another with "
                "CUDA_VISIBLE_DEVICES")
        self.checkpoint, self.state, self.optim_state = None, None, None
        if args.resume:  # the run's saved arguments and newest readable checkpoint; --steps may extend it
            if os.path.isdir(args.resume):
                lock(args.resume)  # first: a folder another job writes into is not read
            self.checkpoint, self.state, self.optim_state = checkpoints.latest(args.resume)
            done = self.state["progress"]["step"]
            args = checkpoints.resume_args(args, self.state["args"], done)
            if done >= args.steps:  # nothing to do: say so, exit 0
                say(f"{args.out} has finished all {args.steps} steps; give --resume a larger --steps to extend it")
                raise SystemExit(0)
        self.args = args = finalize(args)
        check_args(args)
        _guard.update(in_a_row=self.state["progress"].get("bad_updates", 0) if self.state else 0, out=args.out)
        check_model_path(args.model)  # then everything that needs the hub, in seconds
        check_hub({f"--{k}": getattr(args, k) for k in ("model", "dataset") if is_hub_id(getattr(args, k))
                   and not getattr(args, k).endswith((".jsonl", ".json", ".parquet"))})
        self.problems = data.load_problems(args.dataset, args.problem_key, args.answer_key)
        self.tokenizer = load_tokenizer(self.checkpoint or args.model)
        self.method = sys.modules[finalize.__module__]  # remix.py (or a fork of it), as it runs
        self.encode = lambda problem: self.method.build_prompt(self.tokenizer, problem, args.prompt_suffix,
                                                               args.system_prompt)
        if not self.tokenizer.chat_template:
            say(f"{args.model} has no chat template: prompts are the problem and --prompt-suffix as plain text")
        data.first_fitting_prompt(self.problems, self.encode, args.max_prompt_tokens)
        self.benchmarks = evaluation.load_benchmarks(args.eval_benchmarks, args.eval_data_dir, args.eval_limit) \
            if args.eval_every else []
        longest = max((len(self.encode(p["problem"])) for p in self.benchmarks), default=0)
        self.max_model_len = max(args.max_prompt_tokens, longest) + max(args.max_response_tokens,
                                                                       args.eval_max_tokens or 0)
        check_out(args.out, bool(args.resume))
        lock(args.out)
        if not args.resume:
            prepare_out(args.out, args.overwrite)
        torch.manual_seed(args.seed)  # the critic's new head starts alike on every rank

    def restore(self, policy, reference, critic, optimizers: list, replay, llm):
        """The models, optimizers, deque and RNGs of a resumed run (its weights were loaded from the checkpoint);
        then the logs, the prompt stream and the progress bar."""
        from tqdm.auto import tqdm

        from machinery import checkpoints, data, engines

        args = self.args
        self.models = {"policy": policy, "critic": critic, "reference": reference}
        self.optimizers = dict(zip(["policy", "critic"][: len(optimizers)], optimizers))
        self.replay, self.llm = replay, llm
        for seed_fn in (np.random.seed, torch.manual_seed):  # after vLLM's start, which reseeds
            seed_fn(args.seed + dist.rank())
        import random

        random.seed(args.seed + dist.rank())
        self.progress = {"step": 0, "rollouts": 0, "tokens": 0, "data_position": 0}
        if self.state is not None:
            for name, optim in self.optimizers.items():
                checkpoints.load_optimizer_shard(self.models[name], optim, self.optim_state[name])
            replay.extend(self.state["replay"])
            self.progress = {k: v for k, v in self.state["progress"].items() if k != "bad_updates"}
            checkpoints.set_rng_state(self.state["rng"])
            if llm is not None:
                engines.push_weights(llm, policy, args.vllm_sleep)  # the engine started from the base weights
            say(f"resuming {args.out} after step {self.progress['step']} from {self.checkpoint}")
        args.vllm_sleep = args.vllm_sleep and dist.device().type == "cuda"  # the CPU engine has no sleep mode
        self.log = RunLog(args.out, dataclasses.asdict(args), self.progress["step"], args.track)
        self.prompts = data.prompt_stream(self.problems, self.encode, args.max_prompt_tokens, args.seed,
                                          self.progress["data_position"])
        self.bar = tqdm(total=args.steps, initial=self.progress["step"], desc="remix", dynamic_ncols=True,
                        disable=dist.rank() != 0)
        self.step, self.laps, self.clock = self.progress["step"], {}, time.perf_counter()

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        self.bar.close()
        self.log.close()
        if error is not None and from_signal(error):
            from machinery import grader  # what breaks after a signal (a writer wraps it in its own error) is the signal

            grader.close_pool()
            raise Interrupted(self.step, self.args.out) from None
        return False

    def steps(self):
        """The steps still to run, after the evaluation at step 0 (a new run with --eval-every)."""
        if self.args.eval_every and self.progress["step"] == 0:
            self.log.write({"step": 0, **self.evaluate(0), "rollouts/total": 0, "rollouts/generated_tokens": 0})
        for step in range(self.progress["step"] + 1, self.args.steps + 1):
            check_interrupted()
            self.step, self.laps, self.clock, self.started = step, {}, time.perf_counter(), time.perf_counter()
            yield step
        check_interrupted()

    def next_prompts(self, n: int) -> list:
        prompts = [next(self.prompts) for _ in range(n)]
        self.progress["data_position"] = prompts[-1].position  # problems consumed, for --resume
        return prompts

    def lap(self, name: str):
        """Seconds since the last lap (or the step's start), recorded under name."""
        now = time.perf_counter()
        self.laps[name], self.clock = now - self.clock, now

    def evaluate(self, step: int) -> dict:
        """The evaluation's eval/* entries, and its seconds as perf/eval_s."""
        from machinery import evaluation

        start = time.perf_counter()
        return {**evaluation.during_training(self, step), "perf/eval_s": time.perf_counter() - start}

    def end_step(self, record: dict, fresh: list[dict], history: list[dict], on_step=None):
        """The step's record completed (rollouts, timings, an evaluation when due), handed to on_step(step, record,
        policy, tokenizer, batch) if given, and written with a few of its completions; what the next step recomputes
        (pi_k, values, advantages) dropped from the samples, which the deque keeps; a checkpoint when due."""
        from machinery import checkpoints

        args, step = self.args, record["step"]
        gen, trainer, sync = dist.all_reduce(torch.tensor([self.laps.get(k, 0.0) for k in ("gen", "trainer",
                                                                                          "weight_sync")]), "max").tolist()
        self.progress["rollouts"] += record["batch/fresh"]
        self.progress["tokens"] += round(record["response/length_mean"] * record["batch/fresh"])
        record.update({"rollouts/total": self.progress["rollouts"], "rollouts/generated_tokens": self.progress["tokens"],
                       "perf/gen_tokens_per_s": record["response/length_mean"] * record["batch/fresh"] / max(gen, 1e-9),
                       "perf/update_s": trainer, "perf/weight_sync_s": sync})
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            record.update(self.evaluate(step))
        record["perf/step_s"] = time.perf_counter() - self.started
        if on_step is not None:
            on_step(step, record, self.models["policy"], self.tokenizer, fresh + history)
        for sample in fresh + history:
            for key in ("prox_logp", "values", "advantages", "value_targets"):
                sample.pop(key, None)
        self.log.write(record)
        self.log.completions(step, completion_rows(step, fresh + history, self.tokenizer, args.log_completions,
                                                   self.method.final_answer))
        self.bar.set_postfix(reward=f"{record['reward/mean']:.3f}", rollouts=self.progress["rollouts"],
                             phase=record["phase"], refresh=False)
        self.bar.update(1)
        self.progress["step"] = step
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            reincarnated = args.reincarnation and step >= args.reincarnate_step
            checkpoints.save(args.out, step, {**self.models, "reference": self.models["reference"] if reincarnated
                                              else None}, self.tokenizer, self.optimizers,
                             {"args": dataclasses.asdict(args), "replay": list(self.replay),
                              "progress": {**self.progress, "bad_updates": _guard["in_a_row"]}}, args.keep_last)


def load_tokenizer(source: str, prog: str = "remix"):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:  # a folder without a model: OSError, or ValueError from the tokenizer
        fail(f"cannot load model {source!r}: {str(error).splitlines()[0]}{offline_hint()}", prog)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
