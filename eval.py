"""Pass@1 of a model on the paper's math benchmarks: AIME24, AMC, MATH500, Minerva, OlympiadBench.

    python eval.py --model runs/remix/checkpoint-350                      # greedy, on the shipped data/benchmarks
    python eval.py --model M --protocol paper                             # greedy, and temperature 0.1 (32 runs on AIME, AMC)
    python eval.py --model M --protocol deepscaler                        # 16 samples at 0.6 / 0.95
    torchrun --nproc-per-node 8 eval.py --model M --protocol paper        # the problems split over 8 GPUs
    python eval.py --regrade runs/eval/samples.jsonl --grader deepscaler --out runs/eval-deepscaler  # grade again
    python eval.py --curves runs/remix runs/remix-grpo --out runs/curves  # Pass@1 against rollouts, from runs' logs

The prompt, the engines and the answer check are training's (the method's build_prompt, the vLLM engine, its
final_answer and grade_response), through machinery.evaluation, which also evaluates during training. The method is
remix.py beside this file, or the file --method names (a fork: python eval.py --method remix_mine.py --model M),
imported from that path: only the command line chooses the code that runs, never a file in --model or --out. Every
sample is graded by the method's answer check and by DeepScaleR's rules (the grader behind the paper's numbers);
--grader picks which one the table reports, and the table counts the responses on which they disagree. Samples
are written as each benchmark finishes, and a rerun with the same --out continues where the last one stopped.
"""

if __name__ == "__main__":  # first: a Ctrl-C while torch imports ends in one line too
    from machinery import console

    console.one_line_interrupts("eval")

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from machinery import console, data, dist, evaluation, flags, models, paths, runfolder, runner, safeload

PROG = "eval"


@dataclass
class EvalArgs:
    model: str | None = None
    """hub id or local folder of the model (a remix.py checkpoint folder works as it is)"""
    benchmarks: tuple[str, ...] = ("all",)
    """benchmark names: aime24 amc23 amc83 math500 minerva olympiadbench, or all (the paper's five)"""
    data_dir: str | None = None
    """folder of <benchmark>.jsonl files (default: the repository's data/benchmarks, the files the paper's numbers
    are on)"""
    hub: bool = False
    """read the benchmarks from the Hugging Face hub instead of the benchmark folder"""
    protocol: Literal["custom", "paper", "deepscaler"] = "custom"
    """custom: --n/--temperature/--top-p as given; paper: greedy everywhere, plus temperature 0.1 with 32 seeded
    runs on AIME and AMC and one on the rest; deepscaler: 16 samples at temperature 0.6, top-p 0.95"""
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
    """the method file whose prompt builder, answer extraction and answer check evaluate (a fork of remix.py:
    remix_mine.py); default: the remix.py beside eval.py"""
    out: str = "runs/eval"
    """output folder: samples.jsonl, summary.json, results.md (and settings.json, to continue an interrupted run)"""
    overwrite: bool = False
    """replace an earlier evaluation in --out instead of continuing it"""
    regrade: str | None = None
    """grade a saved samples.jsonl again instead of generating (results go to --out, which must not hold an
    evaluation of a model)"""
    curves: tuple[str, ...] = ()
    """run folders: draw Pass@1 against rollouts and generated tokens, and length and self-reflection against steps,
    from their metrics.jsonl into --out (PNG)"""
    workers: int = 2
    """in [1, 1024]: grading worker processes"""
    grade_timeout: float = 20.0
    """in [0.5, 1e6]: seconds one answer may take to grade before it counts as a failure (and wrong)"""
    seed: int = 0
    """in [0, 2147483647]: sampling seed (run r of a protocol uses seed + r)"""
    batch_size: int = 64
    """in [1, 65536]: prompts per generate call with --sampler hf"""


def fail(message: str):
    console.fail(message, PROG)


_methods = {}  # file -> its module: each method file is imported once per process


def load_method(path: str | None):
    """The method's module, imported from the file the user named with --method (remix.py beside eval.py without
    it); its METHOD and Args are what eval.py uses. A module of the same name that is another file (the repository's
    remix.py beside a fork named remix.py) is never taken for it. The file's folder goes last on sys.path: a module
    of the fork's own beside it is imported, a torch.py or json.py there is never taken for the installed one."""
    path = os.path.abspath(path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "remix.py"))
    if not (path.endswith(".py") and os.path.isfile(path)):
        fail(f"--method {path!r} is not a Python file; give the method's file, a copy of remix.py (remix_mine.py)")
    if path not in _methods:
        stem = os.path.basename(path)[:-3]
        same = sys.modules.get(stem)
        if same is not None and os.path.abspath(getattr(same, "__file__", "") or "") == path:
            _methods[path] = same  # already imported from this very file (tests import remix)
        else:
            # a name of its own: no clash with another module of its stem (the repository's remix, another fork)
            name = f"eval_method_{hashlib.sha256(path.encode()).hexdigest()[:12]}_" + re.sub(r"\W", "_", stem)
            if os.path.dirname(path) not in sys.path:  # last: its helpers are found, never its torch.py for torch
                sys.path.append(os.path.dirname(path))
            spec = importlib.util.spec_from_file_location(name, path)
            module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
            try:
                spec.loader.exec_module(module)
            except Exception as error:
                fail(f"--method {path}: importing it failed: {type(error).__name__}: {str(error).splitlines()[0]}")
            _methods[path] = module
    module = _methods[path]
    if not isinstance(getattr(module, "METHOD", None), runner.Method) or not dataclasses.is_dataclass(
            getattr(module, "Args", None)):
        fail(f"--method {path}: it has no METHOD (a machinery.runner.Method) and Args, as remix.py has; give a copy of it")
    return module


def suffix_of(args: EvalArgs) -> str:
    """--prompt-suffix, or the method's default."""
    return args.prompt_suffix if args.prompt_suffix is not None else load_method(args.method).Args.prompt_suffix


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
    """Every flag and input that can be checked before a model loads, each with one line."""
    flags.check_ranges(args, PROG)
    if args.protocol == "custom" and args.n > 1 and args.temperature == 0:
        fail("--n > 1 needs --temperature > 0: greedy samples are all the same")
    if args.protocol != "custom" and (args.n, args.temperature, args.top_p) != (1, 0.0, 1.0):
        fail(f"--protocol {args.protocol} sets its own samples, temperature and top-p: drop --n/--temperature/--top-p")
    if args.model is None:
        fail("--model is required (or --regrade SAMPLES.jsonl, or --curves RUN ...)")
    flags.check_model_path(args.model, PROG)
    if os.path.isdir(args.model) and not any(any(Path(args.model).glob(p)) for p in ("*.safetensors", "*.bin")):
        fail(f"model folder {args.model!r} holds no model weights (*.safetensors)")
    if os.path.isdir(args.model):  # a truncated weights file or a FIFO is named before anything is written
        try:
            safeload.check_model_folder(args.model)
        except ValueError as error:
            fail(f"cannot load model {args.model!r}: {error}")
    flags.check_hub({**({"--model": args.model} if flags.is_hub_id(args.model) else {}),
                   **({"--benchmarks": " ".join(args.benchmarks)} if args.hub else {})}, PROG)
    flags.check_hub_weights(args.model, PROG)
    if dist.world() % args.vllm_tp:
        fail(f"--vllm-tp {args.vllm_tp} must divide the {dist.world()} processes")
    if args.sampler == "vllm" and dist.device().type == "cpu":
        from machinery import engines

        engines.cpu_kv_cache_gib(PROG)  # the CPU engine reads it at its start, after --out is written
    mine, theirs = load_method(args.method).METHOD.record(), trained_by(args.model)
    if theirs is not None and (theirs["file"], theirs.get("sha256")) != (mine["file"], mine["sha256"]):
        console.say(f"{args.model} was trained by {theirs['file']} (sha256 {str(theirs.get('sha256'))[:12]}) and is "
                    f"evaluated with {mine['file']} (sha256 {str(mine['sha256'])[:12]}): its prompt and answer check "
                    f"(--method names the method file)", PROG)


def trained_by(model: str) -> dict | None:
    """The record of the method that trained a checkpoint (its trainer state's, read without running anything), or
    None for a model that is no checkpoint of a run, or one from before runs recorded it."""
    path = os.path.join(model, "trainer_state.pt")
    if not os.path.isfile(path):
        return None
    try:
        state = safeload.read_pt(path)
    except (ValueError, OSError):  # a damaged state trains nothing here: the evaluation goes on without the line
        return None
    record = state.get("method") if isinstance(state, dict) else None
    return record if isinstance(record, dict) and isinstance(record.get("file"), str) else None


def settings_of(args: EvalArgs) -> dict:
    """What the samples depend on: a rerun with the same --out continues only with the same settings."""
    keys = ("model", "benchmarks", "data_dir", "hub", "protocol", "n", "temperature", "top_p", "max_tokens", "sampler",
            "limit", "system_prompt", "seed", "precision")
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(args).items() if k in keys}
    return {**settings, "prompt_suffix": suffix_of(args), "method": load_method(args.method).METHOD.record()}


def stamp_of(settings: dict) -> str:
    """The mark every sample record carries of the settings that made it: a continued evaluation counts only its
    own records, never a regrade's or another evaluation's written into its samples.jsonl."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def saved_settings(out: Path) -> dict | None:
    """OUT/settings.json (an evaluation's settings, or a regrade's source), or None where there is none."""
    path = out / "settings.json"
    if os.path.lexists(path) and not path.is_file():  # a FIFO would block the read
        fail(f"{path} is not a regular file (a FIFO, socket or device), and the evaluation reads its settings from "
             f"it: remove it")
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        saved = None
    if not isinstance(saved, dict):
        fail(f"{path} is damaged (not a JSON object of settings); choose another --out, or pass --overwrite")
    return saved


def held_files(out: Path) -> list[Path]:
    """What --out holds besides the lock of the job in it."""
    return [p for p in out.iterdir() if p.name != runfolder.LOCK] if out.is_dir() else []


def refuse_unsafe_out(out: Path, read=("settings.json", "samples.jsonl")):
    """--out holds no model, and no link where an evaluation reads its own files back (what a link points to would
    be read as this evaluation's settings or samples; the files only written are replaced, never followed)."""
    for name in read:
        if dist.rank() == 0 and (out / name).is_symlink():
            fail(str(runfolder.Linked(str(out / name))))
    if dist.rank() == 0 and out.is_dir() and ((out / "config.json").exists() or any(out.glob("*.safetensors"))):
        fail(f"--out {out} holds a model (config.json, *.safetensors): give the evaluation a folder of its own")


def refuse_foreign(args: EvalArgs):
    """--out is no model's or checkpoint's folder (even with --overwrite), and, unless --overwrite, holds nothing
    but an evaluation: refused before anything, the lock included, is written there."""
    out = Path(args.out)
    refuse_unsafe_out(out)
    if dist.rank() == 0 and held_files(out) and not args.overwrite and saved_settings(out) is None:
        fail(f"--out {out} already holds files that are not an evaluation's; choose another --out or pass --overwrite")


WRITES = ("samples.jsonl", "summary.json", "results.md", "settings.json", runfolder.LOCK)  # --out's files


def check_kept(args: EvalArgs):
    """Nothing the job reads (the model folder, the benchmark folder, the method file, the samples it regrades) is
    a file it writes or replaces in --out: one line names it and the way out, before anything is written."""
    from machinery import paths

    reads = {flag: (value, [value]) for flag, value in (("--model", args.model), ("--data-dir", args.data_dir),
                                                         ("--method", args.method), ("--regrade", args.regrade))
             if value is not None and os.path.lexists(value)}
    found = paths.read_where_written(args.out, reads, WRITES)
    if found:
        flag, value, entry = found
        fail(f"{flag} {value} is {entry}, which this job writes in --out {args.out}: nothing a job reads is replaced "
             f"by it; give --out another folder")


def prepare(args: EvalArgs, sizes: dict) -> list[dict]:
    """--out locked and checked (continued, refused, or replaced); returns the samples of the runs already finished
    there (a run of a benchmark is finished when all its sizes[(label, benchmark)] samples were written)."""
    out, settings = Path(args.out), settings_of(args)
    saved_path, samples_path = out / "settings.json", out / "samples.jsonl"
    refuse_foreign(args)  # before the lock, which would leave its file in a model's folder
    runfolder.lock(args.out, PROG)  # first: a folder another eval writes into is neither read nor written
    kept = []
    if dist.rank() == 0 and out.is_dir():  # nothing read or rewritten there may block
        try:
            safeload.check_special_files(str(out), recursive=False)
        except ValueError as error:
            fail(f"--out {out}: {error}")
    if dist.rank() == 0 and held_files(out) and not args.overwrite:
        saved = saved_settings(out)
        if saved is None:
            fail(f"--out {out} already holds files that are not an evaluation's; choose another --out or pass --overwrite")
        if "regrade" in saved:
            fail(f"--out {out} holds a regrade of {saved['regrade']}, not an evaluation of a model; choose another "
                 f"--out or pass --overwrite")
        changed = sorted(k for k in settings if saved.get(k) != settings[k])
        if changed:
            fail(f"--out {out} holds an evaluation with other settings ({', '.join(f'--{k.replace(chr(95), chr(45))}' for k in changed)}); "
                 f"rerun with the same flags to continue it, choose another --out, or pass --overwrite")
        kept = evaluation.read_samples(str(samples_path), PROG, partial=True) if samples_path.exists() else []
        foreign = [s for s in kept if s.get("settings") != stamp_of(settings)]
        if foreign:
            fail(f"{samples_path} holds {len(foreign)} records these settings did not make (the first: {foreign[0]['run']} "
                 f"{foreign[0]['benchmark']} id {foreign[0]['id']}), which a continued evaluation would count as this "
                 f"model's: choose another --out, or pass --overwrite to start afresh")
        counts = {}
        for s in kept:
            counts[s["run"], s["benchmark"], s["repeat"]] = counts.get((s["run"], s["benchmark"], s["repeat"]), 0) + 1
        kept = [s for s in kept if counts[s["run"], s["benchmark"], s["repeat"]] == sizes.get((s["run"], s["benchmark"]))]
    if dist.rank() == 0:
        for name in ("samples.jsonl", "summary.json", "results.md"):
            if args.overwrite or not kept:
                runfolder.remove(str(out / name), missing_ok=True)
        runfolder.replace_file(str(saved_path), [json.dumps(settings, indent=1)])
        evaluation.write_jsonl(str(samples_path), kept)  # aside, then renamed over it: a signal loses no record
    return dist.broadcast(kept)


def prepare_regrade(args: EvalArgs):
    """--out checked, then locked: a regrade writes samples.jsonl, summary.json and results.md there, so it never
    writes into an evaluation of a model (which a later run with the same --out would continue, counting these
    records as its own), or into anything else but an earlier regrade; --overwrite replaces what is there."""
    out = Path(args.out)
    refuse_unsafe_out(out, read=("settings.json",))  # a regrade writes its samples.jsonl, never reads it
    if dist.rank() == 0 and held_files(out) and not args.overwrite:
        saved = saved_settings(out) or {}
        if "regrade" not in saved:
            what = f"an evaluation of {saved['model']}" if "model" in saved else "files that are not a regrade's"
            fail(f"--out {out} holds {what}, which the regrade's samples.jsonl would replace: give --out a new folder "
                 f"(e.g. --out {out}-regraded), or pass --overwrite")
    runfolder.lock(args.out, PROG)
    if dist.rank() == 0:
        runfolder.replace_file(str(out / "settings.json"), [json.dumps({"regrade": args.regrade, "grader": args.grader})])


def start_sampler(args: EvalArgs, prompts: list[list[int]]):
    import torch

    precision = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    if args.sampler == "vllm":
        from machinery import engines

        settings = flags.settings(
            load_method(args.method).Args, model=args.model, seed=args.seed, vllm_tp=args.vllm_tp, precision=precision,
            max_prompt_tokens=max(map(len, prompts)), max_response_tokens=args.max_tokens, vllm_sleep=False,
            vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization)
        return engines.start(settings)
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **models.NO_CODE)
    return model.to(dist.device()).eval()


def evaluate(args: EvalArgs) -> list[dict]:
    """Every run of the protocol on every benchmark, one (run, benchmark, repetition) at a time, each appended to
    samples.jsonl as it finishes; those already there (an interrupted evaluation with the same settings) are kept."""
    names = evaluation.resolve(args.benchmarks, PROG)
    problems = {name: evaluation.load_benchmark(name, args.data_dir, args.limit, args.hub, PROG) for name in names}
    # every prompt is built before --out is touched: a chat template that fails stops with one line, leaving nothing
    tokenizer = runner.load_tokenizer(args.model, PROG)
    context, source = models.context_length(args.model, tokenizer) or (None, None)
    if context is not None:  # a problem longer than the context can hold is skipped unrendered (data.char_bound)
        bound = data.char_bound(tokenizer, context)
        problems = {name: evaluation.fitting(rows, bound, PROG) for name, rows in problems.items()}
    runs = protocol_runs(args, names)
    sizes = {(r["label"], name): len(problems[name]) * r["n"] for r in runs for name in names}
    if not tokenizer.chat_template:
        console.say(f"{args.model} has no chat template: prompts are the problem and --prompt-suffix as plain text", PROG)
    method, suffix = load_method(args.method).METHOD, suffix_of(args)
    encode = data.template_guard(lambda problem: method.build_prompt(tokenizer, problem, suffix, args.system_prompt),
                                 args.model, PROG)
    prompts = {name: [encode(p["problem"]) for p in rows] for name, rows in problems.items()}
    longest = max((len(p) for ps in prompts.values() for p in ps), default=0)
    if context is not None and longest + args.max_tokens > context:  # before --out is written
        fail(f"{args.model} takes at most {context} tokens ({source}), and the longest prompt "
             f"({longest} tokens) plus --max-tokens {args.max_tokens} is {longest + args.max_tokens}; "
             + (f"lower --max-tokens to {context - longest}" if longest < context else "the prompt alone is too long"))
    samples = None
    try:  # a signal from here on: what --out keeps, and how to continue
        samples = prepare(args, sizes)
        done = {(s["run"], s["benchmark"], s["repeat"]) for s in samples}
        todo = [(r, name, repeat) for r in runs for name in names for repeat in range(r["repeats"][name])
                if (r["label"], name, repeat) not in done]
        if done:
            console.say(f"continuing {args.out}: {len(done)} of {len(done) + len(todo)} runs of benchmarks already there", PROG)
        if not todo:
            return samples
        sampler = start_sampler(args, [p for ps in prompts.values() for p in ps])
        generate_runs(args, sampler, tokenizer, problems, prompts, todo, samples, stamp_of(settings_of(args)))
        if args.sampler == "vllm":
            from machinery import engines

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
        generated = evaluation.generate(sampler, tokenizer, prompts[name], r["n"], r["temperature"], r["top_p"],
                                        args.max_tokens, args.seed + repeat, args.vllm_tp, args.batch_size,
                                        f"{r['label']} {name} run {repeat + 1}/{r['repeats'][name]}", PROG)
        if dist.rank() == 0:
            unit = [{**record, "settings": stamp} for record in
                    evaluation.records(problems[name], generated, r["label"], repeat, args.seed + repeat)]
            evaluation.grade(load_method(args.method).METHOD, unit, args.workers, args.grade_timeout)
            evaluation.write_jsonl(os.path.join(args.out, "samples.jsonl"), unit, mode="a")
            samples += unit
            console.say(f"{r['label']} {name} run {repeat + 1}/{r['repeats'][name]}: {len(unit)} samples in "
                        f"{time.perf_counter() - start:.0f} s", PROG)


def main(args: EvalArgs) -> dict:
    start = time.perf_counter()
    console.catch_interrupts()
    dist.init(prog=PROG)
    if args.curves:
        from machinery import logs

        return logs.draw(args.curves, args.out)
    check_kept(args)
    if args.regrade:
        flags.check_ranges(args, PROG)
        load_method(args.method)
        samples = evaluation.read_samples(args.regrade, PROG)
        prepare_regrade(args)
        if dist.rank() == 0:
            console.say(f"grading {len(samples)} responses with {args.workers} worker processes", PROG)
            evaluation.grade(load_method(args.method).METHOD, samples, args.workers, args.grade_timeout)
            evaluation.write_jsonl(os.path.join(args.out, "samples.jsonl"), samples)
    else:
        check(args)
        samples = evaluate(args)
    words = load_method(args.method).METHOD.reflection_words
    summary = evaluation.summarize(samples, words, args.grader) if dist.rank() == 0 else {}
    if dist.rank() == 0:
        runfolder.replace_file(os.path.join(args.out, "summary.json"), [json.dumps(summary, indent=1)])
        table = evaluation.markdown(summary)
        runfolder.replace_file(os.path.join(args.out, "results.md"), [table])
        print(table)
        print(f"{len(samples)} samples in {time.perf_counter() - start:.1f} s (Pass@1 by {args.grader}); written to "
              f"{args.out}", flush=True)
    return dist.broadcast(summary)


if __name__ == "__main__":
    runner.main(lambda: main(runner.parse(EvalArgs, PROG)), PROG)
