"""The command line and the terminal: the run's settings and their checks, one-line messages, progress, signals.

The bottom of the map: nothing of machinery, nothing heavy (remix.py and eval.py import it before torch); the
program's name, the rank and a stopped run's line reach it as values (one_line_interrupts, set_rank, on_stop).
"""

import ast
import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import os
import re
import signal
import sys
import textwrap
import time
import types
import typing
from typing import Annotated, Literal

_state = {"rank": 0, "seen": None, "stop_line": None, "prog": "remix"}

OTHER_RANK_WAIT = 2.0  # seconds another rank waits before it refuses: torchrun stops it where rank 0 refuses too

def set_rank(rank: int):
    """This process's rank (dist.init says it): only the first process speaks."""
    _state["rank"] = rank

def fail(message: str):
    """Bad input: one clear line on stderr and exit code 2, no traceback."""
    if _state["rank"] != 0:
        time.sleep(OTHER_RANK_WAIT)
        print(f"{_state['prog']}: error: rank {_state['rank']}: {message}", file=sys.stderr, flush=True)
    say(f"error: {message}", sys.stderr)
    raise SystemExit(2)

def say(message: str, stream=None):
    """One line on stdout (or stream), from the first process, on a line of its own beside a progress bar."""
    if _state["rank"] == 0:
        from tqdm import tqdm
        tqdm.write(f"{_state['prog']}: {message}", file=stream or sys.stdout)
        (stream or sys.stdout).flush()

def reason(error: BaseException) -> str:
    """'Type: first line' of what a library raised, its innermost cause's; a signal's error is raised again."""
    if from_signal(error):  # what a library made of a signal is the signal
        raise error
    while error.__cause__ is not None:  # a validation error wraps the one that says what is wrong
        error = error.__cause__
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__

@contextlib.contextmanager
def quiet(library):
    """A library's own log lines (transformers', datasets') held back in the block: one line says what went wrong."""
    verbosity = library.logging.get_verbosity()
    library.logging.set_verbosity_error()
    try:
        yield
    finally:
        library.logging.set_verbosity(verbosity)

def offline_hint() -> str:
    """What a line adds where a load failed with HF_HUB_OFFLINE set."""
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    return " (HF_HUB_OFFLINE is set: only the local cache is read; pass a local path)" if offline else ""

class _Lines:
    """A log file's view of a tqdm bar: each redraw (tqdm writes '\\r' and the bar) becomes a line of its own, unless
    it counts what the last line did (a close after vLLM's last refresh): no line twice."""

    def __init__(self, stream):
        self.stream, self.last = stream, None

    def write(self, text: str):
        if (text := text.strip("\r\n ")) and text.rsplit(" [", 1)[0] != self.last:  # the bar, before its times
            self.last = text.rsplit(" [", 1)[0]
            self.stream.write(f"{_state['prog']}: {text}\n")

    def flush(self):
        self.stream.flush()

def progress(label: str, total: int, unit: str = "problems", stream=None):
    """A tqdm bar on rank 0: redrawn in place in a terminal (80 x 24 where it reports 0 x 0, as a bare pty does: tqdm
    would draw nothing), else plain lines: the first, at most one every 30 s (tqdm's monitor's too), the last."""
    from tqdm import tqdm
    stream = stream or sys.stdout
    tty, size = stream.isatty(), {}
    with contextlib.suppress(OSError, ValueError):  # a stream without a descriptor: tqdm's own size
        size = {"ncols": 80, "nrows": 24} if tty and os.get_terminal_size(stream.fileno()).columns == 0 else {}
    return tqdm(total=total, desc=f"{_state['prog']}: {label}" if tty else label, unit=f" {unit}", ascii=not tty,
                file=stream if tty else _Lines(stream), mininterval=1.0 if tty else 30.0, smoothing=0,
                maxinterval=10.0 if tty else 30.0, disable=_state["rank"] != 0 or total <= 0,
                dynamic_ncols=tty and not size, **size)  # smoothing 0: the rate so far

def engine_progress(label: str | None, responses: int):
    """What vLLM's generate(use_tqdm=...) takes in place of tqdm: a bar of all the responses under label, whatever
    total vLLM passes (its requests: n a prompt in vLLM 0.32); False without a label or on the other ranks (vLLM
    divides by a bar's elapsed time, which a disabled one leaves at 0)."""
    def bar(iterable=None, **ignored):
        return iterable if iterable is not None else progress(label, responses, "responses")
    return bar if _state["rank"] == 0 and label else False

def duration(seconds: float) -> str:
    """3725 -> '1h02m', 190 -> '3m10s', 7.4 -> '7s'."""
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"

def step_line(step: int, steps: int, laps: dict, step_s: float, reward: float, done_here: int,
              elapsed_here: float) -> str:
    """A training step's line: each phase's seconds, the step's, and the time left at done_here steps' pace so far."""
    phases = ", ".join(f"{name} {laps.get(name, 0.0):.1f}s" for name in ("gen", "trainer", "weight_sync", "eval"))
    left = elapsed_here / max(done_here, 1) * (steps - step) if step == steps or done_here and elapsed_here else None
    return (f"step {step}/{steps}: {phases}; step {step_s:.1f}s; reward {reward:.3f}; "
            + (f"{duration(left)} left" if left is not None else "time left unknown yet"))

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}  # 128 + the signal's number
NAMES = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}
# a SIGHUP ignored from the start (nohup) stays ignored: such a run outlives its terminal
HANDLED = [s for s in EXIT_CODES if s != signal.SIGHUP or signal.getsignal(signal.SIGHUP) != signal.SIG_IGN]

def one_line_interrupts(prog: str):
    """A program's first call: unread output dropped, a -P script's folder last on sys.path, a signal one line."""
    _state["prog"] = prog  # what each line of this process begins with (fail, say, progress, runner.main's signal line)
    drop_unwritable_output()
    if sys.flags.safe_path and sys.argv and sys.argv[0].endswith(".py"):  # python -P FOLDER/fork.py
        folder = os.path.dirname(os.path.abspath(sys.argv[0]))
        if folder not in sys.path:  # last: the fork's helpers are found, a json.py there never shadows json
            sys.path.append(folder)

    def handler(signum, frame):
        with contextlib.suppress(OSError):
            os.write(2, f"\n{prog}: {NAMES[signum]} while starting; nothing was written\n".encode())
        os._exit(EXIT_CODES[signum])
    for signum in HANDLED:
        signal.signal(signum, handler)

def catch_interrupts():
    """Each signal raises KeyboardInterrupt and is remembered: one raised in a __del__ is lost (check_interrupted)."""
    def handler(signum, frame):
        _state["seen"] = signum
        raise KeyboardInterrupt
    def unraisable(report, default=sys.unraisablehook):
        if not isinstance(report.exc_value, KeyboardInterrupt):
            default(report)
    for signum in HANDLED:
        signal.signal(signum, handler)
    sys.unraisablehook = unraisable

def seen():
    """The signal that arrived, or None."""
    return _state["seen"]

def from_signal(error: BaseException) -> bool:
    """Whether an error is a signal's: Ctrl-C itself, or what the code it landed in made of it."""
    return isinstance(error, KeyboardInterrupt) or _state["seen"] is not None

def check_interrupted():
    if _state["seen"] is not None:
        raise KeyboardInterrupt

def on_stop(line):
    """line() -> what a signal's line says after its name ('at step 3; the last checkpoint is ...')."""
    _state["stop_line"] = line

def stopped_at() -> str:
    """What a stop's line says of where the run is ('at step 3; the last checkpoint is ...')."""
    return _state["stop_line"]() if _state["stop_line"] else "while starting; nothing to resume"

def stop_line(signum) -> str:
    return f"{NAMES[signum]} {stopped_at()}"

class Stopped(KeyboardInterrupt):
    """A signal that ended a program, with the one line that says what is kept and how to continue."""
    line = property(lambda self: self.args[0])

class Dropping:
    """A stream whose first failed write or flush (its reader or terminal gone) points its descriptor at /dev/null."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError:
            self.drop()
            return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            self.drop()

    def drop(self):
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(null, self.stream.fileno())
        os.close(null)
        with contextlib.suppress(OSError):
            self.stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)

def drop_unwritable_output():
    """stdout and stderr become Dropping streams; a standard descriptor closed at the start (`>&-`) is /dev/null first,
    before a file the program opens takes its number (a library writing to descriptor 2 would write into it)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:  # os.open takes the lowest free number: fd itself, those below it being open
            os.set_inheritable(os.open(os.devnull, os.O_RDWR), True)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name) or open(1 if name == "stdout" else 2, "w", closefd=False, errors="backslashreplace")
        if not isinstance(stream, Dropping):
            setattr(sys, name, Dropping(stream))

def hint(text: str):
    """What --help shows for a default filled in later (tyro's help_behavior_hint); None without tyro."""
    try:
        from tyro.conf import arg
    except ImportError:
        return None
    return arg(help_behavior_hint=text)

@dataclasses.dataclass
class RunArgs:
    """the run: model and data, devices and engines, output, evaluation (the method's settings are its Args)"""
    model: str = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    """hub id or local folder of the base policy (also the reference and, for PPO, the critic's trunk)"""
    dataset: str = "agentica-org/DeepScaleR-Preview-Dataset"
    """hub id, or a local .jsonl/.json/.parquet file of math problems"""
    problem_key: str = "problem"
    """the dataset column holding the problem text"""
    answer_key: str = "answer"
    """the dataset column holding the gold answer"""
    max_tokens_per_micro_batch: int = 16384
    """in [1, 1073741824]: padded tokens per forward/backward; similar lengths share one, a longer one runs alone"""
    sampler: Literal["vllm", "hf"] = "vllm"
    """vllm (default) or transformers' generate, for machines without vLLM"""
    hf_batch_prompts: Annotated[int | None, hint("(default: --mini-batch-prompts)")] = None
    """in [1, 65536]: prompts per transformers generate call with --sampler hf (G responses each); fewer, less memory"""
    vllm_gpu_memory_utilization: float = 0.35
    """in (0, 1): GPU memory share vLLM may take beside the trainer (docs/memory.md has the arithmetic)"""
    vllm_sleep: bool = True
    """GPU only: vLLM sleeps (level 2: weights and KV cache freed, no host copy) from each sample to its push"""
    vllm_tp: int = 1
    """in [1, 1024]: ranks that share one vLLM engine (tensor parallel), for models too large for one GPU's engine"""
    overlap: bool = False
    """asynchronous ReMix: a sampler process (a GPU of its own) draws step k+1's batch with pi_k while step k trains"""
    overlap_gpus: int = 1
    """in [1, 1024]: --overlap's sampler's GPUs, after the trainers' on the first node (on CPU: its processes), its
    engine's tensor parallelism"""
    overlap_after_reincarnation: bool = False
    """--overlap after T too (the clip corrects the one step); without it the sampler drains at T, then synchronous"""
    offload: bool = False
    """keep each trained model's fp32 weights, gradients and AdamW state in host memory (FSDP2's CPU offload)"""
    precision: Annotated[Literal["bf16", "fp32"] | None, hint("(default: bf16 on GPU, fp32 on CPU)")] = None
    """dtype of every forward pass (policy, critic, frozen reference, vLLM); weights and optimizer state stay fp32"""
    gradient_checkpointing: Annotated[bool | None, hint("(default: on GPU)")] = None
    """recompute activations in the backward pass of both models (saves memory on long responses)"""
    grader_workers: int = 2
    """in [1, 1024]: processes (per rank) that grade answers with math-verify"""
    grade_timeout: float = 20.0
    """in [0.5, 1e6]: seconds an answer may take to grade; past it the answer scores 0 and counts as a grader failure"""
    seed: int = 1
    """in [0, 2147483647]: seed of python, numpy, torch and of every vLLM request"""
    dist_timeout: float = 60.0
    """in (0, 1e6]: minutes a collective may wait for the other ranks (they wait while rank 0 writes a checkpoint)"""
    out: str = "runs/remix"
    """output folder: metrics.jsonl, TensorBoard events, checkpoints, evaluations, completions"""
    overwrite: bool = False
    """replace the logs and checkpoints of an earlier run in --out"""
    save_every: int = 50
    """in [0, 1000000]: save a checkpoint every this many steps (and at the end); 0 saves only at the end"""
    keep_last: int = 3
    """in [0, 1000000]: keep the newest this many checkpoints, the newest full and the others model folders (0: all)"""
    resume: str | None = None
    """continue the run in this folder from its newest checkpoint, with the run's saved arguments"""
    resume_other_method: bool = False
    """--resume a run that another method file (or another version of this one) wrote: it continues with this one"""
    resume_changed_data: bool = False
    """--resume a run whose dataset or benchmark files changed since it began: it goes on with them as they are now"""
    track: bool = False
    """log to Weights & Biases as well"""
    eval_every: int = 25
    """in [0, 1000000]: greedy Pass@1 on --eval-benchmarks at step 0, every this many steps and at the end; 0 never"""
    eval_benchmarks: tuple[str, ...] = ("all",)
    """benchmarks evaluated during training: aime24 amc23 amc83 math500 minerva olympiadbench, or all (the five)"""
    eval_limit: int | None = None
    """in [1, 1000000]: evaluate only the first this many problems of each benchmark"""
    eval_max_tokens: int | None = None
    """in [1, 1048576]: generation budget of an evaluation response (default: --max-response-tokens)"""
    eval_data_dir: str | None = None
    """folder of the benchmark files (default: the repository's data/benchmarks)"""
    log_completions: int = 4
    """in [0, 1048576]: responses of each step written to OUT/completions.jsonl (and wandb/TensorBoard); 0 none"""

@functools.cache
def settings_type(method_args: type) -> type:
    """A run's settings dataclass, made once per Args (bases RunArgs, Args); a field in both is refused in one line."""
    shared = {f.name for f in dataclasses.fields(method_args)} & {f.name for f in dataclasses.fields(RunArgs)}
    if shared:
        fail(f"{method_args.__name__}.{sorted(shared)[0]} ({inspect.getsourcefile(method_args)}) is a setting of the "
             f"run too (machinery's RunArgs): give the method's field another name")
    return dataclasses.make_dataclass(
        "Settings", [], bases=(RunArgs, method_args),
        namespace={"__doc__": f"{method_args.__name__}'s fields and RunArgs'", "__module__": __name__,
                   # pickled as its Args and its values: the class itself has no name to be found by
                   "__reduce__": lambda args: (settings_of, (method_args, dataclasses.asdict(args)))})

def settings(method_args: type, **values):
    """A run's settings: settings(remix.Args, steps=2, out="runs/x"); a keyword of neither class is a TypeError."""
    return settings_type(method_args)(**values)

def settings_of(method_args: type, values: dict):
    return settings(method_args, **values)

def fields_of(args) -> dict:
    """A dataclass's fields by name, as they are (dataclasses.asdict copies them)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}

NUMBER = r"-?[0-9][0-9.e+-]*"
BOUND = re.compile(rf"(>=|>) {NUMBER}|({NUMBER} or )?in [\[(]{NUMBER}, {NUMBER}[\])]")  # 'in [0, 1)', '0 or in (0, 1]'

@functools.cache
def ranges(cls) -> dict[str, str]:
    """Each numeric field of a settings dataclass (bases too) with its docstring's range; one without both refused."""
    found = {}
    for part in [p for p in reversed(cls.__mro__) if dataclasses.is_dataclass(p) and inspect.get_annotations(p)]:
        body, hints = ast.parse(textwrap.dedent(inspect.getsource(part))).body[0].body, typing.get_type_hints(part)
        for field, doc in zip(body, body[1:]):
            if not (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)):
                continue
            name = field.target.id
            if not {int, float} & set(typing.get_args(hints[name]) or (hints[name],)) - {bool}:
                continue
            text = doc.value.value if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) else ""
            match = BOUND.search(text if isinstance(text, str) else "")
            if match is None or "in " not in match.group():
                fail(f"the flag --{name.replace('_', '-')} of {part.__name__} ({inspect.getsourcefile(part)}) states "
                     f"no {'upper bound' if match else 'range'}: begin its docstring with a range of both bounds "
                     f"('in [1, 1024]', 'in (0, 1e6]', 'in [0, 1)')")
            found[name] = match.group()
    return found

def within(value, bound: str) -> bool:
    """Whether value satisfies a range written as 'in [0, 1)', 'in (0, 1]', '0 or in [0.01, 100]' (both bounds, finite:
    inf and nan fail a comparison with one)."""
    if " or " in bound:
        point, bound = bound.split(" or ", 1)
        if value == float(point):
            return True
    lo, hi = (float(x) for x in bound[4:-1].split(","))
    return (lo <= value if bound[3] == "[" else lo < value) and (value <= hi if bound[-1] == "]" else value < hi)

def unlike(value, schema, where: str) -> str | None:
    """Where value is not of schema, as "state.progress.step is '3'", or None. A schema is a dict (its fields, each of
    its schema) or a type hint: a class (an int passes for a float), X | None, a Literal, list[X], tuple[X, ...],
    dict[str, X], typing.Any."""
    origin, parts = typing.get_origin(schema), typing.get_args(schema)
    if isinstance(schema, dict) and isinstance(value, dict):
        if odd := sorted(map(str, value.keys() ^ schema.keys())):
            return f"{where}.{odd[0]} is {'missing' if odd[0] in schema else 'no field a save writes'}"
        return next(filter(None, (unlike(value[k], part, f"{where}.{k}") for k, part in schema.items())), None)
    if origin in (list, tuple, dict) and isinstance(value, dict if origin is dict else (list, tuple)):
        items = value.items() if origin is dict else enumerate(value)  # an item's schema: dict[str, X]'s X, list[X]'s
        return next(filter(None, (unlike(v, parts[origin is dict], f"{where}[{k!r}]") for k, v in items)), None)
    if origin is typing.Literal:
        fits = value in parts and type(value) in map(type, parts)
    elif origin in (typing.Union, types.UnionType):
        fits = any(unlike(value, part, where) is None for part in parts)
    else:
        fits = schema is typing.Any or type(value) is schema or (schema is float and type(value) is int)
    return None if fits else f"{where} is {value!r:.60}"

def env_number(name: str, default, bound: str, kind: type = int):
    """The environment variable name as a number of kind (default where unset), in bound or refused in one line."""
    text = os.environ.get(name)
    if text is None:
        return default
    with contextlib.suppress(ValueError):
        if within(value := kind(text), bound):
            return value
    fail(f"the environment variable {name} must be {'a whole number' if kind is int else 'a number'} {bound}, "
         f"got {text!r}: set it to one, or unset it")

def check_ranges(args):
    """Every numeric flag in the range its docstring states: the first that is not gets one line."""
    for name, bound in ranges(type(args)).items():
        value = getattr(args, name)
        if value is not None and not within(value, bound):
            fail(f"--{name.replace('_', '-')} must be {bound}, got {value}")

def check_args(args, world: int):
    """Every flag's range, then every impossible combination over world processes, each with one line."""
    check_ranges(args)
    n_fresh = round((1.0 - args.off_policy_p) * args.prompts_per_step)
    n_history = args.prompts_per_step - n_fresh
    checks = [(args.off_policy_p == 0 or 1 <= n_history < args.prompts_per_step,
               f"--prompts-per-step {args.prompts_per_step} cannot split into whole fresh and historical groups at "
               f"--off-policy-p {args.off_policy_p}: raise --prompts-per-step"),
              (args.algo == "ppo" or args.group_size >= 2,
               "--algo grpo needs --group-size >= 2 (a group of one always has advantage 0)"),
              (n_fresh % world == 0 and n_history % world == 0,
               f"--prompts-per-step {args.prompts_per_step} ({n_fresh} fresh + {n_history} historical at p = "
               f"{args.off_policy_p}) cannot split into whole groups over {world} processes: make each a multiple "
               f"of {world}"),
              (world % args.vllm_tp == 0, f"--vllm-tp {args.vllm_tp} must divide the {world} processes"),
              (not args.overlap or args.sampler == "vllm", "--overlap needs --sampler vllm (the sampler process's "
               "engine)"),
              (not args.overlap or args.vllm_tp == 1, "--vllm-tp is the trainers' engines': under --overlap the engine "
               "is the sampler's, its tensor parallelism --overlap-gpus"),
              (args.overlap or args.overlap_gpus == 1, "--overlap-gpus sets --overlap's sampler: add --overlap"),
              (args.sampler_is_cap is None or args.sampler == "vllm",
               "--sampler-is-cap needs --sampler vllm (the sampler's log-probs come from vLLM)"),
              (not args.track or importlib.util.find_spec("wandb") is not None,
               "--track logs to wandb, which is not installed (it is no dependency): pip install wandb")]
    for ok, message in checks:
        if not ok:
            fail(message)
