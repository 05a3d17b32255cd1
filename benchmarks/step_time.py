"""Seconds per training step of remix.py on the tiny offline model, vLLM sampler vs transformers sampler.

    python benchmarks/step_time.py [--data FILE: default the repository's data/train/deepscaler_partial.jsonl]

Each configuration runs in its own process (vLLM pins the process to one torch thread on CPU), and the
two samplers alternate over several rounds so that machine noise hits both alike. Reported: the median
step time over all rounds (the first step of each run, which warms up, is left out) and the ratio.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
from machinery import report  # noqa: E402
from tests.tiny_model import build_tiny_model, write_short_problems  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(report.data_root() / "train" / "deepscaler_partial.jsonl"),
                        help="a .jsonl with problem/answer (default: the repository's data/train/deepscaler_partial"
                             ".jsonl; REMIX_DATA overrides)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-response-tokens", type=int, default=64)
    cli = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="remix-bench-"))
    model = build_tiny_model(str(work / "tiny"))
    data = write_short_problems(cli.data, work / "train.jsonl", max_chars=200, limit=512)
    times = {"vllm": [], "hf": []}
    gen = {"vllm": [], "hf": []}
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for round_ in range(cli.rounds):
        for sampler in ("hf", "vllm"):
            out = work / f"{sampler}-{round_}"
            cmd = [sys.executable, str(HERE / "remix.py"), "--model", model, "--dataset", data, "--out", str(out),
                   "--algo", cli.algo, "--steps", str(cli.steps), "--prompts-per-step", str(cli.prompts),
                   "--group-size", str(cli.group_size), "--max-response-tokens", str(cli.max_response_tokens),
                   "--sampler", sampler, "--save-every", "0", "--eval-every", "0", "--seed", str(round_)]
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            metrics = [json.loads(line) for line in open(out / "metrics.jsonl")][1:]
            times[sampler] += [m["perf/step_s"] for m in metrics]
            gen[sampler] += [m["perf/gen_tokens_per_s"] for m in metrics]
            print(f"round {round_} {sampler}: median step {statistics.median(times[sampler]):.3f} s", flush=True)
    print(f"\n{cli.algo}, {cli.prompts} prompts x {cli.group_size}, up to {cli.max_response_tokens} tokens, "
          f"{cli.rounds} rounds x {cli.steps - 1} timed steps\n")
    print("| sampler | median s/step | median generated tokens/s |")
    print("|---|---|---|")
    for sampler in ("vllm", "hf"):
        print(f"| {sampler} | {statistics.median(times[sampler]):.3f} | {statistics.median(gen[sampler]):.0f} |")
    print(f"\nhf / vllm step-time ratio: {statistics.median(times['hf']) / statistics.median(times['vllm']):.2f}")


if __name__ == "__main__":
    main()
