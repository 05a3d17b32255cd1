"""A program's entry (main, cli) and the Session that ties a run's parts to remix.train().

A program's entry (main; cli, a run's command line; parse, eval.py's and toy.py's) and the Session that
ties the flags, the run folder, the logs, the metrics and the checkpoints to remix.train(). A reader of the method
may skip this module: it decides nothing about what is computed, and takes what it needs of the method from the
method's own contract."""

import dataclasses
import functools
import os
import re
import signal
import sys
import time
import typing

import numpy as np
import torch

from machinery import console, dist, flags, logs, models, paths, plan, runfolder
from machinery.console import fail, say


def cli(method_args, prog: str = "remix", argv: list[str] | None = None):
    """A run's settings from its command line (argv: sys.argv[1:]): the method's Args (method_args) and the run's
    (flags.RunArgs), flat flags with no prefix, which --help shows in two groups, the method's and the run's; read
    into one object of flags.settings_type(method_args), whose fields are both classes'."""
    tyro = parser(prog)
    command = dataclasses.make_dataclass("Command", [("method", method_args), ("run", flags.RunArgs)])
    parsed = parse(tyro.conf.OmitArgPrefixes[command], prog, argv, flags.settings_type(method_args))
    return flags.settings(method_args, **flags.fields_of(parsed.method), **flags.fields_of(parsed.run))


def parse(cls, prog: str = "remix", argv: list[str] | None = None, named=None):
    """A program's arguments, parsed from the command line (argv: sys.argv[1:]) into its dataclass by tyro: the one
    parser of remix.py, eval.py and toy.py. A flag it does not know is one line naming the closest field of cls (or
    of named, the flat class of a nested cls), exit 2 (tyro's own report is a box of ten lines); --help is tyro's."""
    args, unknown = parser(prog).cli(cls, args=argv, return_unknown_args=True)
    if unknown:
        fail(unknown_flag_line(unknown, named or cls), prog)
    return args


def parser(prog: str):
    """tyro, or one line saying how to install it."""
    try:
        import tyro
    except ImportError:
        fail("tyro (the command-line parser) is not installed: pip install -r requirements.txt", prog)
    return tyro


def unknown_flag_line(unknown: list[str], cls) -> str:
    """What is wrong with the first argument the parser did not take, and the closest flag of cls: ['--temprature',
    '0.5'] -> '--temprature is no flag of remix.py; did you mean --temperature? (remix.py --help lists them)'."""
    import difflib

    script = os.path.basename(sys.argv[0]) or "the program"
    first = unknown[0]
    if not first.startswith("-"):
        return f"unexpected argument {first!r}: each value follows its flag ({script} --help lists them)"
    flag = first.split("=", 1)[0]
    names, hints = [], typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        names.append("--" + field.name.replace("_", "-"))
        if hints[field.name] is bool:  # a plain switch has its --no- form too
            names.append("--no-" + field.name.replace("_", "-"))
    close = difflib.get_close_matches(flag.replace("_", "-"), names, n=1, cutoff=0.6)
    guess = f"; did you mean {close[0]}?" if close else ""
    return f"{flag} is no flag of {script}{guess} ({script} --help lists them)"


def main(program, prog: str = "remix"):
    """A program's entry (remix.py, eval.py): program(), then a clean exit; a signal ends it with one line and the
    signal's exit code (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP), with no traceback and no worker left."""
    from machinery import grader

    try:
        result = program()
    except runfolder.Unwritable as refused:  # a link or a special file where the program writes: never written
        grader.close_pool()
        fail(str(refused), prog)
    except BaseException as interrupt:  # what breaks after a signal (code that wraps it in its own error) is the signal
        if not console.from_signal(interrupt):
            raise
        grader.close_pool()
        signum = console.seen() or signal.SIGINT
        if dist.rank() == 0:
            line = getattr(interrupt, "line", None) or console.starting_line(signum)
            print(f"\n{prog}: {line}", file=sys.stderr, flush=True)
        os._exit(console.EXIT_CODES[signum])
    grader.close_pool()
    dist.finish(result.get("llm") if isinstance(result, dict) else None)


# ----------------------------------------------------------------------------------------------
# The session: everything train() does around the method
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Method:
    """What machinery needs of the method, handed over by it (remix.METHOD): no module of machinery imports the
    method or looks it up by name, so a fork in a file of any name runs its own functions everywhere. The two answer
    functions run in grader workers, which import them by their module and name: they live at module level."""
    finalize: typing.Callable  # (args) -> args with the derived defaults filled in
    build_prompt: typing.Callable  # (tokenizer, problem, suffix, system) -> prompt token ids
    final_answer: typing.Callable  # (response) -> the answer it states, or None
    grade_response: typing.Callable  # (response, answer) -> (1.0 or 0.0, status): the evaluation's answer check
    warm: typing.Callable  # (*warm_args), run in each new grader worker before its first task: slow imports
    warm_args: tuple
    reflection_words: tuple  # the self-reflection rate counts responses holding any of them

    def record(self) -> dict:
        """Which method this is, as a run records it: the file its functions were defined in, by name, and the sha256
        of its bytes ({"file": "remix.py", "sha256": "9f2c..."}); "sha256" is None for code typed in, with no file."""
        import hashlib
        import inspect

        path = inspect.getfile(self.finalize)
        if not os.path.isfile(path):
            return {"file": path, "sha256": None}
        with open(path, "rb") as f:
            return {"file": os.path.basename(path), "sha256": hashlib.sha256(f.read()).hexdigest()}


class Session:
    """train()'s companion. Construction checks everything that can be checked before a file is written (flags,
    model path and hub, data, prompt lengths, benchmarks, --out) and then locks --out; restore() puts a resumed
    run's state back; `with session:` turns a signal into one line; steps() yields the steps to run, and
    end_step() logs, evaluates and saves."""

    def __init__(self, args, method: Method):
        from machinery import checkpoints, data, evaluation, models, paths, safeload

        if not isinstance(args, flags.RunArgs):  # a method's Args alone lacks the run's settings
            raise TypeError(f"a run takes the method's settings and the run's in one object, "
                            f"flags.settings({type(args).__name__}, ...), not a {type(args).__name__}")
        console.catch_interrupts()
        bound = flags.ranges(type(args))["dist_timeout"]
        if not flags.within(args.dist_timeout, bound):
            fail(f"--dist-timeout must be {bound}, got {args.dist_timeout}")
        dist.init(args.dist_timeout, getattr(args, "offload", False))
        if "LOCAL_RANK" in os.environ and "RANK" not in os.environ and torch.cuda.is_available():
            say("LOCAL_RANK is set without RANK (not torchrun): this one process uses GPU 0; pick another with "
                "CUDA_VISIBLE_DEVICES")
        self.checkpoint, self.state, self.optim_state = None, None, None
        self.written_by = method.record()  # read once, as the code was loaded: the checkpoints say who wrote them
        changed_data_ok = getattr(args, "resume_changed_data", False)  # this command's flag, not the run's saved one
        if args.resume:  # the run's saved arguments and newest readable checkpoint; --steps may extend it
            if os.path.isdir(args.resume):
                runfolder.lock(args.resume)  # first: a folder another job writes into is not read
            self.checkpoint, self.state, self.optim_state = checkpoints.latest(args.resume,
                                                                               dataclasses.asdict(type(args)()))
            logs.check_logs(args.resume)
            checkpoints.check_writer(args, self.state, self.written_by)  # the same method, and every saved flag known
            done = self.state["progress"]["step"]
            args = checkpoints.resume_args(args, self.state["args"], done)
            if done >= args.steps:  # nothing to do: say so, exit 0
                say(f"{args.out} has finished all {args.steps} steps; give --resume a larger --steps to extend it")
                raise SystemExit(0)
            paths.check_resumed(args, self.state["args"], self.state.get("inputs"), self.checkpoint)
        self.args = args = method.finalize(args)
        flags.check_args(args)
        if getattr(args, "offload", False) and not dist.host_collectives():  # a resumed run's saved --offload
            fail(f"{args.out} was trained with --offload: give --offload with --resume too (its process group "
                 f"needs gloo beside NCCL)")
        models.reset(self.state["progress"].get("bad_updates", 0) if self.state else 0, args.out)
        flags.check_model_path(args.model)  # then everything that needs the hub, in seconds
        if os.path.isdir(args.model):  # a damaged weights file or a FIFO is named before --out is touched
            try:
                safeload.check_model_folder(args.model)
            except ValueError as error:
                fail(f"cannot load model {args.model!r}: {error}")
        data.check_dataset(args.dataset)  # a folder or a .csv is no hub id
        flags.check_hub({f"--{k}": getattr(args, k) for k in ("model", "dataset") if flags.is_hub_id(getattr(args, k))
                   and not getattr(args, k).endswith((".jsonl", ".json", ".parquet"))})
        flags.check_hub_weights(args.model)
        recorded = (self.state.get("inputs") if self.state else None) or {}
        recorded = recorded if isinstance(recorded, dict) else {}
        rows, dataset_read = data.read_dataset(args.dataset, revision=recorded.get("dataset_revision"))
        self.problems = data.problems_of(rows, args.dataset, args.problem_key, args.answer_key)
        self.tokenizer = load_tokenizer(self.checkpoint or args.model)
        self.method = method
        tokenizer = self.tokenizer  # not self: the Session would hold itself through its encoder (a cycle)
        self.encode = data.template_guard(lambda problem: method.build_prompt(
            tokenizer, problem, args.prompt_suffix, args.system_prompt), self.checkpoint or args.model)
        if not self.tokenizer.chat_template:
            say(f"{args.model} has no chat template: prompts are the problem and --prompt-suffix as plain text")
        self.max_chars = data.char_bound(self.tokenizer, args.max_prompt_tokens)  # longer problems cannot fit
        data.first_fitting_prompt(self.problems, self.encode, args.max_prompt_tokens, self.max_chars)
        self.benchmarks, benchmark_digests = evaluation.read_benchmarks(
            args.eval_benchmarks, args.eval_data_dir, args.eval_limit) if args.eval_every else ([], None)
        read = paths.fingerprints(dataset_read, benchmark_digests, recorded.get("model"))
        # recorded with each checkpoint: a resume checks its inputs by them (the base model's weights hashed once)
        self.inputs = paths.check_data(args, self.state["args"], recorded, read, changed_data_ok) if args.resume \
            else read
        if not isinstance(self.inputs.get("model"), dict):
            self.inputs["model"] = paths.model_record(args.model)
        longest = max((len(self.encode(p["problem"])) for p in self.benchmarks), default=0)
        self.max_model_len = max(args.max_prompt_tokens, longest) + max(args.max_response_tokens,
                                                                       args.eval_max_tokens or 0)
        context, source = models.context_length(self.checkpoint or args.model, self.tokenizer) or (None, None)
        if context is not None and self.max_model_len > context:
            prompt = f"--max-prompt-tokens {args.max_prompt_tokens}" if args.max_prompt_tokens >= longest else \
                f"the longest evaluation prompt ({longest} tokens)"
            response = f"--max-response-tokens {args.max_response_tokens}" if args.max_response_tokens >= \
                (args.eval_max_tokens or 0) else f"--eval-max-tokens {args.eval_max_tokens}"
            fail(f"{args.model} takes at most {context} tokens ({source}), and the run needs {self.max_model_len}: "
                 f"{prompt} plus {response}; lower them to fit")
        paths.check_kept(args, runfolder.WRITES)  # --overwrite would delete it, a checkpoint's rotation later
        paths.check_out(args.out, bool(args.resume))
        lengths = plan.Lengths(eval_prompt=longest, eval_problems=len(self.benchmarks))  # what the data says
        measured = functools.partial(data.longest_prompt, self.problems, self.encode, args.max_prompt_tokens,
                                     self.max_chars)  # every prompt encoded: only where the verdict may hang on it
        self.plan = plan.check(args, self.checkpoint or args.model, lengths=lengths, measure_prompt=measured)  # or stop
        runfolder.lock(args.out)
        if not args.resume:
            runfolder.prepare_out(args.out, args.overwrite)
        done = self.state["progress"]["step"] if self.state else 0
        paths.check_writes(args.out, planned_writes(args, done))  # before step 1, not when first written
        plan.write(self.plan, args.out)
        torch.manual_seed(args.seed)  # the critic's new head starts alike on every rank

    def restore(self, policy, reference, critic, optimizers: list, replay, llm):
        """The models, optimizers, deque and RNGs of a resumed run (its weights were loaded from the checkpoint);
        then the logs and the prompt stream."""
        from machinery import checkpoints, data, engines

        args = self.args
        self.models = {"policy": policy, "critic": critic, "reference": reference}
        self.optimizers = dict(zip(["policy", "critic"][: len(optimizers)], optimizers))
        self.replay, self.llm = replay, llm
        for seed_fn in (np.random.seed, torch.manual_seed):  # after vLLM's start, which reseeds
            seed_fn(args.seed + dist.rank())
        import random

        random.seed(args.seed + dist.rank())
        self.progress = {"step": 0, "rollouts": 0, "tokens": 0, "data_position": 0}
        if self.state is not None:
            for name, optim in self.optimizers.items():
                checkpoints.load_optimizer_shard(self.models[name], optim, self.optim_state[name])
            replay.extend(self.state["replay"])
            self.progress = {k: v for k, v in self.state["progress"].items() if k != "bad_updates"}
            checkpoints.set_rng_state(self.state["rng"])
            engines.push_weights(llm, policy)  # the engine started from the base weights (no engine: nothing)
            say(f"resuming {args.out} after step {self.progress['step']} from {self.checkpoint}")
        self.log = logs.RunLog(args.out, dataclasses.asdict(args), self.progress["step"], args.track)
        self.prompts = data.prompt_stream(self.problems, self.encode, args.max_prompt_tokens, args.seed,
                                          self.progress["data_position"], self.max_chars)
        self.step, self.laps, self.clock = self.progress["step"], {}, time.perf_counter()
        self.first_step_at, self.steps_here = None, 0  # the time left is measured over this process's steps

    def __enter__(self):
        console.running(lambda: (self.step, self.args.out))
        return self

    def __exit__(self, kind, error, trace):
        self.log.close()
        # a signal's line after the steps still names the last step, but no longer through this Session: it holds the
        # models and optimizers, which a process running train() again (gpu_check's parts) must get back
        console.running(lambda step=self.step, out=self.args.out: (step, out))
        if error is not None and console.from_signal(error):
            from machinery import grader  # what breaks after a signal (a writer wraps it in its own error) is the signal

            grader.close_pool()
            raise console.Interrupted(self.step, self.args.out) from None
        return False

    def steps(self):
        """The steps still to run, after the evaluation at step 0 (a new run with --eval-every)."""
        if self.args.eval_every and self.progress["step"] == 0:
            self.log.write({"step": 0, **self.evaluate(0), "rollouts/total": 0, "rollouts/generated_tokens": 0})
        for step in range(self.progress["step"] + 1, self.args.steps + 1):
            console.check_interrupted()
            self.step, self.laps, self.clock, self.started = step, {}, time.perf_counter(), time.perf_counter()
            self.first_step_at = self.first_step_at or self.started
            yield step
        console.check_interrupted()

    def next_prompts(self, n: int) -> list:
        prompts = [next(self.prompts) for _ in range(n)]
        self.progress["data_position"] = prompts[-1].position  # problems consumed, for --resume
        return prompts

    def lap(self, name: str):
        """Seconds since the last lap (or the step's start), recorded under name."""
        now = time.perf_counter()
        self.laps[name], self.clock = now - self.clock, now

    def evaluate(self, step: int) -> dict:
        """The evaluation's eval/* entries, and its seconds as perf/eval_s."""
        from machinery import evaluation

        start = time.perf_counter()
        return {**evaluation.during_training(self, step), "perf/eval_s": time.perf_counter() - start}

    def end_step(self, record: dict, fresh: list[dict], history: list[dict], recomputed: tuple, reincarnated: bool,
                 on_step=None):
        """The step's record completed (rollouts, timings, an evaluation when due), handed to on_step(step, record,
        policy, tokenizer, batch) if given, and written with a few of its completions; the fields the method
        recomputes every step dropped from the samples, which the deque keeps; a checkpoint when due, with the
        reference model once reincarnation has made it pi_T (before, it is the base model, loaded again)."""
        from machinery import checkpoints, console

        args, step = self.args, record["step"]
        gen, trainer, sync = dist.all_reduce(torch.tensor([self.laps.get(k, 0.0) for k in ("gen", "trainer",
                                                                                          "weight_sync")]), "max").tolist()
        self.progress["rollouts"] += record["batch/fresh"]
        self.progress["tokens"] += round(record["response/length_mean"] * record["batch/fresh"])
        record.update({"rollouts/total": self.progress["rollouts"], "rollouts/generated_tokens": self.progress["tokens"],
                       "perf/gen_tokens_per_s": record["response/length_mean"] * record["batch/fresh"] / max(gen, 1e-9),
                       "perf/update_s": trainer, "perf/weight_sync_s": sync})
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            record.update(self.evaluate(step))
        record["perf/step_s"] = time.perf_counter() - self.started
        if on_step is not None:
            on_step(step, record, self.models["policy"], self.tokenizer, fresh + history)
        for sample in fresh + history:
            for key in recomputed:
                sample.pop(key, None)
        self.log.write(record)
        self.log.completions(step, logs.completion_rows(step, fresh + history, self.tokenizer, args.log_completions,
                                                   self.method.final_answer))
        self.steps_here += 1
        say(console.step_line(step, args.steps, {"gen": gen, "trainer": trainer, "weight_sync": sync,
                                                 "eval": record.get("perf/eval_s", 0.0)}, record["perf/step_s"],
                              record["reward/mean"], self.steps_here, time.perf_counter() - self.first_step_at))
        self.progress["step"] = step
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            checkpoints.save(args.out, step, {**self.models, "reference": self.models["reference"] if reincarnated
                                              else None}, self.tokenizer, self.optimizers,
                             {"args": flags.saved(args), "method": self.written_by, "inputs": self.inputs,
                              "replay": list(self.replay),
                              "progress": {**self.progress, "bad_updates": models.in_a_row()}}, args.keep_last)


def planned_writes(args, done: int) -> list[tuple]:
    """What a run writes under --out after step `done` (paths.check_writes' plan): its logs, plan.json, tb (and
    wandb), eval/ with each step-N.jsonl an evaluation will write, and each checkpoint-N a save will replace (of
    these two, only those already there: a run may have any number to come, and only one that exists is in the
    way)."""
    to_come = range(done + 1, args.steps + 1)

    def due(step: int, every: int, at_start: bool = False) -> bool:
        return step in to_come and (step == args.steps or (every > 0 and step % every == 0)) or \
            (at_start and step == 0 == done)  # a new run's evaluation before step 1

    planned = [("metrics.jsonl", "append"), ("completions.jsonl", "append"), ("plan.json", "file"), ("tb", "tree")]
    if args.track:
        planned.append(("wandb", "tree", ("latest-run",)))  # wandb makes that link itself
    if args.eval_every:
        planned.append(("eval", "folder"))
        found = os.listdir(os.path.join(args.out, "eval")) if os.path.isdir(os.path.join(args.out, "eval")) else []
        planned += [(os.path.join("eval", name), "file") for name in sorted(found)
                    if re.fullmatch(r"step-(0|[1-9]\d*)\.jsonl", name) and due(int(name[5:-6]), args.eval_every, True)]
    found = os.listdir(args.out) if os.path.isdir(args.out) else []
    planned += [(name, "replaced") for name in sorted(found)
                if re.fullmatch(r"checkpoint-[1-9]\d*", name) and due(int(name[11:]), args.save_every)]
    return planned


def load_tokenizer(source: str, prog: str = "remix"):
    """The model's tokenizer, never with code from its folder, checked to fit the model (safeload.read_tokenizer):
    anything transformers raises on it is one line naming the folder and the file."""
    from machinery import safeload

    try:
        tokenizer, _ = safeload.read_tokenizer(source)
    except OSError as error:  # a folder without a model, or a hub id out of reach
        fail(f"cannot load model {source!r}: {str(error).splitlines()[0]}{flags.offline_hint()}", prog)
    except ValueError as error:  # safeload names the file
        fail(f"cannot load model {source!r}: {error}", prog)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
