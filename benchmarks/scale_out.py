"""Two processes (torchrun, FSDP2 over gloo) against one on this CPU, on the tiny model (docs/multi_gpu.md).

    python benchmarks/scale_out.py [--data FILE: default the repository's data/train/deepscaler_partial.jsonl]
    python benchmarks/scale_out.py --part host-memory [--before GIT_REVISION]

1. End to end: GRPO, 16 prompts x 4 responses of up to 64 tokens per step, 6 steps (p = 0.4 during the mix
   stage, reincarnation after step 3), with the transformers and the vLLM sampler; `python remix.py` against
   `torchrun --nproc-per-node 2 remix.py` with the same global batch. Rollouts per second over the steps after
   the first (which warms up), from each run's own perf/step_s.
2. One update: the batch update() received at step 2 of a real run, updated once in one process and once
   split over two (test_remix.run_update, the same code the equivalence test checks).
Each measurement runs in its own process, alternating over rounds; medians and ratios.
3. Host memory at start (--part host-memory): each rank's peak resident memory while `machinery.models.load`
   loads and shards the policy, reference and critic of a PPO run under `torchrun --nproc-per-node 2`, on a
   random Qwen2 of 109 M parameters (hidden 1024, 12 layers: 0.44 GB in fp32), stored in bf16 as hub checkpoints
   are, so the weights dominate. With --before REV the same measurement also runs on that git revision's code:
   its remix.py with remix_utils.py (before the restructuring) or machinery/ (after), whichever it has.
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


def end_to_end(model: str, data: str, out: Path, sampler: str, ranks: int) -> float:
    argv = [str(ROOT / "remix.py"), "--model", model, "--dataset", data, "--out", str(out), "--algo", "grpo",
            "--sampler", sampler, "--steps", "6", "--reincarnate-step", "3", "--prompts-per-step", "16",
            "--group-size", "4", "--max-response-tokens", "64", "--mini-batch-prompts", "8", "--save-every", "0",
            "--eval-every", "0"]
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                                    str(ranks)]
    subprocess.run(launcher + argv, check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")][1:]
    return sum(r["batch/fresh"] for r in rows) / sum(r["perf/step_s"] for r in rows)


def update_seconds(case: Path, ranks: int) -> float:
    """Seconds of update() alone (after a first, warm-up run), on the same batch split over the ranks."""
    code = f"""import os, sys, time, torch
sys.path.insert(0, {str(ROOT)!r})
import remix, test_remix
from machinery import dist
seconds, real = [], remix.update
def timed(*a, **k):
    start = time.perf_counter()
    out = real(*a, **k)
    dist.barrier()
    seconds.append(time.perf_counter() - start)
    return out
remix.update = timed
case = torch.load({str(case)!r}, weights_only=False)
test_remix.run_update(case)
test_remix.run_update(case)
print('SECONDS', seconds[-1], flush=True)
os._exit(0)
"""
    script = case.parent / "update_timer.py"
    script.write_text(code)
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                                    str(ranks)]
    done = subprocess.run(launcher + [str(script)], check=True, capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return float([line for line in done.stdout.splitlines() if line.startswith("SECONDS")][0].split()[1])


HOST_MEMORY = """import json, os, resource, sys
sys.path.insert(0, sys.argv[1])
import torch, remix
if os.path.isdir(os.path.join(sys.argv[1], "machinery")):  # the package (after the restructuring)
    import importlib
    from machinery import dist, models
    dist.init()
    rank, barrier = dist.rank, dist.barrier
    homes = [importlib.import_module("machinery." + m) for m in ("console", "flags")  # settings' home, then and now
             if os.path.exists(os.path.join(sys.argv[1], "machinery", m + ".py"))]
    settings = next((h.settings for h in homes if hasattr(h, "settings")),
                    lambda cls, **values: cls(**values))  # remix.Args held the run's too before
    load = lambda: models.load(remix.finalize_args(settings(remix.Args, model=sys.argv[2], algo="ppo")))
else:  # remix_utils.py beside remix.py (before it)
    import remix_utils
    device = remix_utils.init_distributed()
    rank, barrier = remix_utils.rank, remix_utils.barrier
    load = lambda: remix.load_models(remix.Args(model=sys.argv[2], algo="ppo"), device)
imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
load()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("RSS", json.dumps({"rank": rank(), "imports_gib": imported / 2**20, "peak_gib": peak / 2**20}), flush=True)
barrier()
os._exit(0)
"""


def host_memory(source: Path, model: str, work: Path) -> list[dict]:
    """Each rank's peak resident memory (ru_maxrss) after loading and sharding the three models of a PPO run."""
    script = work / "host_memory.py"
    script.write_text(HOST_MEMORY)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
                           str(source), model], check=True, capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return sorted((json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("RSS ")),
                  key=lambda r: r["rank"])


def revision_files(revision: str, dest: Path) -> Path:
    """The method's files as they were at a git revision, written under dest: remix.py, and remix_utils.py (before
    the restructuring) or every file of machinery/ (after), whichever the revision has."""
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", revision, "--", "remix.py", "remix_utils.py",
                             "machinery"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    if "remix.py" not in listed:
        sys.exit(f"scale_out: revision {revision} has no remix.py")
    for name in listed:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(subprocess.run(["git", "show", f"{revision}:{name}"], cwd=ROOT, check=True,
                                                 capture_output=True).stdout)
    return dest


def host_memory_part(before: str | None, rounds: int):
    import torch

    from tests.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="remix-host-"))
    model = build_tiny_model(str(work / "model"), hidden_size=1024, layers=12)
    from transformers import AutoModelForCausalLM

    # stored in bf16, as hub checkpoints are: loading fp32 masters then converts into new memory (an fp32
    # checkpoint would be memory-mapped, and only the pages that sharding reads would count)
    AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16,
                                         trust_remote_code=False).save_pretrained(model)
    sources = {"this checkout": ROOT}
    if before:
        sources = {f"before ({before})": revision_files(before, work / "before"), **sources}
    peaks = {}
    for round_ in range(rounds):
        for label, source in sources.items():
            ranks = host_memory(source, model, work)
            peaks.setdefault(label, []).append(ranks)
            print(f"round {round_}, {label}: " + ", ".join(f"rank {r['rank']} {r['peak_gib']:.2f} GiB" for r in ranks),
                  flush=True)
    print("\n| code | rank 0 peak (GiB) | rank 1 peak (GiB) | after imports (GiB) |\n|---|---|---|---|")
    for label, runs in peaks.items():
        med = [statistics.median(run[r]["peak_gib"] for run in runs) for r in (0, 1)]
        imports = statistics.median(run[0]["imports_gib"] for run in runs)
        print(f"| {label} | {med[0]:.2f} | {med[1]:.2f} | {imports:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("speed", "host-memory"), default="speed")
    parser.add_argument("--data", help="a .jsonl with problem/answer (the speed part; default: the repository's "
                                       "data/train/deepscaler_partial.jsonl, REMIX_DATA overrides)")
    parser.add_argument("--before", help="host-memory: also measure this git revision's remix.py")
    parser.add_argument("--rounds", type=int, default=3)
    cli = parser.parse_args()
    if cli.part == "host-memory":
        return host_memory_part(cli.before, cli.rounds)
    import torch

    import test_remix
    from machinery import report
    from tests.tiny_model import build_tiny_model, write_short_problems

    cli.data = cli.data or str(report.data_root() / "train" / "deepscaler_partial.jsonl")

    work = Path(tempfile.mkdtemp(prefix="remix-scale-"))
    model = build_tiny_model(str(work / "tiny"))
    data = write_short_problems(cli.data, work / "train.jsonl", max_chars=200, limit=512)
    case = test_remix.prepared_update_case(model, data, work / "case-run", "ppo")
    torch.save(case, work / "case.pt")
    rates, updates = {}, {}
    for round_ in range(cli.rounds):
        for ranks in (1, 2):
            for sampler in ("hf", "vllm"):
                rate = end_to_end(model, str(data), work / f"{sampler}-{ranks}-{round_}", sampler, ranks)
                rates.setdefault((sampler, ranks), []).append(rate)
            updates.setdefault(ranks, []).append(update_seconds(work / "case.pt", ranks))
        print(f"round {round_}: " + ", ".join(f"{k}: {v[-1]:.1f}" for k, v in rates.items()) +
              f"; update {updates[1][-1]:.3f} s / {updates[2][-1]:.3f} s", flush=True)
    print(f"\nGRPO, 16 prompts x 4 responses (global), up to 64 tokens, {cli.rounds} rounds\n")
    print("| sampler | rollouts/s, 1 process | rollouts/s, 2 processes | 2 / 1 |\n|---|---|---|---|")
    for sampler in ("hf", "vllm"):
        one, two = statistics.median(rates[sampler, 1]), statistics.median(rates[sampler, 2])
        print(f"| {sampler} | {one:.1f} | {two:.1f} | {two / one:.2f} |")
    one, two = statistics.median(updates[1]), statistics.median(updates[2])
    print(f"\none update of the same PPO batch ({len(case['batch'])} responses, {case['utd']} passes): 1 process "
          f"{one:.3f} s, 2 processes {two:.3f} s, 2 / 1 = {two / one:.2f}")


if __name__ == "__main__":
    main()
