"""The paper's experiment from one run: evaluation during training (logged beside the rollouts, equal to eval.py's
on the checkpoint, and the same under torchrun), the curves drawn from runs' logs, completions to read, the paper's
evaluation protocol, the DeepScaleR-rules grader beside math-verify, and a model without a chat template.

    pytest -q tests/test_experiment.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import eval as eval_cli  # noqa: E402
import remix  # noqa: E402
from tests.common import ROOT, read_metrics, run_remix, tiny_args, tiny_cli  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

EVAL = dict(eval_benchmarks=("aime24", "math500"), eval_limit=3, eval_max_tokens=8)


def torchrun(*argv, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(29600 + os.getpid() % 1000), *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def responses(path: Path) -> list[tuple]:
    rows = [json.loads(line) for line in path.open()]
    return sorted((r["benchmark"], str(r["id"]), r["response"], r["correct"]) for r in rows)


@pytest.mark.long
@pytest.mark.slow
def test_the_evaluation_during_training_is_eval_pys_on_the_checkpoint(tiny_model, train_file, tmp_path, capsys):
    """vLLM, greedy: the responses and Pass@1 logged at the last step are those eval.py gives the saved checkpoint,
    and the eval/* keys sit at steps 0, 1, 2 beside the rollout counts. Each evaluation shows its progress through
    vLLM's bar (a log gets plain lines: its start and its end, with vLLM's token speed), each step its line."""
    out = tmp_path / "run"
    state = remix.train(tiny_args(tiny_model, train_file, out, algo="grpo", group_size=2, steps=2, sampler="vllm",
                                  eval_every=1, actor_lr=1e-2, **EVAL))
    del state
    said = capsys.readouterr().out.splitlines()
    for step in (0, 1, 2):
        lines = [line for line in said if line.startswith(f"remix: evaluation at step {step}: ") and "|" in line]
        assert "| 0/6 [" in lines[0] and "| 6/6 [" in lines[-1] and "output:" in lines[-1], lines  # 6 responses
        assert all("\r" not in line for line in lines), lines
    assert [line.split(":")[1] for line in said if line.startswith("remix: step ")] == [" step 1/2", " step 2/2"]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert {"eval/aime24/pass@1", "eval/math500/pass@1", "eval/average/pass@1", "eval/math500/mean_tokens",
                "eval/aime24/self_reflection", "rollouts/total", "rollouts/generated_tokens"} <= set(r)
    assert rows[0]["rollouts/total"] == 0 < rows[1]["rollouts/total"] < rows[2]["rollouts/total"]
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["step-0.jsonl", "step-1.jsonl", "step-2.jsonl"]
    assert responses(out / "eval" / "step-0.jsonl") != responses(out / "eval" / "step-2.jsonl")  # the policy moved
    done = run_remix("--model", str(out / "checkpoint-2"), "--benchmarks", "aime24", "math500", "--limit", "3",
                     "--max-tokens", "8", "--out", str(tmp_path / "eval"), program="eval.py")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "eval: greedy aime24 run 1/1: 100%" in done.stdout and "| 3/3 [" in done.stdout and "\r" not in done.stdout
    assert responses(tmp_path / "eval" / "samples.jsonl") == responses(out / "eval" / "step-2.jsonl")
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())["greedy"]
    for name in ("aime24", "math500", "average"):
        assert rows[-1][f"eval/{name}/pass@1"] == summary[name]["pass@1"]
        assert rows[-1][f"eval/{name}/mean_tokens"] == summary[name]["mean_tokens"]


@pytest.mark.long
@pytest.mark.slow
def test_eval_and_the_evaluation_during_training_split_over_two_processes_as_one(tiny_model, train_file, tmp_path):
    flags = ["--model", tiny_model, "--benchmarks", "aime24", "amc83", "--limit", "3", "--max-tokens", "6",
             "--sampler", "hf"]
    one = run_remix(*flags, "--out", str(tmp_path / "one"), program="eval.py")
    two = torchrun(str(ROOT / "eval.py"), *flags, "--out", str(tmp_path / "two"))
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert responses(tmp_path / "one" / "samples.jsonl") == responses(tmp_path / "two" / "samples.jsonl")
    assert json.loads((tmp_path / "one" / "summary.json").read_text()) == \
        json.loads((tmp_path / "two" / "summary.json").read_text())
    run_flags = tiny_cli(tiny_model, train_file, tmp_path / "train1", "--steps", "1", "--eval-every", "1",
                         "--eval-benchmarks", "aime24", "--eval-limit", "3", "--eval-max-tokens", "6")
    assert run_remix(*run_flags).returncode == 0
    run_flags[run_flags.index("--out") + 1] = str(tmp_path / "train2")
    done = torchrun(str(ROOT / "remix.py"), *run_flags)
    assert done.returncode == 0, done.stderr[-3000:]
    for step in (0, 1):
        assert responses(tmp_path / "train1" / "eval" / f"step-{step}.jsonl") == \
            responses(tmp_path / "train2" / "eval" / f"step-{step}.jsonl")
    logged = [{k: v for k, v in r.items() if k.startswith("eval/")} for r in read_metrics(tmp_path / "train1")]
    assert logged == [{k: v for k, v in r.items() if k.startswith("eval/")} for r in read_metrics(tmp_path / "train2")]


def test_completions_are_logged_to_read(tiny_model, train_file, tmp_path):
    out = tmp_path / "run"
    remix.train(tiny_args(tiny_model, train_file, out, algo="grpo", group_size=2, steps=3, log_completions=4))
    rows = [json.loads(line) for line in (out / "completions.jsonl").open()]
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4 + [3] * 4
    for r in rows:
        assert set(r) == {"step", "historical", "version", "age", "prompt", "response", "answer", "extracted", "reward",
                          "reward_parts", "status", "length", "truncated"}
        assert r["age"] == r["step"] - r["version"] and r["historical"] == (r["age"] > 0)
        assert r["length"] <= 24 and r["reward"] == r["reward_parts"]["correct"] and r["prompt"] and r["answer"]
    assert any(r["historical"] for r in rows) and not any(r["historical"] for r in rows if r["step"] == 1)


@pytest.mark.long
@pytest.mark.slow
def test_the_curves_are_drawn_from_two_runs(tiny_model, train_file, tmp_path):
    for name in ("a", "b"):
        remix.train(tiny_args(tiny_model, train_file, tmp_path / name, algo="grpo", group_size=2, steps=2,
                              eval_every=1, seed=3 if name == "a" else 4, eval_benchmarks=("aime24",), eval_limit=2,
                              eval_max_tokens=4))
    drawn = eval_cli.main(eval_cli.EvalArgs(curves=(str(tmp_path / "a"), str(tmp_path / "b")),
                                            out=str(tmp_path / "curves")))
    for file in ("pass1_vs_rollouts.png", "pass1_vs_tokens.png", "length_and_reflection_vs_step.png"):
        assert (tmp_path / "curves" / file).stat().st_size > 10_000
    # Pass@1 at steps 0, 1, 2 for the average and aime24; length and reflection at steps 1, 2 (and 0 has none)
    assert drawn["pass1_vs_rollouts.png"] == {"a": 6, "b": 6}
    assert drawn["length_and_reflection_vs_step.png"] == {"a": 4, "b": 4}


def test_the_papers_protocol_and_the_two_graders(tiny_model, tmp_path):
    """--protocol paper: greedy, and temperature 0.1 with 32 seeded runs on AIME (one on MATH500), their mean and
    standard deviation across runs; every sample graded by math-verify and by DeepScaleR's rules."""
    summary = eval_cli.main(eval_cli.EvalArgs(model=tiny_model, benchmarks=("aime24", "math500"), limit=1, max_tokens=3,
                                              protocol="paper", sampler="hf", out=str(tmp_path / "paper")))
    assert set(summary) == {"greedy", "t0.1"}
    assert summary["greedy"]["aime24"]["runs"] == 1 and summary["t0.1"]["aime24"]["runs"] == 32
    assert summary["t0.1"]["math500"]["runs"] == 1 and summary["t0.1"]["aime24"]["samples"] == 32
    samples = [json.loads(line) for line in (tmp_path / "paper" / "samples.jsonl").open()]
    seeds = {s["seed"] for s in samples if s["run"] == "t0.1" and s["benchmark"] == "aime24"}
    assert len(seeds) == 32 and all("correct_deepscaler" in s for s in samples)


def test_the_graders_disagreement_is_counted(tmp_path):
    rows = [{"benchmark": "math500", "id": 1, "answers": ["\\frac{1}{2}"], "response": "\\boxed{2/4}"},  # mv: right
            {"benchmark": "math500", "id": 2, "answers": ["\\sqrt{2}"], "response": "\\boxed{\\sqrt[3]{2}}"},  # ds: right
            {"benchmark": "math500", "id": 3, "answers": ["5"], "response": "\\boxed{5}"}]  # both right
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    by_mv = eval_cli.main(eval_cli.EvalArgs(regrade=str(tmp_path / "s.jsonl"), out=str(tmp_path / "mv")))["greedy"]
    by_ds = eval_cli.main(eval_cli.EvalArgs(regrade=str(tmp_path / "s.jsonl"), out=str(tmp_path / "ds"),
                                            grader="deepscaler"))["greedy"]
    assert by_mv["math500"]["pass@1"] == pytest.approx(200 / 3) and by_ds["math500"]["pass@1"] == pytest.approx(200 / 3)
    assert by_mv["math500"]["disagree"] == by_ds["math500"]["disagree"] == 2
    assert "| graders disagree |" in (tmp_path / "ds" / "results.md").read_text()


def test_a_model_without_a_chat_template_trains_and_evaluates(train_file, tmp_path, capsys):
    model = build_tiny_model(str(tmp_path / "base"), chat=False)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    assert not tokenizer.chat_template
    assert remix.build_prompt(tokenizer, "What is 1+1?") == tokenizer("What is 1+1?" + remix.Args.prompt_suffix).input_ids
    remix.train(tiny_args(model, train_file, tmp_path / "run", steps=1))
    assert "has no chat template: prompts are the problem and --prompt-suffix as plain text" in capsys.readouterr().out
    summary = eval_cli.main(eval_cli.EvalArgs(model=model, benchmarks=("aime24",), limit=2, max_tokens=4, sampler="hf",
                                              out=str(tmp_path / "eval")))
    assert summary["greedy"]["aime24"]["samples"] == 2
    assert "has no chat template" in capsys.readouterr().out
