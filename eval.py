"""Pass@1 of a model on the paper's math benchmarks: AIME24, AMC23, MATH500, Minerva, OlympiadBench.

    python eval.py --model runs/remix/checkpoint-350                        # greedy, the paper's protocol
    python eval.py --model M --n 16 --temperature 0.6 --top-p 0.95          # DeepScaleR's sampled protocol
    python eval.py --model M --benchmarks aime24 math500 --data-dir ../shared/data/benchmarks
    python eval.py --regrade runs/eval/samples.jsonl                        # grade saved samples again

Same prompt, chat template and grader as training (remix.build_prompt, remix.grade_many): worker
processes with a hard time limit per answer, since math-verify's own timeouts need the main thread and
some inputs hang inside C code where no signal reaches them.
"""

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

import remix
import remix_utils

# name -> (local file in --data-dir, hub id, hub config, hub split); "all" is the paper's five
BENCHMARKS = {
    "aime24": ("aime24.jsonl", "HuggingFaceH4/aime_2024", None, "train"),
    "amc23": ("amc23.jsonl", "math-ai/amc23", None, "test"),
    "amc83": ("amc_deepscaler83.jsonl", "AI-MO/aimo-validation-amc", None, "train"),
    "math500": ("math500.jsonl", "HuggingFaceH4/MATH-500", None, "test"),
    "minerva": ("minerva.jsonl", "math-ai/minervamath", None, "test"),
    "olympiadbench": ("olympiadbench.jsonl", "Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
}
PAPER_FIVE = ("aime24", "amc83", "math500", "minerva", "olympiadbench")


@dataclass
class EvalArgs:
    model: str | None = None
    """hub id or local folder of the model (a remix.py checkpoint folder works as it is)"""
    benchmarks: tuple[str, ...] = ("all",)
    """benchmark names: aime24 amc23 amc83 math500 minerva olympiadbench, or all (the paper's five)"""
    data_dir: str | None = None
    """folder of <benchmark>.jsonl files (layout of shared/data/benchmarks); default: the hub"""
    n: int = 1
    """samples per problem"""
    temperature: float = 0.0
    """0 is greedy (the paper's headline protocol); DeepScaleR samples 16 at 0.6"""
    top_p: float = 1.0
    """nucleus sampling (DeepScaleR: 0.95)"""
    max_tokens: int = 8192
    """generation budget per response, as in the paper"""
    sampler: Literal["vllm", "hf"] = "vllm"
    """vllm (default) or hf (transformers' generate)"""
    limit: int | None = None
    """evaluate only the first this many problems of each benchmark (smoke tests)"""
    out: str = "runs/eval"
    """output folder: samples.jsonl, summary.json, results.md"""
    regrade: str | None = None
    """grade a saved samples.jsonl again instead of generating (results go to --out)"""
    workers: int = 2
    """grading worker processes"""
    grade_timeout: float = 20.0
    """seconds one answer may take to grade before it counts as a failure (and wrong)"""
    seed: int = 0
    """sampling seed"""
    batch_size: int = 64
    """prompts per generate call with --sampler hf"""


def fail(message: str):
    remix_utils.fail(message, prog="eval")


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def resolve_benchmarks(names) -> list[str]:
    chosen = []
    for name in names:
        for part in name.split(","):
            if part == "all":
                chosen += PAPER_FIVE
            elif part in BENCHMARKS:
                chosen.append(part)
            else:
                fail(f"unknown benchmark {part!r}; valid names: {', '.join(BENCHMARKS)}, all")
    return list(dict.fromkeys(chosen))


def gold_answers(row: dict) -> list[str]:
    """Every accepted form of the answer: Minerva lists equivalent forms; hub copies differ in layout."""
    if row.get("answers"):
        return [str(a).strip() for a in row["answers"]]
    raw = row.get("answer", row.get("final_answer"))
    if isinstance(raw, list):  # hub OlympiadBench: ["$69$,$84$"], one string of $-delimited parts
        return [", ".join(str(x) for x in raw).replace("$", "").strip()]
    if isinstance(raw, float) and raw.is_integer():  # hub AMC copies store 27.0
        raw = int(raw)
    return [str(raw).strip()]


def load_benchmark(name: str, args: EvalArgs) -> list[dict]:
    local, hub_id, config, split = BENCHMARKS[name]
    if args.data_dir is not None:
        path = Path(args.data_dir) / local
        if not Path(args.data_dir).is_dir():
            fail(f"--data-dir {args.data_dir!r} is not a folder")
        if not path.is_file():
            fail(f"benchmark file {str(path)!r} does not exist (expected {local} in --data-dir)")
        rows = [json.loads(line) for line in path.open() if line.strip()]
    else:
        rows = remix_utils.load_hub_rows(hub_id, config, split, prog="eval")
    problems = []
    for i, row in enumerate(rows[: args.limit]):
        problem = row.get("problem", row.get("question"))
        if problem is None or row.get("answer", row.get("final_answer")) is None:
            fail(f"{name}: row {i} needs a problem (or question) and an answer column; it has {sorted(row)}")
        problems.append({"benchmark": name, "id": row.get("id", i), "problem": problem, "answers": gold_answers(row)})
    return problems


# ----------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------
def generate(args: EvalArgs, problems: list[dict]):
    """n responses per problem, all in one engine call: [[(text, n_tokens, finish_reason), ...] per problem]."""
    import torch
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except OSError as error:
        fail(f"cannot load model {args.model!r}: {str(error).splitlines()[0]}{remix_utils.offline_hint()}")
    prompts = [remix.build_prompt(tokenizer, p["problem"]) for p in problems]
    # the training samplers, with this protocol's settings (temperature 0 is greedy in both)
    settings = remix.Args(model=args.model, seed=args.seed, temperature=args.temperature, top_p=args.top_p,
                          max_prompt_tokens=max(map(len, prompts)), max_response_tokens=args.max_tokens,
                          mini_batch_prompts=args.batch_size, vllm_sleep=False, vllm_gpu_memory_utilization=0.9)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.sampler == "vllm":
        llm = remix.make_vllm(settings, device, "bfloat16" if device.type == "cuda" else "float32")
        seeds = [remix_utils.request_seed(args.seed, 0, i, args.n) for i in range(len(prompts))]
        raw = remix.vllm_generate(llm, prompts, args.n, settings, seeds, use_tqdm=True)
    else:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        raw = remix.hf_generate(model.to(device), tokenizer, prompts, args.n, settings, device)
    return [[(tokenizer.decode(ids, skip_special_tokens=True), len(ids), finish) for ids, finish, _ in group]
            for group in raw]


# ----------------------------------------------------------------------------------------------
# Scores
# ----------------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n - c, k) / C(n, k), n samples of which c are right."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(samples: list[dict]) -> dict:
    """Per benchmark: mean accuracy over all samples (Pass@1), pass@k for k up to n, and diagnostics."""
    summary = {}
    for name in dict.fromkeys(s["benchmark"] for s in samples):
        rows = [s for s in samples if s["benchmark"] == name]
        by_problem: dict = {}
        for s in rows:
            by_problem.setdefault(str(s["id"]), []).append(s["correct"])
        n = min(len(v) for v in by_problem.values())
        entry = {
            "problems": len(by_problem),
            "samples": len(rows),
            "pass@1": 100.0 * float(np.mean([s["correct"] for s in rows])),
            "no_boxed": 100.0 * float(np.mean([s["extracted"] is None for s in rows])),
            "mean_tokens": float(np.mean([s["response_tokens"] for s in rows])),
            "self_reflection": 100.0 * float(np.mean([
                any(w in s["response"].lower() for w in remix.SELF_REFLECTION_WORDS) for s in rows])),
            "grader_failures": sum(s["status"] in ("error", "unparsable", "timeout") for s in rows),
        }
        for k in range(2, n + 1):
            entry[f"pass@{k}"] = 100.0 * float(np.mean([pass_at_k(len(v), sum(v), k) for v in by_problem.values()]))
        summary[name] = entry
    keys = [k for k in next(iter(summary.values())) if k not in ("problems", "samples", "grader_failures")]
    summary["average"] = {k: float(np.mean([v[k] for v in summary.values() if k in v])) for k in keys}
    return summary


def markdown(summary: dict) -> str:
    ks = [k for k in summary["average"] if k.startswith("pass@")]
    """One row per benchmark; every rate is a percentage, as its header says."""
    head = ["benchmark", "problems", *[f"{k} %" for k in ks], "no boxed %", "mean tokens", "self-reflection %",
            "grader failures"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, e in summary.items():
        cells = [name, str(e.get("problems", "")), *[f"{e[k]:.2f}" for k in ks], f"{e['no_boxed']:.2f}",
                 f"{e['mean_tokens']:.0f}", f"{e['self_reflection']:.2f}", str(e.get("grader_failures", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def read_samples(path: str) -> list[dict]:
    if not os.path.isfile(path):
        fail(f"samples file {path!r} does not exist")
    samples = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                _ = record["benchmark"], record["id"], record["response"], record["answers"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                fail(f"{path}: line {number} is not a sample record ({type(error).__name__}: {error})")
            samples.append(record)
    if not samples:
        fail(f"samples file {path!r} holds no samples")
    return samples


def main(args: EvalArgs) -> dict:
    start = time.perf_counter()
    if args.regrade:
        samples = read_samples(args.regrade)
    else:
        if args.model is None:
            fail("--model is required (or --regrade SAMPLES.jsonl)")
        remix_utils.check_model_path(args.model, prog="eval")
        hub = {"--model": args.model} if remix_utils.is_hub_id(args.model) else {}
        remix_utils.check_hub({**hub, **({} if args.data_dir else {"--benchmarks": " ".join(args.benchmarks)})},
                              prog="eval")
        if args.n > 1 and args.temperature == 0:
            fail("--n > 1 needs --temperature > 0: greedy samples are all the same")
        problems = [p for name in resolve_benchmarks(args.benchmarks) for p in load_benchmark(name, args)]
        generations = generate(args, problems)
        samples = [{"benchmark": p["benchmark"], "id": p["id"], "sample": j, "answers": p["answers"], "response": text,
                    "response_tokens": tokens, "finish_reason": finish}
                   for p, group in zip(problems, generations) for j, (text, tokens, finish) in enumerate(group)]
    print(f"grading {len(samples)} responses with {args.workers} worker processes", flush=True)
    grades = remix.grade_many([(s["response"], s["answers"]) for s in samples], args.workers, args.grade_timeout)
    for s, (reward, status) in zip(samples, grades):
        s.update(correct=reward == 1.0, status=status, extracted=remix.final_answer(s["response"]))
    summary = summarize(samples)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "samples.jsonl"), "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    table = markdown(summary)
    Path(args.out, "results.md").write_text(table)
    print(table)
    print(f"{len(samples)} samples in {time.perf_counter() - start:.1f} s; written to {args.out}")
    return summary


if __name__ == "__main__":
    main(tyro.cli(EvalArgs))
