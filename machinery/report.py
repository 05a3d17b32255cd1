"""What a run and an evaluation report: Pass@1 on the benchmarks, and a run's logs and metrics.

One Pass@1 for eval.py and for the evaluation during training; a run's logs are kept up to a resumed checkpoint."""

import collections
import contextlib
import hashlib
import json
import math
import os
import threading
from pathlib import Path

import numpy as np
import torch

from machinery import data, dist, engines, grader, runfolder
from machinery.console import fail, say

# name -> (file in the benchmark folder, hub id, hub config, hub split); "all" is the paper's five
BENCHMARKS = {
    "aime24": ("aime24.jsonl", "HuggingFaceH4/aime_2024", None, "train"),
    "amc23": ("amc23.jsonl", "math-ai/amc23", None, "test"),
    "amc83": ("amc_deepscaler83.jsonl", "AI-MO/aimo-validation-amc", None, "train"),
    "math500": ("math500.jsonl", "HuggingFaceH4/MATH-500", None, "test"),
    "minerva": ("minerva.jsonl", "math-ai/minervamath", None, "test"),
    "olympiadbench": ("olympiadbench.jsonl", "Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
}
PAPER_FIVE = ("aime24", "amc83", "math500", "minerva", "olympiadbench")
REPOSITORY_DATA = Path(__file__).resolve().parent.parent / "data"

def data_root() -> Path:
    """The repository's data/, or REMIX_DATA's folder of the same layout."""
    return Path(os.environ["REMIX_DATA"]) if os.environ.get("REMIX_DATA") else REPOSITORY_DATA

def resolve(names) -> list[str]:
    """Benchmark names ('all' is the paper's five; commas split), each once, in order."""
    parts = [part for name in names for part in name.split(",")]
    if unknown := [part for part in parts if part != "all" and part not in BENCHMARKS]:
        fail(f"unknown benchmark {unknown[0]!r}; valid names: {', '.join(BENCHMARKS)}, all")
    chosen = [name for part in parts for name in (PAPER_FIVE if part == "all" else [part])]
    if not chosen:  # an evaluation of nothing would report 0 samples as if it had run
        fail(f"no benchmark named; valid names: {', '.join(BENCHMARKS)}, all")
    return list(dict.fromkeys(chosen))

def gold_answers(row: dict, where: str) -> list[str]:
    """Every accepted form of a row's answer (Minerva lists equivalent forms; hub copies differ in layout)."""
    if row.get("answers") is not None:
        answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
        return [data.answer_text(a, f"{where}: an entry of 'answers'") for a in answers] or \
            [data.answer_text(None, f"{where}: 'answers'")]
    raw = row.get("answer", row.get("final_answer"))
    if isinstance(raw, list):  # hub OlympiadBench: ["$69$,$84$"], one string of $-delimited parts
        return [data.answer_text(", ".join(str(x) for x in raw).replace("$", ""), f"{where}: 'answer'")]
    return [data.answer_text(raw, f"{where}: 'answer'")]

def read_benchmark(name: str, data_dir: str | None, limit: int | None,
                   hub: bool = False) -> tuple[list[dict], str | None]:
    """A benchmark's problems, every row checked, from its folder or the hub; its bytes' SHA-256 (hub: None)."""
    local, hub_id, config, split = BENCHMARKS[name]
    if hub:
        rows, where, digest = data.hub_rows(hub_id, config, split)[0], hub_id, None
    else:
        folder = Path(data_dir) if data_dir else data_root() / "benchmarks"
        if not folder.is_dir():
            fail(f"benchmark folder {str(folder)!r} does not exist (pass --data-dir, or --hub)")
        if not (path := folder / local).is_file():
            fail(f"benchmark file {str(path)!r} does not exist (expected {local} in the benchmark folder)")
        raw = path.read_bytes()
        rows, where, digest = data.parse_rows(raw, str(path)), str(path), hashlib.sha256(raw).hexdigest()
    problems = []
    for i, row in enumerate(rows[:limit]):
        try:
            problems.append({"benchmark": name, "id": row.get("id", i),
                             "problem": data.problem_text(row.get("problem", row.get("question")),
                                                          f"{where}: row {i + 1}'s problem"),
                             "answers": gold_answers(row, f"{where}: row {i + 1}")})
        except ValueError as error:
            fail(str(error))
    if not problems:  # a table without rows, and during training a KeyError after --out was written
        fail(f"benchmark {name} ({where}) holds no problems; give it problem rows, or leave {name} out")
    return problems, digest

def fitting(problems: list[dict], max_chars: int) -> list[dict]:
    """The problems within max_chars characters; the rest skipped unrendered, counted in one line (Decision 9)."""
    kept = [p for p in problems if len(p["problem"]) <= max_chars]
    if len(kept) < len(problems):
        skipped = next(p for p in problems if len(p["problem"]) > max_chars)
        say(f"{skipped['benchmark']}: skipped {len(problems) - len(kept)} problem(s) longer than the model's context "
            f"can hold (over {max_chars} characters; the first: id {skipped['id']})")
    if not kept:
        fail(f"benchmark {skipped['benchmark']}: every problem is longer than the model's context can hold")
    return kept

def read_benchmarks(names, data_dir: str | None, limit: int | None) -> tuple[list[dict], dict]:
    """The problems of the named benchmarks (training's: local files), and {file name: SHA-256 of the bytes read}."""
    read = {name: read_benchmark(name, data_dir, limit) for name in resolve(names)}
    return [p for found, _ in read.values() for p in found], \
        {BENCHMARKS[name][0]: digest for name, (_, digest) in read.items()}

def grade_any(check: tuple, response: str, answers: list[str]) -> tuple[float, str]:
    """The best grade of the method's answer check (check: grader.reference of it) over the accepted answers."""
    grade_response = grader.resolve(check)
    return max((grade_response(response, answer) for answer in answers), key=lambda graded: graded[0])

def grade_many(method, items: list[tuple[str, list[str]]], workers: int = 2, timeout: float = 20.0) -> list[tuple]:
    """grade_any over (response, answers) items in workers, (0.0, "timeout") past a hard limit per answer."""
    check = grader.reference(method.grade_response)
    return grader.map_with_deadline(grade_any, [(check, *item) for item in items], workers, timeout,
                                    (0.0, "timeout"), warm=method.warm, warm_args=method.warm_args)

def grade(method, samples: list[dict], workers: int, timeout: float, second=None):
    """Sets each sample's `correct`, `status`, `extracted`; by a second check (DeepScaleR's) `correct_deepscaler`."""
    items = [(s["response"], s["answers"]) for s in samples]
    graded = grade_many(method, items, workers, timeout)
    others = grader.map_with_deadline(second, items, workers, timeout, (0.0, "timeout")) if second else \
        [None] * len(items)
    for s, (reward, status), other in zip(samples, graded, others):
        s.update(correct=reward == 1.0, status=status, extracted=method.final_answer(s["response"]))
        if other is not None:
            s["correct_deepscaler"] = other[0] == 1.0

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n - c, k) / C(n, k), n samples of which c are right."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)

def summarize(samples: list[dict], words: tuple, grader_name: str = "math-verify") -> dict:
    """{run label: {benchmark: entry, ..., "average": macro average}}: Pass@1 by the chosen grader, pass@k, and more."""
    key = "correct" if grader_name == "math-verify" else "correct_deepscaler"
    summary = {}
    for label in dict.fromkeys(s["run"] for s in samples):
        table = summary[label] = {}
        for name in dict.fromkeys(s["benchmark"] for s in samples if s["run"] == label):
            rows = [s for s in samples if s["run"] == label and s["benchmark"] == name]
            by_problem, by_run = {}, {}
            for s in rows:
                by_problem.setdefault(str(s["id"]), []).append(s[key])
                by_run.setdefault((s["repeat"], s["sample"]), []).append(s[key])
            per_run = [100.0 * float(np.mean(v)) for v in by_run.values()]
            n = min(len([s for s in rows if str(s["id"]) == pid and s["repeat"] == 0]) for pid in by_problem)
            entry = table[name] = {
                "problems": len(by_problem), "samples": len(rows), "runs": len(by_run),
                "pass@1": 100.0 * float(np.mean([s[key] for s in rows])),
                "pass@1_std": float(np.std(per_run, ddof=1)) if len(per_run) > 1 else 0.0,
                "no_boxed": 100.0 * float(np.mean([s["extracted"] is None for s in rows])),
                "mean_tokens": float(np.mean([s["response_tokens"] for s in rows])),
                "self_reflection": 100.0 * float(np.mean([any(w in s["response"].lower() for w in words)
                                                          for s in rows])),
                "grader_failures": sum(s["status"] in ("error", "unparsable", "timeout") for s in rows),
                "disagree": sum(s["correct"] != s.get("correct_deepscaler", s["correct"]) for s in rows)}
            for k in range(2, n + 1):
                entry[f"pass@{k}"] = 100.0 * float(np.mean([pass_at_k(len(v), sum(v), k) for v in by_problem.values()]))
        keys = [k for k in next(iter(table.values())) if k not in ("problems", "samples", "runs", "grader_failures",
                                                                    "disagree", "pass@1_std")]
        table["average"] = {k: float(np.mean([v[k] for v in table.values() if k in v])) for k in keys}
    return summary

def during_training(session, step: int) -> dict:
    """Greedy Pass@1 on --eval-benchmarks by training's sampler into OUT/eval/step-STEP.jsonl; the eval/* entries."""
    args, method, problems = session.args, session.method, session.benchmarks
    prompts = [session.encode(p["problem"]) for p in problems]
    sampler = next(s for s in (session.llm, session.sampler, session.nets["policy"]) if s is not None)
    generated = engines.generate(sampler, session.tokenizer,
                                 prompts, 1, 0.0, 1.0, args.eval_max_tokens or args.max_response_tokens, args.seed,
                                 args.vllm_tp, engines.hf_batch(args), label=f"evaluation at step {step}")
    record = {}
    if dist.rank() == 0:
        samples = records(problems, generated, "greedy", 0, args.seed)
        grade(method, samples, args.grader_workers, args.grade_timeout)
        runfolder.makedirs(os.path.join(args.out, "eval"))
        write_jsonl(os.path.join(args.out, "eval", f"step-{step}.jsonl"), samples)
        table = summarize(samples, method.reflection_words)["greedy"]
        record = {f"eval/{name}/{k}": entry[k] for name, entry in table.items()
                  for k in ("pass@1", "mean_tokens", "self_reflection")}
        say(f"evaluation at step {step}: greedy {pass_line(record)}; samples in {args.out}/eval/step-{step}.jsonl")
    return dist.broadcast(record)

def pass_line(record: dict) -> str:
    """A record's eval/NAME/pass@1 entries, in one line: 'Pass@1 30.0% on average (aime24 20.0%, math500 40.0%)'."""
    scores = {key.split("/")[1]: value for key, value in record.items() if key.endswith("/pass@1")}
    each = ", ".join(f"{name} {value:.1f}%" for name, value in scores.items() if name != "average")
    return f"Pass@1 {scores['average']:.1f}% on average ({each})"

def records(problems: list[dict], generated: list[list[tuple]], label: str, repeat: int, seed: int) -> list[dict]:
    """One sample record per response: what eval.py's samples.jsonl holds (before grading)."""
    return [{"benchmark": p["benchmark"], "id": p["id"], "run": label, "repeat": repeat, "sample": j, "seed": seed,
             "answers": p["answers"], "response": text, "response_tokens": tokens, "finish_reason": finish}
            for p, group in zip(problems, generated) for j, (text, tokens, finish) in enumerate(group)]

def write_jsonl(path: str, rows: list[dict], mode: str = "w"):
    """rows as a new file (written aside and renamed over path: never half a file), or appended (mode "a")."""
    if mode == "w":
        return runfolder.replace_file(path, [json.dumps(r) + "\n" for r in rows])
    with runfolder.open_file(path, mode) as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.flush()
        os.fsync(f.fileno())

def read_jsonl_upto(path: str, done: int) -> list[str]:
    """The lines of a log whose step is at most done; one without a step (cut short, junk) is dropped with a note."""
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
    """No traceback for the OSError TensorBoard's writer thread re-raises: RunLog already said it in one line."""
    if not (isinstance(report.exc_value, OSError) and type(report.thread).__name__ == "_AsyncWriterThread"):
        default(report)

class RunLog:
    """metrics.jsonl, completions.jsonl, TensorBoard and (--track) wandb on rank 0, from step done + 1.
    A failed write (a full disk) stops the run in one line ending with kept()."""

    def __init__(self, out: str, config: dict, done: int, track: bool, kept=lambda: "the last checkpoint is none yet"):
        self.active, self.out, self.failed, self.kept = dist.rank() == 0, out, False, kept
        if not self.active:
            return
        self.files = {}
        for name in ("metrics", "completions"):
            path = os.path.join(out, f"{name}.jsonl")
            with self.writing(path):
                runfolder.replace_file(path, read_jsonl_upto(path, done) if done else [])
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
            fail(str(error) if isinstance(error, runfolder.Unwritable) else
                 f"cannot write {what}: {error.strerror or error}; {self.kept()}")

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
            for f in self.files.values():  # an __init__ that failed stopped the run: none is half made
                with self.writing(f.name):
                    f.close()
            with self.writing(os.path.join(self.out, "tb")):
                self.writer.close()

def completion_rows(step: int, batch: list[dict], tokenizer, n: int, final_answer) -> list[dict]:
    """n of the step's responses, spread over the batch (fresh first), as completions.jsonl's records."""
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

def step_metrics(step: int, fresh: list[dict], history: list[dict], diagnostics: dict, stats: dict) -> dict:
    """The step's metrics record (docs/metrics.md): each rank's samples and diagnostics combined over the ranks."""
    log_ratio, cut = diagnostics["log_ratio"], diagnostics["trace_cut"]  # [historical tokens]
    hist_adv, fresh_adv = diagnostics["abs_adv_historical"], diagnostics["abs_adv_fresh"]  # [tokens]
    mismatch = sampler_mismatch(fresh)  # its last entry is a largest, not a sum
    raw = {"reward": [s["reward"] for s in fresh], "reward_parts": [s.get("reward_parts", {}) for s in fresh],
           "length": [len(s["response_ids"]) for s in fresh], "truncated": [s["truncated"] for s in fresh],
           "reflects": [s["reflects"] for s in fresh], "zero_spread": diagnostics["zero_spread"].tolist(),
           "grader": [s.get("status", "ok") for s in fresh], "age": [step - s["version"] for s in history],
           "staleness": [step - s["version"] for s in fresh],
           "ratio_min": [log_ratio.min().exp().item()] if len(log_ratio) else [],
           "ratio_max": [log_ratio.max().exp().item()] if len(log_ratio) else [],
           "trace_prod": diagnostics["trace_prod"].tolist(), "mismatch_max": [mismatch[-1]]}
    sums = {"log_ratio": [log_ratio.sum().item(), (log_ratio ** 2).sum().item(), log_ratio.exp().sum().item(),
                          cut.sum().item(), len(log_ratio)], "mismatch": mismatch[:-1],
            "adv": [hist_adv.sum().item(), len(hist_adv), fresh_adv.sum().item(), len(fresh_adv)],
            "work": [dist.padding["tokens"], dist.padding["slots"]], "critic": critic_sums(fresh + history)}
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
        "batch/staleness": mean(merged["staleness"]),  # of the fresh batch's policy: 1 drawn ahead (--overlap)
        "offpolicy/ratio_min": min(merged["ratio_min"], default=1.0),  # pi_k/mu on historical tokens; 1 without
        "offpolicy/ratio_mean": exp_sum / count if count else 1.0,
        "offpolicy/ratio_max": max(merged["ratio_max"], default=1.0), "offpolicy/log_ratio_mean": lr_mean,
        "offpolicy/log_ratio_std": math.sqrt(max(lr_sq / max(count, 1) - lr_mean ** 2, 0.0)),
        "offpolicy/trace_truncated": cut / count if count else 0.0,
        "offpolicy/adv_scale": (hist_adv / hist_tokens) / max(fresh_adv / fresh_tokens, 1e-12) if hist_tokens else 1.0,
        "offpolicy/trace_prod_mean": mean(merged["trace_prod"], 1.0), "replay/mean_age": mean(merged["age"]),
        **({"losses/explained_variance": 1.0 - gap_var / y_var if y_var > 0 else None} if value_count else {}),
        "perf/padding": 1.0 - tokens / max(slots, 1),
        "grader/failures": counts["error"] + counts["unparsable"] + counts["timeout"],
        "grader/no_boxed": counts["no_boxed"],
        **{f"reward/{name}": mean([parts.get(name, 0.0) for parts in merged["reward_parts"]])
           for name in sorted({name for parts in merged["reward_parts"] for name in parts})},
        **({"mismatch/abs_log_ratio_mean": gap_sum / gap_count,
            "mismatch/abs_log_ratio_max": max(merged["mismatch_max"]), "mismatch/k3_kl": k3_sum / gap_count,
            "mismatch/ratio_outside_0.5_2": outside / gap_count, "mismatch/is_weight_mean": weight_sum / gap_count}
           if gap_count else {})}

def critic_sums(samples: list[dict]) -> list[float]:
    """For explained variance, over this rank's critic tokens: sums of y, y^2, y - V, (y - V)^2, and the token count."""
    pairs = [(s["value_targets"], s["values"]) for s in samples if "value_targets" in s]
    if not pairs:
        return [0.0] * 5
    y, v = (torch.cat([x[k].cpu() for x in pairs]).double() for k in (0, 1))  # [tokens]
    return [y.sum().item(), (y ** 2).sum().item(), (y - v).sum().item(), ((y - v) ** 2).sum().item(), float(len(y))]

def sampler_mismatch(fresh: list[dict]) -> list[float]:
    """Over this rank's fresh tokens, r = pi_trainer / pi_sampler: sums of |log r|, of k3 = r - 1 - log r, of tokens
    whose r leaves [0.5, 2], of the correction weights, the token count; last the largest |log r| (not summed)."""
    pairs = [(s["behaviour_logp"], s["sampler_logp"], s.get("sampler_weight")) for s in fresh
             if s.get("sampler_logp") is not None]
    if not pairs:
        return [0.0] * 6
    log_r = torch.cat([trainer - sampler for trainer, sampler, _ in pairs]).double()  # [fresh tokens], fp64 for k3
    weights = torch.cat([w if w is not None else torch.ones_like(t) for t, _, w in pairs])  # [fresh tokens]
    return [log_r.abs().sum().item(), (log_r.exp() - 1 - log_r).sum().item(), (log_r.abs() > math.log(2)).sum().item(),
            weights.sum().item(), float(len(log_r)), log_r.abs().max().item()]
