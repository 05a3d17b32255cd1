"""A long run that must hold: the default schedule's pattern (an evaluation every 25 steps, a save every 50,
reincarnation at 100, 350 steps, --keep-last 3) on CPU, with the tiny offline model and the vLLM sampler, recording at
every step the host memory (RSS), the open file descriptors, the run folder's bytes and the step time.

    python benchmarks/soak.py --out DIR [--steps 350] [--results docs/bench/soak]

Reported: the least-squares slope per 100 steps of RSS and step time after a warm-up (flat is what holds), the fd
count's first and last values, and after each save the run folder's checkpoints against the layout
(machinery.checkpoints: one full state and keep_last - 1 model folders). The per-step rows go to DIR/soak.jsonl as
they come, so a run cut short still leaves what it measured (--table-only DIR writes the table from them).

On CPU, vLLM runs its linear layers through oneDNN, which caches a compiled kernel for each new shape it meets, up
to ONEDNN_PRIMITIVE_CACHE_CAPACITY kernels (1024 by default, least recently used evicted past that). The responses'
lengths, and so the shapes, differ at every step, and the cache's fill shows as host memory growing by about 1 MB a
step with the tiny model. On a GPU, vLLM's linear layers take CUDA's path instead. --onednn-cache sets the capacity
for the benchmark's process: 0 (the default here) leaves the cache's fill out of what is measured; 1024 shows it.
"""

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor


def tree_bytes(folder) -> int:
    """Bytes of the regular files under folder (links are not followed)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                total += os.path.getsize(path)
    return total


def layout_bytes(out) -> dict:
    """What the checkpoints of a run folder hold, and what the layout says they should: the newest full checkpoint
    plus, for each older one, its policy model folder (the files in the checkpoint's top level)."""
    from machinery import checkpoints

    names = checkpoints.named(str(out))
    full = [p for p in names if checkpoints.is_full(p)]
    model_only = [p for p in names if not checkpoints.is_full(p)]
    measured = sum(tree_bytes(p) for p in names)
    expected = (tree_bytes(full[-1]) if full else 0) + sum(model_folder_bytes(p) for p in model_only)
    return {"checkpoints": [os.path.basename(p) for p in names], "full": [os.path.basename(p) for p in full],
            "checkpoint_bytes": measured, "layout_bytes": expected}


def model_folder_bytes(folder: str) -> int:
    """The bytes a checkpoint keeps once reduced: every file of its top level but its training parts."""
    from machinery import checkpoints

    parts = set(checkpoints.training_parts(folder))
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(folder, "*"))
               if p not in parts and os.path.isfile(p) and not os.path.islink(p))


def slope(xs: list, ys: list) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def summarize(rows: list[dict], warmup: int) -> dict:
    saves = [{"step": r["step"] - 1, **r["layout"]} for r in rows if r.get("layout")]
    rows = [r for r in rows if not r.get("after_run")]
    steady = [r for r in rows if r["step"] > warmup]
    steps = [r["step"] for r in steady]
    # a step with an evaluation takes longer by design (perf/step_s ends before the save): the step time's trend is
    # over the other steps
    plain = [r for r in steady if not r["eval"]]
    return {"steps": rows[-1]["step"] if rows else 0, "warmup": warmup,
            "onednn_cache": rows[0].get("onednn_cache") if rows else None,
            "rss_mb_first": steady[0]["rss_mb"] if steady else None, "rss_mb_last": steady[-1]["rss_mb"] if steady else None,
            "rss_mb_per_100_steps": 100 * slope(steps, [r["rss_mb"] for r in steady]),
            "step_s_median": sorted(r["step_s"] for r in plain)[len(plain) // 2] if plain else None,
            "step_s_per_100_steps": 100 * slope([r["step"] for r in plain], [r["step_s"] for r in plain]),
            "fds_first": steady[0]["fds"] if steady else None, "fds_last": steady[-1]["fds"] if steady else None,
            "fds_max": max((r["fds"] for r in steady), default=None),
            "saves": saves,
            "run_bytes_max": max((r["run_bytes"] for r in rows), default=0)}


def table(summary: dict, command: str, requested: int) -> str:
    s = summary
    cut = f" (the run was stopped there, short of the command's {requested}: the figures cover those steps)" \
        if s["steps"] < requested else ""
    lines = ["# Soak: the default schedule's pattern held over a long run (CPU, tiny model, vLLM sampler)", "",
             "Measured by", "", f"    {command}", "",
             f"{s['steps']} steps{cut}; slopes are least squares over the steps after {s['warmup']} (the warm-up); the "
             "step time's slope is over the steps without an evaluation (a step's time ends before its save); "
             f"oneDNN's kernel cache capacity {s['onednn_cache']}.", "",
             "| quantity | value |", "|---|---|",
             f"| host RSS after the warm-up, MB | {s['rss_mb_first']:.0f} |",
             f"| host RSS at the last step, MB | {s['rss_mb_last']:.0f} |",
             f"| host RSS slope, MB per 100 steps | {s['rss_mb_per_100_steps']:+.1f} |",
             f"| step time median (plain steps), s | {s['step_s_median']:.2f} |",
             f"| step time slope, s per 100 steps | {s['step_s_per_100_steps']:+.3f} |",
             f"| open fds after the warm-up / at the end / most | {s['fds_first']} / {s['fds_last']} / {s['fds_max']} |",
             f"| run folder, most bytes seen at a step's end | {s['run_bytes_max']:,} |", "",
             "After each save, the checkpoints on disk against the layout (newest full, older ones their policy model "
             "folder):", "", "| step | checkpoints | full | bytes on disk | layout's bytes |", "|---|---|---|---|---|"]
    for save in s["saves"]:
        lines.append(f"| {save['step']} | {', '.join(save['checkpoints'])} | {', '.join(save['full'])} | "
                     f"{save['checkpoint_bytes']:,} | {save['layout_bytes']:,} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="a new folder: the run and soak.jsonl go there")
    parser.add_argument("--steps", type=int, default=350)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-limit", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--reincarnate-step", type=int, default=100)
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--max-response-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--onednn-cache", type=int, default=0,
                        help="oneDNN's kernel cache capacity on CPU (ONEDNN_PRIMITIVE_CACHE_CAPACITY; its own default "
                             "is 1024): 0 keeps the cache's fill out of the host memory measured")
    parser.add_argument("--results", default=None, help="write PATH.md and PATH.json (e.g. docs/bench/soak)")
    parser.add_argument("--table-only", action="store_true", help="only the table from OUT/soak.jsonl")
    cli = parser.parse_args()
    if cli.onednn_cache < 0:
        parser.error(f"--onednn-cache {cli.onednn_cache}: give a number of kernels, 0 or more")
    out = Path(cli.out)
    argv = [a for a in sys.argv[1:] if a != "--table-only"]
    argv = ["OUT" if i and argv[i - 1] == "--out" else a for i, a in enumerate(argv)]  # no path of this machine
    command = "python benchmarks/soak.py " + " ".join(argv)
    if not cli.table_only:
        run(cli, out)
    rows = [json.loads(line) for line in open(out / "soak.jsonl")]
    summary = summarize(rows, cli.warmup)
    text = table(summary, command, cli.steps)
    print(text)
    if cli.results:
        Path(cli.results + ".md").write_text(text)
        Path(cli.results + ".json").write_text(json.dumps({"command": command, **summary, "rows": rows}, indent=1))


def run(cli, out: Path):
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(cli.onednn_cache)  # read at oneDNN's first kernel: set first
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import remix
    from machinery import console, report
    from tests.tiny_model import build_tiny_model, write_short_problems

    out.mkdir(parents=True, exist_ok=False)
    model = build_tiny_model(str(out / "tiny"))
    data = write_short_problems(report.data_root() / "train" / "deepscaler_partial.jsonl", out / "train.jsonl",
                                max_chars=120, limit=512)
    run_dir = out / "run"
    args = console.settings(remix.Args, model=model, dataset=str(data), out=str(run_dir), steps=cli.steps,
                          sampler="vllm", prompts_per_step=cli.prompts_per_step,
                          max_response_tokens=cli.max_response_tokens, mini_batch_prompts=4,
                          eval_every=cli.eval_every, eval_limit=cli.eval_limit, eval_max_tokens=cli.max_response_tokens,
                          save_every=cli.save_every, keep_last=cli.keep_last, reincarnate_step=cli.reincarnate_step,
                          seed=1, log_completions=0)
    log = open(out / "soak.jsonl", "a")
    last = {"t": time.perf_counter()}

    def on_step(step, record, policy, tokenizer, batch):
        # on_step runs before the step's save: the folder's checkpoints are measured as they stand after the
        # previous save, and the row of a saving step is completed at the next step
        now = time.perf_counter()
        row = {"step": step, "rss_mb": rss_mb(), "fds": open_fds(), "run_bytes": tree_bytes(run_dir),
               "step_s": record["perf/step_s"], "wall_s": now - last["t"], "eval": "perf/eval_s" in record,
               "saved": bool(cli.save_every) and step > 1 and (step - 1) % cli.save_every == 0,
               "onednn_cache": cli.onednn_cache}
        if row["saved"]:
            row["layout"] = layout_bytes(run_dir)
        last["t"] = now
        log.write(json.dumps(row) + "\n")
        log.flush()

    remix.train(args, on_step=on_step)
    final = layout_bytes(run_dir)  # after the last save
    log.write(json.dumps({"step": cli.steps + 1, "rss_mb": rss_mb(), "fds": open_fds(), "run_bytes": tree_bytes(run_dir),
                          "step_s": 0.0, "wall_s": 0.0, "eval": True, "saved": True, "layout": final,
                          "after_run": True}) + "\n")
    log.close()


if __name__ == "__main__":
    main()
