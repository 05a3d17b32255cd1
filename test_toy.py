"""Tests of toy.py's task and bookkeeping: hand-worked targets graded by the real grader, the token budget
of the longest worked answer in the real toy tokenizer, and the rollouts-to-target arithmetic on
hand-made curves. The toy runs themselves are an experiment (python toy.py), not a test.

    pytest -q test_toy.py
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import remix  # noqa: E402
import toy  # noqa: E402
from tiny_model import build_tokenizer  # noqa: E402


def test_problem_and_worked_answer_by_hand():
    assert toy.problem((3, 5, 8, 2)) == {"problem": "What is 3 + 5 + 8 + 2?", "answer": "18"}
    assert toy.worked_answer((3, 5, 8, 2), scratchpad=True) == "3+5=8 8+8=16 16+2=18 \\boxed{18}"
    assert toy.worked_answer((3, 5, 8, 2), scratchpad=False) == "\\boxed{18}"


def test_both_answer_styles_grade_right_and_a_wrong_sum_grades_wrong():
    digits = (9, 0, 7, 4, 6)
    answer = toy.problem(digits)["answer"]
    assert answer == "26"
    assert remix.math_reward(toy.worked_answer(digits, True), answer) == 1.0
    assert remix.math_reward(toy.worked_answer(digits, False), answer) == 1.0
    assert remix.math_reward("9+0=9 9+7=16 16+4=20 20+6=27 \\boxed{27}", answer) == 0.0


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


def test_summary_targets_the_on_policy_mean_final_accuracy():
    results = [{"config": "grpo", "seed": s, "curve": curve(c)} for s, c in
               ((1, [0.5, 0.6, 0.7]), (2, [0.5, 0.55, 0.6]))]
    results += [{"config": "remix-grpo", "seed": s, "curve": curve(c)} for s, c in
                ((1, [0.5, 0.7, 0.8]), (2, [0.5, 0.6, 0.66]), (3, [0.5, 0.55, 0.6]))]
    summary = toy.summarize(results)
    assert summary["grpo"]["target"] == pytest.approx(0.65)  # mean of 0.7 and 0.6
    assert summary["remix-grpo"]["seeds_reaching_target"] == 2  # seed 3 ends at 0.6
    assert summary["remix-grpo"]["rollouts_to_target_median"] == 150  # reached at 100 and 200
    assert summary["grpo"]["rollouts_to_target_median"] == 200  # seed 1 only
    assert summary["remix-grpo"]["final_accuracy_mean"] == pytest.approx((0.8 + 0.66 + 0.6) / 3)
