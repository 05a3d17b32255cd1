"""The paper's evidence, drawn from runs' metrics.jsonl: average and per-benchmark Pass@1 against rollouts and
against generated tokens (its Figures 1 and 3, and the token-normalised cost), and response length and the
self-reflection rate against steps (its Figure 5), one line per run. `python eval.py --curves RUN ... --out DIR`.
A reader of the method may skip this module.
"""

import json
import os

from machinery import runfolder
from machinery.messages import fail, say


def read_runs(folders) -> dict:
    """{run name: its metrics records}; a folder without a readable metrics.jsonl, and a line that is no record
    with a whole-number step (a JSON value that is not an object, bytes that are not UTF-8), are named in one line.
    A last line without its newline that cannot be read is a write cut short, and dropped."""
    runs = {}
    for folder in folders:
        path = os.path.join(folder, "metrics.jsonl")
        if not os.path.isfile(path):
            fail(f"--curves {folder}: no metrics.jsonl there (pass remix.py run folders)", "eval")
        records = []
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
                if not isinstance(record, dict):
                    raise ValueError(f"a JSON {type(record).__name__}, not an object")
                if not isinstance(record.get("step"), int) or isinstance(record["step"], bool):
                    raise ValueError("no whole-number 'step'")
            except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
                if number == len(lines):  # no newline after it: a write cut short
                    continue
                fail(f"--curves {folder}: {path}, line {number} is not a metrics record ({str(error)[:80]}); pass "
                     f"remix.py run folders", "eval")
            records.append(record)
        name = os.path.basename(os.path.normpath(folder))
        runs[name if name not in runs else folder] = records
    return runs


def series(records: list[dict], x: str, y: str) -> tuple[list, list]:
    """The (x, y) points of the records that hold both keys as numbers, in step order."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    points = [(r[x], r[y]) for r in sorted(records, key=lambda r: r["step"]) if number(r.get(x)) and number(r.get(y))]
    return [p[0] for p in points], [p[1] for p in points]


def draw(folders, out: str) -> dict:
    """PNG files in out: pass1_vs_rollouts.png, pass1_vs_tokens.png (average and each benchmark), and
    length_and_reflection_vs_step.png. Returns {file: {run: number of points}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if os.path.lexists(out) and not os.path.isdir(out):
        fail(f"--out {out} is a file, not a folder: choose a new --out for the PNG files", "eval")
    runs = read_runs(folders)
    benchmarks = sorted({k.split("/")[1] for records in runs.values() for r in records for k in r
                         if k.startswith("eval/") and k.endswith("/pass@1") and k.split("/")[1] != "average"})
    if not benchmarks:
        fail("--curves: the runs logged no evaluation (eval/*/pass@1); train with --eval-every K", "eval")
    runfolder.writes_into(out)
    runfolder.makedirs(out)
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
        save(fig, os.path.join(out, name))
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
    save(fig, os.path.join(out, name))
    say(f"drew {', '.join(drawn)} in {out}", "eval")
    return drawn


def save(fig, path: str):
    """One figure as a PNG file, written anew and renamed into place (runfolder.new_file): a link or a FIFO there is
    replaced, never written through; a link on the way is refused in one line."""
    import matplotlib.pyplot as plt

    try:
        with runfolder.new_file(path, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
    except runfolder.Unwritable as error:
        fail(str(error), "eval")
    plt.close(fig)
