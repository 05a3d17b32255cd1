"""What the test files share: the repository's folders, the tiny offline model and a file of short problems
(fixtures), the tiny run's settings, and reading a run's metrics."""

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from tests.tiny_model import build_tiny_model, write_short_problems

ROOT = Path(__file__).resolve().parent.parent  # the repository
DATA = Path(os.environ.get("REMIX_DATA", ROOT / "data"))
TRAIN = DATA / "train" / "deepscaler_partial.jsonl"
BENCH = DATA / "benchmarks"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2"))


@pytest.fixture(scope="session")
def tiny_bf16_model(tiny_model, tmp_path_factory):
    """The tiny model's folder with its weights in bf16 (config.json says so), as most hub models ship."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-bf16") / "qwen2"
    AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).save_pretrained(str(folder))
    for name in os.listdir(tiny_model):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(tiny_model, name), folder / name)
    return str(folder)


@pytest.fixture(scope="session")
def train_file(tmp_path_factory):
    """Short problems from the shipped DeepScaleR sample keep the byte-level prompts small."""
    assert TRAIN.exists(), f"training data not found at {TRAIN}; REMIX_DATA points elsewhere"
    return write_short_problems(TRAIN, tmp_path_factory.mktemp("data") / "train.jsonl", max_chars=120, limit=64)


def tiny_args(model, data, out, **overrides):
    import remix
    from machinery import console

    base = dict(model=model, dataset=data, out=str(out), steps=3, prompts_per_step=10, max_response_tokens=24,
                mini_batch_prompts=4, sampler="hf", save_every=0, seed=3, eval_every=0, log_completions=0)
    base.update(overrides)
    return console.settings(remix.Args, **base)


def refused_in_one_line(program: str, model, data, out, capsys) -> str:
    """remix.py (a tiny run) or eval.py on a model folder it must refuse: exit 2, one line on stderr, and nothing at
    out (no folder, no lock); returns the line."""
    import pytest

    import eval as eval_cli
    import remix
    from machinery import console

    with pytest.raises(SystemExit) as exit_info, pytest.MonkeyPatch.context() as patch:
        patch.setitem(console._state, "prog", program)  # what the program's first call, one_line_interrupts, sets
        if program == "remix":
            remix.train(tiny_args(str(model), data, out))
        else:
            eval_cli.main(eval_cli.EvalArgs(model=str(model), out=str(out), limit=1, sampler="hf"))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith(f"{program}: error: "), err
    assert not os.path.exists(out)
    return err[0]


def read_metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]


def full_state(model) -> dict:
    """A model's state dict with whole tensors (every run's models are FSDP2-sharded, one process too)."""
    from machinery import dist

    return dict(dist.full_tensors(model))


def plain_copy(model):
    """An unsharded copy of a model with its current weights, for reference computations (FSDP2 modules cannot
    be deep-copied). None stays None."""
    if model is None:
        return None
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    copy = cls(model.config).eval()
    copy.load_state_dict(full_state(model))
    return copy


def wait_into_step_3(proc, out, seconds: float):
    """Wait (up to 300 s) until a running job has finished writing checkpoint-2, then seconds more, into step 3."""
    deadline = time.time() + 300
    while not (out / "checkpoint-2" / "trainer_state.pt").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    time.sleep(seconds)


def run_remix(*argv, cwd=None, env=None, timeout=300, program="remix.py"):
    """remix.py (or eval.py) as a user runs it, offline; env entries set to None are removed."""
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([sys.executable, str(ROOT / program), *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def one_error_line(done, text: str, prog: str = "remix", code: int = 2):
    """The program stopped with exit code `code` and exactly one stderr line, `prog: error: ...text...`."""
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert done.returncode == code and len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") \
        and text in lines[0], f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    return lines[0]


def tiny_cli(model, data, out, *extra) -> list[str]:
    """A short GRPO run of the tiny model on the transformers sampler, as command-line flags."""
    return ["--model", model, "--dataset", data, "--out", str(out), "--sampler", "hf", "--algo", "grpo",
            "--prompts-per-step", "4", "--group-size", "2", "--max-response-tokens", "8", "--eval-every", "0",
            "--seed", "5", *extra]


def two_step_ppo_run(model, data, root, keep_last: int, older_full: bool = False):
    """A two-step PPO run (a critic, two optimizers) from the command line, with a checkpoint after each step: the
    newest full, checkpoint-1 its policy's model folder. older_full: checkpoint-1 full too, as a kill during its
    reduction leaves it (the run is stopped after step 1, its checkpoint copied aside, resumed and the copy put back),
    for the tests of a resume that falls back to it."""
    import shutil

    out = root / "run"
    done = run_remix(*tiny_cli(model, data, out, "--algo", "ppo", "--group-size", "1", "--steps",
                               "1" if older_full else "2", "--save-every", "1", "--keep-last", str(keep_last)))
    assert done.returncode == 0, done.stderr[-2000:]
    if older_full:
        shutil.copytree(out / "checkpoint-1", root / "step-1-aside")
        done = run_remix("--resume", str(out), "--steps", "2")
        assert done.returncode == 0, done.stderr[-2000:]
        shutil.rmtree(out / "checkpoint-1")
        os.replace(root / "step-1-aside", out / "checkpoint-1")
    return out


def bad_values(bound: str, integer: bool) -> list:
    """Values just outside a range written as '>= 1', '> 0', 'in [0, 1)', '0 or in [0.01, 100]', ...; NaN and inf
    for floats; for a value beside a range, the middle of the gap between them and the float next to the value."""
    import math

    if " or " in bound:
        point, bound = bound.split(" or ", 1)
        low = float(bound[4:-1].split(",")[0])
        gap = [] if integer else [(float(point) + low) / 2, math.nextafter(float(point), low)]
        return bad_values(bound, integer) + gap
    values = [] if integer else [float("nan"), float("inf")]
    if bound.startswith(">"):
        lo = float(bound.lstrip(">= "))
        values.append(int(lo) - 1 if integer else (lo - 0.5 if bound.startswith(">=") else lo))
    else:
        lo, hi = (float(x) for x in bound[4:-1].split(","))
        values += [int(lo) - 1, int(hi) + 1] if integer else [
            lo - 0.1 if bound[3] == "[" else lo, hi + 0.1 if bound[-1] == "]" else hi]
    return values


def every_file(folder: Path) -> dict:
    """What a manifest should list, computed here: every file under folder but the manifest, its size and SHA-256."""
    return {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def rewrite_manifest(folder: Path):
    """A checkpoint's manifest.json made to list what its folder holds now, as an edit that knows the format would:
    what is read next is the file itself, not its digest."""
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "files": every_file(folder)}))


def load_problems(path: str, problem_key: str, answer_key: str) -> list[tuple[str, str]]:
    """A dataset file's (problem, answer) pairs, as a run reads them."""
    from machinery import data

    return data.problems_of(data.read_dataset(path)[0], path, problem_key, answer_key)


def math_reward(method, response: str, answer) -> float:
    """The method's answer check of one response, as eval.py and the evaluation during training run it (in a grader
    worker, report.grade_many), with a 4 s deadline: math_reward(remix.METHOD, "\\boxed{2}", 2) -> 1.0."""
    from machinery import data, report

    return report.grade_many(method, [(response, [data.answer_text(answer)])], timeout=4.0)[0][0]


def unlock():
    """Lets go of every run folder this process locked, so that a test can run a second job on the same folder in the
    same process (a real run holds its locks until its process ends)."""
    from machinery import runfolder

    while runfolder._locks:
        handle, folder = runfolder._locks.pop()
        handle.close()
        if folder is not None:
            os.close(folder)
