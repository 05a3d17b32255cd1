"""The GPU paths of remix.py, measured on a model shaped like DeepSeek-R1-Distill-Qwen-1.5B (random weights,
built offline: no hub needed) with the transformers sampler (no vLLM needed).

    python benchmarks/gpu_check.py OUT_DIR [--quick: 128-token responses end to end] [--parts ppo,grpo,micro]
    torchrun --nproc-per-node 1 benchmarks/gpu_check.py OUT_DIR     # the same through FSDP2, world size 1

Without CUDA it runs the same code on the CPU with a tiny model and short lengths, as a dry run.

1. End to end: `remix.train` for PPO (critic) and GRPO on CUDA, 3 steps each with reincarnation after step 2,
   so the mix stage, the switch and the on-policy stage all run with bf16 autocast, fp32 master weights and
   gradient checkpointing. Random weights rarely emit EOS, so every response runs to the length limit.
2. One policy and one critic micro-batch (forward, loss, backward, as in an update) of one sequence at
   1,024 prompt + R response tokens, R in 2k / 4k / 8k: peak memory above the resident models and
   optimizer states, and seconds per micro-batch (median of 3), with and without gradient checkpointing.

Writes OUT_DIR/gpu_check.json and prints each figure as it is measured.
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import remix  # noqa: E402
import remix_utils  # noqa: E402
from tiny_model import build_tokenizer  # noqa: E402

GIB = 2**30
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def memory(peak: bool = False) -> int:
    if not CUDA:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()


def reset_peak() -> None:
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


def build_model(path: Path) -> None:
    """The published R1-Distill-Qwen-1.5B config (Qwen2 architecture), random weights, the byte tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    shape = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2) if CUDA else \
        dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)
    config = Qwen2Config(**shape, max_position_embeddings=131072,
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with DEVICE:
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    print(f"gpu_check: built {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", flush=True)


def end_to_end(model: Path, data: Path, out: Path, algo: str, response_tokens: int) -> dict:
    reset_peak()
    extra = dict(prompts_per_step=20, group_size=1, mini_batch_prompts=10) if algo == "ppo" else \
        dict(prompts_per_step=5, group_size=4, mini_batch_prompts=3)
    args = remix.Args(algo=algo, model=str(model), dataset=str(data), out=str(out / algo), steps=3,
                      reincarnate_step=2, max_response_tokens=response_tokens, max_prompt_tokens=256, sampler="hf",
                      save_every=0, grader_workers=2, overwrite=True, **extra)
    start = time.perf_counter()
    remix.train(args)
    rows = [json.loads(line) for line in open(out / algo / "metrics.jsonl")]
    result = {"seconds": time.perf_counter() - start, "peak_gib": memory(peak=True) / GIB,
              "steps": [{k: r[k] for k in ("phase", "perf/step_s", "train/optimizer_steps", "response/length_mean",
                                           "losses/policy_loss", "kl/ref", "rollouts/total") if k in r}
                        for r in rows],
              "finite": all(all(isinstance(v, (int, float)) and v == v for v in r.values()
                                if isinstance(v, (int, float))) for r in rows)}
    print(f"gpu_check: {algo} end to end {json.dumps(result)}", flush=True)
    return result


def micro_batch(model_path: Path, lengths: list[int], checkpointing: bool) -> list[dict]:
    """Peak memory and time of one update micro-batch for the policy (Mix-PPG + KL + entropy) and the critic."""
    # the models exactly as training builds them: fp32 masters, bf16 reference, no dropout, the chunked
    # log-prob head, FSDP2 under torchrun
    args = remix.Args(model=str(model_path), algo="ppo", gradient_checkpointing=checkpointing)
    _, policy, reference, critic = remix.load_models(args, DEVICE)
    models = (policy, critic)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-6, weight_decay=0.01) for m in models]
    for m in models:
        m.train()
    results = []
    for length in lengths:
        prompt = 1024 if CUDA else 32
        ids = torch.randint(300, policy.config.vocab_size, (1, prompt + length))
        sample = {"prompt_ids": ids[0, :prompt].tolist(), "response_ids": ids[0, prompt:].tolist()}
        batch = remix.collate([sample], DEVICE)
        mask = batch["response_mask"]
        for name, model, optim in (("policy", policy, optimizers[0]), ("critic", critic, optimizers[1])):
            seconds = []
            for _ in range(3):
                optim.zero_grad(set_to_none=True)
                resident = memory()
                reset_peak()
                start = time.perf_counter()
                if name == "policy":
                    logp, entropy = remix.policy_forward(model, batch, 1.0)
                    old = logp.detach() - 0.01
                    loss = remix.mix_ppg_loss(logp, old, old, torch.ones_like(logp), mask)[0] \
                        - 0.001 * remix.masked_mean(entropy, mask) \
                        + 0.001 * remix.kl_convex_loss(logp, old, old, 1.0, mask)
                else:
                    values = remix.critic_forward(model, batch)
                    loss = remix.clipped_value_loss(values, values.detach(), values.detach() + 1, mask)
                loss.backward()
                optim.step()
                memory()  # waits for the GPU
                seconds.append(time.perf_counter() - start)
            peak = memory(peak=True)
            row = {"model": name, "response_tokens": length, "checkpointing": checkpointing,
                   "seconds_median": statistics.median(seconds[1:]), "peak_above_resident_gib": (peak - resident) / GIB,
                   "resident_gib": resident / GIB, "peak_gib": peak / GIB}
            print(f"gpu_check: micro-batch {json.dumps(row)}", flush=True)
            results.append(row)
        del batch
    del policy, critic, reference, optimizers
    if CUDA:
        torch.cuda.empty_cache()
    return results


def main():
    out = Path(sys.argv[1])
    quick = "--quick" in sys.argv
    parts = sys.argv[sys.argv.index("--parts") + 1].split(",") if "--parts" in sys.argv else ["ppo", "grpo", "micro"]
    out.mkdir(parents=True, exist_ok=True)
    model, data = out / "r1-distill-1.5b-shaped", out / "problems.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10)))
    remix_utils.init_distributed()  # under torchrun (world size 1 too) the models are FSDP2-sharded
    report = {"device": torch.cuda.get_device_name() if CUDA else "cpu (dry run)", "torch": torch.__version__,
              "world_size": remix_utils.world()}
    build_model(model)
    if "micro" in parts:
        report["micro_batch"] = micro_batch(model, [64] if not CUDA else [2048, 4096, 8192], True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        report["micro_batch"] += micro_batch(model, [64] if not CUDA else [2048], False)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    for algo in [a for a in ("ppo", "grpo") if a in parts]:
        report[f"end_to_end_{algo}"] = end_to_end(model, data, out, algo, (128 if quick else 512) if CUDA else 32)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print("gpu_check: done", flush=True)


if __name__ == "__main__":
    main()
