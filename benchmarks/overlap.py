"""What --overlap buys on this machine: a step's wall-clock with the sampler in a process of its own, drawing the next
step's batch while the trainer trains, against the synchronous run at equal settings, beside the bound the
synchronous run's own timings set, max(gen, train) / (gen + train).

    python benchmarks/overlap.py            # two random-weight Qwen2 models, 8 steps each way (CPU, ~10 min)
    python benchmarks/overlap.py --quick    # the tiny model, 4 steps each way: a smoke run of the script

Each run is a real `remix.train` (GRPO, 8 prompts x 4 responses of up to 96 tokens, the vLLM engine, no save, no
evaluation, T past the last step so that the overlapped run never drains), in its own process; the synchronous and
the overlapped runs alternate, --rounds times each. train is the synchronous run's `trainer` and `weight_sync` laps
(perf/update_s, perf/weight_sync_s), gen the rest of its step (drawing, grading, logging); the step times are
perf/step_s; each figure is the median over the rounds' steps after the first two (the engines' warm-up).
On a CPU the two processes share the machine's cores (the sampler takes half, the trainer the rest): the bound
assumes each phase keeps the speed it has alone, which on a GPU node, where the sampler has GPUs of its own, is
closer to true.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUN = """import sys
sys.path.insert(0, {root!r})
import remix
from machinery import console
args = console.settings(remix.Args, model={model!r}, dataset={data!r}, out={out!r}, algo="grpo", sampler="vllm",
                        overlap={overlap}, steps={steps}, prompts_per_step=8, group_size=4, max_response_tokens=96,
                        mini_batch_prompts=4, save_every=0, eval_every=0, reincarnate_step={steps} + 1,
                        log_completions=0, actor_lr=1e-5)
remix.train(args)
"""


def run(model: str, data: str, out: Path, overlap: bool, steps: int) -> list[dict]:
    script = out.with_suffix(".py")
    script.write_text(RUN.format(root=str(ROOT), model=model, data=data, out=str(out), overlap=overlap, steps=steps))
    subprocess.run([sys.executable, str(script)], check=True, capture_output=True,
                   env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, 4 steps each way (a smoke run)")
    parser.add_argument("--steps", type=int, default=8, help="steps of each run (default 8)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each kind, alternating (default 2)")
    cli = parser.parse_args()
    from machinery import report
    from tests.tiny_model import build_tiny_model, write_short_problems

    work = Path(tempfile.mkdtemp(prefix="remix-overlap-"))
    data = write_short_problems(str(report.data_root() / "train" / "deepscaler_partial.jsonl"), work / "train.jsonl",
                                max_chars=120, limit=64)
    models = {"hidden 128, 2 layers": build_tiny_model(str(work / "tiny"))}
    if not cli.quick:
        models["hidden 512, 8 layers"] = build_tiny_model(str(work / "deeper"), hidden_size=512, layers=8)
    steps = 4 if cli.quick else cli.steps
    print(f"{os.cpu_count()} CPU cores; {steps} steps a run, medians over steps 3-{steps} of each kind's runs\n\n"
          "| model | gen s | train s | synchronous step s | overlapped step s | overlapped / synchronous | "
          "bound max(gen, train) / (gen + train) |\n|---|---|---|---|---|---|---|")
    shares = []
    for name, model in models.items():
        sync, ahead = [], []
        for round_ in range(1 if cli.quick else cli.rounds):
            sync += run(model, data, work / f"{Path(model).name}-sync-{round_}", False, steps)[2:]
            ahead += run(model, data, work / f"{Path(model).name}-overlap-{round_}", True, steps)[2:]
        gen = statistics.median(r["perf/step_s"] - r["perf/update_s"] - r["perf/weight_sync_s"] for r in sync)
        train = statistics.median(r["perf/update_s"] + r["perf/weight_sync_s"] for r in sync)
        step_sync = statistics.median(r["perf/step_s"] for r in sync)
        step_ahead = statistics.median(r["perf/step_s"] for r in ahead)
        print(f"| {name} | {gen:.2f} | {train:.2f} | {step_sync:.2f} | {step_ahead:.2f} | "
              f"{step_ahead / step_sync:.2f} | {max(gen, train) / (gen + train):.2f} |", flush=True)
        shares.append((name, gen / (gen + train)))
    print(node_table(shares))


def node_table(shares: list[tuple[str, float]], gpus: int = 8) -> str:
    """On paper: a node of `gpus` GPUs, the synchronous step gen + train = 1 on all of them (gen's share g), split into
    s GPUs for the sampler and the rest for the trainer. Training scales with its GPUs (train' = (1-g) gpus/(gpus-s)).
    Generation either scales too (throughput-bound: gen' = g gpus/s) or keeps its time, set by its longest responses
    (tail-bound: gen' = g, while s GPUs hold the batch). The overlapped step is max(gen', train'); the best s each."""
    lines = ["", f"On paper, a node of {gpus} GPUs split into s for the sampler and {gpus} - s for the trainer "
             "(speed-up = synchronous step / overlapped step, the best s):", "",
             "| generation's share g | from | throughput-bound generation | tail-bound generation |",
             "|---|---|---|---|"]
    for name, g in shares + [("", x) for x in (0.5, 0.6, 0.7, 0.8)]:
        best = {}
        for regime, gen_time in (("throughput", lambda s: g * gpus / s), ("tail", lambda s: g)):
            step, s = min((max(gen_time(s), (1 - g) * gpus / (gpus - s)), s) for s in range(1, gpus))
            best[regime] = f"{1 / step:.2f}x (s = {s})"
        lines.append(f"| {g:.2f} | {name or 'assumed'} | {best['throughput']} | {best['tail']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
