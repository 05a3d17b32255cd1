"""Where mu comes from under --overlap (docs/decisions.md, Decision 22): the engine's log-probs, or a forward of the
sampler's copy of pi_k with the trainer's code; each measured against the trainer's own log pi_k, what a synchronous
step stores as mu (Decision 1), beside the one step of staleness the clip corrects (log pi_{k+1} / pi_k).

    python benchmarks/overlap_mu.py             # both tiny models, 4 steps each (CPU, ~15 min)
    python benchmarks/overlap_mu.py --quick     # the tiny model in fp32, 2 steps: a smoke run of the script

Each configuration is a real synchronous `remix.train` run (GRPO, 8 prompts x 4 responses of up to 128 tokens, actor
lr 1e-5, the vLLM engine in the trainer's dtype) on a random-weight Qwen2 model. After each step's update the run's
hook reads the policy's full weights into a plain transformers copy (what a sampler process holds: no FSDP, the
weights cast to the compute dtype); on the next step's fresh batch, drawn by that same policy pi_k, it compares
with the trainer's stored mu (its own forward of pi_k):
  engine     vLLM's log-probs of its sampled tokens (sampler_logp)
  copy       remix.policy_forward on the copy: the trainer's code, the sampler's weights
  staleness  remix.policy_forward on the trainer's pi_{k+1}: the gap an overlapped batch carries, which the clip's
             centre pi_k/mu corrects
Figures are token means of |log ratio| over the fresh tokens of steps 2.. (step 1's copy is the base model). The
tiny model runs in fp32 and bf16, the deeper one in fp32 only: on a CPU without bf16 instructions its bf16 step takes
over 20 minutes.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(model: str, data: str, out: Path, precision: str, steps: int) -> dict:
    import torch
    import transformers

    import remix
    from machinery import console, dist, models

    dtype = models.compute_dtype(precision)
    copy = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype, trust_remote_code=False).eval()
    gaps = {"engine": [], "copy": [], "staleness": []}

    def on_step(step, record, policy, tokenizer, batch):
        fresh = [s for s in batch if not s["historical"]]
        with torch.no_grad():
            if step > 1:  # the copy holds pi_k, the policy that drew this step's fresh batch
                mu = [s["behaviour_logp"] for s in fresh]
                copy_logp = models.per_token(remix.logp_of(args), copy, fresh, 1 << 20)
                now = models.per_token(remix.logp_of(args), policy, fresh, 1 << 20)  # pi_{k+1}
                for name, values in (("engine", [s["sampler_logp"] for s in fresh]), ("copy", copy_logp),
                                     ("staleness", now)):
                    gaps[name] += [(v.float() - m).abs() for v, m in zip(values, mu)]
            copy.load_state_dict({name: t.to(dtype) for name, t in dist.full_tensors(policy)})  # pi_{k+1}

    args = console.settings(remix.Args, model=model, dataset=data, out=str(out), algo="grpo", sampler="vllm",
                            steps=steps, prompts_per_step=8, group_size=4, max_response_tokens=128,
                            mini_batch_prompts=4, save_every=0, actor_lr=1e-5, precision=precision, eval_every=0,
                            off_policy_p=0.0)
    remix.train(args, on_step=on_step)
    return {name: torch.cat(values).mean().item() for name, values in gaps.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="a .jsonl with problem/answer (default: the repository's "
                                                      "data/train/deepscaler_partial.jsonl)")
    parser.add_argument("--quick", action="store_true", help="the tiny model in fp32, 2 steps (a smoke run)")
    parser.add_argument("--model", default=None, help="one model folder instead of the two tiny ones")
    cli = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from machinery import report
    from tests.tiny_model import build_tiny_model, write_short_problems

    work = Path(tempfile.mkdtemp(prefix="remix-overlap-mu-"))
    data = write_short_problems(cli.data or str(report.data_root() / "train" / "deepscaler_partial.jsonl"),
                                work / "train.jsonl", max_chars=120, limit=64)
    tiny = build_tiny_model(str(work / "tiny"))
    found = {"hidden 128, 2 layers": (tiny, ("fp32",) if cli.quick else ("fp32", "bf16"))}
    if cli.model:
        found = {cli.model: (cli.model, ("fp32",))}
    elif not cli.quick:  # fp32 only: bf16 without the CPU's bf16 instructions takes over 20 minutes a step here
        found["hidden 512, 8 layers"] = (build_tiny_model(str(work / "deeper"), hidden_size=512, layers=8), ("fp32",))
    print("| model | precision | engine / trainer mu | copy / trainer mu | staleness pi_k+1 / pi_k |\n"
          "|---|---|---|---|---|")
    for name, (model, precisions) in found.items():
        for precision in precisions:
            g = measure(model, data, work / f"{Path(model).name}-{precision}", precision, 2 if cli.quick else 4)
            print(f"| {name} | {precision} | {g['engine']:.2e} | {g['copy']:.2e} | {g['staleness']:.2e} |", flush=True)


if __name__ == "__main__":
    main()
