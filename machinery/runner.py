"""A program's entry (main; cli and parse, its command line) and the Session that carries a training run's schedule.

The Session ties settings, inputs, --out, logs and checkpoints to remix.train(); it decides nothing that is computed.
"""

import collections
import dataclasses
import functools
import inspect
import os
import random
import signal
import sys
import time
import typing

import numpy as np
import torch

from machinery import checkpoints, console, data, dist, engines, grader, models, plan, report, runfolder
from machinery.console import fail, say

Prompt = collections.namedtuple("Prompt", "ids answer position")  # position: problems consumed up to it

def cli(method_args, argv: list[str] | None = None):
    """A run's settings from argv (sys.argv[1:]): method_args and RunArgs as flat flags, in one settings object."""
    command = dataclasses.make_dataclass("Command", [("method", method_args), ("run", console.RunArgs)])
    parsed = parse(parser().conf.OmitArgPrefixes[command], argv, console.settings_type(method_args))
    return console.settings(method_args, **console.fields_of(parsed.method), **console.fields_of(parsed.run))

def parse(cls, argv: list[str] | None = None, named=None):
    """argv parsed by tyro into cls; an unknown flag is one line naming the closest field of cls (or of named)."""
    args, unknown = parser().cli(cls, args=argv, return_unknown_args=True)
    if unknown:
        fail(unknown_flag_line(unknown, named or cls))
    return args

def parser():
    try:
        import tyro
    except ImportError:
        fail("tyro (the command-line parser) is not installed: pip install -r requirements.txt")
    return tyro

def unknown_flag_line(unknown: list[str], cls) -> str:
    """['--temprature', '0.5'] -> '--temprature is no flag of remix.py; did you mean --temperature? (...)'."""
    import difflib
    script, first = os.path.basename(sys.argv[0]) or "the program", unknown[0]
    if not first.startswith("-"):
        return f"unexpected argument {first!r}: each value follows its flag ({script} --help lists them)"
    hints = typing.get_type_hints(cls)
    names = [f"--{no}{field.name.replace('_', '-')}" for field in dataclasses.fields(cls)
             for no in (["", "no-"] if hints[field.name] is bool else [""])]
    close = difflib.get_close_matches(first.split("=", 1)[0].replace("_", "-"), names, n=1, cutoff=0.6)
    return f"{first.split('=', 1)[0]} is no flag of {script}{f'; did you mean {close[0]}?' if close else ''} " \
           f"({script} --help lists them)"

NO_MAIN_GUARD = ("the method's file starts a run when imported, and the grader's workers import it: put the run "
                 "under `if __name__ == \"__main__\":`")

def main(program):
    """program() and a clean exit; a signal: one line, its exit code (130, 143, 129), no traceback, no worker left."""
    try:
        result = program()
    except runfolder.Unwritable as refused:  # a link or a special file where the program writes: never written
        grader.close_pool()
        fail(str(refused))
    except BaseException as interrupt:  # what breaks after a signal (code that wraps it in its own error) is the signal
        if not console.from_signal(interrupt):
            raise
        grader.close_pool()
        if dist.rank() == 0:
            line = getattr(interrupt, "line", None) or console.stop_line(console.seen() or signal.SIGINT)
            print(f"\n{console._state['prog']}: {line}", file=sys.stderr, flush=True)
        os._exit(console.EXIT_CODES[console.seen() or signal.SIGINT])
    grader.close_pool()
    if isinstance(result, dict) and result.get("llm") is not None:
        engines.stop(result["llm"])  # while the process group exists: vLLM's shutdown uses it
    dist.finish()

@dataclasses.dataclass(frozen=True)
class Method:
    """What machinery needs of the method, handed over by it (remix.METHOD), never imported by name, so a fork in any
    file runs its own functions. The answer functions run in grader workers: they live at module level."""
    finalize: typing.Callable  # (args) -> args with the derived defaults filled in
    build_prompt: typing.Callable  # (tokenizer, problem, suffix, system) -> prompt token ids
    final_answer: typing.Callable  # (response) -> the answer it states, or None
    grade_response: typing.Callable  # (response, answer) -> (1.0 or 0.0, status): the evaluation's answer check
    warm: typing.Callable  # (*warm_args): slow imports, run once in each grader worker as it starts
    warm_args: tuple
    reflection_words: tuple  # the self-reflection rate counts responses holding any of them
    recomputed: tuple = ()  # the sample fields a step computes anew: dropped once it is logged (the deque's too)

    def record(self) -> dict:
        """{"file": its file's name, "sha256": of its bytes (None for code typed in, with no file)}."""
        path = inspect.getfile(self.finalize)
        if not os.path.isfile(path):
            return {"file": path, "sha256": None}
        return {"file": os.path.basename(path), "sha256": data.file_digest(path)}

def resume_line(out: str) -> str:
    found = checkpoints.complete(out)
    return f"the last checkpoint is {found[-1]}; continue with --resume {out}" if found else \
        "the last checkpoint is none yet; nothing to resume"

class Session:
    """train()'s companion: construction checks all that can be checked before a file is written; start() locks and
    writes --out and restores a resumed run; `with session:` turns a signal into one line."""

    def __init__(self, args, method: Method):
        if not isinstance(args, console.RunArgs):  # a method's Args alone lacks the run's settings
            raise TypeError(f"a run takes the method's settings and the run's in one object, "
                            f"console.settings({type(args).__name__}, ...), not a {type(args).__name__}")
        if grader.IN_WORKER:  # a method file that calls train() when imported
            raise RuntimeError(NO_MAIN_GUARD)
        console.catch_interrupts()
        self.began, self.scores = time.perf_counter(), None  # the closing line's time and its last evaluation
        # --dist-timeout alone before dist.init uses it: until dist.init names the rank, every rank would say a line
        if not console.within(args.dist_timeout, console.ranges(type(args))["dist_timeout"]):
            fail(f"--dist-timeout must be {console.ranges(type(args))['dist_timeout']}, got {args.dist_timeout}")
        dist.init(args.dist_timeout, args.offload)
        if "LOCAL_RANK" in os.environ and "RANK" not in os.environ and torch.cuda.is_available():
            say("LOCAL_RANK is set without RANK (not torchrun): this one process uses GPU 0; pick another with "
                "CUDA_VISIBLE_DEVICES")
        self.method, self.written_by = method, method.record()  # read once, as the code was loaded
        self.checkpoint, self.state, self.optim_state, recorded = None, None, None, {}
        changed_data_ok = args.resume_changed_data  # this command's flag, not the run's saved one
        if args.resume:  # the run's saved settings and newest readable checkpoint; --steps may extend it
            if os.path.isdir(args.resume):
                runfolder.lock(args.resume)  # first: a folder another job writes into is not read
            console.on_stop(lambda: f"while starting; {resume_line(args.resume)}")
            self.checkpoint, self.state, self.optim_state = checkpoints.latest(args.resume, type(args))
            checkpoints.check_writer(args, self.state, self.written_by)
            done = self.state["progress"]["step"]
            args = checkpoints.resume_args(args, self.state["args"], done)
            if done >= args.steps:  # nothing to do: say so, exit 0
                say(f"{args.out} has finished all {args.steps} steps; give --resume a larger --steps to extend it")
                raise SystemExit(0)
            recorded = self.state["inputs"]
            data.check_resumed(args, self.state["args"], recorded, self.checkpoint)
        self.args = args = method.finalize(args)
        args.precision = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
        console.check_args(args, dist.world())
        if args.offload and not dist.host_collectives():  # a resumed run's saved --offload
            fail(f"{args.out} was trained with --offload: give --offload with --resume too (its process group "
                 f"needs gloo beside NCCL)")
        runfolder.check_out(args.out)  # --out's refusals before anything loads: they need nothing loaded
        self.check_kept()
        if not (args.resume or args.overwrite):  # another run's files there: refused here, start() removes nothing
            runfolder.prepare_out(args.out, overwrite=False)
        models.reset(self.state["progress"].get("bad_updates", 0) if self.state else 0, args.out)
        data.check_model_path(args.model)
        data.check_dataset(args.dataset)
        data.check_hub(args.model, args.dataset)
        self.benchmarks, digests = report.read_benchmarks(args.eval_benchmarks, args.eval_data_dir, args.eval_limit) \
            if args.eval_every else ([], None)
        rows, dataset_read = data.read_dataset(args.dataset, revision=recorded.get("dataset_revision"))
        self.problems = data.problems_of(rows, args.dataset, args.problem_key, args.answer_key)
        self.tokenizer = tokenizer = data.load_tokenizer(self.checkpoint or args.model)
        self.encode = data.template_guard(lambda problem: method.build_prompt(  # not self: a cycle through encode
            tokenizer, problem, args.prompt_suffix, args.system_prompt), self.checkpoint or args.model)
        if not tokenizer.chat_template:
            say(f"{args.model} has no chat template: prompts are the problem and --prompt-suffix as plain text")
        self.max_chars = char_bound(tokenizer, args.max_prompt_tokens)  # longer problems cannot fit
        first_fitting_prompt(self.problems, self.encode, args.max_prompt_tokens, self.max_chars)
        read = {"dataset": dataset_read.get("sha256"), "dataset_revision": dataset_read.get("revision"),
                "eval_data_dir": digests or None, "model": recorded.get("model"),
                "problems": data.problems_digest(self.problems)}
        self.inputs = data.check_data(args, self.state["args"], recorded, read, changed_data_ok) if args.resume \
            else read  # recorded with each checkpoint: a resume checks its inputs by them
        if not isinstance(self.inputs.get("model"), dict):
            self.inputs["model"] = data.model_record(args.model)
        self.check_lengths()
        lengths = plan.Lengths(eval_prompt=self.longest_eval, eval_problems=len(self.benchmarks))
        measured = functools.partial(longest_prompt, self.problems, self.encode, args.max_prompt_tokens,
                                     self.max_chars)  # every prompt encoded: only where the verdict may hang on it
        self.plan = plan.check(args, self.checkpoint or args.model, lengths=lengths, measure_prompt=measured)
        torch.manual_seed(args.seed)  # the critic's new head starts alike on every rank
        try:  # the grader's workers started and warm: a method file they cannot import stops here, nothing written
            grader.map_with_deadline(method.warm, [], args.grader_workers, args.grade_timeout, None, method.warm,
                                     method.warm_args)
        except RuntimeError as error:
            fail(f"the grader's workers cannot start: {error}")

    def check_lengths(self):
        """The longest sequence the run needs (prompt and response, training's or an evaluation's) fits the model."""
        args = self.args
        self.longest_eval = max((len(self.encode(p["problem"])) for p in self.benchmarks), default=0)
        self.max_model_len = max(args.max_prompt_tokens, self.longest_eval) + max(args.max_response_tokens,
                                                                                 args.eval_max_tokens or 0)
        context, source = models.context_length(self.checkpoint or args.model, self.tokenizer) or (None, None)
        if context is not None and self.max_model_len > context:
            prompt = f"--max-prompt-tokens {args.max_prompt_tokens}" if args.max_prompt_tokens >= self.longest_eval \
                else f"the longest evaluation prompt ({self.longest_eval} tokens)"
            response = f"--max-response-tokens {args.max_response_tokens}" if args.max_response_tokens >= \
                (args.eval_max_tokens or 0) else f"--eval-max-tokens {args.eval_max_tokens}"
            fail(f"{args.model} takes at most {context} tokens ({source}), and the run needs {self.max_model_len}: "
                 f"{prompt} plus {response}; lower them to fit")

    def check_kept(self):
        """Nothing the run reads (model, dataset, benchmarks) lies where it writes or deletes under --out."""
        args, reads = self.args, {}
        if os.path.isdir(args.model):
            files = [os.path.join(args.model, name) for name in os.listdir(args.model)]
            reads["--model"] = (args.model, [args.model, *(path for path in files if os.path.isfile(path))])
        if os.path.lexists(args.dataset):
            reads["--dataset"] = (args.dataset, [args.dataset])
        if args.eval_every and args.eval_data_dir and os.path.lexists(args.eval_data_dir):
            reads["--eval-data-dir"] = (args.eval_data_dir, [args.eval_data_dir, *(os.path.join(
                args.eval_data_dir, report.BENCHMARKS[n][0]) for n in report.resolve(args.eval_benchmarks))])
        if found := runfolder.read_where_written(args.out, reads, runfolder.WRITES):
            flag, value, entry = found
            way = (f"copy it out of {args.out} and give that place: --resume {args.resume} {flag} NEW_PLACE"
                   if args.resume else "choose another --out")
            fail(f"{flag} {value} is read from {entry}, inside --out {args.out}, where this run writes and deletes "
                 f"(--overwrite, a checkpoint's rotation): nothing a run reads is deleted by it; {way}")

    def start(self, policy, reference, critic, optimizers: list, replay, llm, sampler=None):
        """--out locked, prepared and checked path by path, plan.json written; a resumed run's state put back."""
        args = self.args
        runfolder.lock(args.out)
        if not args.resume:
            runfolder.prepare_out(args.out, args.overwrite)
        runfolder.check_writes(args.out, planned_writes(args, self.state["progress"]["step"] if self.state else 0))
        plan.write(self.plan, args.out, runfolder.replace_file)
        self.nets, self.replay, self.llm = {"policy": policy, "critic": critic, "reference": reference}, replay, llm
        self.sampler = sampler  # --overlap's sampler process
        self.optimizers = dict(zip(["policy", "critic"][: len(optimizers)], optimizers))
        for seed_fn in (random.seed, np.random.seed, torch.manual_seed):  # after vLLM's start, which reseeds
            seed_fn(args.seed + dist.rank())
        self.progress = {"step": 0, "rollouts": 0, "tokens": 0, "data_position": 0} if self.state is None else {
            k: v for k, v in self.state["progress"].items() if k != "bad_updates"}
        if self.state is not None:
            for name, optim in self.optimizers.items():
                checkpoints.load_optimizer_shard(optim, self.optim_state[name])
            replay.extend(self.state["replay"])
            checkpoints.set_rng_state(self.state["rng"])
            engines.push_weights(llm, policy)  # the engine started from the base weights (no engine: nothing)
            if sampler is not None and (ahead := self.state["in_flight"]) is not None:  # drawn ahead, saved
                sampler.restore({**ahead, "prompts": [Prompt(*p) for p in ahead["prompts"]]})
            say(f"resuming {args.out} after step {self.progress['step']} from {self.checkpoint}")
        self.log_file = report.RunLog(args.out, dataclasses.asdict(args), self.progress["step"], args.track,
                                      kept=lambda: resume_line(args.out))
        self.prompts = prompt_stream(self.problems, self.encode, args.max_prompt_tokens, args.seed,
                                          self.progress["data_position"], self.max_chars)
        self.step, self.laps, self.clock, self.first_step_end, self.steps_here = self.progress["step"], {}, 0.0, None, 0

    def __enter__(self):
        console.on_stop(lambda: f"at step {self.step}; {resume_line(self.args.out)}")
        return self

    def __exit__(self, kind, error, trace):
        self.log_file.close()
        if self.sampler is not None:  # --overlap's sampler ends with the run, however it ends
            self.sampler.close()
        # the line names the last step without holding this Session: a later train() must get the models back
        console.on_stop(lambda step=self.step, out=self.args.out: f"at step {step}; {resume_line(out)}")
        if error is not None and console.from_signal(error):
            grader.close_pool()
            raise console.Stopped(console.stop_line(console.seen() or signal.SIGINT)) from None
        if error is None:  # the closing line: what the finished run made, and where
            scores = f"at step {self.scores[0]} greedy {report.pass_line(self.scores[1])}" if self.scores else \
                "no evaluation (--eval-every 0)"
            say(f"finished steps {self.step - self.steps_here + 1}-{self.step} of {self.args.steps} in "
                f"{console.duration(time.perf_counter() - self.began)}; {scores}; metrics in "
                f"{os.path.join(self.args.out, 'metrics.jsonl')}; {resume_line(self.args.out)}")
        return False

    def steps(self):
        for step in range(self.progress["step"] + 1, self.args.steps + 1):
            console.check_interrupted()
            self.step, self.laps, self.clock = step, {}, time.perf_counter()
            self.started = self.clock
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
        """Greedy Pass@1 on --eval-benchmarks (report.during_training): the record's eval/* entries and perf/eval_s."""
        start, found = time.perf_counter(), report.during_training(self, step)
        self.scores = (step, found)
        return {**found, "perf/eval_s": time.perf_counter() - start}

    def log(self, record: dict, fresh: list[dict] = (), history: list[dict] = (), on_step=None):
        """The step's record completed, handed to on_step(step, record, policy, tokenizer, batch), written and printed;
        the method's recomputed fields dropped from the samples. Step 0: the evaluation alone."""
        args, step = self.args, record["step"]
        if step == 0:
            return self.log_file.write({**record, "rollouts/total": 0, "rollouts/generated_tokens": 0})
        laps = torch.tensor([self.laps.get(k, 0.0) for k in ("gen", "trainer", "weight_sync")])
        gen, trainer, sync = dist.all_reduce(laps, "max").tolist()
        generated = record["response/length_mean"] * record["batch/fresh"]
        self.progress["rollouts"] += record["batch/fresh"]
        self.progress["tokens"] += round(generated)
        record.update({"rollouts/total": self.progress["rollouts"],
                       "rollouts/generated_tokens": self.progress["tokens"],
                       "perf/gen_tokens_per_s": generated / max(gen, 1e-9), "perf/update_s": trainer,
                       "perf/weight_sync_s": sync, "perf/step_s": time.perf_counter() - self.started})
        if on_step is not None:
            on_step(step, record, self.nets["policy"], self.tokenizer, [*fresh, *history])
        for sample in [*fresh, *history]:
            for key in self.method.recomputed:
                sample.pop(key, None)
        self.log_file.write(record)
        self.log_file.completions(step, report.completion_rows(step, [*fresh, *history], self.tokenizer,
                                                               args.log_completions, self.method.final_answer))
        self.steps_here += 1
        self.first_step_end = self.first_step_end or time.perf_counter()  # the rate is of the later steps: no warm-up
        say(console.step_line(step, args.steps, {"gen": gen, "trainer": trainer, "weight_sync": sync,
                                                 "eval": record.get("perf/eval_s", 0.0)}, record["perf/step_s"],
                              record["reward/mean"], self.steps_here - 1, time.perf_counter() - self.first_step_end))
        self.progress["step"] = step

    def save(self, step: int, reincarnated: bool):
        """checkpoint-STEP (the reference only once reincarnated: before, it is the base model, loaded again)."""
        nets = {**self.nets, "reference": self.nets["reference"] if reincarnated else None}
        state = {"args": checkpoints.saved_settings(self.args), "method": self.written_by, "inputs": self.inputs,
                 "replay": list(self.replay), "progress": {**self.progress, "bad_updates": models.in_a_row()},
                 "in_flight": self.sampler.state() if self.sampler is not None else None}  # --overlap
        checkpoints.save(self.args.out, step, nets, self.tokenizer, self.optimizers, state, self.args.keep_last)

def char_bound(tokenizer, tokens: int) -> int:
    """The most characters `tokens` tokens can spell: a longer problem is skipped unrendered (50 MB took minutes)."""
    return tokens * max(map(len, tokenizer.get_vocab()), default=1)

def fitting(problem: str, encode, max_prompt_tokens: int, max_chars=None) -> list[int] | None:
    """The prompt's token ids where they fit max_prompt_tokens, else None; past max_chars it is never rendered."""
    if max_chars is None or len(problem) <= max_chars:
        return ids if len(ids := encode(problem)) <= max_prompt_tokens else None

def first_fitting_prompt(problems: list[tuple], encode, max_prompt_tokens: int, max_chars=None) -> int:
    """The index of the first problem whose prompt fits; one line (before anything is written) when none does."""
    for index, (problem, _) in enumerate(problems):
        if fitting(problem, encode, max_prompt_tokens, max_chars) is not None:
            return index
    fits = [p for p, _ in problems if max_chars is None or len(p) <= max_chars]
    shortest = f"has {min(len(encode(p)) for p in fits[:2000])} tokens" if fits else \
        f"has over {max_chars} characters, more than that many tokens can hold"
    fail(f"every prompt is longer than --max-prompt-tokens {max_prompt_tokens} (the shortest problem's prompt "
         f"{shortest}): raise --max-prompt-tokens")

def longest_prompt(problems: list[tuple], encode, max_prompt_tokens: int, max_chars=None) -> int:
    """The most tokens a prompt of the stream can have (every problem encoded: ask only where a verdict hangs on it)."""
    longest = 0
    for problem, _ in problems:
        if (ids := fitting(problem, encode, max_prompt_tokens, max_chars)) is not None:
            longest = max(longest, len(ids))
            if longest == max_prompt_tokens:
                break
    return longest

def prompt_stream(problems: list[tuple], encode, max_prompt_tokens: int, seed: int, position: int = 0,
                  max_chars=None):
    """Prompt(ids, answer, position) over shuffled passes from position (--resume); longer ones skipped (Decision 9)."""
    while True:
        epoch, offset = divmod(position, len(problems))
        order = np.random.RandomState(seed + epoch).permutation(len(problems))  # the same order on resume
        for index in order[offset:]:
            position, (problem, answer) = position + 1, problems[index]
            if (ids := fitting(problem, encode, max_prompt_tokens, max_chars)) is not None:
                yield Prompt(ids, answer, position)

def planned_writes(args, done: int) -> list[tuple]:
    """check_writes' plan of a run after step done, with each eval/step-N.jsonl and checkpoint-N it will write."""
    def due(every: int, first: int) -> list[int]:
        return [step for step in range(first, args.steps + 1)
                if step == args.steps or (every > 0 and step % every == 0)]
    planned = [("metrics.jsonl", "append"), ("completions.jsonl", "append"), ("plan.json", "file"), ("tb", "tree")]
    if args.track:
        planned.append(("wandb", "tree", ("latest-run",)))  # wandb makes that link itself
    if args.eval_every:
        planned.append(("eval", "folder"))
        planned += [(os.path.join("eval", f"step-{step}.jsonl"), "file")
                    for step in due(args.eval_every, 0 if done == 0 else done + 1)]  # a new run's step 0 too
    return planned + [(f"checkpoint-{step}", "replaced") for step in due(args.save_every, done + 1)]
