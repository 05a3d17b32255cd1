"""One real update of remix on the CPU, its host memory measured against machinery.plan's figure for it; run by
tests/test_plan.py in a process of its own (and by hand):

    MALLOC_MMAP_THRESHOLD_=65536 python tests/plan_step.py MODEL_FOLDER ppo|grpo TOKENS [--checkpointing]

Prints one JSON line: the peak resident memory the loading and two update passes added (VmHWM over VmRSS before
the models, /proc/self/status: torch's memory is outside tracemalloc's view) and the plan's update figure without
its per-process allowance. A fixed mmap threshold makes freed large blocks go back to the kernel, so the peak is
what was live at once."""

import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def step(args, tokens: int, reset: bool = False):
    """Load the models, and run two update passes (two optimizer steps) over one sample of `tokens` tokens, a quarter
    prompt; with reset, the peak is counted from after the loading (its transient is not the step's)."""
    import torch

    import remix
    from machinery import models

    policy, reference, critic = models.load(args)
    optimizers = [models.optimizer(net, 1e-4, 0.01, args.offload) for net in (policy, critic) if net is not None]
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    # two rows of tokens / 2, the second's prompt one token shorter: padding, so an attention mask, as in a run
    generator = torch.Generator().manual_seed(0)
    batch = []
    for row in range(2):
        prompt = tokens // 8 - row
        response = tokens // 2 - tokens // 8
        ids = torch.randint(3, policy.config.vocab_size, (prompt + response,), generator=generator).tolist()
        zeros = torch.zeros(response)
        batch.append({"prompt_ids": ids[:prompt], "response_ids": ids[prompt:], "reward": float(row), "group": row,
                      "version": 1, "behaviour_logp": zeros - 5.0, "prox_logp": zeros - 5.0, "ref_logp": zeros - 5.0,
                      "values": zeros, "advantages": torch.randn(response, generator=generator),
                      "value_targets": torch.randn(response, generator=generator)})
    remix.update(batch, policy, critic, optimizers, 1.0, 2, 1, args)


def main():
    import torch

    import remix
    from machinery import console, dist, plan

    folder, algo, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    args = remix.finalize_args(console.settings(remix.Args, model=folder, algo=algo, sampler="hf",
                                              max_tokens_per_micro_batch=tokens, max_prompt_tokens=tokens // 8,
                                              max_response_tokens=tokens // 2 - tokens // 8, mini_batch_prompts=64,
                                              gradient_checkpointing="--checkpointing" in sys.argv, out="unused"))
    dist.init()
    step(args, 64)  # a first, small run of the same code: libraries, kernels and thread pools before the baseline
    gc.collect()
    before = status("VmRSS")
    step(args, tokens, reset=True)
    measured = status("VmHWM") - before
    shape = plan.shape_of(folder)
    figure = plan.memory(shape, args, 1, False, False, 0.0)
    print(json.dumps({"measured": measured, "plan": figure["update"] - figure["parts"]["runtime"],
                      "parts": figure["parts"], "params": shape.params}))


if __name__ == "__main__":
    main()
