"""Trainer passes at the paper's lengths: memory and speed, before and after chunked log-probs and token-budget
micro-batches (docs/memory.md: Trainer passes at long lengths).

    python benchmarks/update_throughput.py                 # both parts, about 20 minutes on 2 cores
    python benchmarks/update_throughput.py --part memory   # or speed
    python benchmarks/update_throughput.py --part memory --lengths 1024   # one length: a smoke run

Memory: the peak resident memory added by one update micro-batch (forward, Mix-PPG + KL-Convex + entropy,
backward) of a 1,024-token prompt and a 1k / 4k / 8k-token response, on a Qwen2 trunk (hidden 128, 2 layers,
activation checkpointing) with the real 151,936-token vocabulary. "full logits" is the computation remix.py
used before: the [tokens, vocab] logits, their log-softmax and the entropy terms in one piece (kept for the
backward pass); "chunked" is machinery.models.chunked_logprobs. Each measurement runs in its own process, with its
address space capped at 20 GiB so that a run that does not fit fails cleanly on this 24 GiB machine.

Speed: the whole trainer side of one step (behaviour and reference log-probs of 20 fresh responses, pi_k of 12
historical ones, the critic's values for PPO, advantages, 2 update passes of 2 mini-batches) on 32 responses of
long-tailed length (mean about 165, max 458 tokens, 64-token prompts) with a 12.9M-parameter trunk (hidden 384,
6 layers, byte vocabulary), PPO and GRPO. Configurations: "before" (one response per micro-batch, full logits:
the old default), "budget only" (16,384-token micro-batches, full logits) and "after" (16,384-token
micro-batches, chunked log-probs: the new default). Each runs in its own process, alternating over rounds;
medians of the timed repetitions, and their ratio to "before".
"""

import argparse
import collections
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GIB = 2**30
CONFIGS = {"before": (1, False), "budget only": (16384, False), "after": (16384, True)}  # (token budget, chunked)


def full_logits(per_token_fn, hidden, weight, tokens, temperature, chunk=None):
    """The computation remix.py used before: the whole [N, V] logits in one piece (models.chunked_logprobs' call)."""
    return per_token_fn(hidden @ weight.T, tokens, temperature)


def qwen(vocab: int, hidden: int, layers: int, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 128),
                         max_position_embeddings=16384, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def rss(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def memory_child(length: int, chunked: bool) -> dict:
    import torch

    import remix
    from machinery import models

    resource.setrlimit(resource.RLIMIT_AS, (20 * GIB, 20 * GIB))
    if not chunked:
        models.chunked_logprobs = full_logits
    model = qwen(151936, 128, 2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    g = torch.Generator().manual_seed(0)
    sample = {"prompt_ids": torch.randint(0, 151936, (1024,), generator=g).tolist(),
              "response_ids": torch.randint(0, 151936, (length,), generator=g).tolist()}
    batch = models.collate([sample], "cpu")
    mask = batch["response_mask"]
    behaviour = -10 - torch.rand(1, length, generator=g)
    advantages = torch.randn(1, length, generator=g)
    open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from here
    base, start = rss("VmRSS"), time.perf_counter()
    try:
        batch["logp"], batch["entropy"] = remix.policy_forward(model, batch, 1.0)
        batch.update(behaviour_logp=behaviour, prox_logp=behaviour, ref_logp=behaviour, advantages=advantages)
        args = remix.Args(ent_coef=0.001, kl_beta=0.001)
        remix.objective(batch, 0.7, args)[0]["policy"].backward()  # Eq. 6, Mix-PPG + KL-Convex
    except (MemoryError, RuntimeError) as error:
        return {"length": length, "chunked": chunked, "peak_gib": None, "error": str(error).splitlines()[0][:120]}
    return {"length": length, "chunked": chunked, "peak_gib": (rss("VmHWM") - base) / GIB,
            "seconds": time.perf_counter() - start, "logits_gib": length * 151936 * 4 / GIB}


def long_tailed_batch(algo: str, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """32 samples with 64-token prompts and long-tailed response lengths: 20 fresh, 12 historical."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = (torch.distributions.LogNormal(4.85, 0.6).sample((32,)).clamp(8, 458)).round().long().tolist()
    lengths[0] = 458
    group = 8 if algo == "grpo" else 1
    samples = [{"prompt_ids": torch.randint(0, 256, (64,), generator=g).tolist(),
                "response_ids": torch.randint(0, 256, (n,), generator=g).tolist(), "reward": float(i % 3 == 0),
                "group": i // group, "version": 1 if i < 20 else 0} for i, n in enumerate(lengths)]
    return samples[:20], samples[20:]


def speed_child(algo: str, config: str, reps: int) -> dict:
    import torch

    import remix
    from machinery import console, dist, models
    from transformers import AutoModelForTokenClassification

    torch.set_num_threads(2)
    budget, chunked = CONFIGS[config]
    if not chunked:
        models.chunked_logprobs = full_logits
    policy, reference = qwen(259, 384, 6), qwen(259, 384, 6)
    critic = None
    if algo == "ppo":
        critic = AutoModelForTokenClassification.from_config(policy.config.__class__(**{**policy.config.to_dict(),
                                                                                       "num_labels": 1}),
                                                                trust_remote_code=False)
    args = remix.finalize_args(console.settings(remix.Args, algo=algo, max_tokens_per_micro_batch=budget,
                                              mini_batch_prompts=16 if algo == "ppo" else 2,
                                              group_size=8 if algo == "grpo" else 1, actor_lr=1e-6))
    fresh, history = long_tailed_batch(algo)
    remix.behaviour_and_reference(history, policy, reference, args)  # stored earlier
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-6) for m in (policy, critic) if m is not None]
    times, works = [], []
    for rep in range(reps + 1):  # the first repetition warms up
        dist.padding.clear()  # token slots and real tokens of every micro-batch of this repetition
        start = time.perf_counter()
        remix.behaviour_and_reference(fresh, policy, reference, args)
        remix.prox_and_values(fresh, history, policy, critic, args)
        remix.compute_advantages(fresh + history, args)
        remix.update(fresh + history, policy, critic, optimizers, 0.9, 2, 5, args)
        if rep:
            times.append(time.perf_counter() - start)
            works.append(collections.Counter(dist.padding))
    return {"algo": algo, "config": config, "seconds": times, "tokens": works[0]["tokens"],
            "padding": 1 - works[0]["tokens"] / works[0]["slots"],
            "parameters": sum(p.numel() for p in policy.parameters())}


def child(*argv) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["killed"])[-1][:160]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("memory", "speed", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192],
                        help="response tokens of the memory part (default: 1024 4096 8192)")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.child:
        kind, *rest = cli.child
        result = memory_child(int(rest[0]), rest[1] == "chunked") if kind == "memory" else \
            speed_child(rest[0], rest[1], int(rest[2]))
        print(json.dumps(result))
        return
    report = {}
    if cli.part in ("memory", "both"):
        rows = [child("memory", str(n), mode) for n in cli.lengths for mode in ("full", "chunked")]
        report["memory"] = rows
        print("| response tokens | logits alone (GiB) | full logits: peak (GiB) | chunked: peak (GiB) | chunked / full |")
        print("|---|---|---|---|---|")
        for full, chunked in zip(rows[0::2], rows[1::2]):
            f, c = full.get("peak_gib"), chunked.get("peak_gib")
            print(f"| {chunked.get('length', '?'):,} | {chunked.get('logits_gib', 0):.2f} | "
                  f"{f'{f:.2f}' if f else 'does not fit in 20 GiB'} | {f'{c:.2f}' if c else 'does not fit in 20 GiB'} | "
                  f"{f'{c / f:.2f}' if f and c else '-'} |", flush=True)
    if cli.part in ("speed", "both"):
        runs = collections.defaultdict(list)
        for round_ in range(cli.rounds):
            for algo in ("ppo", "grpo"):
                for config in CONFIGS:
                    result = child("speed", algo, config, str(cli.reps))
                    if "error" in result:
                        sys.exit(f"update_throughput: {algo} {config} failed: {result['error']}")
                    runs[algo, config].append(result)
                    print(f"round {round_} {algo} {config}: {statistics.median(result['seconds']):.2f} s", flush=True)
        report["speed"] = {f"{a} / {c}": r for (a, c), r in runs.items()}
        first = next(iter(runs.values()))[0]
        print(f"\n{first['parameters'] / 1e6:.1f}M parameters, {cli.rounds} rounds x {cli.reps} timed repetitions\n")
        print("| algorithm | configuration | median s per step (trainer side) | tokens/s | padding share | s / before |")
        print("|---|---|---|---|---|---|")
        for algo in ("ppo", "grpo"):
            before = statistics.median(s for r in runs[algo, "before"] for s in r["seconds"])
            for config in CONFIGS:
                seconds = statistics.median(s for r in runs[algo, config] for s in r["seconds"])
                r = runs[algo, config][0]
                print(f"| {algo} | {config} | {seconds:.2f} | {r['tokens'] / seconds:,.0f} | {r['padding']:.2f} | "
                      f"{seconds / before:.2f} |")
    if cli.out:
        Path(cli.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
