"""A newcomer's first minutes (issue 59): the terminal tells a run's story, and a refusal comes at once.

    pytest -q tests/test_first_minutes.py -m ""
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.common import ROOT, read_metrics

# remix.py run as its command line does, saying at its exit which heavy libraries it had imported
IMPORTS_AT_EXIT = ("import atexit, runpy, sys; atexit.register(lambda: print('imported:', *[m for m in "
                   "('transformers', 'vllm', 'datasets') if m in sys.modules], file=sys.stderr)); "
                   "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def run(script: str, *argv, probe: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, *(["-c", IMPORTS_AT_EXIT] if probe else []), str(ROOT / script), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def pass_text(scores: dict) -> str:
    """{"aime24": 0.0, "math500": 50.0, "average": 25.0} as the lines write it, worked out here."""
    each = ", ".join(f"{name} {value:.1f}%" for name, value in scores.items() if name != "average")
    return f"Pass@1 {scores['average']:.1f}% on average ({each})"


@pytest.mark.long
@pytest.mark.slow
def test_a_run_says_each_evaluations_pass1_and_ends_with_what_it_made(tiny_model, train_file, tmp_path):
    out = tmp_path / "run"
    done = run("remix.py", "--model", tiny_model, "--dataset", train_file, "--out", str(out), "--sampler", "hf",
               "--algo", "grpo", "--steps", "2", "--prompts-per-step", "4", "--group-size", "2",
               "--max-response-tokens", "8", "--eval-every", "1", "--eval-limit", "2", "--eval-benchmarks", "aime24",
               "math500", "--eval-max-tokens", "8")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    records = {r["step"]: r for r in read_metrics(out)}
    scores = {step: {name: r[f"eval/{name}/pass@1"] for name in ("aime24", "math500", "average")}
              for step, r in records.items()}
    for step in (0, 1, 2):  # one line per evaluation, its numbers those metrics.jsonl holds
        said = [line for line in lines if line.startswith(f"remix: evaluation at step {step}: greedy Pass@1")]
        assert said == [f"remix: evaluation at step {step}: greedy {pass_text(scores[step])}; samples in "
                        f"{out}/eval/step-{step}.jsonl"], lines
    assert (out / "checkpoint-2").is_dir()
    head, tail = lines[-1].split(" in ", 1)
    assert head == "remix: finished steps 1-2 of 2", lines[-1]
    assert tail.split("; ", 1)[1] == (f"at step 2 greedy {pass_text(scores[2])}; metrics in {out}/metrics.jsonl; "
                                      f"the last checkpoint is {out}/checkpoint-2; continue with --resume {out}"), lines[-1]


@pytest.mark.long
@pytest.mark.slow
def test_an_evaluation_ends_with_its_pass1_and_the_files_it_wrote(tiny_model, tmp_path):
    out = tmp_path / "eval"
    done = run("eval.py", "--model", tiny_model, "--sampler", "hf", "--limit", "3", "--max-tokens", "8",
               "--benchmarks", "amc23", "minerva", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    scores = {name: 100.0 * sum(s["correct"] for s in samples if s["benchmark"] == name) / 3
              for name in ("amc23", "minerva")}
    scores["average"] = (scores["amc23"] + scores["minerva"]) / 2
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("6 samples in "), last
    assert last.split("; ", 1)[1] == (f"greedy {pass_text(scores)} by math-verify; written to {out}: samples.jsonl, "
                                      f"summary.json, results.md"), last
    assert all((out / name).is_file() for name in ("samples.jsonl", "summary.json", "results.md"))


@pytest.mark.slow
def test_refusals_that_need_nothing_loaded_come_before_the_plan_and_any_model(tiny_model, train_file, tmp_path):
    """An earlier run's --out, a missing dataset, a bad flag: one line, no plan printed, no model library imported."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # what an earlier run left
    base = ["--model", tiny_model, "--sampler", "hf", "--algo", "grpo", "--steps", "2", "--prompts-per-step", "4",
            "--group-size", "2", "--max-response-tokens", "8", "--eval-limit", "2"]
    cases = [(["--dataset", train_file, "--out", str(out)], f"--out {out} already holds a run"),
             (["--dataset", str(tmp_path / "gone.jsonl"), "--out", str(tmp_path / "new")], "gone.jsonl"),
             (["--dataset", train_file, "--out", str(tmp_path / "new"), "--clip-eps", "-1"], "--clip-eps must be")]
    for extra, message in cases:
        done = run("remix.py", *base, *extra, probe=True)
        *refusal, imported = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(refusal) == 1 and refusal[0].startswith("remix: error: ") \
            and message in refusal[0], done.stderr[-2000:]
        assert imported == "imported:" and "plan:" not in done.stdout, (imported, done.stdout[-2000:])
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n' and not (tmp_path / "new").exists()
