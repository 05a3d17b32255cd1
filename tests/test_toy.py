"""Tests of toy.py's task and bookkeeping: hand-worked targets graded by the real grader, the token budget
of the longest worked answer in the real toy tokenizer, and the rollouts-to-target arithmetic on
hand-made curves; and one short toy run against the curve committed for it, so that a change that moves the toy's
numbers fails a test. The study itself is an experiment (python toy/toy.py --study), not a test.

    pytest -q tests/test_toy.py
"""

import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import remix  # noqa: E402
from machinery import evaluation  # noqa: E402
from tests.tiny_model import build_tokenizer  # noqa: E402
from toy import toy  # noqa: E402


def test_problem_and_worked_answer_by_hand():
    assert toy.problem((3, 5, 8, 2)) == {"problem": "What is 3 + 5 + 8 + 2?", "answer": "18"}
    assert toy.worked_answer((3, 5, 8, 2), scratchpad=True) == "3+5=8 8+8=16 16+2=18 \\boxed{18}"
    assert toy.worked_answer((3, 5, 8, 2), scratchpad=False) == "\\boxed{18}"


def test_both_answer_styles_grade_right_and_a_wrong_sum_grades_wrong():
    digits = (9, 0, 7, 4, 6)
    answer = toy.problem(digits)["answer"]
    assert answer == "26"
    assert evaluation.math_reward(remix.METHOD, toy.worked_answer(digits, True), answer) == 1.0
    assert evaluation.math_reward(remix.METHOD, toy.worked_answer(digits, False), answer) == 1.0
    assert evaluation.math_reward(remix.METHOD, "9+0=9 9+7=16 16+4=20 20+6=27 \\boxed{27}", answer) == 0.0


def test_longest_worked_answer_fits_the_response_limit():
    tokenizer = build_tokenizer()
    longest = toy.worked_answer((9, 9, 9, 9, 9), scratchpad=True)  # "9+9=18 18+9=27 27+9=36 36+9=45 \boxed{45}"
    assert len(tokenizer(longest, add_special_tokens=False).input_ids) + 1 == len(longest) + 1 == 42
    assert 42 <= toy.MAX_TOKENS


def curve(points):
    return [{"step": 5 * i, "accuracy": a, "rollouts": 100 * i, "tokens": 1000 * i, "seconds": float(i),
             "length": 12.0, "worked_share": 0.25} for i, a in enumerate(points)]


def test_cost_to_reach_is_the_first_evaluation_at_or_above_the_target():
    assert toy.cost_to_reach(curve([0.5, 0.6, 0.7, 0.65, 0.8]), 0.7) == \
        {"step": 10, "rollouts": 200, "tokens": 2000, "seconds": 2.0}
    assert toy.cost_to_reach(curve([0.5, 0.6]), 0.61) is None


def test_median_counts_never_as_never():
    assert toy.median([3.0, 1.0, 2.0]) == 2.0 and toy.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert toy.median([1.0, math.inf, math.inf]) == math.inf and toy.median([1.0, 2.0, math.inf]) == 2.0
    assert toy.median([1.0, 3.0, math.inf, math.inf]) == math.inf  # the middle pair holds a never


def test_bootstrap_interval_by_hand():
    # the median of three draws from (1, 2, 3): P(1) = P(3) = 7/27 (two or three of them), P(2) = 13/27. So the
    # 5th and 95th percentiles are 1 and 3, and the 30th and 70th are both 2 (P(<= 1) = 0.26 < 0.3, P(<= 2) = 0.74)
    assert toy.bootstrap_interval([1.0, 2.0, 3.0]) == (1.0, 3.0)
    assert toy.bootstrap_interval([1.0, 2.0, 3.0], level=0.4) == (2.0, 2.0)
    # (3, never, never): the median is never unless two draws are 3, P = 7/27 > 5%
    assert toy.bootstrap_interval([3.0, math.inf, math.inf]) == (3.0, math.inf)
    assert toy.bootstrap_interval([0.5, 0.5, 0.5]) == (0.5, 0.5)


def test_compare_reads_targets_from_hand_made_curves():
    on_policy = [{"curve": curve([0.5, 0.6, 0.7, 0.72])}, {"curve": curve([0.5, 0.55, 0.6, 0.66])}]
    remix_runs = [{"curve": curve([0.5, 0.7, 0.75, 0.8])}, {"curve": curve([0.5, 0.6, 0.66, 0.7])},
                  {"curve": curve([0.5, 0.55, 0.6, 0.65])}]
    result = toy.compare(remix_runs, on_policy)
    assert result["target_final"] == pytest.approx(0.69)  # the median of 0.72 and 0.66
    assert result["half_budget"] == 150 and result["target_half"] == pytest.approx(0.575)  # at 100 rollouts: 0.6, 0.55
    assert result["remix_rollouts_to_final"]["each"] == [100, 300, math.inf]  # the third never reaches 0.69
    assert result["remix_rollouts_to_final"]["median"] == 300
    assert result["on_policy_rollouts_to_final"]["each"] == [200, math.inf]
    assert result["remix_rollouts_to_half"]["each"] == [100, 100, 200]
    assert result["remix_tokens_to_half"]["median"] == 1000
    assert toy.accuracy_at(curve([0.5, 0.6, 0.7]), 150) == 0.6


@pytest.mark.slow
def test_a_short_toy_run_gives_exactly_the_committed_curve(tmp_path):
    """The toy study's results reproduce from the committed code: a short run (a base of 300 supervised steps, 4
    steps of ReMix-GRPO, seed 1, one thread, the baseline CPU kernels that every x86-64 machine runs alike) gives exactly
    the curve committed in docs/toy/pinned_curve.json. A change that moves the toy's numbers fails here; when that is meant, `python toy/toy.py --pin
    docs/toy/pinned_curve.json` regenerates it in the same commit, and the study is rerun."""
    import json
    import subprocess
    import sys

    from tests.common import ROOT

    done = subprocess.run([sys.executable, str(ROOT / "toy" / "toy.py"), "--pin", str(tmp_path / "curve.json"),
                           "--cache", str(tmp_path / "cache")], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "curve.json").read_text()) == json.loads((ROOT / "docs" / "toy" /
                                                                             "pinned_curve.json").read_text())


def test_method_runs_evaluate_every_6_steps_by_default_in_folders_of_their_own(capsys):
    """--method's default grid is every 6 steps, the study's every 3; a run is read back only from the folder of
    its grid, so a run evaluated every 3 steps is never taken for one evaluated every 6; a grid under 1 is one line
    (one past a run's steps is allowed: the study's 60-step runs share the flag with its 24-step ones)."""
    assert toy.settled(toy.ToyArgs()).eval_every == 3
    assert toy.settled(toy.ToyArgs(method="remix_mine.py")).eval_every == 6
    assert toy.settled(toy.ToyArgs(method="remix_mine.py", eval_every=2)).eval_every == 2
    job = toy.job_name("remix-grpo", 1, 3e-5, 24, 12)
    assert toy.run_dir("out", job, 3).as_posix() == "out/runs/remix-grpo/lr3e-05-steps24-T12/seed1"
    assert toy.run_dir("out", job, 6).as_posix() == "out/runs/remix-grpo/lr3e-05-steps24-T12-every6/seed1"
    assert toy.settled(toy.ToyArgs(eval_every=30)).eval_every == 30
    for bad in (0, -1):
        with pytest.raises(SystemExit) as exit_:
            toy.settled(toy.ToyArgs(eval_every=bad))
        assert exit_.value.code == 2 and capsys.readouterr().err.count("\n") == 1


@pytest.mark.slow
def test_a_users_fork_trains_beside_remix_py_at_the_same_seeds_and_both_curves_are_drawn(tmp_path):
    """toy.py --method in small (a base of 20 supervised steps, 40 held-out problems, 2 steps of ReMix-GRPO, one
    seed): the length-penalty fork of docs/forks, saved as remix_mine.py, and remix.py train from the same base at
    the same seed. Step 1 samples the same responses (the same length), and the fork's reward is remix.py's less
    0.001 a token and 0.1 for each cut response; both curves, the table and the plot are written."""
    import json
    import shutil
    import subprocess

    from tests.common import ROOT

    work = tmp_path / "fork"
    work.mkdir()
    shutil.copy(ROOT / "remix.py", work / "remix.py")
    subprocess.run(["git", "apply", str(ROOT / "docs" / "forks" / "length_penalty.diff")], cwd=work, check=True)
    fork = shutil.copy(work / "remix.py", tmp_path / "remix_mine.py")
    cache = toy.build_toy(tmp_path / "cache", supervised_steps=20, test=40)
    cli = toy.ToyArgs(out=str(tmp_path / "out"), cache=str(cache), method=str(fork), configs=("remix-grpo",), seeds=1,
                      steps=2, reincarnate_step=1, eval_every=1, workers=1, lr=1e-3)
    (tmp_path / "out").mkdir()
    table = toy.compare_method(cli, str(cache))
    label = toy.method_label(fork)
    assert label.startswith("remix_mine-") and "| remix-grpo |" in table
    record = json.loads((tmp_path / "out" / "method.json").read_text())
    runs = {r["config"]: r for r in record["runs"]}
    plain, mine = runs["remix-grpo"], runs[f"remix-grpo+{label}"]
    assert [p["step"] for p in plain["curve"]] == [p["step"] for p in mine["curve"]] == [0, 1, 2]
    assert plain["per_step"][0]["length"] == mine["per_step"][0]["length"]
    cost = plain["per_step"][0]["reward"] - mine["per_step"][0]["reward"]  # 0.001 a token, 0.1 more a cut response
    assert 0.001 * plain["per_step"][0]["length"] - 1e-9 <= cost <= 0.001 * plain["per_step"][0]["length"] + 0.1 + 1e-9
    assert (tmp_path / "out" / "method.png").stat().st_size > 0 and (tmp_path / "out" / "method.md").exists()
