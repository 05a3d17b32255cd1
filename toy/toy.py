"""The paper's claim in miniature, on a CPU: when does ReMix save rollouts on a toy task, and why.

    pip install -r requirements-toy.txt && pip uninstall -y torchvision torchaudio torchcodec
    python toy/toy.py            # the short run: about 20 minutes on 2 idle cores
    python toy/toy.py --study    # the study of docs/toy: 200 runs, about 3 hours on 2 cores
    python toy/toy.py --out docs/toy --replot   # the tables and plots again from the committed results.json
    python toy/toy.py --pin docs/toy/pinned_curve.json   # the short run tests/test_toy.py compares bit for bit
    python toy/toy.py --method remix_mine.py   # a fork beside remix.py: about 10 minutes on 2 idle cores
    python toy/toy.py --method remix_mine.py --method-args="--my-flag 0.3"   # with flags of its own, for its runs
    python toy/toy.py --forks --out runs/forks   # every fork of docs/forks against remix.py: forks.md

The toy: "What is 3 + 5 + 8 + 2?" for 3 to 5 digits, graded by remix.py's answer check (report.grade_many).
The base model is a tiny Qwen2 (hidden 128, 2 layers, byte-level tokenizer plus one token for the fixed
instruction) trained by supervised learning on two answer styles: a quarter of the targets work the running sums
out before the box ('3+5=8 8+8=16 16+2=18 \\boxed{18}', up to 42 tokens), the rest give the bare '\\boxed{18}'
(about 11). So response length can move either way under RL. 4,000 training and 1,000 held-out problems. Every
run is the real remix.train loop (transformers sampler), with held-out Pass@1 (one sample per problem at
temperature 1, from a fixed seed on a forked RNG) every --eval-every steps. The paper's time axis is scaled by
about 1/8: 24 steps, reincarnation at T = 12, lambda(t) falling after step T/3 by 0.1 every 2 steps. GRPO runs 8
prompts x 8, PPO 64 prompts x 1. The on-policy baselines are remix.py's --on-policy: p = 0, m = 1, no
reincarnation, KL to the base model only.

The short run trains the four headline configurations and three ablations at one lr, then times TRL's
GRPOTrainer against remix.py. The study:
  1. lr sweep: ReMix-GRPO, GRPO, ReMix-PPO and PPO at actor lr 1e-5, 3e-5, 1e-4 and 3e-4, 5 seeds each;
  2. at each method's best lr (highest median final accuracy): on-policy at 2x and 4x ReMix's best lr (does a
     larger on-policy step buy the same saving?), ReMix-GRPO's p sweep (0, 0.2, 0.6; 0.4 is the default),
     60-step runs (T = 30) of the headline pairs, and ReMix-PPO without replay (p = 0) over 24 and 60 steps;
     the paper's Table 3 in miniature (ReMix-GRPO and ReMix-PPO without higher UTD, without KL-Convex, without
     reincarnation); and the candidate causes of ReMix-GRPO's missing saving, each a fork of docs/forks
     (informative groups only in the deque, a recency-weighted draw, N = 1, a p schedule, the clip centred at 1).
Targets: the rollouts (and generated tokens) each method needs to reach on-policy's final accuracy, and the
accuracy on-policy reaches at half its budget; medians over seeds with bootstrap 90% intervals; a seed that
never reaches a target counts as never. Per step, for historical samples, the mean log(pi_k/mu) and the mean
advantage by response-length bucket (the Whipping-Effect question).

Writes to --out: results.json (one record per run: config, seed, lr, steps, T, curve of step / accuracy /
rollouts / tokens / length / worked share, and per-step statistics; a target never reached is null), results.md,
and the plots.
"""

import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
import types
import typing
from dataclasses import dataclass
from pathlib import Path

# A pinned run (--pin) must give the same bits on any x86-64 machine, but torch and MKL pick kernels for the CPU
# at hand (AVX2, AVX-512), and those round differently: a base model built with AVX2 kernels differs from one built
# with AVX-512 kernels after 40 supervised steps. The pin runs the baseline kernels every x86-64 CPU has, on one
# thread, and AdamW's fused step (pin_fused_adamw). (The study runs the native kernels and the default AdamW: its
# numbers are those of the CPU capability in results.json.)
PORTABLE_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41",
                    "OMP_NUM_THREADS": "1"}
if "--pin" in sys.argv:  # before torch is imported
    os.environ.update(PORTABLE_KERNELS)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent  # the repository: remix.py, machinery/, tests/
# a configuration with a fork runs on a copy of remix.py with that docs/forks diff applied (fork_project)
sys.path[:0] = [os.environ.get("TOY_PROJECT", str(ROOT)), str(ROOT)]

TOY_VERSION = 5  # a cache built by another version of the task is rebuilt (5: built on one thread)
SCRATCHPAD_SHARE = 0.25  # supervised targets with the worked running sums; the rest are the bare boxed answer
SUPERVISED_STEPS, SUPERVISED_LR = 1500, 1e-3
MAX_TOKENS = 48  # the longest worked answer (five 9s) is 42 tokens with EOS
TEST, VAL, TRAIN = 1000, 200, 4000
EVAL_TEMPERATURE = 1.0  # held-out Pass@1 of one sample per problem at the training temperature; 0 = greedy
GRPO = dict(algo="grpo", prompts_per_step=8, group_size=8, mini_batch_prompts=4)
PPO = dict(algo="ppo", prompts_per_step=64, group_size=1, mini_batch_prompts=32)
CONFIGS = {  # name -> remix.Args overrides; ReMix is the paper's defaults p = 0.4, N = 2, m = 2
    "remix-grpo": GRPO,
    "grpo": {**GRPO, "on_policy": True},
    "remix-ppo": PPO,
    "ppo": {**PPO, "on_policy": True},
    "remix-grpo/no-utd": {**GRPO, "utd": 1},
    "remix-grpo/no-kl-convex": {**GRPO, "kl_convex": False},
    "remix-grpo/no-reincarnation": {**GRPO, "reincarnation": False},
    "remix-grpo/p=0.0": {**GRPO, "off_policy_p": 0.0},
    "remix-grpo/p=0.2": {**GRPO, "off_policy_p": 0.2},
    "remix-grpo/p=0.6": {**GRPO, "off_policy_p": 0.6},
    "remix-ppo/p=0.0": {**PPO, "off_policy_p": 0.0},  # ReMix-PPO without replay: what the second pass alone gives
    "remix-ppo/no-utd": {**PPO, "utd": 1},
    "remix-ppo/no-kl-convex": {**PPO, "kl_convex": False},
    "remix-ppo/no-reincarnation": {**PPO, "reincarnation": False},
    # why ReMix-GRPO saves nothing: each candidate cause, one change each (a fork of docs/forks, or a flag)
    "remix-grpo/informative-groups": {**GRPO, "fork": "grpo_informative_groups"},  # no zero-spread groups stored
    "remix-grpo/recency": {**GRPO, "fork": "recency_weighted_replay"},  # staleness: newer batches drawn more
    "remix-grpo/N=1": {**GRPO, "window": 1},  # staleness: only the last policy's batch
    "remix-grpo/p-schedule": {**GRPO, "fork": "p_schedule"},  # p(t) falls to 0 over T instead of a hard switch
    "remix-grpo/clip-at-1": {**GRPO, "fork": "clip_centred_at_one"},  # the clip centred at 1, not at pi_k/mu
    # vLLM's sampler instead of transformers': the arms --method-args="--overlap" compares (benchmarks/overlap.md)
    "remix-ppo/vllm": {**PPO, "sampler": "vllm"},
    "ppo/vllm": {**PPO, "on_policy": True, "sampler": "vllm"},
}
TABLE3 = {"UTD": "no-utd", "KL-Convex": "no-kl-convex", "reincarnation": "no-reincarnation"}  # without ... -> suffix
CAUSES = ("remix-grpo/informative-groups", "remix-grpo/recency", "remix-grpo/N=1", "remix-grpo/p-schedule",
          "remix-grpo/clip-at-1")
PAIRS = {"GRPO": ("remix-grpo", "grpo"), "PPO": ("remix-ppo", "ppo")}  # algorithm -> (ReMix, on-policy)
SHORT = ("remix-grpo", "grpo", "remix-ppo", "ppo", "remix-grpo/no-utd", "remix-grpo/no-kl-convex",
         "remix-grpo/no-reincarnation")
STUDY_LRS = (1e-5, 3e-5, 1e-4, 3e-4)  # 3e-4 because three of the four methods peaked at 1e-4
P_SWEEP = {0.0: "remix-grpo/p=0.0", 0.2: "remix-grpo/p=0.2", 0.4: "remix-grpo", 0.6: "remix-grpo/p=0.6"}
BUCKETS = ((0, 12), (13, 20), (21, 30), (31, MAX_TOKENS))  # response lengths (tokens) for the per-step statistics


@dataclass
class ToyArgs:
    out: str = "runs/toy"
    """output folder: results.json, results.md and the plots"""
    cache: str = "runs/toy-cache"
    """where the toy's data splits and base model are kept (built once, about 3 minutes)"""
    study: bool = False
    """run the whole study (lr sweep, mechanism, p sweep, 60-step runs) instead of the short run"""
    seeds: int | None = None
    """seeds per configuration (default: 3 for the short run, 5 for the study)"""
    configs: tuple[str, ...] = SHORT
    """configurations of the short run"""
    lr: float = 3e-5
    """actor learning rate of the short run (the study sweeps its own)"""
    steps: int = 24
    """training steps per run (the study's durability runs use 60)"""
    reincarnate_step: int = 12
    """T, the last mix-stage step (the study's durability runs use 30)"""
    eval_every: int | None = None
    """held-out evaluation every this many steps, 1 or more (default: 3; 6 with --method, whose runs then take about
    40% less time: an evaluation of the 1,000 held-out problems takes as long as 10-15 training steps)"""
    workers: int = 2
    """runs in parallel, one core each"""
    replot: bool = False
    """rebuild results.md and the plots from the results.json in --out, running nothing"""
    trl_rounds: int = 1
    """rounds of the TRL step-time comparison after the short run (0 skips it)"""
    pin: str | None = None
    """run only the short pinned run (a small base, 4 steps of ReMix-GRPO, seed 1) and write its curve here"""
    method: str | None = None
    """a fork of remix.py (remix_mine.py): train --configs (default remix-grpo remix-ppo) with it and with remix.py at
    the same seeds, and write the verdict, both curves and the rollouts-to-target table (method.md, method.png) into
    --out"""
    method_args: str = ""
    """the --method file's own flags, written as on its command line, for its runs only (remix.py's keep remix.py's
    settings), as in --method-args="--my-flag 0.3 --other" (the = keeps them one value)"""
    forks: bool = False
    """every fork of docs/forks against remix.py, each at the configurations it fits (forks.md, forks.json in --out;
    held-out evaluation at the last step only unless --eval-every)"""
    jobs: tuple[str, ...] = ()
    """(internal: how the workers are started) runs for one worker process, as config@seed@lr@steps@T"""
    probe: bool = False
    """(internal: the probe's workers) the --jobs are probes: no held-out evaluation, the policy's weights kept as a
    digest"""
    check_method: bool = False
    """(internal: the early check's child process) import the method as the jobs do and check --method-args"""


# ----------------------------------------------------------------------------------------------
# The toy task and its base model
# ----------------------------------------------------------------------------------------------
def problem(digits: tuple) -> dict:
    return {"problem": "What is " + " + ".join(map(str, digits)) + "?", "answer": str(sum(digits))}


def worked_answer(digits: tuple, scratchpad: bool) -> str:
    """The supervised target: the boxed sum, after the running sums when scratchpad is set.
    (3, 5, 8) -> '3+5=8 8+8=16 \\boxed{16}' or '\\boxed{16}'."""
    steps, total = [], digits[0]
    for d in digits[1:]:
        steps.append(f"{total}+{d}={total + d} ")
        total += d
    return ("".join(steps) if scratchpad else "") + f"\\boxed{{{total}}}"


def pass_at_1(model, tokenizer, problems: list[dict], temperature: float = 0.0) -> tuple[float, float, float]:
    """Held-out Pass@1 graded by report.grade_many, the mean response length, and the share of
    responses that work the sums out before the box. Temperature 0 is greedy; above 0, one sample per
    problem from a fixed seed, leaving the caller's RNG streams alone."""
    import torch

    import remix

    from machinery import engines, report

    prompts = [remix.build_prompt(tokenizer, p["problem"]) for p in problems]
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        groups = engines.hf_generate(model, tokenizer, prompts, 1, temperature, 1.0, MAX_TOKENS, len(problems))
    texts = [tokenizer.decode(g[0][0], skip_special_tokens=True) for g in groups]
    grades = report.grade_many(remix.METHOD, [(t, [p["answer"]]) for t, p in zip(texts, problems)], workers=1)
    worked = sum(not t.lstrip().startswith("\\boxed") for t in texts) / len(texts)
    return sum(g[0] for g in grades) / len(problems), sum(len(g[0][0]) for g in groups) / len(groups), worked


def build_toy(cache: Path, seed: int = 0, supervised_steps: int = SUPERVISED_STEPS, test: int = TEST) -> Path:
    """Data splits and the warmed-up base model, built once (on one thread, so any machine builds the same model)
    and reused."""
    version = [TOY_VERSION, supervised_steps, test]
    if (cache / "meta.json").exists() and json.loads((cache / "meta.json").read_text()).get("version") == version:
        return cache
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import remix
    from machinery import models
    from tests.tiny_model import build_tiny_model

    rng = random.Random(seed)
    seen, problems = set(), []
    while len(problems) < TEST + VAL + TRAIN:  # distinct lists of 3 to 5 digits
        digits = tuple(rng.randrange(10) for _ in range(rng.randint(3, 5)))
        if digits not in seen:
            seen.add(digits)
            problems.append(digits)
    splits = {"test": problems[:test], "val": problems[TEST:TEST + VAL], "train": problems[TEST + VAL:]}
    cache.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        (cache / f"{name}.jsonl").write_text("".join(json.dumps(problem(t)) + "\n" for t in rows))
    torch.manual_seed(seed)
    build_tiny_model(str(cache / "base"), seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(cache / "base", trust_remote_code=False)
    tokenizer.add_tokens([remix.Args.prompt_suffix])  # one token for the fixed instruction: prompts 3x shorter
    model = AutoModelForCausalLM.from_pretrained(cache / "base", **models.NO_CODE)
    model.resize_token_embeddings(len(tokenizer))
    tokenizer.save_pretrained(cache / "base")
    optim = torch.optim.AdamW(model.parameters(), lr=SUPERVISED_LR)
    val = [problem(t) for t in splits["val"]]

    def example(t):
        text = worked_answer(t, scratchpad=rng.random() < SCRATCHPAD_SHARE)
        target = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        return {"prompt_ids": remix.build_prompt(tokenizer, problem(t)["problem"]), "response_ids": target}

    for step in range(1, supervised_steps + 1):
        model.train()
        batch = models.collate([example(t) for t in rng.sample(splits["train"], 32)], "cpu")
        logp, _ = remix.policy_forward(model, batch, 1.0)
        loss = -remix.masked_mean(logp, batch["response_mask"])
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 500 == 0:
            model.eval()
            accuracy, length, _ = pass_at_1(model, tokenizer, val)
            print(f"toy: supervised step {step}/{supervised_steps}: loss {loss.item():.3f}, validation greedy "
                  f"accuracy {accuracy:.2f}, length {length:.1f}", flush=True)
    model.save_pretrained(cache / "base")
    model.eval()
    accuracy = pass_at_1(model, tokenizer, val)[0]
    test_accuracy, test_length, worked = pass_at_1(model, tokenizer, [problem(t) for t in splits["test"]],
                                                   EVAL_TEMPERATURE)
    greedy_test, _, _ = pass_at_1(model, tokenizer, [problem(t) for t in splits["test"]])
    meta = {"version": version, "supervised_steps": step, "val_greedy_accuracy": accuracy,
            "test_accuracy": test_accuracy, "test_length": test_length, "test_worked_share": worked,
            "test_greedy_accuracy": greedy_test}
    (cache / "meta.json").write_text(json.dumps(meta))
    return cache


# ----------------------------------------------------------------------------------------------
# One training run: the real remix.train loop, with held-out accuracy every few steps
# ----------------------------------------------------------------------------------------------
def job_name(config: str, seed: int, lr: float, steps: int, T: int) -> str:
    return f"{config}@{seed}@{lr:g}@{steps}@{T}"


def run_dir(out: str, job: str, eval_every: int, probe: bool = False) -> Path:
    """A run's folder under --out; a run evaluated every 3 steps (the study's grid) is not one evaluated every 6, and a
    probe (its first steps, no evaluation) is kept apart from the runs."""
    config, seed, lr, steps, T = job.split("@")
    if probe:
        return Path(out) / "probes" / config.replace("/", "_") / f"lr{lr}-steps{steps}-T{T}" / f"seed{seed}"
    grid = "" if eval_every == 3 else f"-every{eval_every}"
    return Path(out) / "runs" / config.replace("/", "_") / f"lr{lr}-steps{steps}-T{T}{grid}" / f"seed{seed}"


def shared_settings(steps: int, T: int, lr: float) -> dict:
    """The remix.Args the toy sets for every configuration, and for both arms of a comparison (--method-args refuses
    them: toy_flag_for)."""
    return dict(steps=steps, reincarnate_step=T, kl_convex_start=T // 3, kl_convex_every=2,
                max_response_tokens=MAX_TOKENS, temperature=1.0, actor_lr=lr, critic_lr=1e-3, sampler="hf",
                save_every=0, grader_workers=1, max_prompt_tokens=256, overwrite=True, eval_every=0, log_completions=0)


def run_args(config: str, seed: int, lr: float, steps: int, T: int, toy: str, folder: Path,
             method_flags: dict | None = None):
    """One run's settings (remix.Args and the run's): the toy's, the configuration's, and on a method's arm its own
    flags."""
    import remix
    from machinery import console

    overrides = {k: v for k, v in config_of(config).items() if k != "fork"}
    return console.settings(remix.Args, **{**shared_settings(steps, T, lr), **overrides, **(method_flags or {})},
                          model=str(Path(toy) / "base"), dataset=str(Path(toy) / "train.jsonl"), out=str(folder),
                          seed=seed)


def zero_spread_share(samples: list[dict]) -> float | None:
    """The share of these samples' groups whose rewards are all equal (GRPO: A_hat = 0, no gradient); None for none.
    (A PPO sample is a group of one: the share is 1 and means nothing there.)"""
    groups = {}
    for s in samples:
        groups.setdefault(s["group"], set()).add(s["reward"])
    return sum(len(rewards) == 1 for rewards in groups.values()) / len(groups) if groups else None


def config_of(name: str) -> dict:
    """A configuration's remix.Args overrides; NAME+LABEL is configuration NAME run by the arm LABEL (--method)."""
    return CONFIGS[name.split("+")[0]]


@functools.cache
def patched_remix(diff: Path) -> bytes:
    """remix.py with a docs/forks diff applied (in a scratch folder), as bytes; one line if it no longer applies."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        shutil.copy(ROOT / "remix.py", Path(work) / "remix.py")
        done = subprocess.run(["git", "apply", str(diff)], cwd=work, capture_output=True, text=True)
        if done.returncode != 0:
            refuse(f"{diff.name} no longer applies to remix.py ({(done.stderr.strip().splitlines() or ['?'])[0]})")
        return (Path(work) / "remix.py").read_bytes()


def project(code: bytes, folder: Path) -> Path:
    """folder/remix.py holding a method's code, beside a copy of the machinery: what the jobs of an arm import as remix
    (TOY_PROJECT). remix.py is written last, so a folder left half made by a stopped toy is made again."""
    import shutil

    if not (folder / "remix.py").exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        shutil.copytree(ROOT / "machinery", folder / "machinery", ignore=shutil.ignore_patterns("__pycache__"))
        (folder / "remix.py").write_bytes(code)
    return folder


def fork_project(fork: str, cache: Path) -> Path:
    """A copy of remix.py with docs/forks/FORK.diff applied, and the machinery, for the jobs of a configuration."""
    return project(patched_remix(ROOT / "docs" / "forks" / f"{fork}.diff"), cache / "forks" / fork)


def bucket_of(length: int) -> str:
    return next(f"{lo}-{hi}" for lo, hi in BUCKETS if lo <= length <= hi)


def weights_digest(model) -> str:
    """sha256 of a model's weights, bit for bit (the probe compares two arms by it)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # remix shards it (FSDP2's DTensor)
        digest.update(name.encode())
        digest.update(whole.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run(job: str, toy: str, out: str, eval_every: int, method_args: str = "", probe: bool = False) -> dict:
    """One run of the real remix.train loop, its held-out Pass@1 every eval_every steps and at the end; a probe
    evaluates nothing. method_args: the flags of the arm's method (remix here is that method's file)."""
    import torch

    torch.set_num_threads(1)  # two runs share the two cores
    import remix

    config, seed, lr, steps, T = job.split("@")
    seed, lr, steps, T = int(seed), float(lr), int(steps), int(T)
    test = [json.loads(line) for line in open(Path(toy) / "test.jsonl")]
    meta = json.loads((Path(toy) / "meta.json").read_text())
    curve = [{"step": 0, "accuracy": meta["test_accuracy"], "length": meta["test_length"],
              "worked_share": meta["test_worked_share"], "rollouts": 0, "tokens": 0, "seconds": 0.0}]
    per_step, start, weights = [], time.perf_counter(), {}

    def on_step(step, record, policy, tokenizer, batch):
        # the Whipping-Effect question: for historical samples, log(pi_k / mu) and the advantage by length
        buckets = {}
        for s in batch:
            if s["historical"]:
                entry = buckets.setdefault(bucket_of(len(s["response_ids"])), [0, 0.0, 0.0])
                entry[0] += 1
                entry[1] += (s["prox_logp"] - s["behaviour_logp"]).mean().item()
                entry[2] += s["advantages"].mean().item()
        fresh = [s for s in batch if not s["historical"]]  # drawn this step, or a step ahead (--overlap)
        worked = sum(not tokenizer.decode(s["response_ids"], skip_special_tokens=True).lstrip().startswith("\\boxed")
                     for s in fresh) / len(fresh)
        per_step.append({"step": step, "reward": record["reward/mean"], "length": record["response/length_mean"],
                         "worked_share": worked, "log_ratio_sd": record["offpolicy/log_ratio_std"],
                         "trace_prod_mean": record["offpolicy/trace_prod_mean"],
                         "clipfrac": record.get("losses/clipfrac"),
                         "historical_zero_spread": zero_spread_share([s for s in batch if s["historical"]]),
                         "historical_by_length": {k: {"n": n, "log_ratio": lr_sum / n, "advantage": adv_sum / n}
                                                  for k, (n, lr_sum, adv_sum) in sorted(buckets.items())}})
        if step == steps:
            weights["policy"] = weights_digest(policy)
        if not probe and (step % eval_every == 0 or step == steps):
            accuracy, length, worked_eval = pass_at_1(policy, tokenizer, test, EVAL_TEMPERATURE)
            record["eval/accuracy"] = accuracy
            curve.append({"step": step, "accuracy": accuracy, "length": length, "worked_share": worked_eval,
                          "rollouts": record["rollouts/total"], "tokens": record["rollouts/generated_tokens"],
                          "seconds": time.perf_counter() - start})

    folder = run_dir(out, job, eval_every, probe)
    import contextlib
    import io

    flags = parse_method_args(remix.Args, method_args) if method_args else {}
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):  # parallel bars
        remix.train(run_args(config, seed, lr, steps, T, toy, folder, flags), on_step=on_step)
    result = {"config": config, "seed": seed, "lr": lr, "steps": steps, "T": T, "curve": curve, "per_step": per_step,
              "weights_sha256": weights.get("policy")}
    (folder / "curve.json").write_text(json.dumps(result))
    if not probe:
        print(f"toy: {config} lr {lr:g} seed {seed} ({steps} steps): accuracy {curve[0]['accuracy']:.3f} -> "
              f"{curve[-1]['accuracy']:.3f}, {curve[-1]['rollouts']} rollouts, {curve[-1]['seconds']:.0f} s",
              flush=True)
    return result


def run_jobs(jobs: list[str], cli: ToyArgs, toy: str, arms: dict | None = None, probe: bool = False) -> list[dict]:
    """The jobs over --workers processes with one core each; each process runs its share one after another,
    so imports and the grader worker are paid once per process. Finished runs are read back, not repeated.
    arms: label -> Arm, for the jobs of CONFIG+LABEL (a method beside remix.py)."""
    jobs = list(dict.fromkeys(jobs))  # a job named twice (the same arm twice) runs once
    todo = [j for j in jobs if not (run_dir(cli.out, j, cli.eval_every, probe) / "curve.json").exists()]

    def side_of(job: str) -> tuple:  # what the job imports as remix (remix.py, a fork's folder) and the flags it gets
        config = job.split("@")[0]
        if "+" in config:
            arm = arms[config.split("+", 1)[1]]
            return arm.project, arm.method_args
        fork = CONFIGS[config].get("fork")
        return (fork_project(fork, Path(toy)) if fork else None), ""

    sides = [side_of(j) for j in todo]
    shares = []  # each a worker process: one side's jobs, split over --workers
    for side in dict.fromkeys(sides):
        mine = [j for j, s in zip(todo, sides) if s == side]
        shares += [(side, mine[i :: cli.workers]) for i in range(min(cli.workers, len(mine)))]
    run_pool(shares, cli, toy, probe)
    return [json.loads((run_dir(cli.out, j, cli.eval_every, probe) / "curve.json").read_text()) for j in jobs]


def run_pool(shares: list[tuple], cli: ToyArgs, toy: str, probe: bool = False):
    """Worker processes, --workers at a time: each runs one share ((project, method_args), jobs), importing as remix
    the repository's remix.py (project None) or the project folder's."""

    def worker(share):
        (folder, method_args), jobs = share
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **({"TOY_PROJECT": str(folder)} if folder else {}))
        done = subprocess.run([sys.executable, str(HERE / "toy.py"), "--cache", toy, "--out", cli.out, "--eval-every",
                               str(cli.eval_every), f"--method-args={method_args}", *(["--probe"] if probe else []),
                               "--jobs", *jobs], env=env, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"toy runs {jobs} failed:\n{done.stderr[-3000:]}")

    with concurrent.futures.ThreadPoolExecutor(cli.workers) as pool:
        list(pool.map(worker, shares))


# ----------------------------------------------------------------------------------------------
# Summaries: targets, medians with bootstrap intervals
# ----------------------------------------------------------------------------------------------
def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of sorted values; infinities allowed."""
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def median(values: list[float]) -> float:
    """The median, with infinities ('never') allowed: the mean of the two middle values, inf if either is."""
    ordered, n = sorted(values), len(values)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def bootstrap_interval(values: list[float], stat=median, level: float = 0.9, draws: int = 4000,
                       seed: int = 0) -> tuple[float, float]:
    """The (1 - level)/2 and (1 + level)/2 nearest-rank percentiles of stat over resamples of values with
    replacement: a 90% interval by default. Infinite values (a seed that never reached) take part as such."""
    rng = random.Random(seed)
    stats = sorted(stat([rng.choice(values) for _ in values]) for _ in range(draws))
    return percentile(stats, (1 - level) / 2), percentile(stats, (1 + level) / 2)


def cost_to_reach(curve: list[dict], target: float) -> dict | None:
    """Rollouts, tokens and seconds at the first evaluation at or above the target accuracy."""
    for point in curve:
        if point["accuracy"] >= target:
            return {k: point[k] for k in ("step", "rollouts", "tokens", "seconds")}
    return None


def costs_to_reach(runs: list[dict], target: float, unit: str = "rollouts") -> list[float]:
    """Each run's rollouts (or tokens) to the target; infinity for a run that never reaches it."""
    return [(cost_to_reach(r["curve"], target) or {unit: math.inf})[unit] for r in runs]


def final_accuracies(runs: list[dict]) -> list[float]:
    return [r["curve"][-1]["accuracy"] for r in runs]


def accuracy_at(curve: list[dict], rollouts: float) -> float:
    """Accuracy at the last evaluation within a rollout budget."""
    return [p["accuracy"] for p in curve if p["rollouts"] <= rollouts][-1]


def spread(values: list[float]) -> dict:
    lo, hi = bootstrap_interval(values)
    return {"median": median(values), "lo": lo, "hi": hi, "each": values}


def fmt(entry: dict, digits: int = 3, scale: float = 1.0) -> str:
    show = lambda x: "never" if x == math.inf else f"{x * scale:,.{digits}f}"  # noqa: E731
    return f"{show(entry['median'])} [{show(entry['lo'])}, {show(entry['hi'])}]"


def by_method(results: list[dict]) -> dict:
    groups: dict = {}
    for r in results:
        groups.setdefault((r["config"], r["lr"], r["steps"]), []).append(r)
    return groups


def best_lrs(groups: dict, steps: int) -> dict:
    """Each method's lr with the highest median final accuracy (the study's sweep)."""
    best = {}
    for name in ("remix-grpo", "grpo", "remix-ppo", "ppo"):
        finals = {lr: median(final_accuracies(runs)) for (c, lr, s), runs in groups.items()
                  if c == name and s == steps and lr in STUDY_LRS}
        if finals:
            best[name] = max(finals, key=finals.get)
    return best


def compare(remix_runs: list[dict], base_runs: list[dict]) -> dict:
    """ReMix against on-policy: rollouts and tokens to on-policy's median final accuracy, and to the accuracy
    on-policy reaches at half its rollout budget; never = infinity."""
    target = median(final_accuracies(base_runs))
    half_budget = base_runs[0]["curve"][-1]["rollouts"] / 2
    half = median([accuracy_at(r["curve"], half_budget) for r in base_runs])
    out = {"target_final": target, "target_half": half, "half_budget": half_budget}
    for side, runs in (("remix", remix_runs), ("on_policy", base_runs)):
        for name, goal in (("final", target), ("half", half)):
            for unit in ("rollouts", "tokens"):
                out[f"{side}_{unit}_to_{name}"] = spread(costs_to_reach(runs, goal, unit))
        out[f"{side}_final_accuracy"] = spread(final_accuracies(runs))
        out[f"{side}_rollouts"] = runs[0]["curve"][-1]["rollouts"]
    return out


def length_table(runs: list[dict]) -> dict:
    """Mean log(pi_k / mu) and mean advantage of historical samples by response length, over steps and seeds."""
    table = {}
    for r in runs:
        for step in r["per_step"]:
            for bucket, e in step["historical_by_length"].items():
                entry = table.setdefault(bucket, [0, 0.0, 0.0])
                entry[0] += e["n"]
                entry[1] += e["log_ratio"] * e["n"]
                entry[2] += e["advantage"] * e["n"]
    return {b: {"samples": n, "log_ratio": s / n, "advantage": a / n} for b, (n, s, a) in sorted(
        table.items(), key=lambda kv: int(kv[0].split("-")[0]))}


def summarize(results: list[dict], cli: ToyArgs) -> dict:
    groups = by_method(results)
    summary = {"methods": {}, "headline": {}}
    for (config, lr, steps), runs in sorted(groups.items(), key=lambda kv: (kv[0][2], list(CONFIGS).index(kv[0][0]), kv[0][1])):
        summary["methods"][f"{config} lr {lr:g} {steps} steps"] = {
            "config": config, "lr": lr, "steps": steps, "seeds": len(runs),
            "final_accuracy": spread(final_accuracies(runs)),
            "rollouts": runs[0]["curve"][-1]["rollouts"], "tokens": median([r["curve"][-1]["tokens"] for r in runs]),
            "final_length": median([r["curve"][-1]["length"] for r in runs]),
            "final_worked_share": median([r["curve"][-1]["worked_share"] for r in runs]),
            "seconds": median([r["curve"][-1]["seconds"] for r in runs])}
    best = best_lrs(groups, cli.steps) if cli.study else {name: cli.lr for name in CONFIGS}
    summary["best_lr"] = best if cli.study else {}
    for algo, (remix_name, base) in PAIRS.items():
        for steps in sorted({s for (_, _, s) in groups}):
            mine, theirs = groups.get((remix_name, best.get(remix_name), steps)), groups.get((base, best.get(base), steps))
            if not (mine and theirs):
                continue
            headline = summary["headline"][f"{algo} {steps} steps"] = {
                "remix_lr": best[remix_name], "on_policy_lr": best[base], **compare(mine, theirs)}
            # the mechanism, on the same targets: on-policy at 2x and 4x ReMix's lr, and ReMix without replay
            others = [(f"on_policy_{f}x_lr", (base, float(f"{f * best[remix_name]:g}"), steps)) for f in (2, 4)
                      if steps == cli.steps] + [("remix_no_replay", (f"{remix_name}/p=0.0", best[remix_name], steps))]
            for key, group in others:
                runs = groups.get(group)
                if runs:
                    headline[key] = {"lr": runs[0]["lr"], "final_accuracy": spread(final_accuracies(runs)),
                                     "rollouts": runs[0]["curve"][-1]["rollouts"],
                                     "rollouts_to_final": spread(costs_to_reach(runs, headline["target_final"])),
                                     "rollouts_to_half": spread(costs_to_reach(runs, headline["target_half"]))}
    # ReMix and on-policy at one shared lr: how a comparison that tunes neither side reads
    summary["same_lr"] = {f"{algo} lr {lr:g}": compare(groups[(remix_name, lr, cli.steps)], groups[(base, lr, cli.steps)])
                          for algo, (remix_name, base) in PAIRS.items() for lr in STUDY_LRS if cli.study
                          and (remix_name, lr, cli.steps) in groups and (base, lr, cli.steps) in groups}
    summary["whipping"] = {name: length_table(groups[(name, best[name], cli.steps)])
                           for name in ("remix-grpo", "remix-ppo") if (name, best.get(name), cli.steps) in groups}
    summary["p_sweep"] = {p: {"final_accuracy": spread(final_accuracies(groups[key])),
                              "length_first_last": [median([r["per_step"][0]["length"] for r in groups[key]]),
                                                    median([r["per_step"][-1]["length"] for r in groups[key]])],
                              "worked_share_first_last": [median([r["per_step"][0]["worked_share"] for r in groups[key]]),
                                                          median([r["per_step"][-1]["worked_share"] for r in groups[key]])],
                              "log_ratio_sd": median([statistics.mean(x["log_ratio_sd"] for x in r["per_step"])
                                                      for r in groups[key]])}
                          for p, name in P_SWEEP.items()
                          for key in [(name, best.get("remix-grpo"), cli.steps)] if key in groups}
    # the paper's Table 3 in miniature, and the candidate causes of ReMix-GRPO's missing saving, on the headline's
    # targets (on-policy's final Pass@1 at each side's best lr, 24 steps)
    summary["table3"], summary["causes"] = {}, {}

    def row(name, lr, headline):
        runs = groups.get((name, lr, cli.steps))
        if not runs:
            return None
        shares = [x["historical_zero_spread"] for r in runs for x in r["per_step"]
                  if x.get("historical_zero_spread") is not None]
        return {"config": name, "final_accuracy": spread(final_accuracies(runs)), "rollouts": runs[0]["curve"][-1]["rollouts"],
                "rollouts_to_final": spread(costs_to_reach(runs, headline["target_final"])),
                "tokens_to_final": spread(costs_to_reach(runs, headline["target_final"], "tokens")),
                "rollouts_to_half": spread(costs_to_reach(runs, headline["target_half"])),
                "historical_zero_spread": statistics.mean(shares) if shares else None}

    for algo, (remix_name, base) in PAIRS.items():
        headline = summary["headline"].get(f"{algo} {cli.steps} steps")
        if not (cli.study and headline):
            continue
        ends = [("ReMix", remix_name, best[remix_name]), ("on-policy", base, best[base])]
        ablations = [(f"without {what}", f"{remix_name}/{suffix}", best[remix_name]) for what, suffix in TABLE3.items()]
        causes = [(name.split("/")[1], name, best[remix_name]) for name in CAUSES] if algo == "GRPO" else []
        for key, rows in (("table3", ends[:1] + ablations + ends[1:]), ("causes", ends[:1] + causes + ends[1:])):
            if key == "causes" and not causes:
                continue
            entries = {label: row(name, lr, headline) for label, name, lr in rows}
            summary[key][algo] = {label: entry for label, entry in entries.items() if entry}
    return summary


def markdown(summary: dict) -> str:
    lines = ["## Configurations (medians over seeds, bootstrap 90% intervals)", "",
             "| configuration | lr | steps | seeds | final Pass@1 | rollouts | generated tokens | final length | "
             "final worked share |", "|" + "---|" * 9]
    for m in summary["methods"].values():
        lines.append(f"| {m['config']} | {m['lr']:g} | {m['steps']} | {m['seeds']} | {fmt(m['final_accuracy'])} | "
                     f"{m['rollouts']:,} | {m['tokens']:,.0f} | {m['final_length']:.1f} | {m['final_worked_share']:.2f} |")
    if summary["best_lr"]:
        lines += ["", "Best lr (highest median final Pass@1): " + ", ".join(f"{k} {v:g}" for k, v in summary["best_lr"].items())]
    lines += ["", "## ReMix against on-policy, each at its lr", "",
              "| pair | target | ReMix: rollouts to it | on-policy: rollouts to it | ReMix: tokens to it | on-policy: tokens to it |",
              "|" + "---|" * 6]
    for name, h in summary["headline"].items():
        for key, label in (("final", f"on-policy's final {h['target_final']:.3f}"),
                           ("half", f"on-policy at half its budget ({h['half_budget']:,.0f} rollouts): {h['target_half']:.3f}")):
            lines.append(f"| {name} (lr {h['remix_lr']:g} vs {h['on_policy_lr']:g}) | {label} | "
                         f"{fmt(h[f'remix_rollouts_to_{key}'], 0)} | {fmt(h[f'on_policy_rollouts_to_{key}'], 0)} | "
                         f"{fmt(h[f'remix_tokens_to_{key}'], 0)} | {fmt(h[f'on_policy_tokens_to_{key}'], 0)} |")
    labels = {"on_policy_2x_lr": "on-policy at 2x ReMix's lr", "on_policy_4x_lr": "on-policy at 4x ReMix's lr",
              "remix_no_replay": "ReMix without replay (p = 0)"}
    mechanism = [(n, labels[k], h[k]) for n, h in summary["headline"].items() for k in labels if k in h]
    if mechanism:
        lines += ["", "## Mechanism: a larger on-policy step, and ReMix without replay, on the pair's targets", "",
                  "| pair | run | lr | final Pass@1 | rollouts | rollouts to on-policy's final | "
                  "rollouts to its half-budget accuracy |", "|" + "---|" * 7]
        for name, label, m in mechanism:
            lines.append(f"| {name} | {label} | {m['lr']:g} | {fmt(m['final_accuracy'])} | {m['rollouts']:,} | "
                         f"{fmt(m['rollouts_to_final'], 0)} | {fmt(m['rollouts_to_half'], 0)} |")
    if summary["same_lr"]:
        lines += ["", "## ReMix against on-policy at one shared lr (neither side tuned)", "",
                  "| pair | final Pass@1, ReMix / on-policy | rollouts to on-policy's final, ReMix / on-policy | "
                  "rollouts to its half-budget accuracy, ReMix / on-policy |", "|" + "---|" * 4]
        for name, h in summary["same_lr"].items():
            lines.append(f"| {name} | {fmt(h['remix_final_accuracy'])} / {fmt(h['on_policy_final_accuracy'])} | "
                         f"{fmt(h['remix_rollouts_to_final'], 0)} / {fmt(h['on_policy_rollouts_to_final'], 0)} | "
                         f"{fmt(h['remix_rollouts_to_half'], 0)} / {fmt(h['on_policy_rollouts_to_half'], 0)} |")
    if summary["p_sweep"]:
        lines += ["", "## ReMix-GRPO's off-policy share p", "",
                  "| p | final Pass@1 | sampled length, step 1 -> last | worked share, step 1 -> last | per-token sd of log(pi_k/mu) |",
                  "|" + "---|" * 5]
        for p, e in summary["p_sweep"].items():
            lines.append(f"| {p} | {fmt(e['final_accuracy'])} | {e['length_first_last'][0]:.1f} -> {e['length_first_last'][1]:.1f} | "
                         f"{e['worked_share_first_last'][0]:.2f} -> {e['worked_share_first_last'][1]:.2f} | {e['log_ratio_sd']:.3f} |")
    for key, title in (("table3", "The paper's Table 3 in miniature: ReMix without each of its parts (ReMix's best lr)"),
                       ("causes", "Why ReMix-GRPO saves nothing: one candidate cause changed at a time (ReMix-GRPO's best lr)")):
        for algo, rows in summary.get(key, {}).items():
            lines += ["", f"## {title}: {algo}", "",
                      "| run | final Pass@1 | rollouts | rollouts to on-policy's final | tokens to it | "
                      "rollouts to its half-budget accuracy | zero-spread share of historical groups |", "|" + "---|" * 7]
            for label, e in rows.items():
                share = "" if e["historical_zero_spread"] is None or algo == "PPO" else f"{e['historical_zero_spread']:.2f}"
                lines.append(f"| {label} ({e['config']}) | {fmt(e['final_accuracy'])} | {e['rollouts']:,} | "
                             f"{fmt(e['rollouts_to_final'], 0)} | {fmt(e['tokens_to_final'], 0)} | "
                             f"{fmt(e['rollouts_to_half'], 0)} | {share} |")
    if summary["whipping"]:
        lines += ["", "## Historical samples by response length (all steps and seeds)", "",
                  "| method | length (tokens) | samples | mean log(pi_k/mu) | mean advantage |", "|" + "---|" * 5]
        for name, table in summary["whipping"].items():
            for bucket, e in table.items():
                lines.append(f"| {name} | {bucket} | {e['samples']:,} | {e['log_ratio']:+.4f} | {e['advantage']:+.3f} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------
def finish(fig, axes, ylabels, xlabel: str, path: Path, log_x=False, zero_line=False, vline=None):
    """Label, grid and legend each panel, then write the figure."""
    import matplotlib.pyplot as plt

    for ax, label in zip(axes, ylabels):
        if log_x:
            ax.set_xscale("log")
        if zero_line:
            ax.axhline(0, color="grey", lw=0.8)
        if vline is not None:
            ax.axvline(vline, color="grey", linestyle=":")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(results: list[dict], summary: dict, out: Path, cli: ToyArgs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_method(results)
    best = summary["best_lr"] or {name: cli.lr for name in CONFIGS}

    def band(runs, key):
        points = list(zip(*[r["curve"] for r in runs]))
        x = [median([p[key] for p in column]) for column in points]
        spreads = [spread([p["accuracy"] for p in column]) for column in points]
        return x, [s["median"] for s in spreads], [s["lo"] for s in spreads], [s["hi"] for s in spreads]

    for steps in sorted({s for (_, _, s) in groups}):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, (algo, (remix_name, base)) in zip(axes, PAIRS.items()):
            lines = [(remix_name, best.get(remix_name)), (base, best.get(base))]
            lines += [(base, float(f"{f * best.get(remix_name, 0):g}")) for f in (2, 4) if steps == cli.steps]
            lines += [(f"{remix_name}/p=0.0", best.get(remix_name))]  # without replay
            for name, lr in lines:
                runs = groups.get((name, lr, steps))
                if runs:
                    x, m, lo, hi = band(runs, "rollouts")
                    ax.plot(x, m, marker=".", label=f"{name}, lr {lr:g}")
                    ax.fill_between(x, lo, hi, alpha=0.15)
            ax.set_title(f"{algo}, {steps} steps: median over seeds, 90% bootstrap band")
        finish(fig, axes, ("held-out Pass@1 (1,000 problems, one sample at T = 1)", ""), "rollouts",
               out / f"accuracy_vs_rollouts_{steps}steps.png")
    if summary["best_lr"]:  # the lr map: final accuracy, then rollouts to each of on-policy's two targets
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        budget = max(r["curve"][-1]["rollouts"] for r in results if r["steps"] == cli.steps)
        never = 1.15 * budget  # a median that never reaches is drawn on this line, marked x
        for name in ("remix-grpo", "grpo", "remix-ppo", "ppo"):
            algo = "GRPO" if "grpo" in name else "PPO"
            headline = summary["headline"].get(f"{algo} {cli.steps} steps", {})
            lrs = [lr for lr in STUDY_LRS if (name, lr, cli.steps) in groups]
            finals = [spread(final_accuracies(groups[(name, lr, cli.steps)])) for lr in lrs]
            line = axes[0].errorbar(lrs, [f["median"] for f in finals], yerr=[[f["median"] - f["lo"] for f in finals],
                                    [f["hi"] - f["median"] for f in finals]], marker="o", capsize=3, label=name)
            color = line.lines[0].get_color()
            for ax, key in zip(axes[1:], ("target_half", "target_final")):
                if key in headline:
                    costs = [median(costs_to_reach(groups[(name, lr, cli.steps)], headline[key])) for lr in lrs]
                    ax.plot(lrs, [min(c, never) for c in costs], color=color, label=name)
                    for lr, c in zip(lrs, costs):
                        ax.plot(lr, min(c, never), "x" if c == math.inf else "o", color=color)
        for ax, title in zip(axes[1:], ("accuracy at half its budget", "final accuracy")):
            ax.axhline(never, color="grey", linestyle=":")
            ax.text(STUDY_LRS[0], never, " never", va="bottom", fontsize=8)
            ax.set_title(f"median rollouts to on-policy's {title}", fontsize=10)
        axes[0].set_title(f"final Pass@1 after {cli.steps} steps", fontsize=10)
        finish(fig, axes, ("median, 90% interval", "rollouts", "rollouts"), "actor lr", out / "lr_map.png", log_x=True)
    if summary["whipping"]:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        for name, table in summary["whipping"].items():
            buckets = [b for b in table if table[b]["samples"] >= 20]  # a bucket of one or two samples is noise
            for ax, key in zip(axes, ("log_ratio", "advantage")):
                ax.plot(buckets, [table[b][key] for b in buckets], marker="o", label=name)
                for b in buckets:
                    ax.annotate(f"n={table[b]['samples']}", (b, table[b][key]), fontsize=7, xytext=(4, 4),
                                textcoords="offset points")
        finish(fig, axes, ("mean log(pi_k / mu), historical samples", "mean advantage, historical samples"),
               "response length (tokens; buckets with 20 or more samples)", out / "log_ratio_vs_length.png",
               zero_line=True)
    if summary["p_sweep"]:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        for p, name in P_SWEEP.items():
            runs = groups.get((name, best.get("remix-grpo"), cli.steps))
            if runs:
                steps = [s["step"] for s in runs[0]["per_step"]]
                for ax, key in zip(axes, ("length", "worked_share")):
                    ax.plot(steps, [statistics.mean(r["per_step"][i][key] for r in runs) for i in range(len(steps))],
                            label=f"p = {p}")
        finish(fig, axes, ("mean sampled length (tokens)", "share of worked answers"), "step",
               out / "length_vs_step.png", vline=cli.reincarnate_step)


def never_as_null(x):
    """x with every infinity (a target never reached) as None, for JSON."""
    if isinstance(x, dict):
        return {k: never_as_null(v) for k, v in x.items()}
    if isinstance(x, list):
        return [never_as_null(v) for v in x]
    return None if x == math.inf else x


def machine(workers: int) -> dict:
    """The machine the runs ran on: the CPU's model name and count, torch's version and CPU kernels, the threads of a
    run and the runs at a time, the OS. The study's numbers depend on the CPU's kernels and threads (docs/toy)."""
    import torch

    model = None
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    return {"cpu": model or platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads_per_run": 1, "workers": workers, "os": platform.platform(), "python": platform.python_version()}


def write_outputs(results: list[dict], cli: ToyArgs, out: Path, saved: dict | None = None) -> str:
    """results.json (a target never reached is null), results.md and the plots; returns the tables. saved: the record
    replotted, whose machine is kept as it was recorded (none where it recorded none); else this machine's."""
    summary = summarize(results, cli)
    import torch

    record = {"settings": dataclasses.asdict(cli)}
    if saved is None:
        record |= {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": machine(cli.workers)}
    else:
        record |= {k: saved[k] for k in ("cpu_capability", "machine") if k in saved}
    record |= {"configs": CONFIGS, "summary": summary, "runs": results}
    (out / "results.json").write_text(json.dumps(never_as_null(record), indent=1, allow_nan=False))
    table = markdown(summary)
    (out / "results.md").write_text(table)
    plot(results, summary, out, cli)
    return table


# ----------------------------------------------------------------------------------------------
# A method beside remix.py (--method, --forks): the method checked first (its import and its own flags, in a child
# process), a probe of both arms' first steps, the runs at the same configurations and seeds, the verdict in words
# ----------------------------------------------------------------------------------------------
METHOD_CONFIGS = ("remix-grpo", "remix-ppo")  # --method's default configurations
PROBE_STEPS = 2  # the probe: both arms' first steps of the first configuration at seed 1, the weights compared
CHECK_SECONDS = 300  # the early check's child process: an import that takes longer is one line
# settings of a run (remix.Args, RunArgs) the toy sets for both arms, beyond shared_settings and the configurations
TOY_FLAGS = {"steps": "--steps", "reincarnate_step": "--reincarnate-step", "kl_convex_start": "--reincarnate-step",
             "kl_convex_every": "--reincarnate-step", "actor_lr": "--lr", "eval_every": "--eval-every",
             "seed": "--seeds", "out": "--out", "model": "--cache", "dataset": "--cache", "resume": None,
             "resume_other_method": None, "track": None}
# docs/forks: what each changes (forks.md); the algorithms it fits (a change to GRPO's groups is GRPO's only); the
# flags that turn its change on, where it sits behind a flag of its own that is off by default (none today)
FORK_CHANGES = {
    "clip_centred_at_one": "PPO's clip around 1 instead of Mix-PPG's around pi_k/mu",
    "clip_higher_replayed_only": "DAPO's wider upper clip (eps_high 0.28) on replayed samples only",
    "dapo_clip_higher": "DAPO's asymmetric clip, eps_low 0.2 and eps_high 0.28, on every sample",
    "dr_grpo": "Dr. GRPO: no std normalisation of the group advantage; sums divided by a constant",
    "format_reward": "0.1 more reward for a response with a boxed answer",
    "grpo_informative_groups": "groups whose rewards are all equal are not stored for replay",
    "gspo_sequence_ratio": "GSPO's length-normalised sequence ratio, clipped at 3e-4 / 4e-4",
    "kl_precedent_previous_policy": "KL-Convex's precedent is pi_{k-1} instead of pi_k",
    "length_penalty": "0.001 less reward a token, 0.1 less for a response cut at the limit",
    "p_schedule": "p(t) falls linearly to 0 over T steps instead of switching off at T",
    "recency_weighted_replay": "a batch i steps old weighs 2^-(i-1) in the replay draw",
    "sequence_mean": "the loss is the mean over responses of their token means",
}
FORK_ALGOS = {"grpo_informative_groups": ("grpo",), "dr_grpo": ("grpo",)}  # the rest: GRPO and PPO
FORK_ARGS: dict[str, str] = {}
# why the toy does not resolve a fork (forks.md): what the fork acts on, against what the toy's runs hold
SPREAD = "the difference is within what 3 seeds resolve (--seeds narrows the interval)"
FORK_WHY: dict[str, str] = {
    "clip_centred_at_one": f"it clips otherwise only where a sample's pi_k/mu is away from 1 (a replayed one); {SPREAD}",
    "dapo_clip_higher": f"the loss changes only where a token's ratio lies between the two upper bounds; {SPREAD}",
    "dr_grpo": "its fixes act on responses' lengths, and the toy's are short and close (about 11 to 42 tokens, at "
               f"most 48); {SPREAD}",
    "format_reward": "every target the base model learned from ends in a boxed answer, so the bonus rewards what it "
                     f"already does; {SPREAD}",
    "grpo_informative_groups": f"it acts only on groups whose 8 rewards are all equal; {SPREAD}",
    "kl_precedent_previous_policy": "its change reaches the weights (the final weights differ at every seed) but no "
                                    "sampled response: every step's reward, length and clip fraction, and the final "
                                    "Pass@1, equal remix.py's at every seed",
    "p_schedule": f"its cost is in rollouts (more fresh prompts before T), which the ratio shows; {SPREAD}",
    "recency_weighted_replay": f"it reweighs a deque of a few recent batches (N = 2 here); {SPREAD}",
    "sequence_mean": "a mean of token means and a token mean differ by the responses' lengths, short and close here "
                     f"(about 11 to 42 tokens); {SPREAD}",
}


@dataclass
class Arm:
    """One side of a comparison: a method's code, read once, its own flags and the configurations it runs."""
    name: str  # what tables call it: remix_mine.py, dr_grpo, remix.py
    source: str  # what a refusal names: the file, or the diff applied to remix.py
    code: bytes
    configs: tuple
    method_args: str = ""  # its flags as given on the command line
    flags: dict = dataclasses.field(default_factory=dict)  # ... as its own Args read them (check_arm)
    label: str = ""  # its runs are CONFIG+LABEL (name_arm)
    project: Path | None = None  # the folder its jobs import remix from; None: the repository's remix.py


def refuse(message: str):
    """Bad input: one line on stderr and exit 2, before anything is built or run."""
    print(f"toy: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def toy_flag_for(field: str) -> str | None:
    """What to give instead, when --method-args names a remix.Args field the toy sets for both arms; None if the toy
    leaves the field to the method."""
    if TOY_FLAGS.get(field):
        return f"give the toy's {TOY_FLAGS[field]}"
    if field != "fork" and any(field in overrides for overrides in CONFIGS.values()):
        return "pick a configuration with the toy's --configs"
    if field in TOY_FLAGS or field in shared_settings(1, 1, 1.0):
        return "the toy fixes it"
    return None


def is_switch(kind) -> bool:
    """A bool field (or bool | None): --flag and --no-flag, no value."""
    return kind is bool or (typing.get_origin(kind) in (typing.Union, types.UnionType)
                            and set(typing.get_args(kind)) == {bool, type(None)})


def typed(kind, text: str, flag: str):
    """text as a value of a field of type kind: int, float, str, a Literal, X | None."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if text == "None" and type(None) in typing.get_args(kind):
            return None
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if typing.get_origin(kind) is typing.Literal:
        choices = typing.get_args(kind)
        if text not in map(str, choices):
            refuse(f"--method-args: --{flag} is one of {', '.join(map(str, choices))}, not {text!r}")
        return next(c for c in choices if str(c) == text)
    try:
        if kind in (int, float, str):
            return kind(text)
    except ValueError:
        refuse(f"--method-args: --{flag} takes {'an integer' if kind is int else 'a number'}, not {text!r}")
    refuse(f"--method-args: --{flag} is a {kind}, which the toy does not read from text")


def parse_method_args(cls, text: str, source: str = "the method") -> dict:
    """--method-args, written as on the method's command line, read by its Args (cls) and the run's settings beside
    them (as its command line reads them: machinery.console.settings_type) into fields of their types:
    '--my-flag 0.3 --other --no-kl-convex' -> {'my_flag': 0.3, 'other': True, 'kl_convex': False}; a tuple field
    takes the values up to the next flag. An unknown flag, a value that does not read, or a flag the toy sets for
    both arms is one line naming the flag (refuse)."""
    import difflib
    import shlex

    try:
        tokens = shlex.split(text)
    except ValueError as error:
        refuse(f"--method-args={text!r} does not split into flags ({error})")
    from machinery import console

    every = console.settings_type(cls)
    fields, hints, parsed = [f.name for f in dataclasses.fields(every)], typing.get_type_hints(every), {}
    while tokens:
        token = tokens.pop(0)
        if not token.startswith("--") or token == "--":
            refuse(f"--method-args: {token!r} is not a flag; write the method's flags as on its command line: "
                   f"--method-args=\"--my-flag 0.3 --other\"")
        flag, given, value = token[2:].partition("=")
        field = flag.replace("-", "_")
        negated = field not in fields and field.startswith("no_") and field[3:] in fields and is_switch(hints[field[3:]])
        field = field[3:] if negated else field
        if field not in fields:
            close = difflib.get_close_matches(flag, [f.replace("_", "-") for f in fields], 1)
            toys = field in {f.name for f in dataclasses.fields(ToyArgs)}
            refuse(f"--method-args: {source} has no flag --{flag}" + (f" (did you mean --{close[0]}?)" if close else
                   f" (--{flag} is the toy's own: give it outside --method-args)" if toys else ""))
        if toy_flag_for(field):
            refuse(f"--method-args: --{flag} is set by the toy for both arms: {toy_flag_for(field)}")
        if field in parsed:
            refuse(f"--method-args: --{flag} is given twice")
        kind = hints[field]
        if is_switch(kind):
            if given:
                refuse(f"--method-args: --{flag} takes no value (--{field.replace('_', '-')} or "
                       f"--no-{field.replace('_', '-')})")
            parsed[field] = not negated
            continue
        many = typing.get_origin(kind) is tuple
        values = [value] if given else []
        while not given and tokens and not tokens[0].startswith("--") and (many or not values):
            values.append(tokens.pop(0))
        if not values:
            refuse(f"--method-args: --{flag} needs a value")
        parsed[field] = tuple(typed(typing.get_args(kind)[0], v, flag) for v in values) if many else \
            typed(kind, values[0], flag)
    return parsed


def import_failure(error: BaseException, copy: Path, source: str) -> str:
    """One line for what importing the method raised: the method's file and line, and the exception."""
    if isinstance(error, SyntaxError) and error.filename and Path(error.filename) == copy:
        return f"{source} line {error.lineno}: {type(error).__name__}: {error.msg}"
    lines = [line for frame, line in traceback.walk_tb(error.__traceback__) if Path(frame.f_code.co_filename) == copy]
    where = f"{source} line {lines[-1]}" if lines else source
    message = (str(error).strip().splitlines() or [""])[0]
    return f"{where}: {type(error).__name__}{': ' + message if message else ''} (raised while importing it)"


def check_method(cli: ToyArgs):
    """The early check's child process, TOY_PROJECT a folder that holds the method as remix.py: the method imported as
    the jobs will import it, what the toy calls found in it, --method-args read by its Args and checked at each
    configuration with the method's own checks; prints the flags as JSON, or one line (exit 2)."""
    import contextlib
    import io

    copy, source = Path(os.environ["TOY_PROJECT"]) / "remix.py", cli.method
    try:
        import remix
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # a SystemExit at import, too
        refuse(import_failure(error, copy, source))
    from machinery import console, runner as session

    lacking = [name for name in ("Args", "train", "build_prompt", "METHOD") if not hasattr(remix, name)]
    if lacking or not dataclasses.is_dataclass(remix.Args) or not isinstance(remix.METHOD, session.Method):
        refuse(f"{source} is not a fork of remix.py: " + (f"it has no {', '.join(lacking)}" if lacking else
               "its Args is not a dataclass or its METHOD not a runner.Method") +
               " (the toy calls its Args, train, build_prompt and METHOD)")
    method_flags = parse_method_args(remix.Args, cli.method_args, source)
    for config in cli.configs:
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                args = run_args(config, 1, cli.lr, cli.steps, cli.reincarnate_step, "toy", Path("out"), method_flags)
                console.check_args(remix.METHOD.finalize(args), 1)
        except SystemExit:
            line = (said.getvalue().strip().splitlines() or ["?"])[-1].split("error: ", 1)[-1]
            refuse(f"--method-args={cli.method_args!r} at {config}: {line.replace(str(copy), source)}")
        except Exception as error:
            refuse(f"--method-args={cli.method_args!r} at {config}: {type(error).__name__}: {error}")
    print(json.dumps({"flags": method_flags}))


def check_arm(arm: Arm, cli: ToyArgs) -> dict:
    """The method checked first, before the base model is built or a job starts: a child process imports it as the
    jobs will (as remix.py in a folder of its own) and reads its flags (check_method). A syntax error, an exception at
    import, a file that is not a fork of remix.py or a bad --method-args is one line naming the file and the line, and
    exit 2. Returns the method's flags as its Args read them."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "remix.py").write_bytes(arm.code)
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOY_PROJECT=folder)
        command = [sys.executable, str(HERE / "toy.py"), "--check-method", "--method", arm.source,
                   f"--method-args={arm.method_args}", "--lr", repr(cli.lr), "--steps", str(cli.steps),
                   "--reincarnate-step", str(cli.reincarnate_step), "--configs", *arm.configs]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CHECK_SECONDS)
        except subprocess.TimeoutExpired:
            refuse(f"{arm.source} did not import in {CHECK_SECONDS} s")
    said = done.stderr.strip().splitlines() or [""]
    if done.returncode == 2 and said[-1].startswith("toy: error: "):
        refuse(said[-1][len("toy: error: "):])
    if done.returncode != 0:
        refuse(f"checking {arm.source} ended with exit code {done.returncode}: {said[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["flags"]


@functools.cache
def machinery_digest() -> bytes:
    """sha256 of the machinery's source, which every arm runs on."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((ROOT / "machinery").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.digest()


def name_arm(arm: Arm, stem: str, toy: str, in_place: bool = False) -> Arm:
    """The arm's label: its stem and a digest of what makes its runs what they are, beyond the settings and the seed
    that a run's folder names: its code, its flags as read, the machinery and the base model. A run under --out is
    read back only under the same label, so remix.py's runs serve every method compared with it, and an edited file or
    other flags train anew. Its project folder, under the cache (in_place: the repository's remix.py, none)."""
    import hashlib

    digest = hashlib.sha256()
    for part in (arm.code, json.dumps(arm.flags, sort_keys=True).encode(), machinery_digest(),
                 (Path(toy) / "meta.json").read_bytes()):
        digest.update(hashlib.sha256(part).digest())
    arm.label = f"{stem}-{digest.hexdigest()[:8]}"
    arm.project = None if in_place else project(arm.code, Path(toy) / "methods" / arm.label)
    return arm


def reference_arm(configs, toy: str) -> Arm:
    """remix.py as it is, the arm every method is compared with."""
    return name_arm(Arm("remix.py", "remix.py", (ROOT / "remix.py").read_bytes(), tuple(configs)), "remix", toy, True)


def method_arms(cli: ToyArgs) -> list[Arm]:
    """--method's file, or (--forks) every diff of docs/forks applied to remix.py, each at the configurations it fits;
    each checked first (check_arm)."""
    if cli.method:
        configs = METHOD_CONFIGS if cli.configs == SHORT else cli.configs
        arms = [Arm(Path(cli.method).name, cli.method, Path(cli.method).read_bytes(), tuple(configs), cli.method_args)]
    else:
        arms = []
        for diff in sorted((ROOT / "docs" / "forks").glob("*.diff")):
            algos = FORK_ALGOS.get(diff.stem, ("grpo", "ppo"))
            configs = [c for c in (METHOD_CONFIGS if cli.configs == SHORT else cli.configs) if CONFIGS[c]["algo"] in algos]
            if configs:
                arms.append(Arm(diff.stem, f"{diff.stem} (remix.py with docs/forks/{diff.name})", patched_remix(diff),
                                tuple(configs), FORK_ARGS.get(diff.stem, "")))
    with concurrent.futures.ThreadPoolExecutor(cli.workers) as pool:
        for arm, method_flags in zip(arms, pool.map(lambda arm: check_arm(arm, cli), arms)):
            arm.flags = method_flags
    return arms


def probe(arms: list[Arm], reference: Arm, cli: ToyArgs, toy: str) -> dict:
    """Each arm and remix.py over the first PROBE_STEPS steps of the arm's first configuration at seed 1: label -> True
    where the policy's weights after them are remix.py's, bit for bit."""
    steps = min(PROBE_STEPS, cli.steps)
    job = lambda config, arm: job_name(f"{config}+{arm.label}", 1, cli.lr, steps, cli.reincarnate_step)  # noqa: E731
    jobs = [job(arm.configs[0], side) for arm in arms for side in (reference, arm)]
    by_label = {arm.label: arm for arm in arms + [reference]}
    weights = {r["config"]: r["weights_sha256"] for r in run_jobs(jobs, cli, toy, by_label, probe=True)}
    return {arm.label: weights[f"{arm.configs[0]}+{arm.label}"] == weights[f"{arm.configs[0]}+{reference.label}"]
            for arm in arms}


def probe_line(arm: Arm, same: bool, steps: int, seconds: float) -> str:
    """The probe's one line: identical first steps are a warning, and say why they may be."""
    where = f"the first {steps} steps of {arm.configs[0]} at seed 1"
    if not same:
        return f"toy: {arm.name} and remix.py differ after {where} (the policy's weights; probed in {seconds:.0f} s)"
    return (f"toy: warning: {arm.name} computed what remix.py computes in {where} (the policy's weights are the same, "
            f"bit for bit): a flag of its own that is off by default (give it with --method-args=\"--flag ...\"), or "
            f"a change that acts later (a schedule, a deque that fills, T); the runs go on (probed in {seconds:.0f} s)")


def same_run(a: dict, b: dict) -> bool:
    """Two runs that computed the same: every evaluation (all but its seconds) and the final weights equal."""
    points = lambda r: [{k: v for k, v in p.items() if k != "seconds"} for p in r["curve"]]  # noqa: E731
    return points(a) == points(b) and a.get("weights_sha256") == b.get("weights_sha256")


def verdict(mine: list[dict], theirs: list[dict]) -> dict:
    """A method's runs against remix.py's at one configuration, paired by seed: the mean over seeds of (method -
    remix.py) final held-out Pass@1 with a percentile bootstrap 90% interval over seeds, the ratio of final rollouts,
    the seeds, and a word: better (the interval above 0), worse (below 0), not resolved (it holds 0), or identical runs
    (same_run at every seed: nothing to compare)."""
    by_seed = {r["seed"]: r for r in theirs}
    pairs = [(r, by_seed[r["seed"]]) for r in sorted(mine, key=lambda r: r["seed"]) if r["seed"] in by_seed]
    differences = [a["curve"][-1]["accuracy"] - b["curve"][-1]["accuracy"] for a, b in pairs]
    lo, hi = bootstrap_interval(differences, stat=statistics.fmean)
    rollouts = median([a["curve"][-1]["rollouts"] for a, _ in pairs]) / median([b["curve"][-1]["rollouts"]
                                                                                for _, b in pairs])
    word = "identical runs" if all(same_run(a, b) for a, b in pairs) else \
        "better" if lo > 0 else "worse" if hi < 0 else "not resolved"
    return {"seeds": len(pairs), "difference": statistics.fmean(differences), "lo": lo, "hi": hi,
            "each": differences, "rollouts_ratio": rollouts, "word": word}


def verdict_words(v: dict) -> str:
    """A verdict in words: '+0.012 [-0.004, +0.027] over 3 seeds, rollouts 1.00x: not resolved (...)'."""
    if v["word"] == "identical runs":
        return f"identical runs at all {v['seeds']} seeds (every evaluation and the final weights the same)"
    text = (f"{v['difference']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}] over {v['seeds']} seeds, rollouts "
            f"{v['rollouts_ratio']:.2f}x: {v['word']}")
    return text + (" (the 90% interval holds 0; more seeds narrow it)" if v["word"] == "not resolved" else "")


def arm_runs(results: list[dict], config: str, arm: Arm) -> list[dict]:
    return [r for r in results if r["config"] == f"{config}+{arm.label}"]


def method_comparison(results: list[dict], arm: Arm, reference: Arm) -> dict:
    """For each configuration of the arm, its runs against remix.py's at the same seeds: the verdict, the final
    accuracies, and the rollouts (and tokens) each needs to reach remix.py's median final accuracy (compare(), with
    remix.py in the place of the baseline)."""
    table = {}
    for config in arm.configs:
        mine, theirs = arm_runs(results, config, arm), arm_runs(results, config, reference)
        table[config] = {"verdict": verdict(mine, theirs), **compare(mine, theirs)}
    return table


VERDICT_TEXT = ("the difference is the mean over seeds of the method's final held-out Pass@1 minus remix.py's at the "
                "same seed, with a percentile bootstrap 90% interval over seeds: better or worse where the interval "
                "lies above or below 0, not resolved where it holds 0 (with 3 to 5 seeds the interval is wide; more "
                "seeds, --seeds, narrow it); identical runs: at every seed, every evaluation and the final weights "
                "are remix.py's, so there is nothing to compare")


def method_markdown(table: dict, arm: Arm, same_start: bool, steps: int) -> str:
    flags = f" with --method-args=\"{arm.method_args}\"" if arm.method_args else ""
    lines = [f"Method {arm.name}{flags} against remix.py, same configurations and seeds; {VERDICT_TEXT}.", "",
             "| configuration | seeds | final Pass@1, remix.py | final Pass@1, method | difference, method - remix.py "
             "[90% interval] | rollouts, method / remix.py | verdict |", "|" + "---|" * 7]
    for config, c in table.items():
        v = c["verdict"]
        lines.append(f"| {config} | {v['seeds']} | {fmt(c['on_policy_final_accuracy'])} | "
                     f"{fmt(c['remix_final_accuracy'])} | {v['difference']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}] | "
                     f"{v['rollouts_ratio']:.2f} | **{v['word']}** |")
    first = next(iter(table))
    lines += ["", f"The probe: after the first {steps} steps of {first} at seed 1 the policy's weights "
              + ("were remix.py's, bit for bit." if same_start else "differed from remix.py's."), "",
              "Rollouts to remix.py's median final Pass@1 (medians over seeds, bootstrap 90% intervals; never = a seed "
              "that does not reach it):", "",
              "| configuration | target: remix.py's final | rollouts to it, remix.py | rollouts to it, method |",
              "|---|---|---|---|"]
    for config, c in table.items():
        lines.append(f"| {config} | {c['target_final']:.3f} | {fmt(c['on_policy_rollouts_to_final'], 0)} | "
                     f"{fmt(c['remix_rollouts_to_final'], 0)} |")
    return "\n".join(lines) + "\n"


def method_plot(results: list[dict], arm: Arm, reference: Arm, path: Path):
    """Held-out accuracy against rollouts: each seed's curve, remix.py's and the method's, one panel a configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(arm.configs), figsize=(6 * len(arm.configs), 4.5), squeeze=False)
    for ax, config in zip(axes[0], arm.configs):
        for side, color in ((reference, "tab:blue"), (arm, "tab:red")):
            for i, r in enumerate(arm_runs(results, config, side)):
                ax.plot([p["rollouts"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]], color=color,
                        alpha=0.7, marker=".", label=side.name if i == 0 else None)
        ax.set_title(config)
    finish(fig, axes[0], ["held-out Pass@1"] * len(arm.configs), "rollouts", path)


def arm_jobs(arms: list[Arm], reference: Arm, cli: ToyArgs) -> list[str]:
    """Every arm's runs and remix.py's, once, at each configuration an arm runs, at the same seeds."""
    seeds = range(1, (cli.seeds or 3) + 1)
    configs = list(dict.fromkeys(c for arm in arms for c in arm.configs))
    return [job_name(f"{c}+{reference.label}", s, cli.lr, cli.steps, cli.reincarnate_step) for c in configs
            for s in seeds] + [job_name(f"{c}+{arm.label}", s, cli.lr, cli.steps, cli.reincarnate_step)
                               for arm in arms for c in arm.configs for s in seeds]


def compare_method(cli: ToyArgs, toy: str, arm: Arm) -> tuple[str, str]:
    """--method: the probe, then the configurations with remix.py and with the method, at the same seeds and settings;
    writes method.json, method.md and method.png into --out. Returns the table and the verdict's line."""
    reference = reference_arm(arm.configs, toy)
    name_arm(arm, Path(cli.method).stem, toy)
    steps, started = min(PROBE_STEPS, cli.steps), time.perf_counter()
    same_start = probe([arm], reference, cli, toy)[arm.label]
    print(probe_line(arm, same_start, steps, time.perf_counter() - started), flush=True)
    results = run_jobs(arm_jobs([arm], reference, cli), cli, toy, {a.label: a for a in (reference, arm)})
    table = method_comparison(results, arm, reference)
    out = Path(cli.out)
    record = {"method": str(Path(cli.method).resolve()), "method_args": arm.method_args, "flags": arm.flags,
              "label": arm.label, "remix_label": reference.label, "settings": dataclasses.asdict(cli),
              "machine": machine(cli.workers), "probe": {"steps": steps, "same_weights": same_start},
              "comparison": table, "runs": results}
    (out / "method.json").write_text(json.dumps(never_as_null(record), indent=1, allow_nan=False))
    text = method_markdown(table, arm, same_start, steps)
    (out / "method.md").write_text(text)
    method_plot(results, arm, reference, out / "method.png")
    line = f"toy: {arm.name} against remix.py: " + "; ".join(f"{config}: {verdict_words(c['verdict'])}"
                                                            for config, c in table.items())
    return text, line


def forks_markdown(record: dict) -> str:
    """docs/toy/forks.md: a row per fork of docs/forks and configuration, from forks.json."""
    s, m, default = record["settings"], record["machine"], ToyArgs()
    command = f"python toy/toy.py --forks --seeds {s['seeds']}" + "".join(
        f" --{k.replace('_', '-')} {s[k]:g}" for k in ("lr", "steps", "reincarnate_step") if s[k] != getattr(default, k))
    grid = "at the last step" if s["eval_every"] >= s["steps"] else f"every {s['eval_every']} steps"
    minutes = round(record["seconds"] / 60)
    lines = ["# Every fork of docs/forks on the toy", "",
             f"Made by one command, `{command} --out OUT` (OUT/forks.md and OUT/forks.json), in {minutes // 60} h "
             f"{minutes % 60:02d} min on {m['cpu']} ({m['cpus']} cores, {m['workers']} runs at a time on one thread "
             f"each, torch {m['torch']}, {m['cpu_capability']} kernels). Each fork runs beside remix.py at the "
             f"configurations it fits (ReMix-GRPO, and ReMix-PPO unless it changes GRPO's groups), at lr "
             f"{s['lr']:g}, {s['steps']} steps, T = {s['reincarnate_step']}, held-out Pass@1 of 1,000 problems {grid}, "
             f"seeds 1 to {s['seeds']}, from one base model; remix.py's runs are made once and serve every fork. "
             f"{VERDICT_TEXT[0].upper()}{VERDICT_TEXT[1:]}. The probe (first steps): the first "
             f"{record['probe_steps']} steps of the fork's first configuration at seed 1, the policy's weights compared "
             f"bit for bit with remix.py's (identical first steps are said, and the runs go on).", "",
             "| fork | what it changes | configuration | flags | difference in final Pass@1, fork - remix.py "
             "[90% interval] | rollouts, fork / remix.py | seeds | verdict | first steps |", "|" + "---|" * 9]
    for name, fork in record["forks"].items():
        for config, v in fork["verdicts"].items():
            difference = "" if v["word"] == "identical runs" else \
                f"{v['difference']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}]"
            lines.append(f"| `{name}` | {fork['changes']} | {config} | {fork['method_args'] or 'none'} | {difference} "
                         f"| {v['rollouts_ratio']:.2f} | {v['seeds']} | **{v['word']}** | "
                         f"{'same' if fork['same_start'] else 'differ'} |")
    remix = ", ".join(f"{config} {fmt(entry)}" for config, entry in record["remix_final_accuracy"].items())
    lines += ["", f"remix.py's final Pass@1 (median over seeds, bootstrap 90% interval): {remix}."]
    unresolved = [(name, fork) for name, fork in record["forks"].items()
                  if any(v["word"] in ("not resolved", "identical runs") for v in fork["verdicts"].values())]
    if unresolved:
        lines += ["", "## Why the toy does not resolve these", ""]
        lines += [f"- `{name}`: {FORK_WHY.get(name) or 'no reason recorded yet'}" for name, _ in unresolved]
    return "\n".join(lines) + "\n"


def compare_forks(cli: ToyArgs, toy: str, arms: list[Arm], start: float) -> str:
    """--forks: every fork of docs/forks against remix.py (its runs made once, shared by all), after the probe;
    writes forks.json and forks.md into --out. Returns the page."""
    configs = list(dict.fromkeys(c for arm in arms for c in arm.configs))
    reference = reference_arm(configs, toy)
    for arm in arms:
        name_arm(arm, arm.name, toy)
    steps, started = min(PROBE_STEPS, cli.steps), time.perf_counter()
    same_start = probe(arms, reference, cli, toy)
    for arm in arms:
        print(probe_line(arm, same_start[arm.label], steps, time.perf_counter() - started), flush=True)
    results = run_jobs(arm_jobs(arms, reference, cli), cli, toy, {a.label: a for a in arms + [reference]})
    forks = {arm.name: {"changes": FORK_CHANGES.get(arm.name, "see the diff"), "method_args": arm.method_args,
                        "flags": arm.flags, "label": arm.label, "same_start": same_start[arm.label],
                        "verdicts": {c: verdict(arm_runs(results, c, arm), arm_runs(results, c, reference))
                                     for c in arm.configs}} for arm in arms}
    kept = ("step", "reward", "length", "clipfrac", "historical_zero_spread")  # of each step's statistics
    record = {"settings": {**dataclasses.asdict(cli), "seeds": cli.seeds or 3}, "machine": machine(cli.workers),
              "seconds": time.perf_counter() - start, "probe_steps": steps, "remix_label": reference.label,
              "remix_final_accuracy": {c: spread(final_accuracies(arm_runs(results, c, reference))) for c in configs},
              "forks": forks, "runs": [{**r, "per_step": [{k: x.get(k) for k in kept} for x in r["per_step"]]}
                                       for r in results]}
    out = Path(cli.out)
    (out / "forks.json").write_text(json.dumps(never_as_null(record), indent=1, allow_nan=False))
    page = forks_markdown(record)
    (out / "forks.md").write_text(page)
    return page


# ----------------------------------------------------------------------------------------------
# Step time against TRL's GRPOTrainer
# ----------------------------------------------------------------------------------------------
def trl_comparison(toy: Path, out: Path, rounds: int, steps: int) -> dict:
    """Median seconds per step of remix.py and TRL's GRPOTrainer, each in its own process, alternating."""
    times: dict = {"remix": [], "trl": []}
    for _ in range(rounds):
        for which in ("remix", "trl"):
            done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trl_step.py"), which, str(toy), str(steps)],
                                  capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
            if done.returncode != 0:
                print(f"toy: the {which} step-time run failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                return {}
            times[which] += json.loads(done.stdout.strip().splitlines()[-1])
    result = {k: statistics.median(v) for k, v in times.items()}
    result["trl_over_remix"] = result["trl"] / result["remix"]
    result["samples"] = {k: len(v) for k, v in times.items()}
    (out / "trl_step_time.json").write_text(json.dumps(result, indent=1))
    return result


PIN = dict(job="remix-grpo@1@0.0001@4@2", supervised_steps=300, test=200, eval_every=2)


def pin_fused_adamw():
    """AdamW's default step takes the square root of its second moment with torch.sqrt, which is MKL's float32 sqrt:
    not correctly rounded, and not the same on every CPU even under MKL_CBWR=COMPATIBLE (of 100,000 values, 19,501
    differ from the exact root on an Intel Xeon, 19,241 on an emulated Haswell or EPYC). torch's fused AdamW kernel
    takes the exact IEEE square root. The pinned run uses it, for the base and for remix.train's optimizers."""
    import torch

    class FusedAdamW(torch.optim.AdamW):
        def __init__(self, params, **kwargs):
            super().__init__(params, fused=True, **kwargs)

    torch.optim.AdamW = FusedAdamW


def pinned_curve(cache: Path) -> dict:
    """The short run tests/test_toy.py pins: a base trained for 300 supervised steps, 200 held-out problems, 4 steps
    of ReMix-GRPO at lr 1e-4 with seed 1, evaluated every 2 steps. Every number but the seconds, which vary."""
    import tempfile

    pin_fused_adamw()
    toy = build_toy(cache, supervised_steps=PIN["supervised_steps"], test=PIN["test"])
    meta = json.loads((toy / "meta.json").read_text())
    with tempfile.TemporaryDirectory() as out:
        result = run(PIN["job"], str(toy), out, PIN["eval_every"])
    return {"base": {k: meta[k] for k in ("test_accuracy", "test_greedy_accuracy", "test_length")},
            "job": PIN["job"], "curve": [{k: v for k, v in point.items() if k != "seconds"} for point in result["curve"]],
            "rewards": [step["reward"] for step in result["per_step"]]}


def settled(cli: ToyArgs) -> ToyArgs:
    """The settings with their defaults filled in: held-out evaluation every 3 steps, every 6 with --method, at the last
    step only with --forks (its verdicts read the final Pass@1)."""
    if cli.eval_every is not None and cli.eval_every < 1:  # a grid past a run's steps evaluates at its end only
        refuse(f"--eval-every {cli.eval_every} is out of range; give 1 or more")
    return dataclasses.replace(cli, eval_every=cli.eval_every or (6 if cli.method else cli.steps if cli.forks else 3))


def check_request(cli: ToyArgs):
    """The toy's own flags together, each problem one line (exit 2)."""
    unknown = [c for c in cli.configs if c not in CONFIGS]
    if unknown:
        refuse(f"unknown configuration {unknown}; valid: {list(CONFIGS)}")
    if cli.method and cli.forks:
        refuse("--method and --forks: give one (--forks runs the forks of docs/forks, --method your file)")
    if cli.method_args and not cli.method:
        refuse("--method-args gives the flags of the --method file: give --method too")
    if cli.method and not (cli.method.endswith(".py") and Path(cli.method).is_file()):
        refuse(f"--method {cli.method!r} is not a Python file; give a fork of remix.py (remix_mine.py)")


def replot(cli: ToyArgs, out: Path):
    """The tables and plots again from the records in --out, with the settings they were run with (--forks: forks.md
    from forks.json)."""
    if cli.forks:
        (out / "forks.md").write_text(forks_markdown(json.loads((out / "forks.json").read_text())))
        print(f"toy: {out / 'forks.md'} rebuilt")
        return
    saved = json.loads((out / "results.json").read_text())
    fields = {f.name for f in dataclasses.fields(ToyArgs)}
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in saved["settings"].items() if k in fields}
    write_outputs(saved["runs"], dataclasses.replace(cli, **{**settings, "out": cli.out, "replot": True}), out, saved)
    print(f"toy: tables and plots rebuilt in {out}")


def main(cli: ToyArgs):
    cli = settled(cli)
    if cli.check_method:
        check_method(cli)
        return
    if cli.pin:
        curve = pinned_curve(Path(cli.cache) / "pin-portable-fused")
        Path(cli.pin).parent.mkdir(parents=True, exist_ok=True)
        Path(cli.pin).write_text(json.dumps(curve, indent=1) + "\n")
        print(f"toy: the pinned run's curve is in {cli.pin}: {curve['curve']}")
        return
    if cli.jobs:
        for job in cli.jobs:
            run(job, cli.cache, cli.out, cli.eval_every, cli.method_args, cli.probe)
        return
    check_request(cli)
    os.environ["HF_HUB_OFFLINE"] = "1"
    out = Path(cli.out)
    if cli.replot:
        replot(cli, out)
        return
    start = time.perf_counter()
    arms = method_arms(cli) if cli.method or cli.forks else []  # checked first: a broken file is one line, now
    out.mkdir(parents=True, exist_ok=True)
    toy = str(build_toy(Path(cli.cache)))
    import torch

    print(f"toy: base model {json.loads((Path(toy) / 'meta.json').read_text())}, torch's CPU kernels: "
          f"{torch.backends.cpu.get_cpu_capability()}", flush=True)
    seeds = range(1, (cli.seeds or (5 if cli.study else 3)) + 1)
    if cli.method:
        text, verdict_line = compare_method(cli, toy, arms[0])
        print(text)
        print(f"toy: done in {time.perf_counter() - start:.0f} s; both curves in {out / 'method.png'}")
        print(verdict_line)
        return
    if cli.forks:
        print(compare_forks(cli, toy, arms, start))
        print(f"toy: done in {time.perf_counter() - start:.0f} s; the table in {out / 'forks.md'}")
        return
    if cli.study:
        four = ("remix-grpo", "grpo", "remix-ppo", "ppo")
        results = run_jobs([job_name(c, s, lr, cli.steps, cli.reincarnate_step) for lr in STUDY_LRS for c in four
                            for s in seeds], cli, toy)
        best = best_lrs(by_method(results), cli.steps)
        print(f"toy: best lr {best}", flush=True)
        phase2 = [job_name(base, s, float(f"{f * best[name]:g}"), cli.steps, cli.reincarnate_step)
                  for name, base in PAIRS.values() for f in (2, 4) for s in seeds]
        phase2 += [job_name(name, s, best["remix-grpo"], cli.steps, cli.reincarnate_step) for name in P_SWEEP.values()
                   if name != "remix-grpo" for s in seeds]
        phase2 += [job_name(name, s, best[name], 60, 30) for name in four for s in seeds]
        phase2 += [job_name("remix-ppo/p=0.0", s, best["remix-ppo"], steps, T) for steps, T in
                   ((cli.steps, cli.reincarnate_step), (60, 30)) for s in seeds]
        # Table 3 in miniature, and the candidate causes of ReMix-GRPO's missing saving, at ReMix's best lr
        phase2 += [job_name(f"{name}/{suffix}", s, best[name], cli.steps, cli.reincarnate_step)
                   for name, _ in PAIRS.values() for suffix in TABLE3.values() for s in seeds]
        phase2 += [job_name(name, s, best["remix-grpo"], cli.steps, cli.reincarnate_step) for name in CAUSES
                   for s in seeds]
        results += run_jobs(phase2, cli, toy)
    else:
        results = run_jobs([job_name(c, s, cli.lr, cli.steps, cli.reincarnate_step) for s in seeds for c in cli.configs],
                           cli, toy)
    print(write_outputs(results, cli, out))
    if cli.trl_rounds and not cli.study:
        print("toy: step time against TRL:", trl_comparison(Path(toy), out, cli.trl_rounds, 6), flush=True)
    print(f"toy: done in {time.perf_counter() - start:.0f} s; results in {out}")


def joined_method_args(argv: list[str]) -> list[str]:
    """argv with '--method-args X' as '--method-args=X': the parser would take a value that starts with '--' for a
    flag of its own."""
    joined = list(argv)
    for i, token in enumerate(joined[:-1]):
        if token == "--method-args":
            joined[i : i + 2] = [f"--method-args={joined[i + 1]}"]
            break
    return joined


if __name__ == "__main__":
    from machinery import console, runner as program

    console._state["prog"] = "toy"  # a refusal of the toy's command line is the toy's; its runs' lines stay remix's
    cli = program.parse(ToyArgs, joined_method_args(sys.argv[1:]))
    console._state["prog"] = "remix"
    main(cli)
