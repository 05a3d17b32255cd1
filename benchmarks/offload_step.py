"""The host AdamW step of an offloaded model (--offload): torch's foreach implementation, what a run uses
(machinery.models.optimizer), beside the per-tensor one torch falls back to for host tensors, in one process, timed
in turns over the same steps. With --offload the step runs on the CPU whatever the device, so this is the step a GPU
run takes too (on its host's cores).

    python benchmarks/offload_step.py > docs/bench/offload_step.md          # both shapes, a few minutes on 2 cores
    python benchmarks/offload_step.py --shapes small --steps 5              # a smoke run

Each shape is a random Qwen2 with the paper's model's layout (28 layers, 339 parameter tensors, untied 151,936-row
embeddings and head) at a smaller width, sharded by dist.shard with offload as a run shards it (a group of one), in
fp32 with random gradients. The two copies start equal and get the same gradients at every step; the first step
(which allocates the moments) is not timed, then the two take turns. Prints a markdown table: the median seconds
of a step each way, their ratio, and whether the weights are still equal bit for bit after the last step."""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # (hidden, intermediate, heads, KV heads): the paper's 1.5B is (1536, 8960, 12, 2)
    "small": (64, 384, 1, 1),
    "wide": (256, 1536, 2, 1),
}


def build(hidden: int, intermediate: int, heads: int, kv_heads: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=28,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=False,
                         max_position_embeddings=4096)
    return Qwen2ForCausalLM(config)


def measure(shape: str, steps: int) -> dict:
    import torch

    from machinery import dist, models

    device = dist.init()
    base = build(*SHAPES[shape])
    params = sum(p.numel() for p in base.parameters())
    tensors = len(list(base.parameters()))
    nets = {"foreach": dist.shard(copy.deepcopy(base), device, torch.float32, offload=True),
            "per tensor": dist.shard(base, device, torch.float32, offload=True)}
    optimizers = {"foreach": models.optimizer(nets["foreach"], 1e-4, 0.01, offload=True),
                  "per tensor": torch.optim.AdamW(nets["per tensor"].parameters(), lr=1e-4, weight_decay=0.01,
                                                  foreach=False)}
    seconds = {name: [] for name in nets}
    generator = torch.Generator().manual_seed(1)
    for step in range(steps + 1):
        grads = [torch.randn(p.shape, generator=generator) for p in nets["foreach"].parameters()]
        order = list(nets) if step % 2 else list(reversed(nets))  # who goes first alternates
        for name in order:
            for p, g in zip(nets[name].parameters(), grads):
                p.grad = torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements)
            start = time.perf_counter()
            optimizers[name].step()
            if step:  # the first step allocates the moments
                seconds[name].append(time.perf_counter() - start)
            optimizers[name].zero_grad(set_to_none=True)
    equal = all(torch.equal(a.full_tensor(), b.full_tensor())
                for a, b in zip(nets["foreach"].parameters(), nets["per tensor"].parameters()))
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    return {"shape": shape, "params": params, "tensors": tensors, "threads": torch.get_num_threads(), "steps": steps,
            **medians, "ratio": medians["per tensor"] / medians["foreach"], "equal": equal}


def main():
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's own)")
    cli = parser.parse_args()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    rows = [measure(shape, cli.steps) for shape in cli.shapes]
    print("# The host AdamW step of an offloaded model: foreach against per tensor\n")
    print(f"`python benchmarks/offload_step.py{' --steps ' + str(cli.steps) if cli.steps != 20 else ''}` "
          f"(torch {torch.__version__}, {rows[0]['threads']} CPU threads; medians of {cli.steps} steps each, taken "
          f"in turns)\n")
    print("| shape (28 layers, 151,936-token vocabulary) | parameters | tensors | per tensor (s) | foreach (s) | "
          "per tensor / foreach | weights equal after |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        hidden, intermediate, heads, kv = SHAPES[r["shape"]]
        print(f"| {r['shape']}: hidden {hidden}, MLP {intermediate}, {heads} heads, {kv} KV "
              f"| {r['params'] / 1e6:.1f} M | {r['tensors']} | {r['per tensor']:.3f} | {r['foreach']:.3f} "
              f"| {r['ratio']:.2f} | {'yes' if r['equal'] else 'NO'} |")


if __name__ == "__main__":
    main()
