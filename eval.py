"""Pass@1 of a model on the paper's math benchmarks: AIME24, AMC, MATH500, Minerva, OlympiadBench.

    python eval.py --model runs/remix/checkpoint-350                      # greedy, on the shipped data/benchmarks
    python eval.py --model M --protocol paper                             # greedy, and temperature 0.1 (32 runs on AIME, AMC)
    python eval.py --model M --protocol deepscaler                        # 16 samples at 0.6 / 0.95
    torchrun --nproc-per-node 8 eval.py --model M --protocol paper        # the problems split over 8 GPUs
    python eval.py --regrade runs/eval/samples.jsonl --grader deepscaler --out runs/eval-deepscaler  # grade again
    python eval.py --curves runs/remix runs/remix-grpo --out runs/curves  # Pass@1 against rollouts, from runs' logs

The prompt, the engines and the answer check are training's (machinery.report also evaluates during training). The
method is remix.py beside this file, or the file --method names (a fork), imported from that path: only the command
line chooses the code that runs. Every sample is graded by the method's answer check and by DeepScaleR's rules (the
paper's grader); --grader picks which the table reports. Samples are written as each benchmark finishes, and a rerun
with the same --out continues where the last one stopped.
"""

if __name__ == "__main__":  # first: a Ctrl-C while torch imports ends in one line too
    from machinery import console

    console.one_line_interrupts("eval")

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Literal

import deepscaler
from machinery import checkpoints, console, data, dist, engines, grader, models, report, runfolder, runner
from machinery.console import fail


@dataclasses.dataclass
class EvalArgs:
    model: str | None = None
    """hub id or local folder of the model (a remix.py checkpoint folder works as it is)"""
    benchmarks: tuple[str, ...] = ("all",)
    """benchmark names: aime24 amc23 amc83 math500 minerva olympiadbench, or all (the paper's five)"""
    data_dir: str | None = None
    """folder of <benchmark>.jsonl files (default: the repository's data/benchmarks)"""
    hub: bool = False
    """read the benchmarks from the Hugging Face hub instead of the benchmark folder"""
    protocol: Literal["custom", "paper", "deepscaler"] = "custom"
    """custom: --n/--temperature/--top-p; paper: greedy, and temperature 0.1 (32 runs on AIME and AMC, 1 on the
    rest); deepscaler: 16 samples at temperature 0.6, top-p 0.95"""
    n: int = 1
    """in [1, 1024]: samples per problem (custom protocol)"""
    temperature: float = 0.0
    """0 or in [0.01, 100]: 0 is greedy (custom protocol)"""
    top_p: float = 1.0
    """nucleus sampling, in (0, 1] (custom protocol)"""
    max_tokens: int = 8192
    """in [1, 1048576]: generation budget per response, as in the paper"""
    grader: Literal["math-verify", "deepscaler"] = "math-verify"
    """the answer check the table reports (both are always computed; the table counts where they disagree)"""
    sampler: Literal["vllm", "hf"] = "vllm"
    """vllm (default) or hf (transformers' generate)"""
    vllm_tp: int = 1
    """in [1, 1024]: ranks sharing one vLLM engine (tensor parallel) under torchrun, for models one GPU cannot hold"""
    vllm_gpu_memory_utilization: float = 0.9
    """in (0, 1): the GPU memory share of the engine"""
    precision: Literal["bf16", "fp32"] | None = None
    """the engine's dtype (default: bf16 on GPU, fp32 on CPU)"""
    limit: int | None = None
    """in [1, 1000000]: evaluate only the first this many problems of each benchmark (smoke tests)"""
    system_prompt: str | None = None
    """a system turn before the problem (training's default has none)"""
    prompt_suffix: str | None = None
    """appended to every problem (default: the method's Args.prompt_suffix, training's prompt)"""
    method: str | None = None
    """the method file whose prompt and answer check evaluate (a fork: remix_mine.py); default: remix.py here"""
    out: str = "runs/eval"
    """output folder: samples.jsonl, summary.json, results.md (and settings.json, to continue an interrupted run)"""
    overwrite: bool = False
    """replace an earlier evaluation in --out instead of continuing it"""
    regrade: str | None = None
    """grade a saved samples.jsonl again instead of generating (into --out, which holds no evaluation of a model)"""
    curves: tuple[str, ...] = ()
    """run folders: Pass@1 against rollouts and tokens, length and self-reflection against steps, PNGs into --out"""
    workers: int = 2
    """in [1, 1024]: grading worker processes"""
    grade_timeout: float = 20.0
    """in [0.5, 1e6]: seconds one answer may take to grade before it counts as a failure (and wrong)"""
    seed: int = 0
    """in [0, 2147483647]: sampling seed (run r of a protocol uses seed + r)"""
    batch_size: int = 64
    """in [1, 65536]: prompts per generate call with --sampler hf"""


def load_method(path: str | None):
    """The method's module (its METHOD and Args), from the file --method names, or remix.py beside eval.py: found by
    its file, never its name (grader.module_at: its folder last on sys.path)."""
    path = os.path.abspath(path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "remix.py"))
    if not (path.endswith(".py") and os.path.isfile(path)):
        fail(f"--method {path!r} is not a Python file; give the method's file, a copy of remix.py (remix_mine.py)")
    try:
        module = grader.module_at(path)
    except Exception as error:
        fail(f"--method {path}: importing it failed: {console.reason(error)}")
    if not isinstance(getattr(module, "METHOD", None), runner.Method) or not dataclasses.is_dataclass(
            getattr(module, "Args", None)):
        fail(f"--method {path}: it has no METHOD (a machinery.runner.Method) and Args, as remix.py has; give a copy of it")
    return module


def protocol_runs(args: EvalArgs, names: list[str]) -> list[dict]:
    """The protocol as runs: a label, sampling settings, and how many seeded repetitions each benchmark gets."""
    if args.protocol == "paper":  # the authors' README: greedy / temperature 0.1, the latter 32 runs on AIME and AMC
        return [{"label": "greedy", "n": 1, "temperature": 0.0, "top_p": 1.0, "repeats": dict.fromkeys(names, 1)},
                {"label": "t0.1", "n": 1, "temperature": 0.1, "top_p": 1.0,
                 "repeats": {name: 32 if name in ("aime24", "amc23", "amc83") else 1 for name in names}}]
    if args.protocol == "deepscaler":
        return [{"label": "t0.6", "n": 16, "temperature": 0.6, "top_p": 0.95, "repeats": dict.fromkeys(names, 1)}]
    label = "greedy" if args.temperature == 0 else f"t{args.temperature:g}"
    return [{"label": label, "n": args.n, "temperature": args.temperature, "top_p": args.top_p,
             "repeats": dict.fromkeys(names, 1)}]


def check(args: EvalArgs):
    """Every flag and input that can be checked before a model loads (the ranges: main's), each with one line."""
    if args.protocol == "custom" and args.n > 1 and args.temperature == 0:
        fail("--n > 1 needs --temperature > 0: greedy samples are all the same")
    if args.protocol != "custom" and (args.n, args.temperature, args.top_p) != (1, 0.0, 1.0):
        fail(f"--protocol {args.protocol} sets its own samples, temperature and top-p: drop --n/--temperature/--top-p")
    if args.model is None:
        fail("--model is required (or --regrade SAMPLES.jsonl, or --curves RUN ...)")
    data.check_model_path(args.model)  # a FIFO in it, pickled weights only: before anything is written
    hub_ids = [report.BENCHMARKS[name][1] for name in report.resolve(args.benchmarks)] if args.hub else []
    data.check_hub(args.model, None, hub_ids)  # one request decides: no look-up retries for half a minute
    if dist.world() % args.vllm_tp:
        fail(f"--vllm-tp {args.vllm_tp} must divide the {dist.world()} processes")
    if args.sampler == "vllm" and dist.device().type == "cpu":
        engines.cpu_kv_cache_gib()  # the CPU engine reads it at its start, after --out is written
    mine, theirs = load_method(args.method).METHOD.record(), trained_by(args.model)
    if theirs is not None and (theirs["file"], theirs.get("sha256")) != (mine["file"], mine["sha256"]):
        console.say(f"{args.model} was trained by {theirs['file']} (sha256 {str(theirs.get('sha256'))[:12]}) and is "
                    f"evaluated with {mine['file']} (sha256 {str(mine['sha256'])[:12]}): its prompt and answer check "
                    f"(--method names the method file)")


def trained_by(model: str) -> dict | None:
    """The record of the method that trained a checkpoint (read without running anything), or None."""
    try:
        state = checkpoints.read_pt(os.path.join(model, "trainer_state.pt"))
    except (ValueError, OSError):  # none (a hub id, a plain model) or a damaged one: the evaluation goes on without it
        return None
    record = state.get("method") if isinstance(state, dict) else None
    return record if isinstance(record, dict) and isinstance(record.get("file"), str) else None


def settings_of(args: EvalArgs) -> dict:
    """What the samples depend on: a rerun with the same --out continues only with the same settings."""
    keys = ("model", "benchmarks", "data_dir", "hub", "protocol", "n", "temperature", "top_p", "max_tokens", "sampler",
            "limit", "system_prompt", "seed", "precision")
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(args).items() if k in keys}
    suffix = args.prompt_suffix if args.prompt_suffix is not None else load_method(args.method).Args.prompt_suffix
    return {**settings, "prompt_suffix": suffix, "method": load_method(args.method).METHOD.record()}


def stamp_of(settings: dict) -> str:
    """The mark every sample record carries of the settings that made it: a continued evaluation counts only its
    own records, never a regrade's or another evaluation's written into its samples.jsonl."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


WRITES = ("samples.jsonl", "summary.json", "results.md", "settings.json", runfolder.LOCK)  # --out's files


def check_out(args: EvalArgs) -> dict | None:
    """--out before anything is written there (the lock included), rank 0: nothing the job reads (the model, the
    benchmark folder, the method file, the samples it regrades) is a file it writes there; no model in it, and no
    link where the job reads its own files back; unless --overwrite, nothing but an evaluation (a regrade: an earlier
    regrade). Returns its saved settings.json, or None."""
    reads = {flag: (value, [value]) for flag, value in (("--model", args.model), ("--data-dir", args.data_dir),
                                                         ("--method", args.method), ("--regrade", args.regrade))
             if value is not None and os.path.lexists(value)}
    found = runfolder.read_where_written(args.out, reads, WRITES)
    if found:
        fail(f"{found[0]} {found[1]} is {found[2]}, which this job writes in --out {args.out}: nothing a job reads is "
             f"replaced by it; give --out another folder")
    out, saved = Path(args.out), None
    if dist.rank() != 0:
        return None
    for name in ("settings.json",) if args.regrade else ("settings.json", "samples.jsonl"):
        if (out / name).is_symlink():  # what it points to would be read as this evaluation's
            fail(str(runfolder.Linked(str(out / name))))
    if out.is_dir() and ((out / "config.json").exists() or any(out.glob("*.safetensors"))):
        fail(f"--out {out} holds a model (config.json, *.safetensors): give the evaluation a folder of its own")
    path = out / "settings.json"
    if os.path.lexists(path) and not path.is_file():  # a FIFO would block the read
        fail(f"{path} is not a regular file (a FIFO, socket or device), and the evaluation reads its settings from "
             f"it: remove it")
    if path.is_file():
        with contextlib.suppress(ValueError, OSError, RecursionError):
            saved = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(saved, dict):
            fail(f"{path} is damaged (not a JSON object of settings); choose another --out, or pass --overwrite")
    held = [p for p in out.iterdir() if p.name != runfolder.LOCK] if out.is_dir() else []
    if held and not args.overwrite and args.regrade and "regrade" not in (saved or {}):
        what = f"an evaluation of {saved['model']}" if "model" in (saved or {}) else "files that are not a regrade's"
        fail(f"--out {out} holds {what}, which the regrade's samples.jsonl would replace: give --out a new folder "
             f"(e.g. --out {out}-regraded), or pass --overwrite")
    if held and not args.overwrite and not args.regrade and saved is None:
        fail(f"--out {out} already holds files that are not an evaluation's; choose another --out or pass --overwrite")
    if saved is not None and not args.overwrite and not args.regrade:
        if "regrade" in saved:
            fail(f"--out {out} holds a regrade of {saved['regrade']}, not an evaluation of a model; choose another "
                 f"--out or pass --overwrite")
        changed = [f"--{k.replace('_', '-')}" for k, v in sorted(settings_of(args).items()) if saved.get(k) != v]
        if changed:
            fail(f"--out {out} holds an evaluation with other settings ({', '.join(changed)}); rerun with the same flags "
                 f"to continue it, choose another --out, or pass --overwrite")
    return None if args.overwrite else saved


def prepare(args: EvalArgs, sizes: dict, saved: dict | None) -> list[dict]:
    """--out (checked: check_out's saved settings) locked and made ready, continued or replaced (--overwrite); returns
    the samples of the runs already finished there (all sizes[(label, benchmark)] of a run's samples written)."""
    out, settings, kept = Path(args.out), settings_of(args), []
    runfolder.lock(args.out)  # first: a folder another eval writes into is neither read nor written
    if dist.rank() == 0:  # nothing read or rewritten there may block
        data.check_regular_files(str(out), f"--out {out}")
    if dist.rank() == 0 and saved is not None:
        kept = read_samples(str(out / "samples.jsonl"), partial=True) if (out / "samples.jsonl").exists() else []
        foreign = [s for s in kept if s.get("settings") != stamp_of(settings)]
        if foreign:
            fail(f"{out / 'samples.jsonl'} holds {len(foreign)} records these settings did not make (the first: "
                 f"{foreign[0]['run']} {foreign[0]['benchmark']} id {foreign[0]['id']}), which a continued evaluation "
                 f"would count as this model's: choose another --out, or pass --overwrite to start afresh")
        units = [(s["run"], s["benchmark"], s["repeat"]) for s in kept]
        kept = [s for s, unit in zip(kept, units) if units.count(unit) == sizes.get(unit[:2])]
    if dist.rank() == 0:
        for name in ("samples.jsonl", "summary.json", "results.md"):
            if not kept:
                runfolder.remove(str(out / name), missing_ok=True)
        runfolder.replace_file(str(out / "settings.json"), [json.dumps(settings, indent=1)])
        report.write_jsonl(str(out / "samples.jsonl"), kept)  # aside, then renamed over it: a signal loses no record
    return dist.broadcast(kept)


def start_sampler(args: EvalArgs, prompts: list[list[int]]):
    """The engine (vLLM) or the model (transformers), its weights checked against its config as they load."""
    precision = args.precision or ("bf16" if dist.device().type == "cuda" else "fp32")
    if args.sampler == "vllm":
        settings = console.settings(
            load_method(args.method).Args, model=args.model, seed=args.seed, vllm_tp=args.vllm_tp, precision=precision,
            max_prompt_tokens=max(map(len, prompts)), max_response_tokens=args.max_tokens, vllm_sleep=False,
            vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization)
        return engines.start(settings)
    return models.pretrained(args.model, models.compute_dtype(precision)).to(dist.device()).eval()


def evaluate(args: EvalArgs, saved: dict | None) -> list[dict]:
    """Every run of the protocol on every benchmark, one (run, benchmark, repetition) at a time, each appended to
    samples.jsonl as it finishes; those already there (an interrupted evaluation with the same settings) are kept."""
    names = report.resolve(args.benchmarks)
    problems = {name: report.read_benchmark(name, args.data_dir, args.limit, args.hub)[0] for name in names}
    # every prompt is built before --out is touched: a chat template that fails stops with one line, leaving nothing
    tokenizer = data.load_tokenizer(args.model)
    context, source = models.context_length(args.model, tokenizer) or (None, None)
    if context is not None:  # a problem longer than the context can hold is skipped unrendered (runner.char_bound)
        bound = runner.char_bound(tokenizer, context)
        problems = {name: report.fitting(rows, bound) for name, rows in problems.items()}
    runs = protocol_runs(args, names)
    sizes = {(r["label"], name): len(problems[name]) * r["n"] for r in runs for name in names}
    if not tokenizer.chat_template:
        console.say(f"{args.model} has no chat template: prompts are the problem and --prompt-suffix as plain text")
    method, suffix = load_method(args.method).METHOD, settings_of(args)["prompt_suffix"]
    encode = data.template_guard(lambda problem: method.build_prompt(tokenizer, problem, suffix, args.system_prompt),
                                 args.model)
    prompts = {name: [encode(p["problem"]) for p in rows] for name, rows in problems.items()}
    longest = max((len(p) for ps in prompts.values() for p in ps), default=0)
    if context is not None and longest + args.max_tokens > context:  # before --out is written
        fail(f"{args.model} takes at most {context} tokens ({source}), and the longest prompt "
             f"({longest} tokens) plus --max-tokens {args.max_tokens} is {longest + args.max_tokens}; "
             + (f"lower --max-tokens to {context - longest}" if longest < context else "the prompt alone is too long"))
    sampler = start_sampler(args, [p for ps in prompts.values() for p in ps])  # before --out: a bad model, one line
    samples = None
    try:  # a signal from here on: what --out keeps, and how to continue
        samples = prepare(args, sizes, saved)
        done = {(s["run"], s["benchmark"], s["repeat"]) for s in samples}
        todo = [(r, name, repeat) for r in runs for name in names for repeat in range(r["repeats"][name])
                if (r["label"], name, repeat) not in done]
        if done:
            console.say(f"continuing {args.out}: {len(done)} of {len(done) + len(todo)} runs of benchmarks already there")
        generate_runs(args, sampler, tokenizer, problems, prompts, todo, samples, stamp_of(settings_of(args)))
        if args.sampler == "vllm":
            engines.stop(sampler)  # before the process group goes (dist.finish): vLLM's shutdown uses it
    except BaseException as error:  # a signal, or what the code it landed in made of it
        if not console.from_signal(error):
            raise
        finished = "finished runs of benchmarks" if samples is None else \
            f"{len({(s['run'], s['benchmark'], s['repeat']) for s in samples})} finished runs of benchmarks"
        raise console.Stopped(f"interrupted; the {finished} are in {args.out}/samples.jsonl: rerun the same command to "
                              f"continue") from None
    return samples


def generate_runs(args, sampler, tokenizer, problems, prompts, todo, samples, stamp: str):
    for r, name, repeat in todo:
        start = time.perf_counter()
        generated = engines.generate(sampler, tokenizer, prompts[name], r["n"], r["temperature"], r["top_p"],
                                        args.max_tokens, args.seed + repeat, args.vllm_tp, args.batch_size,
                                        f"{r['label']} {name} run {repeat + 1}/{r['repeats'][name]}")
        if dist.rank() == 0:
            unit = [{**record, "settings": stamp} for record in
                    report.records(problems[name], generated, r["label"], repeat, args.seed + repeat)]
            report.grade(load_method(args.method).METHOD, unit, args.workers, args.grade_timeout, deepscaler.grade_any)
            report.write_jsonl(os.path.join(args.out, "samples.jsonl"), unit, mode="a")
            samples += unit
            console.say(f"{r['label']} {name} run {repeat + 1}/{r['repeats'][name]}: {len(unit)} samples in "
                        f"{time.perf_counter() - start:.0f} s")


def main(args: EvalArgs) -> dict:
    start = time.perf_counter()
    console.catch_interrupts()
    dist.init()
    rank = dist.rank()  # read now: vLLM's engine, freed as evaluate returns, takes torchrun's process group with it
    if args.curves:
        return draw(args.curves, args.out)
    console.check_ranges(args)
    if args.regrade:
        load_method(args.method)
        samples = read_samples(args.regrade)
        check_out(args)
        runfolder.lock(args.out)
        if dist.rank() == 0:
            runfolder.replace_file(os.path.join(args.out, "settings.json"), [json.dumps({"regrade": args.regrade,
                                                                                        "grader": args.grader})])
            console.say(f"grading {len(samples)} responses with {args.workers} worker processes")
            report.grade(load_method(args.method).METHOD, samples, args.workers, args.grade_timeout, deepscaler.grade_any)
            report.write_jsonl(os.path.join(args.out, "samples.jsonl"), samples)
    else:
        check(args)
        samples = evaluate(args, check_out(args))
    words = load_method(args.method).METHOD.reflection_words
    summary = report.summarize(samples, words, args.grader) if rank == 0 else {}
    if rank == 0:
        runfolder.replace_file(os.path.join(args.out, "summary.json"), [json.dumps(summary, indent=1)])
        table = markdown(summary)
        runfolder.replace_file(os.path.join(args.out, "results.md"), [table])
        print(table)
        scores = "; ".join(f"{label} " + report.pass_line({f"eval/{name}/pass@1": entry["pass@1"] for name, entry
                                                            in runs.items()}) for label, runs in summary.items())
        print(f"{len(samples)} samples in {console.duration(time.perf_counter() - start)}; {scores} by {args.grader}; "
              f"written to {args.out}: samples.jsonl, summary.json, results.md", flush=True)
    return dist.broadcast(summary)


# ----------------------------------------------------------------------------------------------
# Samples read back, the table
# ----------------------------------------------------------------------------------------------
def read_samples(path: str, partial: bool = False) -> list[dict]:
    """The sample records of a samples.jsonl, each checked: benchmark, id, response and answers (a list of strings or
    numbers, or one); run and benchmark strings, repeat, sample and response_tokens whole numbers, where given.
    partial: an unreadable last line (a write cut short) is dropped instead of refused."""
    if not os.path.isfile(path):
        fail(f"samples file {path!r} does not exist")
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(number, line) for number, line in enumerate(f.read().split("\n"), 1) if line.strip()]
    samples = []
    for number, line in lines:
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
            missing = [k for k in ("benchmark", "id", "response", "answers") if k not in record]
            if missing or not isinstance(record["response"], str):
                raise ValueError(f"no {', '.join(missing)}" if missing else "'response' is not a string")
            for key, kind in (("benchmark", str), ("run", str), ("repeat", int), ("sample", int),
                              ("response_tokens", int)):  # the summary groups and averages by them
                if key in record and (not isinstance(record[key], kind) or isinstance(record[key], bool)
                                      or kind is int and record[key] < 0):
                    raise ValueError(f"'{key}' is {json.dumps(record[key])[:40]}, not "
                                     + ("a string" if kind is str else "a whole number >= 0"))
            answers = record["answers"] if isinstance(record["answers"], list) else [record["answers"]]
            record["answers"] = [data.answer_text(a, "an entry of 'answers'") for a in answers] or \
                [data.answer_text(None, "'answers'")]
        except (ValueError, RecursionError) as error:  # bad JSON, an integer past Python's digits, deep nesting
            if partial and number == lines[-1][0]:
                console.say(f"{path}: dropped an unreadable last line (a write cut short)")
                continue
            fail(f"{path}: line {number} is not a sample record ({error})")
        samples.append({**record, **{k: v for k, v in (("run", "greedy"), ("repeat", 0), ("sample", 0),
                                                       ("response_tokens", 0)) if k not in record}})  # keys kept in order
    if not samples and not partial:
        fail(f"samples file {path!r} holds no samples")
    return samples


def markdown(summary: dict) -> str:
    """One table per run label; every rate is a percentage, as its header says."""
    lines = []
    for label, table in summary.items():
        ks = [k for k in table["average"] if k.startswith("pass@")]
        head = ["benchmark", "problems", "runs", *[f"{k} %" for k in ks], "sd across runs", "no boxed %",
                "mean tokens", "self-reflection %", "grader failures", "graders disagree"]
        lines += [f"### {label}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, e in table.items():
            cells = [name, str(e.get("problems", "")), str(e.get("runs", "")), *[f"{e[k]:.2f}" for k in ks],
                     f"{e['pass@1_std']:.2f}" if "pass@1_std" in e else "", f"{e['no_boxed']:.2f}",
                     f"{e['mean_tokens']:.0f}", f"{e['self_reflection']:.2f}", str(e.get("grader_failures", "")),
                     str(e.get("disagree", ""))]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


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
            fail(f"--curves {folder}: no metrics.jsonl there (pass remix.py run folders)")
        records = []
        lines = Path(path).read_bytes().split(b"\n")
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
                console.fail(f"--curves {folder}: {path}, line {number} is not a metrics record ({str(error)[:80]}); pass "
                     f"remix.py run folders")
            records.append(record)
        name = os.path.basename(os.path.normpath(folder))
        runs[name if name not in runs else folder] = records
    return runs


def series(records: list[dict], x: str, y: str) -> tuple[list, list]:
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
        fail(f"--out {out} is a file, not a folder: choose a new --out for the PNG files")
    runs = read_runs(folders)
    benchmarks = sorted({k.split("/")[1] for records in runs.values() for r in records for k in r
                         if k.startswith("eval/") and k.endswith("/pass@1") and k.split("/")[1] != "average"})
    if not benchmarks:
        fail("--curves: the runs logged no evaluation (eval/*/pass@1); train with --eval-every K")
    runfolder.writes_into(out)
    runfolder.makedirs(out)
    drawn = {}

    def figure(name: str, panels: list[tuple]):  # panels: (title, x key, x label, y key)
        fig, axes = plt.subplots(1, len(panels), figsize=(max(4 * len(panels), 10), 3.6), squeeze=False)
        for ax, (title, x, x_label, y) in zip(axes[0], panels):
            for run_name, records in runs.items():
                xs, ys = series(records, x, y)
                ax.plot(xs, ys, marker=".", label=run_name)
                drawn.setdefault(name, {})[run_name] = drawn.get(name, {}).get(run_name, 0) + len(xs)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel(x_label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        with runfolder.new_file(os.path.join(out, name), "wb") as f:  # renamed into place: a link or FIFO is replaced
            fig.savefig(f, format="png", dpi=100)
        plt.close(fig)

    for name, x, x_label in (("pass1_vs_rollouts.png", "rollouts/total", "rollouts"),
                             ("pass1_vs_tokens.png", "rollouts/generated_tokens", "generated tokens")):
        figure(name, [(f"{b}: greedy Pass@1 (%)" if b != "average" else "average of the benchmarks (%)", x, x_label,
                       f"eval/{b}/pass@1") for b in ["average", *benchmarks]])
    figure("length_and_reflection_vs_step.png", [
        ("mean response length (tokens), training samples", "step", "step", "response/length_mean"),
        ("self-reflection rate, training samples", "step", "step", "response/self_reflection")])
    console.say(f"drew {', '.join(drawn)} in {out}")
    return drawn


if __name__ == "__main__":
    runner.main(lambda: main(runner.parse(EvalArgs)))
