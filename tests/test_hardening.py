"""Nothing run, nothing lost: what a careful user and an attacker try against remix.py and eval.py. A resume or a
regrade that executes no code from its folder, one run per folder, a full disk and damaged files, every numeric
flag checked up front, data validated where it comes in, signals that end in one line, an evaluation that keeps
its work, and the GPU review's CPU-testable items (the engine in process, a push that covers every weight).

    pytest -q tests/test_hardening.py
"""

import ast
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import eval as eval_cli  # noqa: E402
import remix  # noqa: E402
from machinery import console, engines  # noqa: E402
from tests.common import (ROOT, bad_values, load_problems, math_reward, one_error_line, read_metrics,  # noqa: E402
                          rewrite_manifest, run_remix, tiny_args, tiny_cli, two_step_ppo_run)


# ----------------------------------------------------------------------------------------------
# Every numeric flag, in its range, up front
# ----------------------------------------------------------------------------------------------
def field_docstrings(path: Path, cls: str) -> dict:
    """{field: its docstring} of a dataclass in a source file, read as tyro reads them."""
    tree = ast.parse(path.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return {a.target.id: b.value.value for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}


# the ranges the docstrings state, written out again here as the reference
REMIX_RANGES = {
    "steps": "in [1, 1000000]", "prompts_per_step": "in [1, 65536]", "group_size": "in [1, 1024]",
    "off_policy_p": "in [0, 1)", "window": "in [1, 1000]", "utd": "in [1, 1000]", "reincarnate_step": "in [0, 1000000]",
    "kl_convex_start": "in [0, 1000000]", "kl_convex_every": "in [1, 1000000]", "kl_beta": "in [0, 1e6]",
    "ent_coef": "in [0, 1e6]", "clip_eps": "in (0, 1)", "value_clip": "in (0, 1e6]", "vtrace_c_bar": "in (0, 1e6]",
    "gamma": "in (0, 1]", "gae_lambda": "in [0, 1]", "actor_lr": "in (0, 1]", "critic_lr": "in (0, 1]",
    "weight_decay": "in [0, 1e6]", "max_grad_norm": "in (0, 1e6]", "mini_batch_prompts": "in [1, 65536]",
    "temperature": "in [0.01, 100]", "top_p": "in (0, 1]", "max_prompt_tokens": "in [1, 1048576]",
    "max_response_tokens": "in [1, 1048576]", "sampler_is_cap": "in (0, 1e6]",
    "max_tokens_per_micro_batch": "in [1, 1073741824]", "vllm_gpu_memory_utilization": "in (0, 1)",
    "vllm_tp": "in [1, 1024]", "grader_workers": "in [1, 1024]", "grade_timeout": "in [0.5, 1e6]",
    "seed": "in [0, 2147483647]", "dist_timeout": "in (0, 1e6]", "save_every": "in [0, 1000000]",
    "keep_last": "in [0, 1000000]", "eval_every": "in [0, 1000000]", "eval_limit": "in [1, 1000000]",
    "eval_max_tokens": "in [1, 1048576]", "log_completions": "in [0, 1048576]", "hf_batch_prompts": "in [1, 65536]"}
EVAL_RANGES = {"n": "in [1, 1024]", "temperature": "0 or in [0.01, 100]", "top_p": "in (0, 1]",
               "max_tokens": "in [1, 1048576]",
               "vllm_tp": "in [1, 1024]", "vllm_gpu_memory_utilization": "in (0, 1)", "limit": "in [1, 1000000]",
               "workers": "in [1, 1024]", "grade_timeout": "in [0.5, 1e6]", "seed": "in [0, 2147483647]",
               "batch_size": "in [1, 65536]"}


@pytest.mark.parametrize("program, sources, reference", [
    ("remix", [("remix.py", "Args"), ("machinery/console.py", "RunArgs")], REMIX_RANGES),
    ("eval", [("eval.py", "EvalArgs")], EVAL_RANGES)])
def test_every_numeric_flag_has_the_range_its_help_states(program, sources, reference):
    """console.ranges reads each numeric field's range from its docstring, over both classes of a run's settings (the
    method's Args and the run's RunArgs): every field of the reference table has that range (a fork's new numeric
    flag has one too, or ranges() refuses it: the next test)."""
    import dataclasses
    import typing

    target = console.settings_type(remix.Args) if program == "remix" else eval_cli.EvalArgs
    hints = typing.get_type_hints(target)
    numeric = {f.name for f in dataclasses.fields(target)
               if {int, float} & set(typing.get_args(hints[f.name]) or (hints[f.name],)) - {bool}}
    found = console.ranges(target)
    assert set(found) == numeric and reference.items() <= found.items(), (set(reference) ^ set(found))
    docs = {name: doc for file, cls in sources for name, doc in field_docstrings(ROOT / file, cls).items()}
    for name, bound in found.items():
        assert bound in docs[name], f"--{name}'s help does not say {bound!r}: {docs[name]!r}"


def test_a_numeric_flag_without_a_range_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "forked_flags.py").write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Args:\n    steps: int = 3\n"
        '    """in [1, 100]: steps"""\n    clip_eps_high: float = 0.28\n    """the upper clip (DAPO)"""\n'
        '    name: str = "x"\n    """no range: not a number"""\n\n\n@dataclass\nclass Floor:\n'
        '    window: int = 4\n    """>= 1: a lower bound only"""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    import forked_flags

    for cls, flag, said in ((forked_flags.Args, "--clip-eps-high", "states no range"),
                            (forked_flags.Floor, "--window", "states no upper bound")):
        with pytest.raises(SystemExit) as exit_info:
            console.ranges(cls)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and f"{flag} of {cls.__name__}" in err[0] \
            and said in err[0], err
    assert console.within(0.0, "in [0, 1)") and not console.within(1.0, "in [0, 1)") and console.within(1.0, "in (0, 1]")
    assert not console.within(float("nan"), "in [0, 1)")


@pytest.mark.parametrize("name, bound", list(console.ranges(console.settings_type(remix.Args)).items()))
def test_each_bad_value_of_a_remix_flag_gets_one_line_and_writes_nothing(name, bound, tiny_model, train_file,
                                                                         tmp_path, capsys):
    import typing

    integer = typing.get_type_hints(console.settings_type(remix.Args))[name] in (int, int | None)
    for value in bad_values(bound, integer):
        out = tmp_path / "out"
        with pytest.raises(SystemExit) as exit_info:
            remix.train(tiny_args(tiny_model, train_file, out, **{name: value}))
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1, (name, value, err)
        assert err[0] == f"remix: error: --{name.replace('_', '-')} must be {bound}, got {value}"
        assert not out.exists()


@pytest.mark.parametrize("flag, value", [("grade_timeout", 1e300), ("dist_timeout", 1e300),
                                         ("window", 99999999999999999999), ("group_size", 100000000000000000000)])
def test_the_numbers_past_any_sane_bound_that_overflowed_get_one_line(flag, value, tiny_model, train_file, tmp_path,
                                                                      capsys):
    """Issue 37's four: each overflowed in a select, a timedelta or a deque after --out was written."""
    with pytest.raises(SystemExit) as exit_info:
        remix.train(tiny_args(tiny_model, train_file, tmp_path / "out", **{flag: value}))
    err, bound = capsys.readouterr().err.strip().splitlines(), console.ranges(console.settings_type(remix.Args))[flag]
    assert exit_info.value.code == 2 and err == [f"remix: error: --{flag.replace('_', '-')} must be {bound}, "
                                                 f"got {value}"], err
    assert not (tmp_path / "out").exists()


# every environment variable read as a number: (its name, its range, the run's flags and the other variables that
# make the code read it); torchrun's are read by dist.init before the process group starts
ENV_NUMBERS = [("VLLM_CPU_KVCACHE_SPACE", "in [1, 1048576]", {"sampler": "vllm"}, {}),
               ("LOCAL_WORLD_SIZE", "in [1, 1]", {}, {}),
               ("WORLD_SIZE", "in [1, 1048576]", {}, {"RANK": "0"}),
               ("RANK", "in [0, 1]", {}, {"WORLD_SIZE": "2"}),
               ("LOCAL_WORLD_SIZE", "in [1, 2]", {}, {"RANK": "0", "WORLD_SIZE": "2"}),
               ("LOCAL_RANK", "in [0, 1]", {}, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}),
               ("MASTER_PORT", "in [1, 65535]", {}, {"RANK": "0", "WORLD_SIZE": "1"})]


def env_bad_values(bound: str) -> list[str]:
    """What a shell may hold where a whole number in `bound` belongs: words, nothing, nan, inf, a fraction, and the
    whole numbers just outside each end."""
    low, high = (int(float(x)) for x in bound[4:-1].split(","))
    return ["abc", "", "nan", "inf", "-inf", "1.5", str(low - 1), str(high + 1)]


@pytest.mark.parametrize("name, bound, changes, context", ENV_NUMBERS)
def test_an_environment_variable_read_as_a_number_is_checked_as_a_flag_is(name, bound, changes, context, tiny_model,
                                                                          train_file, tmp_path, capsys, monkeypatch):
    """Each bad value stops remix.py in one line naming the variable and its range, exit 2, nothing written (nan
    had passed the memory check; 'abc' had ended in a traceback from int())."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in context.items():
        monkeypatch.setenv(key, value)
    for value in env_bad_values(bound):
        monkeypatch.setenv(name, value)
        out = tmp_path / "out"
        with pytest.raises(SystemExit) as exit_info:
            remix.train(tiny_args(tiny_model, train_file, out, **changes))
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and err == [
            f"remix: error: the environment variable {name} must be a whole number {bound}, got {value!r}: set it to "
            f"one, or unset it"], (value, err)
        assert not out.exists()


@pytest.mark.parametrize("name, value", [("VLLM_CPU_KVCACHE_SPACE", "nan"), ("VLLM_CPU_KVCACHE_SPACE", "0"),
                                         ("RANK", "x")])
def test_eval_checks_the_environment_numbers_it_reads_before_writing(name, value, tiny_model, tmp_path, capsys,
                                                                     monkeypatch):
    """eval.py with the CPU engine reads VLLM_CPU_KVCACHE_SPACE (vLLM does, as it starts, after --out is written),
    and torchrun's numbers at its start: one line, nothing written."""
    monkeypatch.setenv(name, value)
    if name == "RANK":
        monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setitem(console._state, "prog", "eval")  # what eval.py's one_line_interrupts("eval") sets
    out = tmp_path / "eval"
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main(eval_cli.EvalArgs(model=tiny_model, out=str(out), limit=1, sampler="vllm"))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith(
        f"eval: error: the environment variable {name} must be a whole number in ["), err
    assert not out.exists()


def test_an_environment_number_in_range_is_what_the_plan_counts(tiny_model, monkeypatch):
    """VLLM_CPU_KVCACHE_SPACE=3: the CPU engine's part is its weights and 3 GiB; unset, the 1 GiB remix sets."""
    from machinery import plan

    shape = plan.shape_of(tiny_model)
    args = remix.finalize_args(console.settings(remix.Args, model=tiny_model, sampler="vllm"))
    for value, gib in (("3", 3), (None, 1)):
        if value is None:
            monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        else:
            monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
        assert plan.memory(shape, args, 1, False, False, 0.0)["parts"]["engine"] == 4 * shape.params + gib * 2**30


@pytest.mark.parametrize("name, bound", list(console.ranges(eval_cli.EvalArgs).items()))
def test_each_bad_value_of_an_eval_flag_gets_one_line(name, bound, tiny_model, tmp_path, capsys, monkeypatch):
    import typing

    monkeypatch.setitem(console._state, "prog", "eval")  # what eval.py's one_line_interrupts("eval") sets
    integer = typing.get_type_hints(eval_cli.EvalArgs)[name] in (int, int | None)
    for value in bad_values(bound, integer):
        with pytest.raises(SystemExit) as exit_info:
            eval_cli.main(eval_cli.EvalArgs(model=tiny_model, out=str(tmp_path / "out"), **{name: value}))
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and err == [f"eval: error: --{name.replace('_', '-')} must be {bound}, "
                                                     f"got {value}"], (name, value, err)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("program, flag, value", [("remix", "temperature", 1e-300), ("remix", "temperature", 0.005),
                                                   ("remix", "grade_timeout", 1e-300), ("remix", "grade_timeout", 0.4),
                                                   ("eval", "temperature", 1e-300), ("eval", "grade_timeout", 0.4)])
def test_a_flag_that_divides_or_times_out_is_refused_under_its_floor(program, flag, value, tiny_model, train_file,
                                                                     tmp_path, capsys, monkeypatch):
    """Issue 43: --temperature 1e-300 passed its range and crashed mid-run (logits / T overflow: the sampler's
    probabilities are NaN), --grade-timeout 1e-300 turned every grade into a timeout. Each is refused in one line
    before anything is written; eval.py's temperature 0 (greedy) is still taken (the bad values of its range, above,
    include the float next to 0)."""
    out = tmp_path / "out"
    monkeypatch.setitem(console._state, "prog", program)  # what the program's one_line_interrupts sets
    with pytest.raises(SystemExit) as exit_info:
        if program == "remix":
            remix.train(tiny_args(tiny_model, train_file, out, **{flag: value}))
        else:
            eval_cli.main(eval_cli.EvalArgs(model=tiny_model, out=str(out), limit=1, sampler="hf", **{flag: value}))
    bound = {"temperature": "0 or in [0.01, 100]" if program == "eval" else "in [0.01, 100]",
             "grade_timeout": "in [0.5, 1e6]"}[flag]
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        f"{program}: error: --{flag.replace('_', '-')} must be {bound}, got {value}"]
    assert not out.exists()
    assert console.within(0.0, console.ranges(eval_cli.EvalArgs)["temperature"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_temperature_floor_keeps_the_log_probs_finite(dtype):
    """The arithmetic behind the floor: log pi and the entropy at temperature T (remix.token_logprobs, what the
    trainer computes; the samplers divide fp32 logits likewise) from logits as large as a model's get, in the
    model's dtype: finite at 0.01, not at the 1e-300 the range let through."""
    logits = torch.linspace(-1e4, 1e4, 64).to(dtype).repeat(3, 1)  # [3, V]
    tokens = torch.tensor([0, 31, 63])  # [3]
    assert torch.isfinite(remix.token_logprobs(logits, tokens, 0.01)).all()
    assert not torch.isfinite(remix.token_logprobs(logits, tokens, 1e-300)).all()


@pytest.mark.parametrize("cls, argv, line", [
    ("remix", ["remix.py", "--temprature", "0.5"],
     "--temprature is no flag of remix.py; did you mean --temperature? (remix.py --help lists them)"),
    ("remix", ["remix_mine.py", "--steps", "3", "--no-kl-convx"],
     "--no-kl-convx is no flag of remix_mine.py; did you mean --no-kl-convex? (remix_mine.py --help lists them)"),
    ("remix", ["remix.py", "--steps", "3", "--sampler", "hf", "--no-vllm-slep"],  # a run's switch, after a method's
     "--no-vllm-slep is no flag of remix.py; did you mean --no-vllm-sleep? (remix.py --help lists them)"),
    ("eval", ["eval.py", "--n", "2", "--modle=runs/x"],
     "--modle is no flag of eval.py; did you mean --model? (eval.py --help lists them)"),
    ("eval", ["eval.py", "--zzzz", "1"], "--zzzz is no flag of eval.py (eval.py --help lists them)"),
    ("eval", ["eval.py", "--n", "2", "3"],
     "unexpected argument '3': each value follows its flag (eval.py --help lists them)"),
])
def test_a_misspelled_flag_is_one_line_naming_the_closest_one(cls, argv, line, monkeypatch, capsys):
    """Issue 43: tyro's box of ten lines for a flag it does not know is one line: the flag, the closest valid one (a
    switch's --no- form too), --help; exit 2. A command line without one parses as before."""
    from machinery import runner

    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setitem(console._state, "prog", cls)  # what the program's one_line_interrupts sets
    with pytest.raises(SystemExit) as exit_info:
        runner.cli(remix.Args) if cls == "remix" else runner.parse(eval_cli.EvalArgs)
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [f"{cls}: error: {line}"]
    parsed = runner.cli(remix.Args, ["--temperature", "0.5", "--no-kl-convex", "--eval_every", "3"])
    assert (parsed.temperature, parsed.kl_convex, parsed.eval_every) == (0.5, False, 3)


def help_rows(method_args, monkeypatch, capsys) -> dict[str, list[str]]:
    """A run's --help as a user reads it (120 columns: one group under another, boxed on a terminal, plain text
    elsewhere): {group title: the flags its rows begin with}."""
    import re

    from machinery import runner

    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as exit_info:
        runner.cli(method_args, ["--help"])
    assert exit_info.value.code == 0
    rows, title = {}, None
    for line in capsys.readouterr().out.splitlines():
        if group := re.match(r"(?:╭─)? ((?:\w+ )*options)\b", line):
            title = group.group(1)
            rows[title] = []
        elif row := re.match(r"(?:│ |  )(--?[a-z][-\w]*(, --[-\w]+)?)", line):  # a row's flags, at the edge
            rows[title] += row.group(1).split(", ")
    return rows


def flags_of(cls) -> list[str]:
    """The flags a dataclass's fields make, in their order: --name, and --no-name beside a plain switch."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    return [flag for f in dataclasses.fields(cls) for flag in
            ["--" + f.name.replace("_", "-")] + (["--no-" + f.name.replace("_", "-")] if hints[f.name] is bool else [])]


def test_help_shows_every_setting_once_flat_in_the_methods_group_and_the_runs(monkeypatch, capsys):
    """Issue 45: remix.Args holds the method's settings (at most 36), machinery's RunArgs the run's, no field in
    both; --help shows each field's flag once, without a prefix, the method's in one group and the run's in the
    other (the flags the one Args of before made: the same 64 fields)."""
    import dataclasses

    method, run_settings = dataclasses.fields(remix.Args), dataclasses.fields(console.RunArgs)
    assert len(method) <= 36 and not {f.name for f in method} & {f.name for f in run_settings}
    assert help_rows(remix.Args, monkeypatch, capsys) == {
        "options": ["-h", "--help"], "method options": flags_of(remix.Args), "run options": flags_of(console.RunArgs)}
    assert {"--algo", "--group-size", "--off-policy-p", "--no-kl-convex"} <= set(flags_of(remix.Args))
    assert {"--model", "--sampler", "--out", "--resume", "--no-vllm-sleep"} <= set(flags_of(console.RunArgs))


def test_a_run_is_built_in_one_call_and_a_misspelled_keyword_is_an_error():
    """console.settings(Args, ...): the method's and the run's fields in one object, by keyword, the rest at their
    defaults; a keyword of neither class is a TypeError, and a method's Args alone is no run's settings."""
    import dataclasses
    import pickle

    args = console.settings(remix.Args, steps=2, group_size=4, sampler="hf", out="runs/x")
    assert isinstance(args, remix.Args) and isinstance(args, console.RunArgs)
    assert (args.steps, args.group_size, args.sampler, args.out) == (2, 4, "hf", "runs/x")
    assert (args.window, args.seed) == (remix.Args.window, console.RunArgs.seed)
    assert type(args) is type(console.settings(remix.Args)) and len(dataclasses.fields(args)) == \
        len(dataclasses.fields(remix.Args)) + len(dataclasses.fields(console.RunArgs))
    assert pickle.loads(pickle.dumps(args)) == args  # as the one Args of before was (a class made at run time)
    for typo in ("stpes", "sampelr"):
        with pytest.raises(TypeError, match=typo):
            console.settings(remix.Args, **{typo: 2})
    with pytest.raises(TypeError, match=r"console.settings\(Args, ...\)"):
        remix.train(remix.Args(steps=2))


def test_a_forks_new_setting_is_a_flag_of_the_method_with_its_range_checked(tmp_path, monkeypatch, capsys):
    """A fork adds a field to its Args as remix.py's are written: it is a flag of the method's group, parsed flat
    beside the run's, its range read from its docstring and checked, a misspelling of it named; a field named as a
    run's setting is refused in one line."""
    import dataclasses
    import importlib.util

    from machinery import runner

    anchor = '    value_clip: float = 0.5\n'
    added = '    clip_eps_high: float = 0.28\n    """eps_high, in (0, 1): the upper clip range (DAPO)"""\n'
    source = (ROOT / "remix.py").read_text()
    assert source.count(anchor) == 1
    (tmp_path / "remix_mine.py").write_text(source.replace(anchor, added + anchor))
    spec = importlib.util.spec_from_file_location("remix_mine_settings", tmp_path / "remix_mine.py")
    fork = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fork)
    rows = help_rows(fork.Args, monkeypatch, capsys)
    assert rows["method options"] == flags_of(remix.Args)[:flags_of(remix.Args).index("--value-clip")] + \
        ["--clip-eps-high"] + flags_of(remix.Args)[flags_of(remix.Args).index("--value-clip"):]
    assert rows["run options"] == flags_of(console.RunArgs)
    parsed = runner.cli(fork.Args, ["--clip-eps-high", "0.3", "--sampler", "hf", "--clip-eps", "0.1"])
    assert (parsed.clip_eps_high, parsed.sampler, parsed.clip_eps) == (0.3, "hf", 0.1)
    assert console.ranges(type(parsed))["clip_eps_high"] == "in (0, 1)"
    with pytest.raises(SystemExit) as exit_info:
        console.check_ranges(dataclasses.replace(parsed, clip_eps_high=1.5))
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "remix: error: --clip-eps-high must be in (0, 1), got 1.5"]
    monkeypatch.setattr(sys, "argv", ["remix_mine.py", "--clip-eps-hihg", "0.3"])
    monkeypatch.setitem(console._state, "prog", "remix_mine")
    with pytest.raises(SystemExit):
        runner.cli(fork.Args)
    assert capsys.readouterr().err.strip().splitlines() == [
        "remix_mine: error: --clip-eps-hihg is no flag of remix_mine.py; did you mean --clip-eps-high? "
        "(remix_mine.py --help lists them)"]
    (tmp_path / "clash.py").write_text("from dataclasses import dataclass\n\n\n@dataclass\nclass Args:\n"
                                       "    seed: int = 3\n    \"\"\"in [0, 9]: the method's own seed\"\"\"\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import clash

    with pytest.raises(SystemExit) as exit_info:
        console.settings_type(clash.Args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "Args.seed" in err[0] and "a setting of the run" in err[0]


@pytest.mark.slow
@pytest.mark.parametrize("program, argv, line", [
    ("toy/toy.py", ["--stpes", "3"], "toy: error: --stpes is no flag of toy.py; did you mean --steps? (toy.py --help "
                                     "lists them)"),
    pytest.param("remix.py", ["--sed", "3"], "remix: error: --sed is no flag of remix.py; did you mean --seed? "
                 "(remix.py --help lists them)", marks=pytest.mark.long),
    pytest.param("eval.py", ["--benchmark", "aime24"], "eval: error: --benchmark is no flag of eval.py; did you mean "
                 "--benchmarks? (eval.py --help lists them)", marks=pytest.mark.long)])
def test_each_program_parses_its_command_line_with_the_one_parser(program, argv, line):
    done = run_remix(*argv, program=program)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [line] and not done.stdout, done.stderr


def test_track_without_wandb_installed_gets_one_line_and_writes_nothing(tiny_model, train_file, tmp_path, capsys,
                                                                        monkeypatch):
    real = console.importlib.util.find_spec
    monkeypatch.setattr(console.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit) as exit_info:
        remix.train(tiny_args(tiny_model, train_file, tmp_path / "out", track=True))
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "remix: error: --track logs to wandb, which is not installed (it is no dependency): pip install wandb"]
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------
# Data validated where it comes in
# ----------------------------------------------------------------------------------------------
def test_answers_of_any_stored_type_grade_alike_and_unusable_rows_are_skipped_with_a_count(tmp_path, capsys):
    rows = [{"problem": "a", "answer": "5"}, {"problem": "b", "answer": 5}, {"problem": "c", "answer": 5.0},
            {"problem": "d", "answer": None}, {"problem": "e", "answer": ["1", "2"]}, {"problem": "", "answer": "1"},
            {"problem": None, "answer": "1"}, {"problem": "h", "answer": True}, {"problem": "i", "answer": " "}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_problems(str(path), "problem", "answer") == [("a", "5"), ("b", "5"), ("c", "5")]
    out = capsys.readouterr().out
    assert "skipped 6 of 9 rows" in out and "row 4" in out
    assert math_reward(remix.METHOD, "so \\boxed{5}", 5) == math_reward(remix.METHOD, "so \\boxed{5}", "5") == 1.0
    assert math_reward(remix.METHOD, "\\boxed{None}", "5") == 0.0
    for bad in (None, "", ["5"], True, float("nan")):
        with pytest.raises(ValueError, match="must be a non-empty string or a number"):
            math_reward(remix.METHOD, "\\boxed{5}", bad)


def test_a_regrade_never_iterates_a_string_answer(tmp_path):
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in [
        {"benchmark": "aime24", "id": 1, "answers": "204", "response": "\\boxed{2}"},
        {"benchmark": "aime24", "id": 2, "answers": 204, "response": "\\boxed{204}"},
        {"benchmark": "aime24", "id": 3, "answers": ["204"], "response": "\\boxed{204}"}]))
    summary = eval_cli.main(eval_cli.EvalArgs(regrade=str(samples), out=str(tmp_path / "re")))
    graded = [json.loads(line) for line in (tmp_path / "re" / "samples.jsonl").open()]
    assert [s["correct"] for s in graded] == [False, True, True]
    assert summary["greedy"]["aime24"]["pass@1"] == pytest.approx(200 / 3)
    samples.write_text(json.dumps({"benchmark": "aime24", "id": 1, "answers": [None], "response": "x"}) + "\n")
    with pytest.raises(SystemExit):
        eval_cli.main(eval_cli.EvalArgs(regrade=str(samples), out=str(tmp_path / "re2")))


@pytest.mark.parametrize("case, content, message", [
    ("first-line", '["problem"]\n', "row 1 is a JSON str, not an object"),
    ("list-of-numbers", "[1, 2]", "row 1 is a JSON int, not an object"),
    ("utf8", b"\xff\xfe{}\n", "is not UTF-8 text"),
    ("parquet", b"PAR1 not really", "cannot read dataset"),
    ("one-dict", '{\n  "problem": "1+1?",\n  "answer": "2"\n}\n', "holds one JSON object, not rows"),
    ("folder", None, "is a folder, not a file"),
    ("fifo", None, "is not a regular file"),
])
def test_every_broken_dataset_gets_one_line_that_names_it(case, content, message, tmp_path, capsys):
    path = tmp_path / ("d.parquet" if case == "parquet" else "d.json" if case in ("list-of-numbers", "one-dict")
                       else "d.jsonl")
    if case == "folder":
        path.mkdir()
    elif case == "fifo":
        os.mkfifo(path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        load_problems(str(path), "problem", "answer")
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0] and str(path) in err[0], err


def test_late_bad_input_is_found_before_anything_is_written(tiny_model, train_file, tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit):
        remix.train(tiny_args(tiny_model, train_file, out, max_prompt_tokens=5))  # no prompt is that short
    err = capsys.readouterr().err
    assert "every prompt is longer than --max-prompt-tokens 5" in err and not out.exists()
    with pytest.raises(SystemExit):
        remix.train(tiny_args(tiny_model, train_file, out, eval_every=1, eval_data_dir=str(tmp_path / "none")))
    assert "benchmark folder" in capsys.readouterr().err and not out.exists()


# ----------------------------------------------------------------------------------------------
# The run folder: where it may be, one run at a time
# ----------------------------------------------------------------------------------------------
def test_an_out_inside_a_run_or_under_a_file_is_refused_before_the_model_loads(tiny_model, train_file, tmp_path,
                                                                              capsys):
    remix.train(tiny_args(tiny_model, train_file, tmp_path / "run", steps=1))
    for nested in (tmp_path / "run" / "sub", tmp_path / "run" / "checkpoint-1" / "sub"):
        with pytest.raises(SystemExit):
            remix.train(tiny_args(tiny_model, train_file, nested, steps=1))
        assert f"is inside the run folder {tmp_path / 'run'}" in capsys.readouterr().err and not nested.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        remix.train(tiny_args(tiny_model, train_file, tmp_path / "file" / "run", steps=1))
    assert "which is a file, not a folder" in capsys.readouterr().err


def planted_run(out: Path, model: str) -> Path:
    """A folder holding what --overwrite finds of a run: a checkpoint (a model folder), evaluations, a log."""
    shutil.copytree(model, out / "checkpoint-1")
    (out / "eval").mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    return out


def every_entry(folder: Path) -> dict:
    """Each path under folder: a link's target, a file's bytes, a folder's None."""
    return {str(p.relative_to(folder)): ("link", os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file()
            else None for p in folder.rglob("*")}


def linked_model(model: str, out: Path, tmp: Path) -> dict:
    """A model folder outside --out whose weights file is a link into --out's checkpoint."""
    shutil.copytree(model, tmp / "model", ignore=shutil.ignore_patterns("model.safetensors"))
    (tmp / "model" / "model.safetensors").symlink_to(out / "checkpoint-1" / "model.safetensors")
    return {"model": str(tmp / "model")}


def inside(out: Path, relative: str, source: str) -> str:
    (out / relative).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, out / relative)
    return str(out / relative)


# flag pointed into --out -> (what the run is given, the entry of --out it is read through)
READ_INSIDE_OUT = {
    "model-a-checkpoint-of-the-run": (lambda out, tmp: {"model": str(out / "checkpoint-1")}, "checkpoint-1"),
    "model-a-link-to-that-checkpoint": (lambda out, tmp: (tmp / "linked").symlink_to(out / "checkpoint-1") or
                                        {"model": str(tmp / "linked")}, "checkpoint-1"),
    "model-whose-weights-link-into-out": (lambda out, tmp: linked_model(str(out / "checkpoint-1"), out, tmp),
                                          "checkpoint-1"),
    "dataset-in-the-evaluations": (lambda out, tmp: {"dataset": inside(out, "eval/train.jsonl", TRAIN_SAMPLE)},
                                   "eval"),
    "eval-data-dir-in-a-checkpoint": (lambda out, tmp: {
        "eval_data_dir": os.path.dirname(inside(out, "checkpoint-1/bench/aime24.jsonl", BENCH_FILE)), "eval_every": 1,
        "eval_benchmarks": ("aime24",), "eval_limit": 1}, "checkpoint-1"),
}
TRAIN_SAMPLE, BENCH_FILE = str(ROOT / "data" / "train" / "deepscaler_partial.jsonl"), str(
    ROOT / "data" / "benchmarks" / "aime24.jsonl")


@pytest.mark.parametrize("case", list(READ_INSIDE_OUT))
def test_overwrite_never_deletes_what_the_run_reads_inside_out(case, tiny_model, train_file, tmp_path, capsys):
    """--model runs/x/checkpoint-N --out runs/x --overwrite deleted the model before loading it (so did a dataset or
    a benchmark folder inside --out): refused in one line naming the path and another --out, nothing touched."""
    given, entry = READ_INSIDE_OUT[case]
    out = planted_run(tmp_path / "run", tiny_model)
    given = given(out, tmp_path)
    before = every_entry(out)
    with pytest.raises(SystemExit) as exit_info:
        remix.train(tiny_args(given.pop("model", tiny_model), given.pop("dataset", train_file), out, steps=1,
                              overwrite=True, **given))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert f"is read from {out.resolve() / entry}, inside --out {out}" in err[0] and "choose another --out" in err[0]
    assert every_entry(out) == before


def test_a_regrade_never_replaces_the_samples_it_reads(tmp_path, capsys):
    """eval.py --regrade OUT/samples.jsonl --out OUT (a regrade's folder, so no --overwrite asked) replaced the
    samples it read with its own: refused in one line, the file as it was."""
    out = tmp_path / "regraded"
    out.mkdir()
    samples = out / "samples.jsonl"
    samples.write_text(json.dumps({"benchmark": "aime24", "id": 0, "response": "\\boxed{7}", "answers": ["7"],
                                   "correct": False}) + "\n")
    (out / "settings.json").write_text(json.dumps({"regrade": str(samples), "grader": "math-verify"}))
    before = every_entry(out)
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main(eval_cli.EvalArgs(regrade=str(samples), out=str(out)))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and f"--regrade {samples} is {samples.resolve()}, which this " \
        f"job writes in --out {out}" in err[0] and "give --out another folder" in err[0], err
    assert every_entry(out) == before


@pytest.mark.long
@pytest.mark.slow
def test_two_runs_on_one_folder_cannot_both_start(tiny_model, train_file, tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, str(ROOT / "remix.py"), *tiny_cli(tiny_model, train_file, out,
                                                                                "--steps", "200")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists():
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.1)
        line = one_error_line(run_remix(*tiny_cli(tiny_model, train_file, out, "--overwrite")), "is in use by a "
                                                                                                 "running job")
        assert str(first.pid) in line
        one_error_line(run_remix("--resume", str(out)), "is in use by a running job")
    finally:
        first.kill()
        first.wait()
    assert (out / "metrics.jsonl").exists()  # the refused runs removed nothing
    done = run_remix("--resume", str(out), "--steps", "2")  # the lock died with its process
    assert done.returncode == 0 or "holds no complete checkpoint" in done.stderr, done.stderr[-2000:]


# ----------------------------------------------------------------------------------------------
# A resume that runs no code, a full disk, damaged files
# ----------------------------------------------------------------------------------------------
class Payload:
    """Unpickled by an unrestricted loader, it would run a shell command (touch MARKER)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def finished_run(tiny_model, train_file, tmp_path_factory):
    """A two-step PPO run with a checkpoint after each step (PPO: a critic folder too)."""
    return two_step_ppo_run(tiny_model, train_file, tmp_path_factory.mktemp("finished"), keep_last=0,
                            older_full=True)


def plant(folder: Path, name: str, marker: Path):
    checkpoint = folder / "checkpoint-2"
    if name in ("trainer_state.pt", "optim/rank-0.pt"):
        state = torch.load(checkpoint / name, weights_only=True)
        torch.save({"payload": Payload(marker), "state": state}, checkpoint / name)
    elif name in ("model.safetensors", "critic/model.safetensors"):
        target = checkpoint / name
        torch.save({"payload": Payload(marker)}, target.parent / "pytorch_model.bin")
        target.unlink()
    elif name == "tokenizer_config.json":
        config = json.loads((checkpoint / name).read_text())
        config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
        (checkpoint / name).write_text(json.dumps(config))
        (checkpoint / "evil.py").write_text(f"import os\nos.system('touch {marker}')\n")
    elif name == "config.json":
        config = json.loads((checkpoint / name).read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel"}
        (checkpoint / name).write_text(json.dumps(config))
        (checkpoint / "evil.py").write_text(f"import os\nos.system('touch {marker}')\n")


@pytest.mark.long
@pytest.mark.slow
def test_a_saved_flag_under_its_floor_is_refused_before_a_resume_runs_a_step(finished_run, tmp_path):
    """The run's own arguments, read back on --resume (a run saved by an older version, whose range let --temperature
    1e-300 through), are checked as a command line's are: one line, before step 3."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    state = torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=True)
    state["args"]["method"]["temperature"] = 1e-300
    torch.save(state, out / "checkpoint-2" / "trainer_state.pt")
    rewrite_manifest(out / "checkpoint-2")  # as that version saved it
    done = run_remix("--resume", str(out), "--steps", "3")
    one_error_line(done, "--temperature must be in [0.01, 100], got 1e-300")
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and not (out / "checkpoint-3").exists()


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("name", ["trainer_state.pt", "optim/rank-0.pt", "model.safetensors", "critic/model.safetensors",
                                  "tokenizer_config.json", "config.json"])
def test_a_payload_planted_in_any_file_a_resume_reads_never_runs(name, finished_run, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "MARKER"
    shutil.copytree(finished_run, out)
    plant(out, name, marker)
    rewrite_manifest(out / "checkpoint-2")  # past the digests: what stands between the payload and a resume
    done = run_remix("--resume", str(out), "--steps", "3")
    assert not marker.exists(), f"the payload in {name} ran"
    if name.endswith(".pt"):  # refused outright, naming the file: the folder may be tampered with
        one_error_line(done, f"checkpoint-2/{name} holds objects the safe loader refuses")
    elif name.endswith(".safetensors"):  # weights are read from safetensors alone: the pickle is never opened
        one_error_line(done, f"cannot load model '{out / 'checkpoint-2' / Path(name).parent}'")
        assert "no *.safetensors file in" in done.stderr
    else:  # remote code is never trusted: the run either ignores the map or stops with one line
        assert done.returncode in (0, 2) and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated-weights", "truncated-state", "missing-optim", "partial-metrics"])
def test_damaged_files_are_named_and_the_previous_checkpoint_resumes(damage, finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    newest = out / "checkpoint-2"
    if damage == "truncated-weights":
        weights = newest / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "truncated-state":
        state = newest / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[:200])
    elif damage == "missing-optim":
        shutil.rmtree(newest / "optim")
    else:
        with open(out / "metrics.jsonl", "a") as f:
            f.write('{"step": 3, "reward/me')  # what a crash mid-write leaves
    done = run_remix("--resume", str(out), "--steps", "3")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    if damage == "partial-metrics":
        assert "dropped an unreadable line" in done.stdout
        assert "resuming" in done.stdout and "after step 2" in done.stdout
    else:
        assert "checkpoint-2" in done.stdout and f"resuming from {out / 'checkpoint-1'} instead" in done.stdout
        assert "after step 1" in done.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


@pytest.mark.long
@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_ends_in_one_line_and_keeps_the_earlier_ones(finished_run, tmp_path):
    """A real write failure: the resumed process may write no file larger than 300 kB (RLIMIT_FSIZE, SIGXFSZ
    ignored), so the model file of checkpoint-3 fails as on a full disk, in whatever writer hits it first."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    done = subprocess.run([sys.executable, str(ROOT / "remix.py"), "--resume", str(out), "--steps", "3"],
                          capture_output=True, text=True, timeout=300, preexec_fn=small_files,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    errors = [line for line in done.stderr.replace("\r", "\n").splitlines() if "error" in line.lower()]
    assert done.returncode == 2 and len(errors) == 1 and "cannot write checkpoint" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and str(out / "checkpoint-3") in errors[0]
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-1", "checkpoint-2"]
    from transformers import AutoModelForCausalLM

    assert all(torch.isfinite(p).all() for p in AutoModelForCausalLM.from_pretrained(out / "checkpoint-2").parameters())


# ----------------------------------------------------------------------------------------------
# Signals: one line from the first instant, and the signal's exit code
# ----------------------------------------------------------------------------------------------
@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("program", ["remix.py", "eval.py"])
def test_ctrl_c_while_torch_imports_ends_in_one_line(program, tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / program), "--model", "x/y"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    time.sleep(0.5)  # the first line of the program has run; torch is still importing
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130 and len(lines) == 1 and "interrupted while starting" in lines[0], err[-2000:]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("signum, code, name", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                                 (signal.SIGHUP, 129, "hung up (SIGHUP)")])
def test_sigterm_and_sighup_end_a_run_with_one_line(signum, code, name, tiny_model, train_file, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "remix.py"), *tiny_cli(tiny_model, train_file, out, "--steps",
                                                                               "100", "--save-every", "1")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    deadline = time.time() + 120
    while not (out / "checkpoint-1" / "trainer_state.pt").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("remix: ") and "%" not in line]
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith(f"remix: {name} at step "), err[-2000:]
    assert f"continue with --resume {out}" in lines[0] and "Traceback" not in err


# ----------------------------------------------------------------------------------------------
# Output nobody reads: a closed stdout or stderr, a reader gone
# ----------------------------------------------------------------------------------------------
def test_output_whose_reader_is_gone_is_dropped_and_the_program_goes_on():
    """console.Dropping over a pipe whose reader has gone: the write that fails (EPIPE) and every later one, a
    message (console.say), a progress meter's lines, are dropped without an exception; the descriptor then points at
    /dev/null, which the workers a program starts later inherit."""
    from machinery import console

    read, write = os.pipe()
    stream = console.Dropping(os.fdopen(write, "w"))
    stream.write("first\n")
    stream.flush()
    assert os.read(read, 100) == b"first\n"
    os.close(read)
    stream.write("x" * 200_000)  # past the buffer: written at once, and refused
    stream.flush()
    bar = console.progress("greedy aime24", 10, stream=stream)
    bar.update(5)
    bar.close()
    console.say("still here", stream)
    assert os.path.samefile(f"/proc/self/fd/{stream.fileno()}", os.devnull)
    stream.close()


UNREAD = {">&-": dict(preexec_fn=lambda: os.close(1)),
          ">&- 2>&-": dict(preexec_fn=lambda: (os.close(1), os.close(2))),
          "| head -1": dict(stdout=subprocess.PIPE),
          "2>&1 | head -1": dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT)}


def run_unread(form: str, program: str, argv: list, err_file: Path) -> int:
    """The program started as a shell would start `program ARGV FORM`: its stdout (and stderr) closed, or read for
    one line and then closed, as head -1 does; stderr into err_file where the form leaves it. Returns the exit code."""
    with err_file.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(ROOT / program), *argv], stdin=subprocess.DEVNULL,
                                **{"stderr": err, **UNREAD[form]}, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        if proc.stdout is not None:
            proc.stdout.readline()
            proc.stdout.close()
        return proc.wait(timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["| head -1", pytest.param(">&-", marks=pytest.mark.long),
                                  pytest.param("2>&1 | head -1", marks=pytest.mark.long),
                                  pytest.param(">&- 2>&-", marks=pytest.mark.long)])
def test_a_run_whose_output_is_closed_or_unread_finishes_as_it_would_have(form, tiny_model, train_file, tmp_path):
    """Issue 43: `remix.py ... >&-` ended in a traceback before step 1, `remix.py ... | head -1` at the first step's
    line, the step lost. The run goes on and ends as it would have: exit 0, both steps logged, the last checkpoint
    whole (its trainer state at step 2), no traceback."""
    from machinery import checkpoints

    out = tmp_path / "run"
    code = run_unread(form, "remix.py", tiny_cli(tiny_model, train_file, out, "--steps", "2", "--save-every", "1",
                                                 "--log-completions", "2"), tmp_path / "stderr")
    err = (tmp_path / "stderr").read_text()
    assert code == 0 and "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert [json.loads(line)["step"] for line in (out / "completions.jsonl").open()] == [1, 1, 2, 2]
    assert checkpoints.complete(str(out)) == [str(out / "checkpoint-2")]
    assert checkpoints.read_pt(str(out / "checkpoint-2" / "trainer_state.pt"))["progress"]["step"] == 2


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("form", ["| head -1", ">&-", "2>&1 | head -1"])
def test_an_evaluation_whose_output_is_closed_or_unread_writes_all_it_would_have(form, tiny_model, tmp_path):
    argv = ["--model", tiny_model, "--benchmarks", "aime24", "amc23", "--limit", "2", "--max-tokens", "6",
            "--sampler", "hf"]
    code = run_unread(form, "eval.py", [*argv, "--out", str(tmp_path / "eval")], tmp_path / "stderr")
    err = (tmp_path / "stderr").read_text()
    assert code == 0 and "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    straight = run_remix(*argv, "--out", str(tmp_path / "straight"), program="eval.py")
    assert straight.returncode == 0
    for name in ("summary.json", "results.md"):
        assert (tmp_path / "eval" / name).read_text() == (tmp_path / "straight" / name).read_text()


@pytest.mark.long
@pytest.mark.slow
def test_a_vllm_run_whose_reader_is_gone_finishes_as_an_unread_one_does(tiny_model, train_file, tmp_path):
    """The same run on vLLM, its output read by head -1 and by nothing after: the same metrics as with its output
    read to the end (timings aside)."""
    runs = {}
    for form in ("2>&1 | head -1", "read"):
        out = tmp_path / form.replace(" ", "")
        argv = tiny_cli(tiny_model, train_file, out, "--steps", "2", "--sampler", "vllm")
        if form == "read":
            assert run_remix(*argv, env={"VLLM_CPU_KVCACHE_SPACE": "1"}).returncode == 0
        else:
            assert run_unread(form, "remix.py", argv, tmp_path / "stderr") == 0
        runs[form] = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_metrics(out)]
    assert runs["2>&1 | head -1"] == runs["read"] and len(runs["read"]) == 2


# ----------------------------------------------------------------------------------------------
# eval.py keeps its work
# ----------------------------------------------------------------------------------------------
EVAL_FLAGS = ["--benchmarks", "aime24", "amc83", "math500", "--limit", "2", "--max-tokens", "6", "--sampler", "hf"]


@pytest.mark.long
@pytest.mark.slow
def test_an_interrupted_eval_keeps_what_it_finished_and_continues(tiny_model, tmp_path):
    straight = run_remix("--model", tiny_model, "--out", str(tmp_path / "straight"), *EVAL_FLAGS, program="eval.py")
    assert straight.returncode == 0, straight.stderr[-2000:]
    out = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, str(ROOT / "eval.py"), "--model", tiny_model, "--out", str(out),
                             *EVAL_FLAGS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    deadline = time.time() + 120
    while not (out / "samples.jsonl").exists() or not (out / "samples.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("eval: greedy")]
    assert proc.returncode == 130 and len(lines) == 1 and "rerun the same command to continue" in lines[0], err
    kept = [json.loads(line) for line in (out / "samples.jsonl").open()]
    assert kept and len(kept) < 6
    done = run_remix("--model", tiny_model, "--out", str(out), *EVAL_FLAGS, program="eval.py")
    assert done.returncode == 0 and "continuing" in done.stdout, done.stderr[-2000:]
    key = lambda s: (s["benchmark"], str(s["id"]))  # noqa: E731
    finished = sorted((json.loads(line) for line in (out / "samples.jsonl").open()), key=key)
    assert finished == sorted((json.loads(line) for line in (tmp_path / "straight" / "samples.jsonl").open()), key=key)
    changed = run_remix("--model", tiny_model, "--out", str(out), *EVAL_FLAGS, "--max-tokens", "7", program="eval.py")
    one_error_line(changed, "holds an evaluation with other settings (--max-tokens)", "eval")


def test_eval_refuses_a_model_folder_without_weights_and_a_broken_benchmark(tmp_path, capsys, tiny_model):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        eval_cli.main(eval_cli.EvalArgs(model=str(tmp_path / "empty"), out=str(tmp_path / "a")))
    assert "holds no model weights" in capsys.readouterr().err
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "aime24.jsonl").write_text('{"problem": "1+1?", "answer": "2"}\n{oops\n')
    with pytest.raises(SystemExit):
        eval_cli.main(eval_cli.EvalArgs(model=tiny_model, benchmarks=("aime24",), data_dir=str(bench),
                                        out=str(tmp_path / "b")))
    err = capsys.readouterr().err
    assert "line 2 is not valid JSON" in err and str(bench / "aime24.jsonl") in err


# ----------------------------------------------------------------------------------------------
# The GPU review, where a CPU shows it: the engine in this process, every weight pushed, the trainer's threads
# ----------------------------------------------------------------------------------------------
@pytest.mark.long
@pytest.mark.slow
def test_the_engine_runs_in_process_and_a_push_that_misses_a_weight_stops_the_run(tiny_model, monkeypatch, capsys):
    from machinery import dist

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the user's environment asks for another process
    dist.init()
    args = remix.finalize_args(console.settings(remix.Args, model=tiny_model, max_prompt_tokens=64,
                                              max_response_tokens=16))
    llm = engines.start(args)
    assert type(llm.llm_engine.engine_core).__name__ == "InprocClient"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING is ignored" in capsys.readouterr().out
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model)
    engines.push_weights(llm, policy)  # every weight: no complaint
    capsys.readouterr()
    real = dist.full_tensors
    monkeypatch.setattr(dist, "full_tensors", lambda model: ((n, t) for n, t in real(model) if "layers.1.mlp" not in n))
    with pytest.raises(SystemExit):
        engines.push_weights(llm, policy)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "left some of the engine's weights unset" in err[0] and "layers.1.mlp" in err[0]


def test_the_trainers_thread_count_survives_what_an_engine_start_does():
    before = torch.get_num_threads()
    with engines.kept_threads():
        torch.set_num_threads(1)  # what vLLM's start does on a GPU machine
    assert torch.get_num_threads() == before
