"""The run's settings (RunArgs) and every flag's checks, made before anything is written.

RunArgs (what a run sets beside the method's Args: model and data, engines, output, evaluation), the one object a
run reads both from (settings), and the checks made before anything is written: each numeric field's range, stated
in its docstring and read from there (a new flag is one edit, in its dataclass), the impossible combinations, the
model path and the hub. A reader of the method may skip this module."""

import ast
import dataclasses
import functools
import importlib.util
import inspect
import math
import os
import re
import socket
import textwrap
import typing
from typing import Annotated, Literal
from urllib.parse import urlparse

from machinery import dist
from machinery.console import fail


def hint(text: str):
    """What --help shows for a default that the method fills in later (tyro's help_behavior_hint). None without tyro:
    the method imports without its command line, as benchmarks on a bare GPU machine do."""
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
    """The one dataclass a run reads its settings from: the method's Args (method_args) and RunArgs as its bases, so
    args.group_size and args.sampler are both fields of it. Made once per Args, so type(args)() is its defaults. A
    method field named as a run's is refused in one line (both would be one flag)."""
    shared = {f.name for f in dataclasses.fields(method_args)} & {f.name for f in dataclasses.fields(RunArgs)}
    if shared:
        name = sorted(shared)[0]
        fail(f"{method_args.__name__}.{name} ({inspect.getsourcefile(method_args)}) is a setting of the run too "
             f"(machinery's RunArgs): give the method's field another name")
    return dataclasses.make_dataclass(
        "Settings", [], bases=(RunArgs, method_args),
        namespace={"__doc__": f"{method_args.__name__}'s fields and RunArgs'", "__module__": __name__,
                   # pickled as its Args and its values: the class itself has no name to be found by
                   "__reduce__": lambda args: (settings_of, (method_args, dataclasses.asdict(args)))})


def settings(method_args: type, **values):
    """A run's settings in one call, every field of the method's Args and of RunArgs by its keyword, the others at
    their defaults: settings(remix.Args, steps=2, out="runs/x"). A keyword of neither (a misspelling) is a TypeError."""
    return settings_type(method_args)(**values)


def settings_of(method_args: type, values: dict):
    """settings() from a dict of fields (how a pickled run's settings come back)."""
    return settings(method_args, **values)


def fields_of(args) -> dict:
    """A dataclass's fields by name, as they are (dataclasses.asdict copies them)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}


def saved(args) -> dict:
    """The settings as a checkpoint saves them, the method's and the run's apart: {"method": {"algo": "ppo", ...},
    "run": {"model": ..., ...}}."""
    run = {f.name for f in dataclasses.fields(RunArgs)}
    values = fields_of(args)
    return {"method": {k: v for k, v in values.items() if k not in run},
            "run": {k: v for k, v in values.items() if k in run}}


def from_saved(groups) -> dict | None:
    """saved()'s two groups as one dict of every field, or None where groups is not in that layout."""
    if not (isinstance(groups, dict) and set(groups) == {"method", "run"}
            and all(isinstance(part, dict) for part in groups.values())) or groups["method"].keys() & groups["run"]:
        return None
    return {**groups["method"], **groups["run"]}


# A range as a docstring states it: '>= 1', '> 0', 'in [0, 1)', 'in (0, 1]', 'in [0, 2147483647]', and one value
# beside a range, '0 or in [0.01, 100]' (a temperature: 0 is greedy; one under 0.01 overflows the logits' division)
NUMBER = r"-?[0-9][0-9.e+-]*"
BOUND = re.compile(rf"(>=|>) {NUMBER}|({NUMBER} or )?in [\[(]{NUMBER}, {NUMBER}[\])]")


@functools.cache
def ranges(cls) -> dict[str, str]:
    """Each numeric field of a flags dataclass with its range, the first BOUND its docstring states ('p, in [0, 1):
    ...' -> 'in [0, 1)'): the range is declared beside the field, and --help shows it. A numeric field whose docstring
    states none, or only a lower bound ('>= 1'), is refused with one line, so a new flag cannot go unchecked or
    unbounded (1e300 seconds overflow a select, 1e20 a deque's length). The fields of a run's settings (settings_type)
    are those of its bases: each dataclass in the class's ancestry declaring fields is read from its own source."""
    found = {}
    for part in reversed(cls.__mro__):
        if dataclasses.is_dataclass(part) and inspect.get_annotations(part):
            found.update(declared_ranges(part))
    return found


def declared_ranges(cls) -> dict[str, str]:
    """ranges() of the fields one dataclass declares itself, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body, hints, found = tree.body[0].body, typing.get_type_hints(cls), {}
    for field, doc in zip(body, body[1:]):
        if not (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)):
            continue
        name = field.target.id
        kinds = set(typing.get_args(hints[name]) or (hints[name],))
        if not {int, float} & kinds - {bool}:
            continue
        text = doc.value.value if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) else ""
        match = BOUND.search(text if isinstance(text, str) else "")
        if match is None or "in " not in match.group():  # a number without a ceiling overflows somewhere
            fail(f"the flag --{name.replace('_', '-')} of {cls.__name__} ({inspect.getsourcefile(cls)}) states no "
                 f"{'upper bound' if match else 'range'}: begin its docstring with a range of both bounds "
                 f"('in [1, 1024]', 'in (0, 1e6]', 'in [0, 1)')")
        found[name] = match.group()
    return found


def within(value, bound: str) -> bool:
    """Whether value satisfies a range written as '>= 1', '> 0', 'in [0, 1)', 'in (0, 1]', '0 or in [0.01, 100]', ..."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if " or " in bound:  # one value beside the range
        point, bound = bound.split(" or ", 1)
        if value == float(point):
            return True
    if bound.startswith(">="):
        return value >= float(bound[2:])
    if bound.startswith(">"):
        return value > float(bound[1:])
    lo, hi = (float(x) for x in bound[4:-1].split(","))
    return (lo <= value if bound[3] == "[" else lo < value) and (value <= hi if bound[-1] == "]" else value < hi)


def env_number(name: str, default, bound: str, kind: type = int, prog: str = "remix"):
    """The environment variable `name` read as a number of `kind` (int or float; `default` where it is unset),
    checked as a flag is: a value that is no such number (nan and inf included, an empty one too) or is outside
    `bound` (a range as a flag's docstring writes it: 'in [1, 1048576]') stops the program in one line naming the
    variable and its range, exit 2. Every such reading happens before anything is written."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = kind(text)
    except ValueError:  # 'abc', '', and for an int also '1.5', 'nan', 'inf'
        value = None
    if value is None or not within(value, bound):
        fail(f"the environment variable {name} must be {'a whole number' if kind is int else 'a number'} {bound}, "
             f"got {text!r}: set it to one, or unset it", prog)
    return value


def check_ranges(args, prog: str = "remix"):
    """Every numeric flag in the range its docstring states: the first that is not gets one line."""
    for name, bound in ranges(type(args)).items():
        value = getattr(args, name)
        if value is not None and not within(value, bound):
            fail(f"--{name.replace('_', '-')} must be {bound}, got {value}", prog)


def check_args(args):
    """Every flag's range, then every impossible combination, each with one line saying what to change."""
    check_ranges(args)
    n_fresh = round((1.0 - args.off_policy_p) * args.prompts_per_step)
    n_history, ranks = args.prompts_per_step - n_fresh, dist.world()
    checks = [(args.off_policy_p == 0 or 1 <= n_history < args.prompts_per_step,
               f"--prompts-per-step {args.prompts_per_step} cannot split into whole fresh and historical groups at "
               f"--off-policy-p {args.off_policy_p}: raise --prompts-per-step"),
              (args.algo == "ppo" or args.group_size >= 2, "--algo grpo needs --group-size >= 2 (a group of one "
                                                           "always has advantage 0)"),
              (n_fresh % ranks == 0 and n_history % ranks == 0 and args.prompts_per_step % ranks == 0,
               f"--prompts-per-step {args.prompts_per_step} ({n_fresh} fresh + {n_history} historical at p = "
               f"{args.off_policy_p}) cannot split into whole groups over {ranks} processes: make each a multiple "
               f"of {ranks}"),
              (ranks % args.vllm_tp == 0, f"--vllm-tp {args.vllm_tp} must divide the {ranks} processes"),
              (args.sampler_is_cap is None or args.sampler == "vllm",
               "--sampler-is-cap needs --sampler vllm (the sampler's log-probs come from vLLM)"),
              (not args.track or importlib.util.find_spec("wandb") is not None,
               "--track logs to wandb, which is not installed (it is no dependency): pip install wandb")]
    for ok, message in checks:
        if not ok:
            fail(message)


HUB_ID = re.compile(r"^(?![.-])[\w.-]{1,96}(?<![.-])(/(?![.-])[\w.-]{1,96}(?<![.-]))?$")


def is_hub_id(name: str) -> bool:
    """org/name (or name) in the hub's alphabet that is not a local path. './x', '/x', '~/x', 'a/b/c', 'a b',
    and 'runs/tiny' when a local ./runs exists are local paths."""
    if os.path.exists(name) or ("/" in name and os.path.exists(name.split("/")[0])):
        return False
    return bool(HUB_ID.match(name)) and "--" not in name and ".." not in name


def check_model_path(model: str, prog: str = "remix"):
    """A model that is not a hub id is a local folder, and must exist."""
    if not is_hub_id(model) and not os.path.isdir(model):
        fail(f"model folder {model!r} does not exist; pass an existing local folder or a hub id (org/name)", prog)


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def offline_hint() -> str:
    return " (HF_HUB_OFFLINE is set: only the local cache is read; pass a local path)" if offline() else ""


def check_hub(needed: dict, prog: str = "remix"):
    """Fail in seconds, not after minutes of retries, when hub ids are asked for and the hub is out of reach.
    needed: {'--model': id, ...}, the flags whose values are hub ids. HF_HUB_OFFLINE=1 reads the local cache."""
    if not needed or offline():
        return
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    proxy = urlparse(os.environ.get("HTTPS_PROXY", os.environ.get("https_proxy", "")) or "//")
    host, port = (proxy.hostname, proxy.port or 80) if proxy.hostname else \
        (endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80))
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as error:
        what = ", ".join(f"{flag} {value}" for flag, value in needed.items())
        fail(f"the Hugging Face hub ({endpoint.geturl()}) cannot be reached ({error.strerror or error}), and {what} "
             f"{'is a hub id' if len(needed) == 1 else 'are hub ids'}: pass local paths, or set HF_HUB_OFFLINE=1 to "
             f"use the files already in the local cache", prog)


def check_hub_weights(model: str, prog: str = "remix"):
    """A hub model whose weights are pickles only (pytorch_model.bin, no *.safetensors) is refused in one line before
    anything loads, as a local folder is (safeload.check_model_folder): remix reads safetensors only, and vLLM's
    loader would end in a traceback. The files are the local cache's snapshot under HF_HUB_OFFLINE=1 (what a load
    reads then), else the hub's listing; where neither can be read the load says why."""
    import fnmatch

    from machinery.safeload import PICKLES

    files = hub_files(model) if is_hub_id(model) else None
    pickles = [f for f in files or [] if any(fnmatch.fnmatch(f, pattern) for pattern in PICKLES)]
    if pickles and not any(f.endswith(".safetensors") for f in files):
        fail(f"hub model {model!r} holds its weights as {pickles[0]}, a pickle (loading one can run code), and no "
             f"*.safetensors: remix never unpickles a model; convert it to safetensors where you trust its source "
             f"(transformers' from_pretrained, then save_pretrained, writes model.safetensors)", prog)


def hub_files(model: str) -> list[str] | None:
    """The top-level file names of a hub model, or None where they cannot be read (not cached, gated, missing)."""
    import huggingface_hub

    try:
        if offline():
            return sorted(os.listdir(huggingface_hub.snapshot_download(model, local_files_only=True)))
        return sorted(s.rfilename for s in huggingface_hub.HfApi().model_info(model).siblings or []
                      if "/" not in s.rfilename)
    except Exception:  # noqa: BLE001 any failure here only skips this early check: loading the model reports it
        return None
