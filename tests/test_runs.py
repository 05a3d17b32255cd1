"""Tests of remix.py as a program: end to end with real vLLM (CPU build), the command line, crashes and bad input,
the grader from any caller, a new user's first hour, several processes under torchrun, the GPU's numerics
(--precision bf16) on the CPU, the benchmarks' own scripts, and the forks of docs/forks. The method's formulas
and the spied loop are in test_remix.py, whose helpers these tests share.

    pytest -q tests/test_runs.py
"""

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # also run as a script, under torchrun

import remix  # noqa: E402
from machinery import checkpoints, console, data, dist, engines, grader, models, report, runner  # noqa: E402
from test_remix import prepared_update_case, run_update  # noqa: E402
from tests.common import (DATA, ROOT, full_state, load_problems, math_reward, read_metrics, tiny_args,  # noqa: E402
                          wait_into_step_3)

HERE = ROOT


# ----------------------------------------------------------------------------------------------
# End to end: real vLLM (CPU build), the command line
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_vllm_ppo_and_grpo_end_to_end(tiny_model, train_file, tmp_path):
    """Real vLLM: every step logged, the pushed weights are the trainer's, checkpoints reload."""
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    out = tmp_path / "ppo"
    state = remix.train(tiny_args(tiny_model, train_file, out, algo="ppo", sampler="vllm", actor_lr=1e-3))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["perf/weight_sync_s"] > 0 for r in rows)
    llm, policy, tokenizer = state["llm"], state["policy"], state["tokenizer"]
    prompt = remix.build_prompt(tokenizer, "What is 1+1?")

    def engine_vs(model, engine):
        gen = engine.generate([TokensPrompt(prompt_token_ids=prompt)],
                              SamplingParams(n=4, temperature=1.0, max_tokens=24, logprobs=0, seed=0), use_tqdm=False)
        diffs = []
        for c in gen[0].outputs:
            sample = {"prompt_ids": prompt, "response_ids": list(c.token_ids)}
            mine, _ = remix.policy_forward(model, models.collate([sample], "cpu"), 1.0)
            theirs = torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])
            diffs.append((mine[0].detach() - theirs).abs().max().item())
        return max(diffs)

    with torch.no_grad():
        assert engine_vs(policy, llm) < 1e-4  # after the last push the engine is the trainer
        base = AutoModelForCausalLM.from_pretrained(tiny_model)
        assert engine_vs(base, llm) > 1e-3  # and it is not the base model any more
    # the checkpoint reloads in transformers (same logits) and in vLLM (same log-probs)
    ckpt = out / "checkpoint-3"
    reloaded = AutoModelForCausalLM.from_pretrained(str(ckpt))
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), full_state(policy).values()))
    assert (ckpt / "critic" / "config.json").exists()
    del state, llm
    engine = LLM(model=str(ckpt), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0)
    with torch.no_grad():
        assert engine_vs(reloaded, engine) < 1e-4
    del engine

    out = tmp_path / "grpo"
    remix.train(tiny_args(tiny_model, train_file, out, algo="grpo", sampler="vllm", prompts_per_step=4, group_size=4))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [(r["batch/fresh"], r["batch/historical"]) for r in rows] == [(8, 0), (8, 8), (8, 8)]


@pytest.mark.long
@pytest.mark.slow
def test_cli_runs_and_rejects_bad_flags(tiny_model, train_file, tmp_path):
    cmd = [sys.executable, str(HERE / "remix.py"), "--model", tiny_model, "--dataset", train_file,
           "--out", str(tmp_path / "cli"), "--steps", "1", "--prompts-per-step", "4", "--max-response-tokens", "8",
           "--eval-every", "0", "--sampler", "hf"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(read_metrics(tmp_path / "cli")) == 1
    bad = subprocess.run(cmd[:-2] + ["--off-policy-p", "1.5"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--off-policy-p must be in [0, 1)" in bad.stderr
    assert "Traceback" not in bad.stderr


# ----------------------------------------------------------------------------------------------
# Crashes and bad input
# ----------------------------------------------------------------------------------------------
def cli(model, data, out, *extra, sampler="hf") -> list[str]:
    return [sys.executable, str(HERE / "remix.py"), "--model", model, "--dataset", data, "--out", str(out),
            "--sampler", sampler, "--algo", "ppo", "--steps", "6", "--prompts-per-step", "10", "--max-response-tokens",
            "24", "--mini-batch-prompts", "4", "--save-every", "2", "--keep-last", "2",
            "--seed", "5", "--eval-every", "0", *extra]


def comparable(row: dict) -> dict:
    """Everything but wall-clock timings; floats to 1e-4 relative (1e-7 absolute): a resumed process computes
    on freshly loaded tensors, whose memory layout can change the CPU kernels' summation order, a drift of
    about 1e-7 in the log-probs that the KL terms (about 1e-5) show most."""
    return {k: pytest.approx(v, rel=1e-4, abs=1e-7) if isinstance(v, float) else v for k, v in row.items()
            if not k.startswith("perf/")}


@pytest.mark.slow
@pytest.mark.parametrize("sampler", [pytest.param("hf", marks=pytest.mark.long), "vllm"])
def test_resume_after_sigkill_matches_an_uninterrupted_run(sampler, tiny_model, train_file, tmp_path):
    """vLLM too: every request's seed is a function of (seed, step, prompt), so a new engine resamples the same."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run(cli(tiny_model, train_file, tmp_path / "straight", sampler=sampler), check=True, env=env,
                   capture_output=True, timeout=600)
    out = tmp_path / "killed"
    proc = subprocess.Popen(cli(tiny_model, train_file, out, sampler=sampler), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_into_step_3(proc, out, 0.4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "checkpoint-6").exists(), "the run finished before it was killed"
    done = subprocess.run([sys.executable, str(HERE / "remix.py"), "--resume", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming" in done.stdout
    resumed, straight = read_metrics(out), read_metrics(tmp_path / "straight")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]  # every step once
    # the deque, optimizer, RNG and data position were restored: the same numbers as without the crash
    assert [comparable(r) for r in straight] == [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in resumed]
    assert resumed[2]["batch/historical"] == 4 and resumed[2]["replay/deque_size"] == 2
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]  # --keep-last 2
    assert not list(out.glob(".tmp-*"))


def test_resume_without_a_checkpoint_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        remix.train(console.settings(remix.Args, resume=str(tmp_path / "empty")))
    assert exit_info.value.code == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("case, overrides, message", [
    ("model", {"model": "/no/such/model"}, "model folder '/no/such/model' does not exist"),
    ("p", {"off_policy_p": 1.0}, "--off-policy-p must be in [0, 1), got 1.0"),
    ("p-negative", {"off_policy_p": -0.1}, "--off-policy-p must be in [0, 1), got -0.1"),
    ("window", {"window": 0}, "--window must be in [1, 1000], got 0"),
    ("utd", {"utd": 0}, "--utd must be in [1, 1000], got 0"),
    ("reincarnate", {"reincarnate_step": -1}, "--reincarnate-step must be in [0, 1000000], got -1"),
    ("groups", {"prompts_per_step": 1, "off_policy_p": 0.4}, "cannot split into whole fresh and historical groups"),
    ("max-response", {"max_response_tokens": 0}, "--max-response-tokens must be in [1, 1048576], got 0"),
    ("grpo-group", {"algo": "grpo", "group_size": 1}, "--algo grpo needs --group-size >= 2"),
    ("temperature", {"temperature": 0.0}, "--temperature must be in [0.01, 100], got 0.0"),
    ("tp", {"vllm_tp": 2}, "--vllm-tp 2 must divide the 1 processes"),
])
def test_bad_flags_get_one_clear_line(tiny_model, train_file, tmp_path, capsys, case, overrides, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        remix.train(tiny_args(overrides.pop("model", tiny_model), train_file, out, **overrides))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("remix: error: ") and message in err[0]
    assert not out.exists()  # nothing written


def one_line_exit(capsys, call, message: str):
    """call() stops with exit code 2 and one stderr line containing message."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_resume_by_another_method_or_with_an_unknown_saved_flag_is_one_line(capsys):
    """checkpoints.check_writer: another file, or another version of this one, is refused naming both (their names
    and sha256 starts) unless --resume-other-method; a saved flag the resuming Args lacks is refused naming it and
    its value, with that flag too; the same method, and a run from before the record, pass."""
    mine, theirs = {"file": "remix.py", "sha256": "a" * 64}, {"file": "remix_mine.py", "sha256": "b" * 64}
    saved, args = dataclasses.asdict(console.settings(remix.Args)), console.settings(remix.Args, resume="runs/x")
    one_line_exit(capsys, lambda: checkpoints.check_writer(args, {"method": theirs, "args": saved}, mine),
                  "was written by remix_mine.py (sha256 bbbbbbbbbbbb), not by remix.py (sha256 aaaaaaaaaaaa): "
                  "resume it with remix_mine.py; or pass --resume-other-method")
    one_line_exit(capsys, lambda: checkpoints.check_writer(args, {"method": {**mine, "sha256": "c" * 64},
                                                                  "args": saved}, mine), "another version of it")
    other = console.settings(remix.Args, resume="runs/x", resume_other_method=True)
    checkpoints.check_writer(other, {"method": theirs, "args": saved}, mine)
    checkpoints.check_writer(args, {"method": mine, "args": saved}, mine)
    for who in (args, other):
        one_line_exit(capsys, lambda: checkpoints.check_writer(who, {"method": mine, "args": {**saved, "clip_eps_high":
                                                                                              0.28}}, mine),
                      "saved argument --clip-eps-high = 0.28 is no flag of remix.py")


def test_datasets_load_from_parquet_and_json_lists_and_name_what_is_wrong(tmp_path, capsys):
    import pandas as pd

    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": "4"}]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "bad.json").write_text("[{\"problem\": 1,")
    for name in ("d.parquet", "d.json"):
        assert load_problems(str(tmp_path / name), "problem", "answer") == [("1+1?", "2"), ("2+2?", "4")]
    one_line_exit(capsys, lambda: load_problems(str(tmp_path / "bad.json"), "problem", "answer"),
                  "is not valid JSON")
    one_line_exit(capsys, lambda: runner.first_fitting_prompt([("a long problem", "1")], lambda text: [0] * len(text), 3),
                  "every prompt is longer than --max-prompt-tokens 3")


def test_resume_refusals_get_one_line(tmp_path, capsys):
    one_line_exit(capsys, lambda: checkpoints.latest(str(tmp_path / "nowhere")), "no such run folder")
    args = console.settings(remix.Args, resume=str(tmp_path), steps=3)
    one_line_exit(capsys, lambda: checkpoints.resume_args(args, dataclasses.asdict(console.settings(remix.Args)), 5),
                  "the run has finished 5 steps, more than --steps 3")


def test_resume_steps_given_at_the_default_value_still_extend_the_run(tmp_path, monkeypatch):
    """--resume OUT --steps 350 after a 2-step run extends it to 350, though 350 is --steps' default; without
    --steps the saved 2 stands."""
    saved = dataclasses.asdict(console.settings(remix.Args, steps=2, out=str(tmp_path)))
    args = console.settings(remix.Args, resume=str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["remix.py", "--resume", str(tmp_path), "--steps", str(remix.Args.steps)])
    assert checkpoints.resume_args(args, saved, 2).steps == remix.Args.steps
    monkeypatch.setattr(sys, "argv", ["remix.py", "--resume", str(tmp_path)])
    assert checkpoints.resume_args(args, saved, 2).steps == 2


def test_a_model_folder_without_a_model_and_a_missing_vllm_get_one_line(tmp_path, capsys, monkeypatch):
    dist.init()
    one_line_exit(capsys, lambda: models.load(remix.finalize_args(console.settings(remix.Args, model=str(tmp_path)))),
                  f"cannot load model {str(tmp_path)!r}")
    one_line_exit(capsys, lambda: data.load_tokenizer(str(tmp_path)), f"cannot load model {str(tmp_path)!r}")
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    one_line_exit(capsys, lambda: engines.start(remix.finalize_args(console.settings(remix.Args))),
                  "vLLM is not installed")


def test_an_interrupt_swallowed_by_a_finaliser_still_stops_the_run(monkeypatch):
    """Python drops an exception raised in a __del__ and reports it to sys.unraisablehook: the hook stays quiet
    about the interrupt, the flag remembers it, and the loop's next check raises it."""
    monkeypatch.setattr(console, "_state", {**console._state, "seen": None})
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        console.catch_interrupts()
        reported = []
        sys.unraisablehook.__defaults__ = (lambda report: reported.append(report),)

        class Finaliser:
            def __del__(self):
                signal.raise_signal(signal.SIGINT)

        Finaliser()  # the SIGINT lands in __del__: its KeyboardInterrupt is dropped
        assert console.seen() == signal.SIGINT and reported == []
        with pytest.raises(KeyboardInterrupt):
            console.check_interrupted()
        sys.unraisablehook(types.SimpleNamespace(exc_value=ValueError("other")))
        assert len(reported) == 1  # anything else still goes to the default hook
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@pytest.mark.parametrize("case", ["missing", "empty", "columns", "broken"])
def test_bad_dataset_gets_one_clear_line(tiny_model, tmp_path, capsys, case):
    path = tmp_path / "data.jsonl"
    if case == "empty":
        path.write_text("")
    elif case == "columns":
        path.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    elif case == "broken":
        path.write_text('{"problem": "1+1?", "answer": "2"}\n{not json\n')
    with pytest.raises(SystemExit):
        remix.train(tiny_args(tiny_model, str(path), tmp_path / "out"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("remix: error: ")
    expected = {"missing": "does not exist", "empty": "is empty", "columns": "['question', 'solution']",
                "broken": "line 2 is not valid JSON"}[case]
    assert expected in err[0] and str(path) in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("response", [
    "\\boxed{10^{10^{10^{10}}}}",
    "\\boxed{" + "\\frac{1}{" * 700 + "2" + "}" * 700 + "}",  # about 5,000 characters
    "the answer is \\boxed{\\frac{1}{2}",
    "\\boxed{\x00\x01\x02\xff\xfe}",
    "",
])
def test_math_reward_never_hangs_or_raises(response):
    """A hang guard, not a speed claim: 4 s of grading, plus about 2 s to start a fresh worker (imports
    included) when the previous input's timeout killed the last one."""

    start = time.perf_counter()
    assert math_reward(remix.METHOD, response, "1") == 0.0
    assert time.perf_counter() - start < 10.0


def test_grader_failures_are_counted_in_the_step(tiny_model, train_file, tmp_path, monkeypatch):
    """The real loop with a sampler that always answers with a number too large to compare."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    stuck = tokenizer("\\boxed{10^{10^{10^{10}}}}", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    fine = tokenizer("\\boxed{7}", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]

    def sampler(policy, tok, prompts, n, *sampling, **kw):
        return [[(stuck if i == 0 else fine, "stop", None) for _ in range(n)] for i in range(len(prompts))]

    monkeypatch.setattr(engines, "hf_generate", sampler)
    remix.train(tiny_args(tiny_model, train_file, tmp_path, steps=1, prompts_per_step=3, off_policy_p=0.0,
                          grade_timeout=3.0))
    row = read_metrics(tmp_path)[0]
    assert row["grader/failures"] == 1 and row["grader/no_boxed"] == 0


def test_non_finite_updates_stop_the_run_and_keep_the_last_good_checkpoint(tiny_model, train_file, tmp_path,
                                                                           monkeypatch, capsys):
    step = {"now": 0}
    schedule, loss = remix.kl_convex_lambda, remix.mix_ppg_loss

    def lam(t, *rest):  # called once a step with the step number
        step["now"] = t
        return schedule(t, *rest)

    def poisoned(*a, **k):
        value, stats = loss(*a, **k)
        return (value * float("nan") if step["now"] >= 3 else value), stats

    monkeypatch.setattr(remix, "kl_convex_lambda", lam)
    monkeypatch.setattr(remix, "mix_ppg_loss", poisoned)
    with pytest.raises(SystemExit):
        remix.train(tiny_args(tiny_model, train_file, tmp_path, steps=5, save_every=1, keep_last=0))
    err = capsys.readouterr().err
    assert "3 non-finite updates in a row at step 3" in err and err.count("update skipped") == 3
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "checkpoint-2"))
    assert all(torch.isfinite(p).all() for p in reloaded.parameters())


def test_one_non_finite_update_is_skipped_and_the_run_carries_on_with_finite_weights(tiny_model, train_file, tmp_path,
                                                                                      monkeypatch, capsys):
    """One poisoned mini-batch at step 2: its optimizer step is skipped (a stepped NaN gradient would put NaN in every
    weight, and every later update would be skipped too), the run finishes, and the final policy is finite."""
    step, calls, loss = {"now": 0}, {"n": 0}, remix.mix_ppg_loss
    schedule = remix.kl_convex_lambda

    def lam(t, *rest):
        step["now"] = t
        return schedule(t, *rest)

    def poisoned_once(*a, **k):
        value, stats = loss(*a, **k)
        if step["now"] == 2:
            calls["n"] += 1
            if calls["n"] == 1:
                return value * float("nan"), stats
        return value, stats

    monkeypatch.setattr(remix, "kl_convex_lambda", lam)
    monkeypatch.setattr(remix, "mix_ppg_loss", poisoned_once)
    done = remix.train(tiny_args(tiny_model, train_file, tmp_path, steps=4))
    assert capsys.readouterr().err.count("update skipped") == 1
    rows = read_metrics(tmp_path)
    assert [r["train/skipped_updates"] for r in rows] == [0, 1, 0, 0]
    assert all(math.isfinite(r["losses/policy_loss"]) for r in rows)
    assert all(torch.isfinite(p).all() for p in done["policy"].parameters())


# ----------------------------------------------------------------------------------------------
# The grader from any caller; a checkpoint that cannot be written
# ----------------------------------------------------------------------------------------------
GRADE = ("import sys, time; sys.path.insert(0, {here!r}); import remix; from machinery import report; "
         "start = time.perf_counter(); "
         "reward = lambda r: report.grade_many(remix.METHOD, [(r, ['2'])], timeout=4.0)[0][0]; "
         "print(reward('so \\\\boxed{{2}}'), reward('\\\\boxed{{3}}'), "
         "round(time.perf_counter() - start, 1))")


def double(x):
    return 2 * x


def explode(x):
    raise ValueError(f"bad item {x}")


def vanish(x):
    os._exit(3)


@pytest.mark.slow
def test_a_failing_worker_function_stops_with_its_error_and_a_vanishing_one_fails_its_item():
    with pytest.raises(RuntimeError, match="explode failed in a worker process: ValueError: bad item 1"):
        grader.map_with_deadline(explode, [(1,)], 1, 10.0, None)
    # a worker gone mid-task is a killed one to the caller (the OOM killer's SIGKILL looks the same): the item fails
    assert grader.map_with_deadline(vanish, [(1,)], 1, 10.0, "gone") == ["gone"]
    assert grader.map_with_deadline(double, [(3,)], 1, 10.0, None) == [6]  # its replacement works
    grader.close_pool()


def test_a_worker_killed_mid_task_is_replaced_and_its_item_fails_as_a_timeout_does(tmp_path, monkeypatch):
    """SIGKILL to the real worker process of a task that sleeps 60 s (issue 37: a BrokenPipeError ended the run):
    that item gets the timeout's answer at once, the others their results, and the pool serves the next call."""
    import threading

    (tmp_path / "sleeper.py").write_text(
        "import os, time\ndef nap(x, where):\n    with open(os.path.join(where, str(x)), 'w') as f:\n"
        "        f.write(str(os.getpid()))\n    time.sleep(x)\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sleeper

    killed, marks = [], tmp_path / "pids"
    marks.mkdir()

    def kill_the_long_task():  # the worker that took the 60 s task says its pid there
        deadline = time.time() + 60
        while time.time() < deadline and not killed:
            if (marks / "60").exists() and (marks / "60").read_text():
                time.sleep(0.5)  # inside time.sleep(60) by now
                killed.append(int((marks / "60").read_text()))
                os.kill(killed[0], signal.SIGKILL)
            time.sleep(0.05)

    grader.close_pool()
    killer = threading.Thread(target=kill_the_long_task)
    killer.start()
    start = time.perf_counter()
    answers = grader.map_with_deadline(sleeper.nap, [(60, str(marks)), (0.1, str(marks)), (0.2, str(marks))], 2, 120.0,
                                       "timeout")
    elapsed = time.perf_counter() - start
    killer.join()
    assert killed and answers == ["timeout", 0.1, 0.2] and elapsed < 30, (killed, answers, elapsed)
    assert grader.map_with_deadline(sleeper.nap, [(0.1, str(marks)), (0.3, str(marks))], 2, 60.0, "timeout") == \
        [0.1, 0.3]
    assert killed[0] not in {int((marks / name).read_text()) for name in ("0.1", "0.3")}  # a new worker took over
    grader.close_pool()


def test_a_slow_first_import_of_a_task_is_no_part_of_its_deadline(tmp_path, monkeypatch):
    """A worker imports a task's module before its first item (math-verify and sympy take seconds on a loaded
    machine): the item's deadline starts after the import, so a 2 s import under a 1 s deadline is no timeout."""
    imported_by = tmp_path / "imported_by"  # each process that imports the module adds its pid
    (tmp_path / "slow_to_import.py").write_text(
        f"import os, time\nwith open({str(imported_by)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n"
        "time.sleep(2)\ndef triple(x):\n    return 3 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import slow_to_import

    grader.close_pool()
    assert grader.map_with_deadline(slow_to_import.triple, [(2,), (5,)], 1, 1.0, "timeout") == [6, 15]
    importers = [int(pid) for pid in imported_by.read_text().split()]
    assert len(importers) == 2 and importers[0] == os.getpid() != importers[1]  # the worker imported it itself
    grader.close_pool()


def test_a_worker_function_must_be_importable(monkeypatch):
    main = types.ModuleType("__main__")  # an interactive session's __main__ has no file
    monkeypatch.setitem(sys.modules, "__main__", main)
    exec("def typed_in(x):\n    return x", main.__dict__)
    with pytest.raises(ValueError, match="must live in an importable file"):
        grader.map_with_deadline(main.typed_in, [(1,)], 1, 10.0, None)


def test_workers_run_each_function_from_its_own_file_whatever_its_modules_name(tmp_path):
    """A fork named remix.py in another folder, loaded under the module name the repository's remix.py already holds in
    this process, a second one likewise, and remix_mine.py beside them: the same workers run each task from the file
    its function came from, never another module of the same name (by sys.path or sys.modules)."""
    import importlib.util

    functions = []
    for folder, file in (("a", "remix.py"), ("b", "remix.py"), ("b", "remix_mine.py")):
        path = tmp_path / folder / file
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"def who(x):\n    return {folder + '/' + file!r}, x\n")
        spec = importlib.util.spec_from_file_location("remix", path)  # the name sys.modules gives the repository's
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        functions.append(module.who)
    assert sys.modules["remix"] is remix
    for _ in range(2):  # the second round in workers that have imported all three
        assert [grader.map_with_deadline(fn, [(1,)], 2, 20.0, None)[0] for fn in functions] == \
            [("a/remix.py", 1), ("b/remix.py", 1), ("b/remix_mine.py", 1)]
    assert grader.resolve(grader.reference(remix.final_answer)) is remix.final_answer  # this process's, from that file
    assert grader.resolve(grader.reference(remix.final_answer))("\\boxed{7}") == "7"
    grader.close_pool()


@pytest.mark.slow
def test_worker_pool_runs_the_function_it_is_given():
    """Workers outlive a call; a call with another function must not get the old function's answers."""
    assert report.grade_many(remix.METHOD, [("\\boxed{1}", ["1"])]) == [(1.0, "ok")]
    assert grader.map_with_deadline(double, [(3,), (4,)], 2, 10.0, None) == [6, 8]
    assert report.grade_many(remix.METHOD, [("\\boxed{1}", ["1"])]) == [(1.0, "ok")]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("shape", ["script-with-guard", "script-without-guard", "python-c", "stdin", "interactive"])
def test_math_reward_works_from_every_kind_of_caller(shape, tmp_path):
    code = GRADE.format(here=str(HERE))
    script = tmp_path / "caller.py"
    script.write_text(f"if __name__ == '__main__':\n    {code}\n" if shape == "script-with-guard" else code + "\n")
    argv, stdin = {"script-with-guard": ([str(script)], None), "script-without-guard": ([str(script)], None),
                   "python-c": (["-c", code], None), "stdin": (["-"], code + "\n"),
                   "interactive": (["-i", "-q"], code + "\n")}[shape]
    done = subprocess.run([sys.executable, *argv], input=stdin, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    right, wrong, seconds = done.stdout.split()[-3:]
    assert (right, wrong) == ("1.0", "0.0")
    assert float(seconds) < 10.0  # a hang guard (worker start-up included), not a speed claim


def test_a_checkpoint_holds_one_models_whole_weights_on_the_host_at_a_time(tiny_model, train_file, tmp_path,
                                                                           monkeypatch):
    """checkpoints.save gathers each model's full state dict on rank 0's host: the one written before (two fp32
    7B copies would be 56 GB) must be freed before the next is gathered."""
    import weakref

    import torch.distributed.checkpoint.state_dict as dcp_state

    real, alive_at_call = dcp_state.get_model_state_dict, []
    earlier: list = []

    def gather(model, **kwargs):
        alive_at_call.append(sum(ref() is not None for ref in earlier))
        full = real(model, **kwargs)
        earlier.extend(weakref.ref(t) for t in full.values())
        return full

    monkeypatch.setattr(dcp_state, "get_model_state_dict", gather)
    remix.train(tiny_args(tiny_model, train_file, tmp_path, algo="ppo", steps=1, save_every=1))
    assert alive_at_call == [0, 0]  # the policy's, then the critic's: nothing of the policy's left at the second


def test_a_checkpoint_that_cannot_be_written_keeps_the_previous_one(tiny_model, train_file, tmp_path, monkeypatch,
                                                                    capsys):
    import errno

    from transformers import AutoModelForCausalLM

    real_save = torch.save

    def full_disk(obj, path, *a, **k):  # the policy and optimizer of checkpoint-2 are written, then the disk is full
        name = str(getattr(path, "name", path))  # a path, or the file runfolder.open_file opened there
        if "checkpoint-2" in name and name.endswith("trainer_state.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(SystemExit) as exit_info:
        remix.train(tiny_args(tiny_model, train_file, tmp_path, steps=3, save_every=1, keep_last=0))
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines()
           if line.strip() and not re.match(r"remix:\s+\d+%", line)]  # all but the progress bar
    assert len(err) == 1 and "cannot write checkpoint" in err[0] and str(tmp_path / "checkpoint-2") in err[0]
    assert "No space left on device" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]  # no .tmp left
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "checkpoint-1"))
    assert all(torch.isfinite(p).all() for p in reloaded.parameters())


# ----------------------------------------------------------------------------------------------
# A new user's first hour: fast clear failures, Ctrl-C, files that are not clobbered, quiet logs
# ----------------------------------------------------------------------------------------------
def run_remix(*argv, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([sys.executable, str(HERE / "remix.py"), *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def one_error_line(done: subprocess.CompletedProcess, text: str):
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("remix: error: ") and text in lines[0], \
        done.stderr[-2000:]


@pytest.mark.long
@pytest.mark.slow
def test_a_mistyped_local_model_folder_fails_in_seconds(tmp_path, train_file):
    (tmp_path / "runs").mkdir()

    start = time.perf_counter()
    done = run_remix("--model", "runs/tiny-qwen3", "--dataset", train_file, cwd=tmp_path, env={"HF_HUB_OFFLINE": None})
    one_error_line(done, "model folder 'runs/tiny-qwen3' does not exist")
    done = run_remix("--model", "my model", "--dataset", train_file, cwd=tmp_path, env={"HF_HUB_OFFLINE": None})
    one_error_line(done, "model folder 'my model' does not exist")
    assert time.perf_counter() - start < 60  # a hang guard: the hub's retries took 50 s for each


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("offline", [False, True])
def test_hub_ids_without_the_hub_fail_in_seconds(tmp_path, offline):
    # no cache in HF_HOME; the endpoint is a closed local port, so this also holds on a machine with a network
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1" if offline else None}
    done = run_remix("--steps", "350", "--out", str(tmp_path / "out"), env=env, timeout=120)
    one_error_line(done, "HF_HUB_OFFLINE" if offline else "cannot be reached")
    if not offline:
        assert "--model deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B" in done.stderr and "HF_HUB_OFFLINE=1" in done.stderr
    eval_done = subprocess.run([sys.executable, str(HERE / "eval.py"), "--model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"],
                               capture_output=True, text=True, timeout=120,
                               env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
    lines = eval_done.stderr.strip().splitlines()
    assert eval_done.returncode == 2 and len(lines) == 1 and lines[0].startswith("eval: error: "), eval_done.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.long
@pytest.mark.slow
def test_an_existing_run_is_not_clobbered(tiny_model, train_file, tmp_path):
    out = tmp_path / "run"
    base = ["--model", tiny_model, "--dataset", train_file, "--out", str(out), "--sampler", "hf", "--algo", "grpo",
            "--prompts-per-step", "4", "--group-size", "2", "--max-response-tokens", "8", "--eval-every", "0"]
    assert run_remix(*base, "--steps", "2").returncode == 0
    before = (out / "metrics.jsonl").read_text()
    one_error_line(run_remix(*base, "--steps", "1"), f"--out {out} already holds a run")
    assert (out / "metrics.jsonl").read_text() == before and len(list((out / "tb").iterdir())) == 1
    # --resume with a larger --steps extends the finished run; other flags are named as ignored
    done = run_remix("--resume", str(out), "--steps", "3", "--actor-lr", "0.5")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ignored: --actor-lr" in done.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    done = run_remix("--resume", str(out))  # nothing left to do: it says so and starts nothing
    assert done.returncode == 0 and "has finished all 3 steps" in done.stdout
    # --overwrite replaces the old run
    assert run_remix(*base, "--steps", "1", "--overwrite").returncode == 0
    assert [r["step"] for r in read_metrics(out)] == [1]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"] and len(list((out / "tb").iterdir())) == 1


def child_pids(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.3, 0.9, 1.6])
def test_ctrl_c_ends_the_run_with_one_line(tiny_model, train_file, tmp_path, delay):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, at several points after step 1."""

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(HERE / "remix.py"), "--model", tiny_model, "--dataset", train_file,
                             "--out", str(out), "--sampler", "hf", "--algo", "ppo", "--steps", "50", "--save-every", "1",
                             "--prompts-per-step", "10", "--max-response-tokens", "24", "--eval-every", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    deadline = time.time() + 240
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.05)
    time.sleep(delay)
    workers = child_pids(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)  # never a hang
    assert proc.returncode == 130
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not line.startswith("remix: ")
             or line.startswith("remix: interrupted")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    step = int(lines[0].split("interrupted at step ")[1].split(";")[0])
    assert step in (len(read_metrics(out)), len(read_metrics(out)) + 1)  # while saving it, or in the next step
    found = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if found:
        assert f"the last checkpoint is {found[-1]}; continue with --resume {out}" in lines[0]
    else:  # interrupted while step 1 was being saved
        assert "the last checkpoint is none yet; nothing to resume" in lines[0]
    time.sleep(0.5)
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)  # the grader workers are gone


@pytest.mark.long
@pytest.mark.slow
def test_a_vllm_run_is_quiet_and_its_step_lines_are_in_step(tiny_model, train_file, tmp_path):
    """A vLLM run's stderr holds nothing but torch's one NUMA line; stdout has one line per step, in order, each
    showing its own step's reward (console.step_line), never a step behind."""
    out = tmp_path / "run"
    done = run_remix("--model", tiny_model, "--dataset", train_file, "--out", str(out), "--algo", "ppo", "--steps", "3",
                     "--prompts-per-step", "10", "--max-response-tokens", "16", "--reincarnate-step", "2",
                     "--eval-every", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    noise = [s for s in done.stderr.replace("\r", "\n").splitlines() if s.strip()]
    # on CPU torch itself prints one NUMA line when vLLM binds memory; nothing else may appear
    assert len(noise) <= 1 and all("NUMA" in s for s in noise), noise
    assert "Failed to load weights" not in done.stderr and "MISSING" not in done.stderr + done.stdout
    assert done.stdout.count("critic: the base model with a new scalar value head") == 1
    rewards = {r["step"]: r["reward/mean"] for r in read_metrics(out)}
    shown = [(int(m.group(1)), float(m.group(2))) for line in done.stdout.splitlines()
             for m in [re.match(r"remix: step (\d+)/3: .*; reward (-?[\d.]+); ", line)] if m]
    assert [step for step, _ in shown] == [1, 2, 3], done.stdout[-2000:]
    assert all(abs(rewards[step] - reward) <= 5e-4 for step, reward in shown), (shown, rewards)


@pytest.mark.long
@pytest.mark.slow
def test_help_shows_one_default_per_flag():
    done = subprocess.run([sys.executable, str(HERE / "remix.py"), "--help"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, COLUMNS="120"))
    text = done.stdout
    for flag, following, default in (("--prompts-per-step", "--group-size", "(default: 256 PPO, 128 GRPO)"),
                                     ("--group-size", "--off-policy-p", "(default: 1 for PPO, 8 for GRPO)")):
        entry = text[text.index(flag) : text.index(following, text.index(flag) + len(flag))]
        entry = " ".join(entry.replace("│", " ").split())
        assert entry.count("(default:") == 1 and default in entry, entry


# ----------------------------------------------------------------------------------------------
# Several processes: torchrun with FSDP2 on CPU (gloo), 2 processes
# ----------------------------------------------------------------------------------------------
def torchrun(*argv, timeout=600, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(29500 + os.getpid() % 1000), *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_two_processes_make_the_same_update_as_one(algo, tiny_model, train_file, tmp_path):
    case = prepared_update_case(tiny_model, train_file, tmp_path / "run", algo)
    assert case["lam"] < 1 and any(s["version"] < case["step"] for s in case["batch"])  # history in it
    # Adam moves a weight by about lr whatever its gradient's size, so summation-order noise on a gradient near
    # zero can shift it by up to lr: compare at lr 1e-4 (about 1e-6 of such noise), not the run's 1e-3
    case["args"].update(actor_lr=1e-4, critic_lr=1e-4)
    torch.save(case, tmp_path / "case.pt")
    one, one_stats = run_update(case)
    done = torchrun(str(HERE / "tests" / "test_runs.py"), "update", str(tmp_path / "case.pt"), str(tmp_path / "two.pt"))
    assert done.returncode == 0, done.stderr[-3000:]
    two, two_stats = torch.load(tmp_path / "two.pt", weights_only=False)
    assert set(one) == set(two)
    for name in one:
        moved = max((one[name][k] - case[name][k]).abs().max().item() for k in one[name])
        assert moved > 1e-4  # the update changed the weights
        for key in one[name]:
            torch.testing.assert_close(two[name][key], one[name][key], rtol=0, atol=1e-5)
    assert set(one_stats) == set(two_stats)
    for key in one_stats:
        assert two_stats[key] == pytest.approx(one_stats[key], rel=1e-4, abs=1e-6), key


def distributed_main(argv: list[str]):
    """torchrun --nproc-per-node 2 test_remix.py update CASE.pt OUT.pt"""

    full, stats = run_update(torch.load(argv[1], weights_only=False))
    if dist.rank() == 0:
        torch.save((full, stats), argv[2])
    dist.barrier()
    os._exit(0)  # skip the process group's teardown, which can abort at exit


def engine_tokens_main(argv: list[str]):
    """torchrun --nproc-per-node 2 tests/test_runs.py engine-tokens OUT REMIX_FLAGS...: remix.train with the token ids of
    every vLLM call saved per rank (OUT/engine-tokens-rankR.pt), to compare the ranks of one engine."""
    calls, real = [], engines.vllm_generate

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append([[ids for ids, _, _ in group] for group in result])
        return result

    engines.vllm_generate = spy
    # held, as runner.main holds it: once a tensor-parallel engine is collected, the process group it shares is gone
    result = remix.train(runner.cli(remix.Args, argv=argv[2:]))
    torch.save(calls, Path(argv[1]) / f"engine-tokens-rank{dist.rank()}.pt")
    dist.barrier()
    del result
    os._exit(0)


def batches_main(argv: list[str]):
    """torchrun --nproc-per-node 2 tests/test_runs.py batches OUT REMIX_FLAGS...: remix.train with each rank's fresh
    samples of every step saved (OUT/batches-rankR.pt: their prompt and response token ids, in the batch's order)."""
    steps = []

    def on_step(step, record, policy, tokenizer, batch):
        steps.append([(s["prompt_ids"], s["response_ids"]) for s in batch if not s["historical"]])

    result = remix.train(runner.cli(remix.Args, argv=argv[2:]), on_step=on_step)
    torch.save(steps, Path(argv[1]) / f"batches-rank{dist.rank()}.pt")
    dist.barrier()
    del result
    os._exit(0)


def timeout_main(argv: list[str]):
    """torchrun --nproc-per-node 2 test_remix.py timeout SECONDS: rank 1 enters a barrier SECONDS late; rank 0 reports
    how long it waited before its barrier gave up."""
    import torch.distributed as torch_dist

    dist.init(timeout_minutes=0.05)  # 3 s
    start = time.time()
    if torch_dist.get_rank() == 1:
        time.sleep(float(argv[1]))
        os._exit(0)
    try:
        torch_dist.barrier()
        print("WAITED", time.time() - start, "no error", flush=True)
    except Exception as error:  # gloo: a timeout error from the barrier
        print("WAITED", time.time() - start, type(error).__name__, flush=True)
    os._exit(0)


def remix_cli(model, data, out, *extra) -> list[str]:
    return [str(HERE / "remix.py"), "--model", model, "--dataset", data, "--out", str(out), "--steps", "4",
            "--reincarnate-step", "2", "--prompts-per-step", "10", "--max-response-tokens", "16",
            "--mini-batch-prompts", "3", "--save-every", "2", "--eval-every", "0", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("algo, sampler", [pytest.param("grpo", "hf", marks=pytest.mark.long),
                                           pytest.param("ppo", "hf", marks=pytest.mark.long),
                                           pytest.param("grpo", "vllm", marks=pytest.mark.long), ("ppo", "vllm")])
def test_torchrun_two_processes_end_to_end(algo, sampler, tiny_model, train_file, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    group = 2 if algo == "grpo" else 1
    done = torchrun(*remix_cli(tiny_model, train_file, out, "--algo", algo, "--sampler", sampler, "--group-size",
                               str(group)))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # each step once: one process writes
    assert len(list((out / "tb").iterdir())) == 1
    # 10 prompts over 2 processes: 6 fresh + 4 historical during the mix stage, 10 fresh after T = 2
    assert [(r["batch/fresh"], r["batch/historical"]) for r in rows] == \
        [(6 * group, 0), (6 * group, 4 * group), (10 * group, 0), (10 * group, 0)]
    assert [r["rollouts/total"] for r in rows] == [6 * group, 12 * group, 22 * group, 32 * group]
    assert [r["phase"] for r in rows] == ["mix", "mix", "on-policy", "on-policy"]
    checkpoint = out / "checkpoint-4"
    assert sorted(p.name for p in checkpoint.glob("trainer_state*.pt")) == ["trainer_state-rank1.pt", "trainer_state.pt"]
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), base.state_dict().values()))
    assert (checkpoint / "reference" / "config.json").exists() and ((checkpoint / "critic").exists() == (algo == "ppo"))
    # the sharded reference took pi_T's weights at T = 2: the policy saved at step 2
    pi_t = AutoModelForCausalLM.from_pretrained(str(out / "checkpoint-2")).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(str(checkpoint / "reference")).state_dict()
    assert all(torch.equal(reference[k], pi_t[k]) for k in pi_t)


@pytest.mark.long
@pytest.mark.slow
def test_two_ranks_share_one_tensor_parallel_engine(tiny_model, train_file, tmp_path):
    """--vllm-tp 2: both ranks drive one engine sharded over them and draw the same tokens for its prompts (each
    request carries its own seed); each trains on its half of the responses."""
    out = tmp_path / "run"
    flags = remix_cli(tiny_model, train_file, out, "--algo", "grpo", "--sampler", "vllm", "--group-size", "2",
                      "--vllm-tp", "2", "--steps", "2")[1:]
    done = torchrun(str(HERE / "tests" / "test_runs.py"), "engine-tokens", str(out), *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(out)
    assert [(r["batch/fresh"], r["batch/historical"]) for r in rows] == [(12, 0), (12, 8)]
    assert all(r["perf/weight_sync_s"] > 0 for r in rows)
    ranks = [torch.load(out / f"engine-tokens-rank{r}.pt") for r in (0, 1)]
    assert len(ranks[0]) == 2 and [len(call) for call in ranks[0]] == [6, 6]  # the engine's 6 prompts, each step
    assert ranks[0] == ranks[1]
    assert ranks[0][0][0] != ranks[0][0][1]  # and the prompts' own seeds differ


@pytest.mark.long
@pytest.mark.slow
def test_every_collective_waits_at_most_the_dist_timeout(tmp_path):
    done = torchrun(str(HERE / "tests" / "test_runs.py"), "timeout", "8", timeout=120)
    waited = [line.split() for line in done.stdout.splitlines() if line.startswith("WAITED")]
    assert len(waited) == 1 and waited[0][2] != "no", done.stdout + done.stderr[-2000:]
    assert 2.5 < float(waited[0][1]) < 10  # the 3 s timeout, not gloo's default of 30 minutes


def test_a_refusal_on_a_rank_other_than_0_is_said_by_that_rank(monkeypatch, capsys):
    """console.fail on rank 1 (its own checkpoint shard, its own GPU): its line, naming the rank, after the wait that
    lets a rank 0 refusing the same input end the job first; on rank 0 the plain line at once."""
    from machinery import console

    monkeypatch.setattr(console, "OTHER_RANK_WAIT", 0.3, raising=False)
    monkeypatch.setitem(console._state, "prog", "eval")  # what eval.py's one_line_interrupts("eval") sets
    for rank, line in ((1, "eval: error: rank 1: its shard is damaged"), (0, "eval: error: its shard is damaged")):
        monkeypatch.setitem(console._state, "rank", rank)
        start = time.monotonic()
        with pytest.raises(SystemExit) as exit_info:
            console.fail("its shard is damaged")
        waited = time.monotonic() - start
        assert exit_info.value.code == 2 and capsys.readouterr().err.splitlines() == [line]
        assert (waited >= 0.3) == (rank == 1)


REFUSING = """
import sys
sys.path.insert(0, sys.argv[1])
from machinery import console, dist, runner

def program():  # as remix.py and eval.py run, checking an input once the process group is there
    console.catch_interrupts()
    dist.init()
    if dist.rank() == 1 or sys.argv[2] == "every-rank":
        console.fail(f"planted on rank {dist.rank()}")
    dist.barrier()

runner.main(program)
"""


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("refusing", ["rank-1", "every-rank"])
def test_a_refusal_under_torchrun_is_one_line_and_ends_every_rank(refusing, tmp_path):
    """Rank 1 alone refusing says its line itself (rank 0, in a collective, is stopped); every rank refusing the same
    input is one line, rank 0's (rank 1, waiting to say it, is stopped by torchrun first)."""
    script = tmp_path / "refuse.py"
    script.write_text(REFUSING)
    start = time.monotonic()
    done = torchrun(str(script), str(HERE), refusing, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("remix: error")]
    assert done.returncode != 0 and time.monotonic() - start < 120, done.stderr[-3000:]
    assert errors == [{"rank-1": "remix: error: rank 1: planted on rank 1",
                       "every-rank": "remix: error: planted on rank 0"}[refusing]], done.stderr[-3000:]


def worker_pids(agent: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of torchrun's worker processes."""
    ranks = {}
    for pid in child_pids(agent):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"LOCAL_RANK=")]
        if rank:
            ranks[int(rank[0])] = pid
    return ranks


@pytest.mark.long
@pytest.mark.slow
def test_a_killed_rank_ends_the_job_and_resume_completes_it(tiny_model, train_file, tmp_path):

    out = tmp_path / "run"
    argv = remix_cli(tiny_model, train_file, out, "--algo", "grpo", "--sampler", "hf", "--group-size", "2", "--steps", "6")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(29500 + os.getpid() % 1000), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    wait_into_step_3(proc, out, 0.3)
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    killed = time.time()
    proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.time() - killed < 60  # the whole job ends, never a hang
    assert not (out / "checkpoint-6").exists()
    done = torchrun(str(HERE / "remix.py"), "--resume", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    # a different number of processes is refused with one line
    refused = run_remix("--resume", str(out), "--steps", "8")
    one_error_line(refused, "was trained by 2 processes, this is 1")


@pytest.mark.long
@pytest.mark.slow
def test_a_resume_on_more_processes_than_the_run_had_says_so(tiny_model, train_file, tmp_path):
    """The second rank finds no state of its own in any checkpoint: one line saying how many processes trained the
    run, not a fall-back through every checkpoint."""
    out = tmp_path / "run"
    done = run_remix(*remix_cli(tiny_model, train_file, out, "--algo", "grpo", "--sampler", "hf", "--group-size", "2",
                                "--steps", "2")[1:])
    assert done.returncode == 0, done.stderr[-3000:]
    done = torchrun(str(HERE / "remix.py"), "--resume", str(out), "--steps", "4")
    errors = [line for line in done.stderr.splitlines() if line.startswith("remix: error:")]
    assert done.returncode != 0 and errors == [
        f"remix: error: --resume {str(out)!r}: the run was trained by 1 processes, this is 2; resume it with "
        f"torchrun --nproc-per-node 1 (or python for 1)"], done.stderr[-3000:]
    assert "falling back" not in done.stderr and "instead" not in done.stderr


@pytest.mark.long
@pytest.mark.slow
def test_prompts_that_do_not_split_over_the_processes_are_refused(tiny_model, train_file, tmp_path):
    done = torchrun(*remix_cli(tiny_model, train_file, tmp_path / "run", "--sampler", "hf", "--prompts-per-step", "5"))
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("remix: error:")]
    assert errors == ["remix: error: --prompts-per-step 5 (3 fresh + 2 historical at p = 0.4) cannot split into whole "
                      "groups over 2 processes: make each a multiple of 2"]
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------
# The GPU's numerics on the CPU: --precision bf16, kl/ref = 0 before the first update; the sampler correction
# ----------------------------------------------------------------------------------------------
def first_kl_to_reference(monkeypatch) -> list:
    """Spies kl_convex_loss: the k3 KL to the reference of the first update micro-batch of the run."""
    seen, real = [], remix.kl_convex_loss

    def spy(logp, ref_logp, prox_logp, lam, mask):
        if not seen:
            seen.append(remix.masked_mean(remix.k3_kl(logp.detach().float(), ref_logp.float()), mask).item())
        return real(logp, ref_logp, prox_logp, lam, mask)

    monkeypatch.setattr(remix, "kl_convex_loss", spy)
    return seen


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("algo, sampler", [("grpo", "hf"), ("ppo", "hf"), ("grpo", "vllm"), ("ppo", "vllm")])
def test_bf16_runs_in_one_process_with_kl_zero_before_the_first_update(algo, sampler, tiny_model, train_file,
                                                                        tmp_path, monkeypatch):
    """--precision bf16 on the CPU: the GPU's numerics (FSDP2 mixed precision over fp32 masters, a bf16 reference,
    a bf16 vLLM engine). Before the first optimizer step the policy and the reference give the same log-probs."""
    first = first_kl_to_reference(monkeypatch)
    group = 2 if algo == "grpo" else 1
    state = remix.train(tiny_args(tiny_model, train_file, tmp_path, algo=algo, sampler=sampler, precision="bf16",
                                  group_size=group, steps=2, actor_lr=1e-3))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["batch/historical"] > 0
    assert first[0] < 1e-5
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert next(state["reference"].parameters()).dtype == torch.bfloat16
    assert next(state["policy"].parameters()).dtype == torch.float32  # the masters
    if sampler == "vllm":
        assert state["llm"].llm_engine.model_config.dtype == torch.bfloat16
        assert rows[0]["mismatch/abs_log_ratio_mean"] > 0  # a bf16 engine against the trainer's own bf16 passes


@pytest.mark.long
@pytest.mark.slow
def test_bf16_under_torchrun_with_kl_zero_before_the_first_update(tiny_model, train_file, tmp_path):
    """Two processes, FSDP2 mixed precision over gloo, bf16 vLLM engines: step 1 takes one optimizer step on the
    whole batch, so its logged kl/ref is the token mean over micro-batches that all ran before any update."""
    out = tmp_path / "run"
    done = torchrun(*remix_cli(tiny_model, train_file, out, "--algo", "ppo", "--sampler", "vllm", "--precision", "bf16",
                               "--utd", "1", "--mini-batch-prompts", "10", "--steps", "2", "--actor-lr", "1e-3"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["train/optimizer_steps"] == 1
    assert rows[0]["kl/ref"] < 1e-5 < rows[1]["kl/ref"]
    assert rows[0]["mismatch/abs_log_ratio_mean"] > 0


@pytest.mark.long
@pytest.mark.slow
def test_fp32_has_kl_zero_before_the_first_update_too(tiny_model, train_file, tmp_path, monkeypatch):
    first = first_kl_to_reference(monkeypatch)
    remix.train(tiny_args(tiny_model, train_file, tmp_path, algo="ppo", steps=1))
    assert first[0] < 1e-5


@pytest.mark.long
@pytest.mark.slow
def test_sampler_correction_weights_are_stored_replayed_and_reach_the_loss(tiny_model, train_file, tmp_path,
                                                                           monkeypatch):
    seen, real = [], remix.mix_ppg_loss

    def spy(*args, **kwargs):
        seen.append(args[6])
        return real(*args, **kwargs)

    monkeypatch.setattr(remix, "mix_ppg_loss", spy)
    batches = {}

    def on_step(step, record, policy, tokenizer, batch):
        batches[step] = [(s, s["sampler_weight"].clone()) for s in batch]

    cap = 1.0  # on CPU the fp32 engine and the trainer agree to about 1e-6: a cap of 1 binds on about half the tokens
    remix.train(tiny_args(tiny_model, train_file, tmp_path, algo="grpo", sampler="vllm", group_size=2, steps=2,
                          sampler_is_cap=cap), on_step=on_step)
    rows = read_metrics(tmp_path)
    fresh = [s for s, _ in batches[1]]
    for s in fresh:
        expected = torch.exp(s["behaviour_logp"] - s["sampler_logp"]).clamp(max=cap)
        torch.testing.assert_close(s["sampler_weight"], expected)
    weights = torch.cat([s["sampler_weight"] for s in fresh])
    assert (weights == cap).any() and (weights < cap).any()
    assert rows[0]["mismatch/is_weight_mean"] == pytest.approx(weights.mean().item(), rel=1e-5)
    replayed = [(s, w) for s, w in batches[2] if s["version"] == 1]
    assert replayed and all(torch.equal(s["sampler_weight"], w) for s, w in replayed)
    assert all(w is not None for w in seen)  # every Mix-PPG call was weighted


# ----------------------------------------------------------------------------------------------
# The benchmarks' scripts stay runnable: gpu_check's CPU dry run, the mutation check's planted bugs
# ----------------------------------------------------------------------------------------------
@pytest.mark.long
@pytest.mark.slow
def test_gpu_check_dry_runs_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.py is what a session lent a GPU runs first, on a budget of minutes: its CPU dry run
    (the same code on a tiny model) must keep working, or that budget goes on fixing the script. Mix stage,
    switch and on-policy stage, with the PPO and GRPO step counts and rollouts of its three-step runs."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, str(HERE / "benchmarks" / "gpu_check.py"), str(tmp_path), "--quick",
                           "--budget-s", "1500", "--limit-s", "1500", "--part-limit-s", "1500"],  # a busy CPU is slow
                          env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["device"] == "cpu (dry run)" and result["world_size"] == 1
    for algo in ("ppo", "grpo"):
        run = result[f"end_to_end_{algo}"]
        assert run["finite"] and [s["phase"] for s in run["steps"]] == ["mix", "mix", "on-policy"]
        assert [s["rollouts/total"] for s in run["steps"]] == {"ppo": [6, 12, 22], "grpo": [12, 24, 44]}[algo]
    assert {m["model"] for m in result["micro_batch"]} == {"policy", "critic"}
    for algo in ("ppo", "grpo"):  # the evaluation at step 0 and at the end; the 1.5B checkpoint never written
        run = result[f"end_to_end_{algo}"]
        assert run["evaluated_at"] == [0, 3] and [s["step"] for s in run["checkpoints_not_written"]] == [3]
    assert result["save_and_resume"]["ok"] and result["save_and_resume"]["steps"] == [3, 3]
    assert set(result["seconds"]) == {"attention", "fp32", "micro", "grpo", "ppo", "save"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "problems.jsonl"]  # nothing left
    # each part's models gone before the next (a run's Session once held them until the next run's ended)
    assert set(result["leftovers"]) == set(result["seconds"])
    assert all(left["models_alive"] == [] for left in result["leftovers"].values()), result["leftovers"]
    for algo in ("ppo", "grpo"):  # each phase's peak beside the plan's figure (the host's on the CPU, 0 measured)
        phases = result[f"end_to_end_{algo}"]["phases"]
        assert set(phases) == {"generation", "update"} and all(p["ok"] and p["plan_gib"] > 0 for p in phases.values())


PLANTED = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("gpu_check", Path(sys.argv[1]) / "benchmarks" / "gpu_check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
from machinery.console import fail

def planted_fp32():
    fail("planted in the fp32 part")

def planted_train(args, on_step=None):  # the end-to-end runs write into their folder, then fail or hang
    Path(args.out).mkdir(parents=True)
    Path(args.out, "model.safetensors").write_bytes(bytes(2**20))
    if args.algo == "grpo":
        fail("planted in the grpo run")
    time.sleep(600)

check.fp32_head_grad = planted_fp32
check.remix.train = planted_train
check.GRADER = True
check.main(sys.argv[2:])
"""


@pytest.mark.long
@pytest.mark.slow
def test_a_part_of_the_gpu_check_that_fails_or_hangs_leaves_the_others_and_no_folder(tmp_path):
    """A part that calls fail() (SystemExit) and one that runs past its limit are recorded, the other parts still
    run, their run folders are removed, and the check exits 1 with every result in gpu_check.json."""
    done = subprocess.run([sys.executable, "-c", PLANTED, str(HERE), str(tmp_path), "--parts", "attention,fp32,grpo,ppo",
                           "--part-limit-s", "20"], env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True,
                          text=True, timeout=600, cwd=HERE)
    assert done.returncode == 1, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["cudnn_attention"]["ok"] is True  # the part before the failures
    assert result["fp32_head_grad"]["error"] == "SystemExit: 2" and "planted in the fp32 part" in done.stderr
    assert result["end_to_end_grpo"]["error"] == "SystemExit: 2" and "planted in the grpo run" in done.stderr
    assert result["end_to_end_ppo"]["error"].startswith("PartTimeout") and result["seconds"]["ppo"] < 60
    assert done.stdout.strip().splitlines()[-1].endswith("failed: fp32, grpo, ppo")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "problems.jsonl"]  # nothing left


PLANTED_PEAK = """
import dataclasses, importlib.util, os, signal, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("gpu_check", Path(sys.argv[1]) / "benchmarks" / "gpu_check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
from machinery import plan

check.VLLM = False  # transformers' generate, one step: the quicker run (the dry run above has the whole one)
three_steps = check.run_args
check.run_args = lambda *args, **kwargs: dataclasses.replace(three_steps(*args, **kwargs), steps=1, eval_every=0)
plan.free_bytes = lambda path: 1  # the free space at its one reading: no real checkpoint fits
check.memory = lambda peak=False: 10**13 if peak else 0  # every peak read 10 TB, above any plan

def stopped_by_sigterm(data, out):  # a SIGTERM once a remix run's handlers have replaced the check's own
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)

check.save_and_resume = stopped_by_sigterm
check.main(sys.argv[2:])
"""


@pytest.mark.long
@pytest.mark.slow
def test_the_gpu_check_flags_a_peak_above_the_plan_plans_no_stubbed_checkpoint_and_ends_143_on_sigterm(tmp_path):
    """One real GRPO part (the dry run's, one step) with the free space patched to 1 byte and every peak read 10 TB:
    the run is not refused for a checkpoint the check never writes, each phase's peak is recorded above the plan's
    figure as a failure, its models are gone after it; then a SIGTERM, after the run replaced the check's handler with
    remix's, ends the check with 143 (it exited 130: an uncaught KeyboardInterrupt)."""
    done = subprocess.run([sys.executable, "-c", PLANTED_PEAK, str(HERE), str(tmp_path), "--parts", "grpo,save",
                           "--budget-s", "1500", "--limit-s", "1500", "--part-limit-s", "1500"],
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=900,
                          cwd=HERE)
    assert done.returncode == 143 and "stopped by SIGTERM" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    run = result["end_to_end_grpo"]
    assert [s["phase"] for s in run["steps"]] == ["mix"], run  # not refused by the disk plan
    assert "disk: 0.0 MB needed, 0.0 MB there" in done.stdout  # the plan counts no checkpoint, against 1 byte free
    for phase in ("generation", "update"):
        row = run["phases"][phase]
        assert not row["ok"] and row["peak_gib"] > 9000 and 0 < row["plan_gib"] < 100, row
        assert f"grpo: the {phase} peak" in done.stdout
    assert result["leftovers"]["grpo"]["models_alive"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "problems.jsonl"]  # nothing left


def test_the_gpu_checks_command_line_takes_its_folder_anywhere(tmp_path):
    """`gpu_check.py --full OUT` (as docs/memory.md writes it) is OUT in full mode, not a folder named --full."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", HERE / "benchmarks" / "gpu_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    for argv in (["--full", "OUT"], ["OUT", "--full"]):
        parsed = check.parse(argv)
        assert parsed.out == "OUT" and parsed.full and parsed.parts.split(",") == check.PARTS
    with pytest.raises(SystemExit):
        check.parse(["OUT", "--parts", "fp23"])


@pytest.mark.long
@pytest.mark.slow
def test_the_soak_benchmarks_short_form_holds_memory_files_and_disk(tmp_path):
    """benchmarks/soak.py's pattern in 8 steps (vLLM, an evaluation every 2, a save every 3, reincarnation at 4,
    --keep-last 3): host memory flat within a loose bound, no file descriptor left open step after step, and after
    every save the checkpoints on disk what the layout says (the newest full, the older ones model folders)."""
    done = subprocess.run([sys.executable, str(HERE / "benchmarks" / "soak.py"), "--out", str(tmp_path / "soak"),
                           "--steps", "8", "--eval-every", "2", "--eval-limit", "1", "--save-every", "3",
                           "--reincarnate-step", "4", "--prompts-per-step", "4", "--max-response-tokens", "8",
                           "--warmup", "2"], env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "soak" / "soak.jsonl").open()]
    steps = [r for r in rows if not r.get("after_run")]
    assert [r["step"] for r in steps] == list(range(1, 9)) and {r["onednn_cache"] for r in steps} == {0}
    assert max(r["fds"] for r in steps[2:]) <= steps[2]["fds"] + 2  # a leak would add one or more every step
    assert max(r["rss_mb"] for r in steps[2:]) - steps[2]["rss_mb"] < 200  # MB: a loose bound on a busy machine
    saves = [r["layout"] for r in rows if r.get("layout")]
    assert [s["checkpoints"] for s in saves] == [["checkpoint-3"], ["checkpoint-3", "checkpoint-6"],
                                                 ["checkpoint-3", "checkpoint-6", "checkpoint-8"]]
    assert [s["full"] for s in saves] == [["checkpoint-3"], ["checkpoint-6"], ["checkpoint-8"]]
    assert all(s["checkpoint_bytes"] == s["layout_bytes"] for s in saves)


def test_fsdp_parameter_groups_are_read_in_each_torch_layout(tiny_model):
    """dist.unsharded saves and restores each FSDP2 group's post-forward setting. torch 2.13 and 2.14 keep a
    state's groups in a list, 2.11 (the lent GPU machine's) in one attribute that may be None: both give the same
    groups (the 2.11 layout shown by a state object with that one attribute, holding this torch's real group)."""
    import types

    from transformers import AutoModelForCausalLM

    dist.init()
    model = dist.shard(AutoModelForCausalLM.from_pretrained(tiny_model), torch.device("cpu"), torch.float32)
    state = model._get_fsdp_state()
    groups = dist._param_groups(state)
    assert groups == list(state._fsdp_param_groups) and len(groups) == 1
    assert dist._param_groups(types.SimpleNamespace(_fsdp_param_group=groups[0])) == groups
    assert dist._param_groups(types.SimpleNamespace(_fsdp_param_group=None)) == []


@pytest.mark.parametrize("program", ["remix", "eval"])
def test_a_torch_older_than_the_checked_range_is_refused_at_start(program, tiny_model, train_file, tmp_path, capsys,
                                                                   monkeypatch):
    """Where a program starts (dist.init): a torch before 2.11, whose FSDP2 remix was never read against, in one line
    with nothing written."""
    from tests.common import refused_in_one_line

    monkeypatch.setattr(torch, "__version__", "2.10.2+cu128")
    line = refused_in_one_line(program, tiny_model, train_file, tmp_path / "out", capsys)
    assert "torch 2.10.2+cu128 is older than 2.11: remix runs on torch 2.11 to 2.14" in line, line


def test_a_torch_in_the_checked_range_runs_silently_and_a_newer_one_is_warned_about_once(capsys, monkeypatch):
    for version in ("2.11.0+cu130", "2.13.0+cpu", "2.14.0", "2.14.2+cu128"):
        dist.check_torch(version)
    assert capsys.readouterr().out == ""
    monkeypatch.setitem(console._state, "prog", "eval")  # what eval.py's one_line_interrupts("eval") sets
    for _ in range(2):
        dist.check_torch("2.15.0.dev20270301+cu130")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("eval: warning: torch 2.15.0.dev20270301+cu130 is newer than 2.14")


@pytest.mark.long
@pytest.mark.slow
def test_the_device_wheel_folder_is_complete_and_small(tmp_path):
    """benchmarks/device_wheels.py fetches what requirements.txt needs beyond the GPU machine's packages, for its
    Python 3.12, with every dependency; its check finds a dependency taken out (from PyPI, as pip does)."""
    helper = [sys.executable, str(HERE / "benchmarks" / "device_wheels.py"), str(tmp_path)]
    done = subprocess.run(helper, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    names = {p.name.split("-")[0].lower() for p in tmp_path.glob("*.whl")}
    assert {"tyro", "math_verify", "latex2sympy2_extended", "antlr4_python3_runtime", "typeguard",
            "docstring_parser"} <= names and not names & {"torch", "transformers", "vllm", "numpy", "sympy"}
    assert sum(p.stat().st_size for p in tmp_path.glob("*.whl")) < 48 * 2**20
    next(tmp_path.glob("typeguard-*.whl")).unlink()
    done = subprocess.run(helper + ["--check"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "typeguard" in done.stderr and "needed by tyro" in done.stderr, done.stderr


@pytest.mark.slow
def test_the_method_imports_without_the_command_lines_parser(tmp_path):
    """A bare GPU machine has torch and transformers but no tyro: gpu_check imports remix.py there, and
    `python remix.py` without tyro says what to install, in one line."""
    hide = "import sys; sys.modules['tyro'] = None; "  # a module set to None cannot be imported
    settings = "import remix; from machinery import console; print(console.settings(remix.Args).prompts_per_step)"
    done = subprocess.run([sys.executable, "-c", hide + settings],
                          cwd=HERE, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr[-2000:]
    main = hide + "sys.argv = ['remix.py', '--help']; import runpy; runpy.run_path('remix.py', run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", main], cwd=HERE, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "tyro" in lines[0] and "requirements.txt" in lines[0], done.stderr


@pytest.mark.slow  # with its benchmark: a fork must not fail an unrelated fast test on its first commit
def test_every_planted_bug_of_the_mutation_check_still_applies():
    """benchmarks/mutation_check.py plants each bug by replacing one exact piece of code. A reshaped line
    silently retires its mutant until someone runs the script, so check here that every piece still occurs
    exactly once and that the mutant changes it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutation_check", HERE / "benchmarks" / "mutation_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert len(check.MUTANTS) >= 28
    for name, (path, old, new, *_) in check.MUTANTS.items():
        assert (HERE / path).read_text().count(old) == 1, f"mutant {name!r}: its code is no longer in {path}"
        assert old != new, name


# ----------------------------------------------------------------------------------------------
# Forking for an ablation: each diff of docs/forks applied to a copy of remix.py and run
# ----------------------------------------------------------------------------------------------
# Every fork of docs/forks in one process: each forked remix.py saved as remix_NAME.py and imported under that
# name (machinery never imports the method, so each runs its own code, its grader workers included)
FORKS_RUN = """import collections, importlib.util, json, os, random, sys, time, types, typing
sys.path[:0] = [{here!r}]
import test_remix
from machinery import console
from machinery import engines
from tests.common import bad_values
generate = engines.hf_generate
for name, path, algos in json.loads(sys.argv[1]):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    remix = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(remix)
    for algo in algos:  # two steps, saved at each; then resumed for a third, from the fork's own checkpoint
        out = os.path.join(os.path.dirname(path), name + "-" + algo)
        engines.hf_generate = generate  # the same right answers, drawn anew, for every fork and algorithm
        test_remix.scripted_right_answers(types.SimpleNamespace(setattr=setattr), {data!r})
        remix.train(console.settings(remix.Args, **{args!r}, algo=algo, out=out,
                                   group_size=2 if algo == "grpo" else 1))
        remix.train(console.settings(remix.Args, resume=out, steps=3))
    tried, refused, started = 0, 0, time.perf_counter()  # the fork's own flag checks: each value just outside a
    # numeric flag's range is refused, the method's and the run's
    every = console.settings_type(remix.Args)
    for flag, bound in console.ranges(every).items():
        for value in bad_values(bound, typing.get_type_hints(every)[flag] in (int, int | None)):
            tried += 1
            try:
                remix.train(console.settings(remix.Args, **{{**{args!r}, "out": out + "-refused", flag: value}}))
            except SystemExit as stop:
                refused += stop.code == 2
    print("FLAGS", name, round(time.perf_counter() - started, 1), "s", flush=True)
    random.seed(0)  # the share of 4,000 draws of one group from the newer of two stored batches (uniform: 0.5)
    replay = collections.deque([[[{{"b": 0}}] for _ in range(4)], [[{{"b": 1}}] for _ in range(4)]], maxlen=2)
    probe = sum(remix.draw_history(replay, 1)[0][0]["b"] for _ in range(4000)) / 4000
    print("FORK", json.dumps(dict(name=name, probe=probe, tried=tried, refused=refused, numeric=list(console.ranges(
        every)), budget=getattr(remix, "RESPONSE_BUDGET", {{}}).get("tokens"), refused_out=os.path.exists(
        out + "-refused"))), flush=True)
"""

# fork -> the logged key it changes (replay/probe: the probe above)
FORKS = {
    "recency_weighted_replay": "replay/probe",
    "p_schedule": "batch/fresh",
    "clip_centred_at_one": "losses/policy_loss",
    "grpo_informative_groups": "batch/historical",
    "kl_precedent_previous_policy": "losses/kl_convex",
    "dapo_clip_higher": "losses/clipfrac",
    "gspo_sequence_ratio": "losses/clipfrac",
    "dr_grpo": "losses/policy_loss",
    "sequence_mean": "losses/policy_loss",
    "format_reward": "reward/mean",
    "clip_higher_replayed_only": "losses/policy_loss",  # at step 2, where it replays (PPO's clipfrac stays)
    "length_penalty": "reward/mean",
}
GRPO_ONLY = ("grpo_informative_groups", "dr_grpo")  # they change GRPO's group advantage or its groups


def copy_project(folder: Path):
    """remix.py, eval.py (with deepscaler.py) and the machinery package, copied into folder (a fork's working copy)."""
    import shutil

    for file in ("remix.py", "eval.py", "deepscaler.py"):
        shutil.copy(HERE / file, folder / file)
    shutil.copytree(HERE / "machinery", folder / "machinery", ignore=shutil.ignore_patterns("__pycache__"))


def forked_file(name: str, folder: Path) -> Path:
    """remix.py with docs/forks/NAME.diff applied, saved as folder/remix_NAME.py."""
    work = folder / f"apply-{name}"
    work.mkdir()
    shutil.copy(HERE / "remix.py", work / "remix.py")
    applied = subprocess.run(["git", "apply", str(HERE / "docs" / "forks" / f"{name}.diff")], cwd=work,
                             capture_output=True, text=True)
    assert applied.returncode == 0, f"docs/forks/{name}.diff no longer applies: {applied.stderr}"
    return shutil.copy(work / "remix.py", folder / f"remix_{name}.py")


@pytest.mark.slow
def test_every_fork_applies_runs_saves_resumes_and_changes_what_it_should(tiny_model, train_file, tmp_path):
    """Each fork of docs/forks under GRPO and, where it applies, PPO, from a file of its own name: it runs, saves and
    resumes (steps 1-3 logged once each), refuses every value outside its flags' ranges (a flag it adds included),
    and changes what it should against the unforked code, run the same way."""
    jobs = [("unforked", str(shutil.copy(HERE / "remix.py", tmp_path / "remix_unforked.py")), ["grpo", "ppo"])]
    jobs += [(name, str(forked_file(name, tmp_path)), ["grpo"] if name in GRPO_ONLY else ["grpo", "ppo"])
             for name in FORKS]
    args = dict(model=tiny_model, dataset=train_file, steps=2, prompts_per_step=5, mini_batch_prompts=2,
                max_response_tokens=24, sampler="hf", save_every=1, keep_last=0, seed=3, actor_lr=3e-2,
                kl_convex_start=0, kl_convex_every=1, reincarnate_step=2, eval_every=0, log_completions=0)
    (tmp_path / "forks.py").write_text(FORKS_RUN.format(here=str(HERE), data=train_file, args=args))
    done = subprocess.run([sys.executable, str(tmp_path / "forks.py"), json.dumps(jobs)], capture_output=True,
                          text=True, timeout=1500, env=dict(os.environ, HF_HUB_OFFLINE="1", REMIX_DATA=str(DATA)))
    assert done.returncode == 0, done.stderr[-3000:]
    found = {r["name"]: r for r in (json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("FORK"))}
    assert set(found) == {job[0] for job in jobs}
    metrics = {(name, algo): read_metrics(tmp_path / f"{name}-{algo}") for name, _, algos in jobs for algo in algos}
    base = found["unforked"]
    assert abs(base["probe"] - 0.5) < 0.05 and all("reward/format" not in r for r in metrics["unforked", "grpo"])
    for name, path, algos in jobs:
        fork = found[name]
        assert fork["tried"] == fork["refused"] > 2 * len(fork["numeric"]) and not fork["refused_out"], fork
        assert set(fork["numeric"]) - set(base["numeric"]) == ({"clip_eps_high"} if name == "dapo_clip_higher" else
                                                               set()), name
        for algo in algos:
            rows = metrics[name, algo]
            assert [r["step"] for r in rows] == [1, 2, 3], (name, algo)
            if name == "unforked":
                continue
            if FORKS[name] == "replay/probe":
                assert fork["probe"] > 0.6, fork  # weights 1 and 2: two thirds from the newer batch
                continue
            assert [r[FORKS[name]] for r in rows] != pytest.approx([r[FORKS[name]] for r in metrics["unforked", algo]],
                                                                   rel=1e-6, abs=1e-9), (name, algo)
    # what single forks must show
    grpo = {name: metrics[name, "grpo"] for name, _, _ in jobs}
    assert all(r["reward/format"] > 0 for r in grpo["format_reward"])
    assert [r["reward/correct"] for r in grpo["format_reward"]] == [r["reward/correct"] for r in grpo["unforked"]]
    assert grpo["grpo_informative_groups"][1]["batch/historical"] < grpo["unforked"][1]["batch/historical"]
    # p(2) = 0.2: 4 fresh prompts of 5 at step 2, against 3
    assert [r["batch/fresh"] for r in grpo["p_schedule"][:2]] == [6, 8]
    assert [r["batch/fresh"] for r in grpo["unforked"][:2]] == [6, 6]
    assert found["dr_grpo"]["budget"] == args["max_response_tokens"]  # the run's budget, not Args' 8192
    for algo in ("grpo", "ppo"):
        base, wider, longer = (metrics[name, algo] for name in ("unforked", "clip_higher_replayed_only", "length_penalty"))
        # the wider clip touches replayed samples only: step 1 has none, and its losses are the unforked step's to the
        # bit; step 2 replays (the loop above: its policy loss differs)
        same = ("losses/", "reward/", "offpolicy/", "kl/")
        assert {k: v for k, v in wider[0].items() if k.startswith(same)} == \
            {k: v for k, v in base[0].items() if k.startswith(same)}, algo
        assert wider[1]["batch/historical"] > 0, algo
        # the length penalty: 0.001 a token and 0.1 more when cut, by hand from the logged means; the answer check as is
        for row, plain in zip(longer, base):
            assert row["reward/length"] == pytest.approx(-0.001 * row["response/length_mean"]
                                                         - 0.1 * row["response/truncated"], abs=1e-9), algo
            assert row["reward/mean"] == pytest.approx(row["reward/correct"] + row["reward/length"], abs=1e-9)
        assert [r["reward/correct"] for r in longer] == [r["reward/correct"] for r in base], algo


def test_no_module_of_machinery_imports_the_method_or_finds_it_by_name():
    import ast

    for path in sorted((HERE / "machinery").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {"remix", "eval", "test_remix"} & imported, path.name
        assert "finalize.__module__" not in path.read_text() and "import_module(\"remix" not in path.read_text()


def test_a_fork_under_another_name_trains_evaluates_and_grades_with_its_own_functions(tiny_model, train_file,
                                                                                      tmp_path, monkeypatch):
    """remix_mine.py, a fork whose answer check calls every answer right and whose final answer is "forked": its
    training reward (grader workers), its evaluation during training (grader workers again) and its completions log
    use its functions, and the unforked module's stay as they are."""
    source = (HERE / "remix.py").read_text()
    for head, body in (("def grade_response(response: str, answer: str) -> tuple[float, str]:\n", "return 1.0, 'ok'"),
                       ("def final_answer(response: str) -> str | None:\n", "return 'forked'")):
        assert source.count(head) == 1
        source = source.replace(head, f"{head}    {body}  # fork\n")
    (tmp_path / "remix_mine.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    import remix_mine

    out = tmp_path / "run"
    args = dataclasses.asdict(tiny_args(tiny_model, train_file, out, algo="grpo", group_size=2, prompts_per_step=4,
                                        steps=1, eval_every=1, eval_benchmarks=("aime24",), eval_limit=2,
                                        eval_max_tokens=8, log_completions=2))
    remix_mine.train(console.settings(remix_mine.Args, **args))
    rows = read_metrics(out)
    assert [r["eval/aime24/pass@1"] for r in rows] == [100.0, 100.0] and rows[1]["reward/mean"] == 1.0
    for step in (0, 1):
        samples = [json.loads(line) for line in (out / "eval" / f"step-{step}.jsonl").open()]
        assert len(samples) == 2 and all(s["correct"] and s["extracted"] == "forked" for s in samples)
    assert {json.loads(line)["extracted"] for line in (out / "completions.jsonl").open()} == {"forked"}
    assert remix.grade_response("no answer", "1") == (0.0, "no_boxed") and remix.final_answer("x") is None


def load_file(path: Path, name: str):
    """A method file imported from its path under a module name of its own (as eval.py and the forks test do)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_run_resumes_only_with_the_method_that_wrote_it_and_drops_no_saved_flag(tiny_model, train_file, tmp_path,
                                                                                   capsys):
    """A run records the method file that wrote it (name and sha256). The DAPO fork's run (a flag of its own,
    --clip-eps-high) resumed by remix.py: refused in one line naming both files; with --resume-other-method, refused in
    one line naming the fork's flag and its value, which remix.py would drop; by the fork: it continues, flag kept. A
    renamed copy of remix.py's run continues under remix.py with --resume-other-method, which records remix.py."""
    import hashlib

    fork_path = forked_file("dapo_clip_higher", tmp_path)
    fork = load_file(fork_path, "remix_dapo_clip_higher")
    tiny = dict(model=tiny_model, dataset=train_file, prompts_per_step=4, max_response_tokens=16, mini_batch_prompts=2,
                sampler="hf", save_every=1, seed=3, eval_every=0, log_completions=0, algo="grpo", group_size=2)
    out = tmp_path / "fork-run"
    fork.train(console.settings(fork.Args, **tiny, steps=1, out=str(out)))
    state = torch.load(out / "checkpoint-1" / "trainer_state.pt", weights_only=True)
    assert state["method"] == {"file": "remix_dapo_clip_higher.py",
                               "sha256": hashlib.sha256(fork_path.read_bytes()).hexdigest()}
    capsys.readouterr()
    one_line_exit(capsys, lambda: remix.train(console.settings(remix.Args, resume=str(out), steps=2)),
                  f"was written by remix_dapo_clip_higher.py (sha256 {state['method']['sha256'][:12]}), not by remix.py")
    one_line_exit(capsys, lambda: remix.train(console.settings(remix.Args, resume=str(out), steps=2,
                                                             resume_other_method=True)),
                  "saved argument --clip-eps-high = 0.28 is no flag of remix.py")
    assert not (out / "checkpoint-2").exists()
    fork.train(console.settings(fork.Args, resume=str(out), steps=2))
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    saved = torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=True)["args"]
    assert saved["method"]["clip_eps_high"] == 0.28 and "clip_eps_high" not in saved["run"]
    copy = load_file(shutil.copy(HERE / "remix.py", tmp_path / "remix_copy.py"), "remix_copy")
    out = tmp_path / "copy-run"
    copy.train(console.settings(copy.Args, **tiny, steps=1, out=str(out)))
    capsys.readouterr()
    one_line_exit(capsys, lambda: remix.train(console.settings(remix.Args, resume=str(out), steps=2)), "not by remix.py")
    remix.train(console.settings(remix.Args, resume=str(out), steps=2, resume_other_method=True))
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=True)["method"]["file"] == "remix.py"


@pytest.mark.slow
def test_eval_grades_with_the_method_it_is_named_and_says_when_another_trained_the_checkpoint(tiny_model, train_file,
                                                                                             tmp_path):
    """A fork whose answer check calls every answer right, in a folder of its own: trained one step, its checkpoint
    scores 100 on two benchmarks in eval.py --method remix_mine.py (its prompt and check, in the grading workers too)
    and 0 with the default remix.py, which says in one line that another method trained it; the same fork saved as
    remix.py in another folder (the module name of eval.py's own remix.py) scores 100 with --method too."""
    source = (HERE / "remix.py").read_text()
    head = "def grade_response(response: str, answer: str) -> tuple[float, str]:\n"
    assert source.count(head) == 1
    source = source.replace(head, f"{head}    return 1.0, 'ok'  # fork: every answer right\n")
    for folder, name in (("mine", "remix_mine.py"), ("clash", "remix.py")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text(source)
    fork = load_file(tmp_path / "mine" / "remix_mine.py", "remix_mine")
    run_folder = tmp_path / "run"
    fork.train(console.settings(fork.Args, model=tiny_model, dataset=train_file, prompts_per_step=2,
                              max_response_tokens=8, steps=1, sampler="hf", save_every=1, eval_every=0,
                              log_completions=0, out=str(run_folder)))
    model = run_folder / "checkpoint-1"
    for method, score, said in ((tmp_path / "mine" / "remix_mine.py", 100.0, False), (None, 0.0, True),
                                (tmp_path / "clash" / "remix.py", 100.0, True)):
        out = tmp_path / f"eval-{score}-{said}"
        done = subprocess.run([sys.executable, str(HERE / "eval.py"), "--model", str(model), "--benchmarks", "aime24",
                               "amc23", "--limit", "2", "--sampler", "hf", "--max-tokens", "8", "--out", str(out),
                               *(["--method", str(method)] if method else [])], capture_output=True, text=True,
                              timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())["greedy"]
        assert [summary[b]["pass@1"] for b in ("aime24", "amc23")] == [score, score], (method, summary)
        lines = [line for line in done.stdout.splitlines() if "was trained by remix_mine.py" in line]
        assert len(lines) == said, done.stdout[-3000:]
        assert not said or f"evaluated with {'remix.py' if method is None else method.name}" in lines[0]


@pytest.mark.long
@pytest.mark.slow
def test_the_format_reward_fork_leaves_eval_pass_at_1_alone(tmp_path):
    """eval.py reports the answer check, not the training reward: the same Pass@1 from the forked copy."""
    bench = [json.loads(line) for line in (DATA / "benchmarks" / "aime24.jsonl").open()][:4]
    responses = [f"so \\boxed{{{bench[0]['answer']}}}", "so \\boxed{-1}", "no answer", f"\\boxed{{{bench[3]['answer']}}}"]
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"benchmark": "aime24", "id": p["id"], "sample": 0, "answers": [p["answer"]],
                                           "response": r, "response_tokens": 5, "finish_reason": "stop"}) + "\n"
                               for p, r in zip(bench, responses)))
    summaries = []
    for name in (None, "format_reward"):
        fork = tmp_path / (name or "unforked")
        fork.mkdir()
        copy_project(fork)
        if name:
            subprocess.run(["git", "apply", str(HERE / "docs" / "forks" / f"{name}.diff")], cwd=fork, check=True)
        subprocess.run([sys.executable, str(fork / "eval.py"), "--regrade", str(samples), "--out", str(fork / "eval")],
                       check=True, capture_output=True, timeout=300)
        summaries.append(json.loads((fork / "eval" / "summary.json").read_text()))
    assert summaries[0]["greedy"]["aime24"]["pass@1"] == summaries[1]["greedy"]["aime24"]["pass@1"] == 50.0


if __name__ == "__main__" and len(sys.argv) > 1:
    {"update": distributed_main, "engine-tokens": engine_tokens_main, "batches": batches_main,
     "timeout": timeout_main}[sys.argv[1]](sys.argv[1:])
