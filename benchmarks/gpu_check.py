"""The GPU paths of remix.py, measured on a model shaped like DeepSeek-R1-Distill-Qwen-1.5B (random weights,
built offline: no hub needed). One command on a GPU machine, under 5 minutes; the parts that need vLLM or two
GPUs run when they are there and are reported as skipped when not.

    python benchmarks/gpu_check.py OUT_DIR [--quick: 128-token responses end to end] [--parts micro,ppo,grpo,tp]
    torchrun --nproc-per-node 1 benchmarks/gpu_check.py OUT_DIR     # the same under torchrun, world size 1

Without CUDA it runs the same code on the CPU with a tiny model and short lengths, as a dry run.

1. micro: the memory a run holds between updates (policy and critic with their fp32 masters and AdamW states,
   the bf16 reference), read after a real `remix.update` has released its gradients; then one policy and one
   critic micro-batch (forward, loss, backward, as in an update) of 1,024 prompt + R response tokens, R in
   2k / 4k / 8k: peak memory above that, and seconds per micro-batch (median of 3), with and without gradient
   checkpointing. Every model is FSDP2-sharded (one process is a group of one) with bf16 mixed precision.
2. ppo, grpo: `remix.train` for 3 steps each with reincarnation after step 2 (mix stage, switch, on-policy
   stage), --precision bf16, with vLLM when it is installed (so the sleep / wake / push cycle runs every step,
   and the sampler-trainer mismatch is logged) and transformers' generate otherwise. Random weights rarely emit
   EOS, so every response runs to the length limit. Reports kl/ref at step 1 (0 before any update).
3. tp (two or more GPUs and vLLM): `torchrun --nproc-per-node 2` of one engine sharded over both ranks
   (--vllm-tp 2): the two ranks must hold identical token ids for the engine's prompts.

Writes OUT_DIR/gpu_check.json and prints each figure as it is measured.
"""

import importlib.util
import json
import os
import statistics
import subprocess
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
VLLM = importlib.util.find_spec("vllm") is not None


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
    extra = dict(prompts_per_step=10, group_size=1, mini_batch_prompts=5) if algo == "ppo" else \
        dict(prompts_per_step=5, group_size=4, mini_batch_prompts=3)
    sampler = "vllm" if VLLM else "hf"
    args = remix.Args(algo=algo, model=str(model), dataset=str(data), out=str(out / algo), steps=3,
                      reincarnate_step=2, max_response_tokens=response_tokens, max_prompt_tokens=256, sampler=sampler,
                      save_every=0, grader_workers=2, overwrite=True, precision="bf16",
                      vllm_gpu_memory_utilization=0.3, **extra)
    start = time.perf_counter()
    remix.train(args)
    rows = [json.loads(line) for line in open(out / algo / "metrics.jsonl")]
    keys = ("phase", "perf/step_s", "perf/weight_sync_s", "train/optimizer_steps", "response/length_mean",
            "losses/policy_loss", "kl/ref", "rollouts/total", "mismatch/abs_log_ratio_mean", "mismatch/k3_kl",
            "mismatch/ratio_outside_0.5_2")
    result = {"sampler": sampler, "seconds": time.perf_counter() - start, "peak_gib": memory(peak=True) / GIB,
              "steps": [{k: r[k] for k in keys if k in r} for r in rows],
              "finite": all(all(isinstance(v, (int, float)) and v == v for v in r.values()
                                if isinstance(v, (int, float))) for r in rows)}
    print(f"gpu_check: {algo} end to end {json.dumps(result)}", flush=True)
    return result


def resident_after_update(policy, critic, optimizers) -> float:
    """GiB held between updates: one real update() of a small PPO batch, after which no gradient is kept."""
    samples = []
    for i in range(2):
        ids = torch.randint(300, policy.config.vocab_size, (96,)).tolist()
        zeros = torch.zeros(64)
        samples.append({"prompt_ids": ids[:32], "response_ids": ids[32:], "group": i, "behaviour_logp": zeros - 5,
                        "prox_logp": zeros - 5, "ref_logp": zeros - 5, "advantages": zeros + 1, "values": zeros,
                        "value_targets": zeros + 1, "sampler_logp": None})
    args = remix.Args(algo="ppo", mini_batch_prompts=2, group_size=1)
    remix.update(samples, policy, critic, optimizers, 1.0, 1, 1, args, DEVICE, {"bad_updates": 0},
                 __import__("collections").Counter())
    held = memory() / GIB
    print(f"gpu_check: resident between updates {held:.2f} GiB (gradients: "
          f"{sum(p.grad is not None for m in (policy, critic) for p in m.parameters())} tensors)", flush=True)
    return held


def micro_batch(model_path: Path, lengths: list[int], checkpointing: bool) -> tuple[float, list[dict]]:
    """Peak memory and time of one update micro-batch for the policy (Mix-PPG + KL + entropy) and the critic."""
    # the models exactly as training builds them: fp32 masters, bf16 reference, no dropout, the chunked
    # log-prob head, FSDP2 (a group of one in one process)
    args = remix.Args(model=str(model_path), algo="ppo", gradient_checkpointing=checkpointing, precision="bf16")
    _, policy, reference, critic = remix.load_models(args, DEVICE)
    models = (policy, critic)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-6, weight_decay=0.01) for m in models]
    held = resident_after_update(policy, critic, optimizers)
    results = []
    for m in models:
        m.train()
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
    return held, results


def tensor_parallel(model: Path, data: Path, out: Path) -> dict:
    """Two ranks of one vLLM engine (--vllm-tp 2): identical token ids on both (test_runs.py's own driver)."""
    root = Path(__file__).resolve().parent.parent
    flags = ["--model", str(model), "--dataset", str(data), "--out", str(out / "tp"), "--algo", "grpo", "--steps", "2",
             "--prompts-per-step", "10", "--group-size", "2", "--max-response-tokens", "128", "--sampler", "vllm",
             "--vllm-tp", "2", "--save-every", "0", "--vllm-gpu-memory-utilization", "0.3"]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(root / "test_runs.py"), "engine-tokens", str(out / "tp"), *flags],
                          capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if done.returncode != 0:
        return {"ok": False, "error": done.stderr[-2000:]}
    ranks = [torch.load(out / "tp" / f"engine-tokens-rank{r}.pt") for r in (0, 1)]
    return {"ok": ranks[0] == ranks[1], "calls": len(ranks[0])}


def main():
    out = Path(sys.argv[1])
    quick = "--quick" in sys.argv
    parts = sys.argv[sys.argv.index("--parts") + 1].split(",") if "--parts" in sys.argv else ["micro", "ppo", "grpo", "tp"]
    out.mkdir(parents=True, exist_ok=True)
    model, data = out / "r1-distill-1.5b-shaped", out / "problems.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10)))
    remix_utils.init_distributed()  # a group of one, or torchrun's: the models are FSDP2-sharded either way
    report = {"device": torch.cuda.get_device_name() if CUDA else "cpu (dry run)", "torch": torch.__version__,
              "world_size": remix_utils.world(), "vllm": VLLM, "gpus": torch.cuda.device_count()}
    save = lambda: (out / "gpu_check.json").write_text(json.dumps(report, indent=1))  # noqa: E731
    build_model(model)
    if "micro" in parts:
        report["resident_between_updates_gib"], report["micro_batch"] = micro_batch(
            model, [64] if not CUDA else [2048, 4096, 8192], True)
        save()
        report["micro_batch"] += micro_batch(model, [64] if not CUDA else [2048], False)[1]
        save()
    for algo in [a for a in ("ppo", "grpo") if a in parts]:
        report[f"end_to_end_{algo}"] = end_to_end(model, data, out, algo, (128 if quick else 256) if CUDA else 32)
        save()
    if "tp" in parts:
        report["tensor_parallel"] = tensor_parallel(model, data, out) if VLLM and torch.cuda.device_count() >= 2 \
            and remix_utils.world() == 1 else "skipped: needs vLLM and two GPUs"
        print(f"gpu_check: tensor parallel {report['tensor_parallel']}", flush=True)
        save()
    print("gpu_check: done", flush=True)


if __name__ == "__main__":
    main()
