"""What a run records: metrics.jsonl, completions.jsonl, TensorBoard and wandb, and the curves drawn from them.

The run's logs (one metrics record per step, completions.jsonl, TensorBoard and wandb), kept up to a resumed
checkpoint's step. The step's metrics record, over the samples of every rank (docs/metrics.md): what the method hands
over, combined. The paper's evidence, drawn from runs' metrics.jsonl (`python eval.py --curves RUN ... --out DIR`):
average and per-benchmark Pass@1 against rollouts and against generated tokens (its Figures 1 and 3, and the
token-normalised cost), and response length and the self-reflection rate against steps (its Figure 5), one line per
run. A reader of the method may skip this module.
"""

import collections
import contextlib
import json
import math
import os
import threading

import numpy as np
import torch

from machinery import console, dist, runfolder
from machinery.console import fail, say
from machinery.runfolder import replace_file


def check_logs(out: str):
    """A resumed run's logs are files it can read and rewrite: a FIFO in their place would block it for good, and a
    link would be read as the run's own (its target is never written: the rewrite replaces the link)."""
    for name in ("metrics.jsonl", "completions.jsonl"):
        path = os.path.join(out, name)
        if os.path.islink(path):
            fail(str(runfolder.Linked(path)))
        if os.path.lexists(path) and not os.path.isfile(path):
            fail(f"--resume {out}: {path} is not a regular file (a FIFO, socket, device or broken link); remove it")


def read_jsonl_upto(path: str, done: int) -> list[str]:
    """The lines of a log whose step is at most done. A line that is no record with a step (a partial last line
    from a crash mid-write, or junk) is dropped with a note naming the file and line: it holds nothing to keep."""
    kept = []
    if not os.path.exists(path):
        return kept
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        try:
            if json.loads(line)["step"] <= done:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            if line.strip():
                say(f"{path}, line {number}: dropped an unreadable line"
                    + (" (a write cut short)" if number == len(lines) and not line.endswith("\n") else ""))
    return kept



def _quiet_writer_thread(report, default=threading.excepthook):
    """TensorBoard's writer thread hands a failed write (a full disk) to the next call of the main thread, where
    RunLog reports it in one line, and then re-raises it: that second report, a traceback, is not printed."""
    if not (isinstance(report.exc_value, OSError) and type(report.thread).__name__ == "_AsyncWriterThread"):
        default(report)


class RunLog:
    """metrics.jsonl (one JSON object per step), completions.jsonl, TensorBoard and, with --track, wandb; on the
    first process only. A resumed run keeps the steps up to its checkpoint and drops any logged after it. A failed
    write (a full disk) stops the run with one line; the checkpoints, written apart, stay as they were."""

    def __init__(self, out: str, config: dict, done: int, track: bool):
        self.active, self.out, self.failed = dist.rank() == 0, out, False
        if not self.active:
            return
        runfolder.writes_into(out)
        self.files = {}
        for name in ("metrics", "completions"):
            path = os.path.join(out, f"{name}.jsonl")
            with self.writing(path):
                replace_file(path, read_jsonl_upto(path, done) if done else [])
                self.files[name] = runfolder.open_file(path, "a")
        from torch.utils.tensorboard import SummaryWriter

        threading.excepthook = _quiet_writer_thread
        with self.writing(os.path.join(out, "tb")):
            runfolder.check_tree(os.path.join(out, "tb"))  # TensorBoard opens its files by name: no link in there
            self.writer = SummaryWriter(os.path.join(out, "tb"), purge_step=done + 1 if done else None)
            self.writer.add_text("args", json.dumps(config, indent=1))
        self.wandb = None
        if track:
            import wandb

            self.wandb = wandb
            with self.writing(os.path.join(out, "wandb")):  # wandb replaces its own latest-run link
                runfolder.check_tree(os.path.join(out, "wandb"), allowed=("latest-run",))
            wandb.init(project=os.environ.get("WANDB_PROJECT", "remix"), config=config, dir=out)

    @contextlib.contextmanager
    def writing(self, what: str):
        """An OSError in the block (a full disk, a file-size limit) stops the run with one line naming what."""
        try:
            yield
        except OSError as error:
            if self.failed:  # closing the logs after the failure already reported
                return
            self.failed = True
            if isinstance(error, runfolder.Unwritable):
                fail(str(error))
            fail(f"cannot write {what}: {error.strerror or error}; {console.resume_line(self.out)}")

    def write(self, record: dict):
        if not self.active:
            return
        with self.writing(self.files["metrics"].name):
            self.files["metrics"].write(json.dumps(record) + "\n")
            self.files["metrics"].flush()
        with self.writing(os.path.join(self.out, "tb")):  # flushed each step: a failed write shows here
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])

    def completions(self, step: int, rows: list[dict]):
        if not self.active or not rows:
            return
        with self.writing(self.files["completions"].name):
            self.files["completions"].writelines(json.dumps(row) + "\n" for row in rows)
            self.files["completions"].flush()
        with self.writing(os.path.join(self.out, "tb")):
            self.writer.add_text("completions", "\n\n".join(
                f"**step {r['step']}, reward {r['reward']}, age {r['age']}**\n\n    {r['response'][:2000]}"
                for r in rows), step)
        if self.wandb is not None:
            columns = list(rows[0])
            self.wandb.log({"completions": self.wandb.Table(columns=columns, data=[[json.dumps(r[c]) if isinstance(
                r[c], (dict, list)) else r[c] for c in columns] for r in rows])}, step=step)

    def close(self):
        if self.active:
            for f in getattr(self, "files", {}).values():
                with self.writing(f.name):
                    f.close()
            if hasattr(self, "writer"):
                with self.writing(os.path.join(self.out, "tb")):
                    self.writer.close()


def completion_rows(step: int, batch: list[dict], tokenizer, n: int, final_answer) -> list[dict]:
    """n of the step's responses, spread over the batch (fresh ones first, then historical), as records to read:
    the text, its reward and parts, the grader's status and the answer it extracted, the policy version that
    sampled it and its age (0 when fresh), its length and whether it was cut at the limit."""
    if n <= 0 or not batch:
        return []
    picked = [batch[round(i * (len(batch) - 1) / max(n - 1, 1))] for i in range(min(n, len(batch)))]
    rows = []
    for s in {id(s): s for s in picked}.values():  # each once
        response = tokenizer.decode(s["response_ids"], skip_special_tokens=True)
        rows.append({"step": step, "historical": s["version"] < step, "version": s["version"],
                     "age": step - s["version"], "prompt": tokenizer.decode(s["prompt_ids"], skip_special_tokens=True),
                     "response": response, "answer": s["answer"], "extracted": final_answer(response),
                     "reward": s["reward"], "reward_parts": s.get("reward_parts", {}), "status": s.get("status"),
                     "length": len(s["response_ids"]), "truncated": s["truncated"]})
    return rows


# ----------------------------------------------------------------------------------------------
# The step's metrics record, combined over the ranks
# ----------------------------------------------------------------------------------------------
def step_metrics(step: int, fresh: list[dict], history: list[dict], diagnostics: dict, stats: dict) -> dict:
    """Each rank condenses its samples and the method's off-policy diagnostics (remix.offpolicy_diagnostics) into
    sums and lists; rank-order concatenation and sums combine them."""
    log_ratio, cut = diagnostics["log_ratio"], diagnostics["trace_cut"]  # [historical tokens]
    hist_adv, fresh_adv = diagnostics["abs_adv_historical"], diagnostics["abs_adv_fresh"]  # [tokens]
    raw = {"reward": [s["reward"] for s in fresh], "reward_parts": [s.get("reward_parts", {}) for s in fresh],
           "length": [len(s["response_ids"]) for s in fresh],
           "truncated": [s["truncated"] for s in fresh], "reflects": [s["reflects"] for s in fresh],
           "zero_spread": diagnostics["zero_spread"].tolist(),
           "grader": [s.get("status", "ok") for s in fresh], "age": [step - s["version"] for s in history],
           "ratio_min": [log_ratio.min().exp().item()] if len(log_ratio) else [],
           "ratio_max": [log_ratio.max().exp().item()] if len(log_ratio) else [],
           "trace_prod": diagnostics["trace_prod"].tolist()}
    sums = {"log_ratio": [log_ratio.sum().item(), (log_ratio ** 2).sum().item(), log_ratio.exp().sum().item(),
                          cut.sum().item(), len(log_ratio)],
            "adv": [hist_adv.sum().item(), len(hist_adv), fresh_adv.sum().item(), len(fresh_adv)],
            "work": [dist.padding["tokens"], dist.padding["slots"]], "critic": critic_sums(fresh + history)}
    mismatch = sampler_mismatch(fresh)
    sums["mismatch"], raw["mismatch_max"] = mismatch[:-1], [mismatch[-1]]
    dist.padding.clear()
    every = dist.all_gather((raw, sums))
    merged = {k: [v for r, _ in every for v in r[k]] for k in raw}
    lr_sum, lr_sq, exp_sum, cut, count = np.sum([s["log_ratio"] for _, s in every], axis=0)
    hist_adv, hist_tokens, fresh_adv, fresh_tokens = np.sum([s["adv"] for _, s in every], axis=0)
    tokens, slots = np.sum([s["work"] for _, s in every], axis=0)
    y_sum, y_sq, gap_sum_v, gap_sq, value_count = np.sum([s["critic"] for _, s in every], axis=0)
    y_var = y_sq / max(value_count, 1) - (y_sum / max(value_count, 1)) ** 2
    gap_var = gap_sq / max(value_count, 1) - (gap_sum_v / max(value_count, 1)) ** 2
    gap_sum, k3_sum, outside, weight_sum, gap_count = np.sum([s["mismatch"] for _, s in every], axis=0)
    rewards, counts = merged["reward"], collections.Counter(merged["grader"])
    mean = lambda xs, empty=0.0: float(np.mean(xs)) if len(xs) else empty  # noqa: E731
    lr_mean = lr_sum / max(count, 1)
    return {
        "reward/mean": mean(rewards), "reward/std": float(np.std(rewards, ddof=1)) if len(rewards) > 1 else 0.0,
        "reward/zero_std_groups": mean(merged["zero_spread"]),
        "response/length_mean": mean(merged["length"]), "response/length_max": max(merged["length"]),
        "response/truncated": mean(merged["truncated"]), "response/self_reflection": mean(merged["reflects"]),
        **{k: float(np.mean(v)) for k, v in stats.items() if not k.startswith("train/")},
        "train/optimizer_steps": len(stats.get("train/optimizer_steps", [])),
        "train/skipped_updates": len(stats.get("train/skipped_updates", [])),
        "batch/fresh": len(rewards), "batch/historical": len(merged["trace_prod"]),
        "offpolicy/ratio_min": min(merged["ratio_min"], default=1.0),  # pi_k/mu on historical tokens; 1 without
        "offpolicy/ratio_mean": exp_sum / count if count else 1.0,
        "offpolicy/ratio_max": max(merged["ratio_max"], default=1.0),
        "offpolicy/log_ratio_mean": lr_mean,
        "offpolicy/log_ratio_std": math.sqrt(max(lr_sq / max(count, 1) - lr_mean ** 2, 0.0)),
        "offpolicy/trace_truncated": cut / count if count else 0.0,
        "offpolicy/adv_scale": (hist_adv / hist_tokens) / max(fresh_adv / fresh_tokens, 1e-12) if hist_tokens else 1.0,
        "offpolicy/trace_prod_mean": mean(merged["trace_prod"], 1.0),
        "replay/mean_age": mean(merged["age"]),
        **({"losses/explained_variance": 1.0 - gap_var / y_var if y_var > 0 else None} if value_count else {}),
        "perf/padding": 1.0 - tokens / max(slots, 1),
        "grader/failures": counts["error"] + counts["unparsable"] + counts["timeout"],
        "grader/no_boxed": counts["no_boxed"],
        **{f"reward/{name}": mean([parts.get(name, 0.0) for parts in merged["reward_parts"]])
           for name in sorted({name for parts in merged["reward_parts"] for name in parts})},
        **({"mismatch/abs_log_ratio_mean": gap_sum / gap_count, "mismatch/abs_log_ratio_max": max(merged["mismatch_max"]),
            "mismatch/k3_kl": k3_sum / gap_count, "mismatch/ratio_outside_0.5_2": outside / gap_count,
            "mismatch/is_weight_mean": weight_sum / gap_count} if gap_count else {}),
    }


def critic_sums(samples: list[dict]) -> list[float]:
    """Sums for the critic's explained variance over this rank's response tokens (PPO), CleanRL's diagnostic,
    1 - Var(target - V) / Var(target) with V the values before the update: of the targets, their squares, the
    residuals, their squares, and the token count. Empty (zeros) without a critic."""
    pairs = [(s["value_targets"], s["values"]) for s in samples if "value_targets" in s]
    if not pairs:
        return [0.0] * 5
    y, v = (torch.cat([x[k].cpu() for x in pairs]).double() for k in (0, 1))  # [tokens]
    return [y.sum().item(), (y ** 2).sum().item(), (y - v).sum().item(), ((y - v) ** 2).sum().item(), float(len(y))]


def sampler_mismatch(fresh: list[dict]) -> list[float]:
    """How far the sampler's probabilities of its own tokens are from the trainer's (pi_k recomputed), over this
    rank's fresh tokens: sums of |log pi_trainer - log pi_sampler|, of the k3 estimate of KL(sampler || trainer)
    (r - 1 - log r with r = pi_trainer / pi_sampler, on the sampler's tokens), of tokens whose r leaves [0.5, 2],
    of the correction weights, the token count, and the largest |log r|, last (not summed over ranks)."""
    pairs = [(s["behaviour_logp"], s["sampler_logp"], s.get("sampler_weight")) for s in fresh
             if s.get("sampler_logp") is not None]
    if not pairs:
        return [0.0] * 6
    log_r = torch.cat([trainer - sampler for trainer, sampler, _ in pairs]).double()  # [fresh tokens], fp64 for r-1-log r
    weights = torch.cat([w if w is not None else torch.ones_like(t) for t, _, w in pairs])  # [fresh tokens]
    return [log_r.abs().sum().item(), (log_r.exp() - 1 - log_r).sum().item(),
            (log_r.abs() > math.log(2)).sum().item(), weights.sum().item(), float(len(log_r)), log_r.abs().max().item()]


# ----------------------------------------------------------------------------------------------
# The curves of eval.py --curves, drawn from runs' metrics.jsonl
# ----------------------------------------------------------------------------------------------
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
