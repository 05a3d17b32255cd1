"""How far vLLM's probabilities of its own sampled tokens are from the trainer's (docs/precision.md:
the sampler-trainer mismatch), on the CPU: a vLLM engine in fp32 and in bf16 against the fp32 trainer, and both in
bf16 (what --precision bf16, the GPU default, runs).

    python benchmarks/sampler_mismatch.py [--data FILE: default the repository's data/train/deepscaler_partial.jsonl]
    python benchmarks/sampler_mismatch.py --quick     # the tiny model only, 2 steps: a smoke run of the script

Each configuration is a real `remix.train` run (GRPO, 8 prompts x 4 responses of up to 128 tokens, 4 steps at
actor lr 1e-5) in its own process, on two random-weight Qwen2 models: the tests' tiny one (hidden 128, 2
layers) and a deeper one (hidden 512, 8 layers). The figures are the run's own logged mismatch/* metrics
(token means over every fresh token of the 4 steps, and the largest |log ratio| seen). Random weights give
nearly flat next-token distributions: a trained model's sharper ones can differ more.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUN = """import dataclasses, json, sys
sys.path.insert(0, {root!r})
import remix
from machinery import console, engines
start = engines.start
# the engine's dtype alone: engines.start takes it from --precision, the trainer keeps its own
engines.start = lambda args, max_model_len=None: start(dataclasses.replace(args, precision={engine_precision!r}),
                                                       max_model_len)
args = console.settings(remix.Args, model={model!r}, dataset={data!r}, out={out!r}, algo="grpo", sampler="vllm",
                      steps={steps}, prompts_per_step=8, group_size=4, max_response_tokens=128, mini_batch_prompts=4,
                      save_every=0, actor_lr=1e-5, precision={precision!r}, eval_every=0)
remix.train(args)
"""

KEYS = ("mismatch/abs_log_ratio_mean", "mismatch/k3_kl", "mismatch/ratio_outside_0.5_2")


def run(model: str, data: str, out: Path, engine: str, precision: str, steps: int = 4) -> dict:
    script = out.with_suffix(".py")
    script.write_text(RUN.format(root=str(ROOT), model=model, data=data, out=str(out), steps=steps, precision=precision,
                                 engine_precision={"float32": "fp32", "bfloat16": "bf16"}[engine]))
    subprocess.run([sys.executable, str(script)], check=True, capture_output=True,
                   env=dict(os.environ, HF_HUB_OFFLINE="1"))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    weights = [r["batch/fresh"] * r["response/length_mean"] for r in rows]  # fresh tokens per step
    summary = {k: sum(w * r[k] for w, r in zip(weights, rows)) / sum(weights) for k in KEYS}
    summary["mismatch/abs_log_ratio_max"] = max(r["mismatch/abs_log_ratio_max"] for r in rows)
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="a .jsonl with problem/answer (default: the repository's "
                                                      "data/train/deepscaler_partial.jsonl; REMIX_DATA overrides)")
    parser.add_argument("--quick", action="store_true", help="the tiny model only, 2 steps per run (a smoke run)")
    cli = parser.parse_args()
    from machinery import report
    from tests.tiny_model import build_tiny_model, write_short_problems

    cli.data = cli.data or str(report.data_root() / "train" / "deepscaler_partial.jsonl")

    work = Path(tempfile.mkdtemp(prefix="remix-mismatch-"))
    data = write_short_problems(cli.data, work / "train.jsonl", max_chars=120, limit=64)
    models = {"hidden 128, 2 layers": build_tiny_model(str(work / "tiny"))}
    if not cli.quick:
        models["hidden 512, 8 layers"] = build_tiny_model(str(work / "deeper"), hidden_size=512, layers=8)
    configs = [("float32", "fp32", "vLLM fp32 / trainer fp32"), ("bfloat16", "fp32", "vLLM bf16 / trainer fp32"),
               ("bfloat16", "bf16", "vLLM bf16 / trainer bf16 (--precision bf16)")]
    print("| model | sampler / trainer | mean abs log ratio | k3 KL | max abs log ratio | ratio outside [0.5, 2] |\n"
          "|---|---|---|---|---|---|")
    for name, model in models.items():
        for engine, precision, label in configs:
            s = run(model, data, work / f"{Path(model).name}-{engine}-{precision}", engine, precision,
                    2 if cli.quick else 4)
            print(f"| {name} | {label} | {s[KEYS[0]]:.2e} | {s[KEYS[1]]:.2e} | {s['mismatch/abs_log_ratio_max']:.2e} "
                  f"| {s[KEYS[2]]:.2e} |", flush=True)


if __name__ == "__main__":
    main()
