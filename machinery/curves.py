"""The paper's evidence, drawn from runs' metrics.jsonl: average and per-benchmark Pass@1 against rollouts and
against generated tokens (its Figures 1 and 3, and the token-normalised cost), and response length and the
self-reflection rate against steps (its Figure 5), one line per run. `python eval.py --curves RUN ... --out DIR`.
A reader of the method may skip this module.
"""

import json
import os

from machinery.messages import fail, say


def read_runs(folders) -> dict:
    """{run name: its metrics records}; a folder without a readable metrics.jsonl is named in one line."""
    runs = {}
    for folder in folders:
        path = os.path.join(folder, "metrics.jsonl")
        if not os.path.isfile(path):
            fail(f"--curves {folder}: no metrics.jsonl there (pass remix.py run folders)", "eval")
        records = []
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a write cut short
        name = os.path.basename(os.path.normpath(folder))
        runs[name if name not in runs else folder] = records
    return runs


def series(records: list[dict], x: str, y: str) -> tuple[list, list]:
    """The (x, y) points of the records that hold both keys, in step order."""
    points = [(r[x], r[y]) for r in sorted(records, key=lambda r: r["step"]) if x in r and y in r]
    return [p[0] for p in points], [p[1] for p in points]


def draw(folders, out: str) -> dict:
    """PNG files in out: pass1_vs_rollouts.png, pass1_vs_tokens.png (average and each benchmark), and
    length_and_reflection_vs_step.png. Returns {file: {run: number of points}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = read_runs(folders)
    benchmarks = sorted({k.split("/")[1] for records in runs.values() for r in records for k in r
                         if k.startswith("eval/") and k.endswith("/pass@1") and k.split("/")[1] != "average"})
    if not benchmarks:
        fail("--curves: the runs logged no evaluation (eval/*/pass@1); train with --eval-every K", "eval")
    os.makedirs(out, exist_ok=True)
    drawn = {}
    panels = ["average"] + benchmarks
    for x, label, name in (("rollouts/total", "rollouts", "pass1_vs_rollouts.png"),
                           ("rollouts/generated_tokens", "generated tokens", "pass1_vs_tokens.png")):
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
        for ax, bench in zip(axes[0], panels):
            for run_name, records in runs.items():
                xs, ys = series(records, x, f"eval/{bench}/pass@1")
                ax.plot(xs, ys, marker=".", label=run_name)
                drawn.setdefault(name, {})[run_name] = drawn.get(name, {}).get(run_name, 0) + len(xs)
            ax.set_title(f"{bench}: greedy Pass@1 (%)" if bench != "average" else "average of the benchmarks (%)",
                         fontsize=9)
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=100)
        plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    name = "length_and_reflection_vs_step.png"
    for ax, key, title in ((axes[0], "response/length_mean", "mean response length (tokens), training samples"),
                           (axes[1], "response/self_reflection", "self-reflection rate, training samples")):
        for run_name, records in runs.items():
            xs, ys = series(records, "step", key)
            ax.plot(xs, ys, label=run_name)
            drawn.setdefault(name, {})[run_name] = drawn.get(name, {}).get(run_name, 0) + len(xs)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=100)
    plt.close(fig)
    say(f"drew {', '.join(drawn)} in {out}", "eval")
    return drawn
