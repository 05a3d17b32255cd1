"""The paper's claim in miniature, on a CPU in minutes: ReMix against on-policy GRPO and PPO on a toy task.

    pip install -r requirements-toy.txt && python toy.py            # about 9.5 minutes on 2 cores

The toy: "What is 3 + 5 + 8 + 2?" for 3 to 5 digits, graded by remix.math_reward. The base model is a
tiny Qwen2 (hidden 128, 2 layers, byte-level tokenizer plus one token for the fixed instruction) trained by
supervised learning on two answer styles: a quarter of the targets work the running sums out before the
box ('3+5=8 8+8=16 16+2=18 \\boxed{18}', up to 42 tokens), the rest give the bare '\\boxed{18}' (about 11).
Response length is free to move either way under RL: the base writes the sums out in about 28% of its
samples, and those are right less often than its bare answers (about 40% against 57%).
4,000 training and 300 held-out problems. Every run is the real remix.train loop (transformers sampler),
with held-out Pass@1 (one sample per problem at temperature 1, from a fixed seed) every 6 steps. The
paper's time axis is scaled by about 1/8: 24 steps, reincarnation at T = 12, the KL-Convex lambda falling
after step 4 by 0.1 every 2 steps. The actor lr, 3e-5, is the best of 1e-5 / 3e-5 / 1e-4 for both
on-policy baselines (docs/toy/lr_sweep.md); TOY_LR, TOY_STEPS and TOY_T override the three.

Writes to --out: results.json (per configuration and seed: accuracy after each evaluation, rollouts and
generated tokens so far, wall seconds; and the cost to reach a target accuracy), results.md, and the
plots accuracy_vs_rollouts.png, accuracy_vs_tokens.png and length_vs_step.png; then a step-time
comparison with TRL's GRPOTrainer on the same model and batch (trl_step_time.json).
"""

import argparse
import json
import concurrent.futures
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

TOY_VERSION = 4  # a cache built by another version of the task is rebuilt
SCRATCHPAD_SHARE = 0.25  # supervised targets with the worked running sums; the rest are the bare boxed answer
SUPERVISED_STEPS, SUPERVISED_LR = 1500, 1e-3
MAX_TOKENS = 48  # the longest worked answer (five 9s) is 42 tokens with EOS
TEST, VAL, TRAIN = 1000, 200, 4000
EVAL_TEMPERATURE = 1.0  # held-out Pass@1 of one sample per problem at the training temperature; 0 = greedy
STEPS, T = int(os.environ.get("TOY_STEPS", 24)), int(os.environ.get("TOY_T", 12))
SHARED = dict(steps=STEPS, reincarnate_step=T, kl_convex_start=T // 3, kl_convex_every=2,
              max_response_tokens=MAX_TOKENS,
              temperature=1.0, actor_lr=float(os.environ.get("TOY_LR", 3e-5)), critic_lr=1e-3, sampler="hf",
              save_every=0, grader_workers=1, max_prompt_tokens=256)
GRPO = dict(algo="grpo", prompts_per_step=8, group_size=8, mini_batch_prompts=4)
PPO = dict(algo="ppo", prompts_per_step=64, group_size=1, mini_batch_prompts=32)
ON_POLICY = dict(on_policy=True)  # p = 0, m = 1, no reincarnation, KL to the base model only
CONFIGS = {  # name -> remix.Args overrides; ReMix is the paper's defaults p = 0.4, N = 2, m = 2
    "remix-grpo": GRPO,
    "grpo": {**GRPO, **ON_POLICY},
    "remix-ppo": PPO,
    "ppo": {**PPO, **ON_POLICY},
    "remix-grpo/no-utd": {**GRPO, "utd": 1},
    "remix-grpo/no-kl-convex": {**GRPO, "kl_convex": False},
    "remix-grpo/no-reincarnation": {**GRPO, "reincarnation": False},
    "remix-grpo/p=0.0": {**GRPO, "off_policy_p": 0.0},
    "remix-grpo/p=0.2": {**GRPO, "off_policy_p": 0.2},
    "remix-grpo/p=0.6": {**GRPO, "off_policy_p": 0.6},
}
P_SWEEP = {0.0: "remix-grpo/p=0.0", 0.2: "remix-grpo/p=0.2", 0.4: "remix-grpo", 0.6: "remix-grpo/p=0.6"}


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
    """Held-out Pass@1 graded by math_reward's grader, the mean response length, and the share of
    responses that work the sums out before the box. Temperature 0 is greedy; above 0, one sample per
    problem from a fixed seed, leaving the caller's RNG streams alone."""
    import torch

    import remix

    settings = remix.Args(temperature=temperature, max_response_tokens=MAX_TOKENS, mini_batch_prompts=len(problems))
    prompts = [remix.build_prompt(tokenizer, p["problem"]) for p in problems]
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        groups = remix.hf_generate(model, tokenizer, prompts, 1, settings, model.device)
    texts = [tokenizer.decode(g[0][0], skip_special_tokens=True) for g in groups]
    grades = remix.grade_many([(t, [p["answer"]]) for t, p in zip(texts, problems)], workers=1)
    worked = sum(not t.lstrip().startswith("\\boxed") for t in texts) / len(texts)
    return sum(g[0] for g in grades) / len(problems), sum(len(g[0][0]) for g in groups) / len(groups), worked


def build_toy(cache: Path, seed: int = 0) -> Path:
    """Data splits and the warmed-up base model, built once and reused."""
    if (cache / "meta.json").exists() and json.loads((cache / "meta.json").read_text()).get("version") == TOY_VERSION:
        return cache
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import remix
    from tiny_model import build_tiny_model

    rng = random.Random(seed)
    seen, problems = set(), []
    while len(problems) < TEST + VAL + TRAIN:  # distinct lists of 3 to 5 digits
        digits = tuple(rng.randrange(10) for _ in range(rng.randint(3, 5)))
        if digits not in seen:
            seen.add(digits)
            problems.append(digits)
    splits = {"test": problems[:TEST], "val": problems[TEST:TEST + VAL], "train": problems[TEST + VAL:]}
    cache.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        (cache / f"{name}.jsonl").write_text("".join(json.dumps(problem(t)) + "\n" for t in rows))
    torch.manual_seed(seed)
    build_tiny_model(str(cache / "base"), seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(cache / "base")
    tokenizer.add_tokens([remix.PROMPT_SUFFIX])  # one token for the fixed instruction: prompts 3x shorter
    model = AutoModelForCausalLM.from_pretrained(cache / "base")
    model.resize_token_embeddings(len(tokenizer))
    tokenizer.save_pretrained(cache / "base")
    optim = torch.optim.AdamW(model.parameters(), lr=SUPERVISED_LR)
    val = [problem(t) for t in splits["val"]]

    def example(t):
        text = worked_answer(t, scratchpad=rng.random() < SCRATCHPAD_SHARE)
        target = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        return {"prompt_ids": remix.build_prompt(tokenizer, problem(t)["problem"]), "response_ids": target}

    for step in range(1, SUPERVISED_STEPS + 1):
        model.train()
        batch = remix.collate([example(t) for t in rng.sample(splits["train"], 32)], "cpu")
        logp, _ = remix.policy_forward(model, batch, 1.0)
        loss = -remix.masked_mean(logp, batch["response_mask"])
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 500 == 0:
            model.eval()
            accuracy, length, _ = pass_at_1(model, tokenizer, val)
            print(f"toy: supervised step {step}/{SUPERVISED_STEPS}: loss {loss.item():.3f}, validation greedy "
                  f"accuracy {accuracy:.2f}, length {length:.1f}", flush=True)
    model.save_pretrained(cache / "base")
    test_accuracy, test_length, worked = pass_at_1(model, tokenizer, [problem(t) for t in splits["test"]],
                                                   EVAL_TEMPERATURE)
    greedy_test, _, _ = pass_at_1(model, tokenizer, [problem(t) for t in splits["test"]])
    meta = {"version": TOY_VERSION, "supervised_steps": step, "val_greedy_accuracy": accuracy,
            "test_accuracy": test_accuracy, "test_length": test_length, "test_worked_share": worked,
            "test_greedy_accuracy": greedy_test}
    (cache / "meta.json").write_text(json.dumps(meta))
    return cache


# ----------------------------------------------------------------------------------------------
# One training run: the real remix.train loop, with held-out accuracy every few steps
# ----------------------------------------------------------------------------------------------
def run_dir(out: str, name: str, seed: int) -> Path:
    return Path(out) / "runs" / name.replace("/", "_") / f"seed{seed}"


def run(name: str, seed: int, toy: str, out: str, eval_every: int) -> dict:
    import torch

    torch.set_num_threads(1)  # two runs share the two cores
    import remix

    test = [json.loads(line) for line in open(Path(toy) / "test.jsonl")]
    meta = json.loads((Path(toy) / "meta.json").read_text())
    curve = [{"step": 0, "accuracy": meta["test_accuracy"], "length": meta["test_length"],
              "worked_share": meta["test_worked_share"], "rollouts": 0, "tokens": 0, "seconds": 0.0}]
    start = time.perf_counter()

    def evaluate(step, record, policy, tokenizer, batch):
        if step % eval_every == 0 or step == STEPS:
            accuracy, length, worked = pass_at_1(policy, tokenizer, test, EVAL_TEMPERATURE)
            record["eval/accuracy"] = accuracy
            curve.append({"step": step, "accuracy": accuracy, "length": length, "worked_share": worked,
                          "rollouts": record["rollouts/total"], "tokens": record["rollouts/generated_tokens"],
                          "seconds": time.perf_counter() - start})

    folder = run_dir(out, name, seed)
    args = remix.Args(**{**SHARED, **CONFIGS[name]}, model=str(Path(toy) / "base"),
                      dataset=str(Path(toy) / "train.jsonl"), out=str(folder), seed=seed)
    import contextlib
    import io

    with contextlib.redirect_stderr(io.StringIO()):  # the progress bars of parallel runs would interleave
        remix.train(args, on_step=evaluate)
    steps = [json.loads(line) for line in open(folder / "metrics.jsonl")]
    result = {"config": name, "seed": seed, "curve": curve,
              "length": [s["response/length_mean"] for s in steps], "reward": [s["reward/mean"] for s in steps]}
    (folder / "curve.json").write_text(json.dumps(result))
    print(f"toy: {name} seed {seed}: accuracy {curve[0]['accuracy']:.2f} -> {curve[-1]['accuracy']:.2f}, "
          f"{curve[-1]['rollouts']} rollouts, {curve[-1]['seconds']:.0f} s", flush=True)
    return result


def runs_in_process(jobs: list[tuple], toy: str, out: str, eval_every: int) -> list[dict]:
    """Several runs, one after the other, in one process with one torch thread: the imports and the
    grader worker are paid once per process, not once per run."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(HERE / "toy.py"), "--runs", *[f"{n}@{s}" for n, s in jobs],
                           "--cache", toy, "--out", out, "--eval-every", str(eval_every)], env=env,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"toy runs {jobs} failed:\n{done.stderr[-3000:]}")
    return [json.loads((run_dir(out, n, s) / "curve.json").read_text()) for n, s in jobs]


# ----------------------------------------------------------------------------------------------
# Summaries and plots
# ----------------------------------------------------------------------------------------------
def cost_to_reach(curve: list[dict], target: float) -> dict | None:
    """Rollouts, tokens and seconds at the first evaluation at or above the target accuracy."""
    for point in curve:
        if point["accuracy"] >= target:
            return {k: point[k] for k in ("step", "rollouts", "tokens", "seconds")}
    return None


def summarize(results: list[dict]) -> dict:
    by_config: dict = {}
    for r in results:
        by_config.setdefault(r["config"], []).append(r)
    summary = {}
    for name, runs in by_config.items():
        finals = [r["curve"][-1]["accuracy"] for r in runs]
        summary[name] = {"final_accuracy_mean": statistics.mean(finals), "final_accuracy_each": finals,
                         "start_accuracy": statistics.mean(r["curve"][0]["accuracy"] for r in runs),
                         "rollouts": statistics.mean(r["curve"][-1]["rollouts"] for r in runs),
                         "tokens": statistics.mean(r["curve"][-1]["tokens"] for r in runs),
                         "final_worked_share": statistics.mean(r["curve"][-1]["worked_share"] for r in runs),
                         "final_length": statistics.mean(r["curve"][-1]["length"] for r in runs),
                         "seconds": statistics.mean(r["curve"][-1]["seconds"] for r in runs)}
    for remix_name, base in (("remix-grpo", "grpo"), ("remix-ppo", "ppo")):
        if remix_name not in summary or base not in summary:
            continue
        target = summary[base]["final_accuracy_mean"]  # the on-policy method's final accuracy
        for name in (remix_name, base):
            reached = [cost_to_reach(r["curve"], target) for r in by_config[name]]
            summary[name]["target"] = target
            summary[name]["to_target"] = reached
            summary[name]["seeds_reaching_target"] = sum(x is not None for x in reached)
            costs = [x["rollouts"] for x in reached if x is not None]
            summary[name]["rollouts_to_target_median"] = statistics.median(costs) if costs else None
    return summary


def markdown(summary: dict) -> str:
    lines = ["| configuration | seeds | start acc | final acc (mean) | final acc (each seed) | rollouts | tokens | "
             "seconds | final length | final worked share | target | seeds at target | median rollouts to target |",
             "|" + "---|" * 13]
    for name, s in summary.items():
        lines.append(f"| {name} | {len(s['final_accuracy_each'])} | {s['start_accuracy']:.3f} | "
                     f"{s['final_accuracy_mean']:.3f} | {', '.join(f'{a:.3f}' for a in s['final_accuracy_each'])} | "
                     f"{s['rollouts']:.0f} | {s['tokens']:.0f} | {s['seconds']:.0f} | {s['final_length']:.1f} | "
                     f"{s['final_worked_share']:.2f} | {s.get('target', float('nan')):.3f} | "
                     f"{s.get('seeds_reaching_target', '')} | "
                     f"{s.get('rollouts_to_target_median') or ''} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def mean_curve(name, key):
        runs = [r["curve"] for r in results if r["config"] == name]
        x = np.mean([[p[key] for p in c] for c in runs], axis=0)
        y = np.array([[p["accuracy"] for p in c] for c in runs])
        return x, y.mean(0), y.std(0)

    for key, label, filename in (("rollouts", "rollouts", "accuracy_vs_rollouts.png"),
                                 ("tokens", "generated tokens", "accuracy_vs_tokens.png")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, pair in zip(axes, (("remix-grpo", "grpo"), ("remix-ppo", "ppo"))):
            for name in pair:
                x, m, s = mean_curve(name, key)
                ax.plot(x, m, label=name)
                ax.fill_between(x, m - s, m + s, alpha=0.2)
            ax.set_xlabel(label)
            ax.set_title(" vs ".join(pair) + " (mean +- std over seeds)")
            ax.legend()
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("held-out Pass@1 (one sample at T = 1)")
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for p, name in P_SWEEP.items():
        lengths = np.mean([r["length"] for r in results if r["config"] == name], axis=0)
        ax.plot(np.arange(1, len(lengths) + 1), lengths, label=f"p = {p}")
    ax.axvline(T, color="grey", linestyle=":", label="reincarnation")
    ax.set_xlabel("step")
    ax.set_ylabel("mean sampled response length (tokens)")
    ax.set_title("ReMix-GRPO: off-policy share p")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "length_vs_step.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Step time against TRL's GRPOTrainer
# ----------------------------------------------------------------------------------------------
def trl_comparison(toy: Path, out: Path, rounds: int, steps: int) -> dict:
    """Median seconds per step of remix.py and TRL's GRPOTrainer, each in its own process, alternating."""
    times: dict = {"remix": [], "trl": []}
    for _ in range(rounds):
        for which in ("remix", "trl"):
            done = subprocess.run([sys.executable, str(HERE / "benchmarks" / "trl_step.py"), which, str(toy), str(steps)],
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/toy")
    parser.add_argument("--cache", default="runs/toy-cache", help="where the toy data and base model are kept")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), help=f"any of {list(CONFIGS)}")
    parser.add_argument("--eval-every", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (one core each)")
    parser.add_argument("--trl-rounds", type=int, default=1, help="0 skips the TRL step-time comparison")
    parser.add_argument("--runs", nargs="+", metavar="CONFIG@SEED", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.runs:
        for job in cli.runs:
            name, seed = job.rsplit("@", 1)
            run(name, int(seed), cli.cache, cli.out, cli.eval_every)
        return
    unknown = [c for c in cli.configs if c not in CONFIGS]
    if unknown:
        print(f"toy: error: unknown configuration {unknown}; valid: {list(CONFIGS)}", file=sys.stderr)
        raise SystemExit(2)
    os.environ["HF_HUB_OFFLINE"] = "1"
    out = Path(cli.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    toy = build_toy(Path(cli.cache))
    print(f"toy: base model {json.loads((toy / 'meta.json').read_text())}", flush=True)
    jobs = [(name, seed) for seed in range(1, cli.seeds + 1) for name in cli.configs]
    with concurrent.futures.ThreadPoolExecutor(cli.workers) as pool:  # worker i takes jobs i, i + workers, ...
        shares = pool.map(lambda i: runs_in_process(jobs[i::cli.workers], str(toy), str(out), cli.eval_every),
                          range(cli.workers))
        results = sorted((r for share in shares for r in share),
                         key=lambda r: (list(CONFIGS).index(r["config"]), r["seed"]))
    summary = summarize(results)
    table = markdown(summary)
    (out / "results.json").write_text(json.dumps({"summary": summary, "runs": results, "steps": STEPS, "T": T,
                                                  "shared": SHARED, "configs": CONFIGS}, indent=1))
    (out / "results.md").write_text(table)
    print(table)
    if all(name in cli.configs for pair in (("remix-grpo", "grpo"), ("remix-ppo", "ppo")) for name in pair) and \
            all(name in cli.configs for name in P_SWEEP.values()):
        plot(results, out)
    if cli.trl_rounds:
        print("toy: step time against TRL:", trl_comparison(toy, out, cli.trl_rounds, 6), flush=True)
    print(f"toy: done in {time.perf_counter() - start:.0f} s; results in {out}")


if __name__ == "__main__":
    main()
