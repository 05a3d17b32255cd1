"""The plan's figures for the paper's models, the tables of docs/memory.md, computed by machinery.plan
(the code a run's plan uses) from the models' configs in benchmarks/configs/ (DeepSeek-R1-Distill-Qwen-1.5B and -7B:
Qwen2, shapes from their config.json):

    python benchmarks/plan_figures.py > figures.md                                # the tables
    python benchmarks/plan_figures.py CONFIG --gpus N --gpu-gb G [remix.py's flags]   # one config's plan, JSON

Every run's defaults (350 steps, --save-every 50, --keep-last 3, bf16, gradient checkpointing, 16,384-token
micro-batches, --vllm-gpu-memory-utilization 0.35, the engine asleep during updates); one process per GPU."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import remix  # noqa: E402
from machinery import console, plan  # noqa: E402

MODELS = {"1.5B": "deepseek-r1-distill-qwen-1.5b.json", "7B": "deepseek-r1-distill-qwen-7b.json"}
CARDS = (80, 40, 24)


def gpu_args(**changes):
    args = remix.finalize_args(console.settings(remix.Args, **changes))
    args.precision, args.gradient_checkpointing = "bf16", None  # a GPU's defaults
    return args


def gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def main():
    print("| model | algorithm | full checkpoint (GB) | model folder (GB) | peak of a save, defaults (GB) | "
          "with --keep-last 1 (GB) |")
    print("|---|---|---|---|---|---|")
    shapes = {name: plan.shape_of(str(ROOT / "benchmarks" / "configs" / config)) for name, config in MODELS.items()}
    for name, shape in shapes.items():
        for algo in ("ppo", "grpo"):
            d = plan.disk(shape, gpu_args(algo=algo), 1)
            one = plan.disk(shape, gpu_args(algo=algo, keep_last=1), 1)
            print(f"| {name} | {algo.upper()} | {gb(d['full'])} | {gb(d['model_folder'])} | {gb(d['peak'])} | "
                  f"{gb(one['peak'])} |")
    print()
    print("| model | algorithm | --offload | GPUs | states per GPU (GB) | update peak (GB) | generation peak on "
          "80 / 40 / 24 GB (GB) | fits 80 / 40 / 24 GB | host per node (GB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, shape in shapes.items():
        for algo in ("ppo", "grpo"):
            for offload in (False, True):
                for gpus in (1, 2, 4, 8):
                    rows = [plan.figures(shape, gpu_args(algo=algo), gpus, True, card * 1e9, offload, local=gpus)
                            for card in CARDS]
                    parts = rows[0]["memory"]["parts"]
                    states = sum(parts[k] for k in ("weights (fp32 masters)", "AdamW moments (fp32)", "reference"))
                    fits = " / ".join("yes" if r["memory"]["peak"] <= card * 1e9 else "no"
                                      for r, card in zip(rows, CARDS))
                    generation = " / ".join(gb(r["memory"]["generation"]) for r in rows)
                    print(f"| {name} | {algo.upper()} | {'yes' if offload else 'no'} | {gpus} | {gb(states)} | "
                          f"{gb(rows[0]['memory']['update'])} | {generation} | {fits} | {gb(rows[0]['host'])} |")


def one(argv: list[str]):
    """The plan's figures for one model's config (a config.json file, a model folder or a hub id) on N GPUs of G GB
    each, with remix.py's flags, as JSON."""
    import argparse
    import json

    from machinery import runner

    parser = argparse.ArgumentParser(prog="python benchmarks/plan_figures.py")
    parser.add_argument("config")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--gpu-gb", type=float, default=80.0)
    known, rest = parser.parse_known_args(argv)
    sys.argv = ["remix"] + rest
    args = remix.finalize_args(runner.cli(remix.Args))
    if "--precision" not in rest:
        args.precision = "bf16"  # the figures are a GPU's
    figures = plan.figures(plan.shape_of(known.config), args, known.gpus, True, known.gpu_gb * 1e9, args.offload,
                           local=known.gpus)
    print(json.dumps(figures, indent=1, default=float))


if __name__ == "__main__":
    one(sys.argv[1:]) if len(sys.argv) > 1 else main()
