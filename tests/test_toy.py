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
from tests.common import math_reward  # noqa: E402
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
    assert math_reward(remix.METHOD, toy.worked_answer(digits, True), answer) == 1.0
    assert math_reward(remix.METHOD, toy.worked_answer(digits, False), answer) == 1.0
    assert math_reward(remix.METHOD, "9+0=9 9+7=16 16+4=20 20+6=27 \\boxed{27}", answer) == 0.0


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


@pytest.mark.long
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
    table, _ = toy.compare_method(cli, str(cache), toy.method_arms(cli)[0])
    record = json.loads((tmp_path / "out" / "method.json").read_text())
    label = record["label"]
    assert label.startswith("remix_mine-") and "| remix-grpo |" in table
    runs = {r["config"]: r for r in record["runs"]}
    plain, mine = runs[f"remix-grpo+{record['remix_label']}"], runs[f"remix-grpo+{label}"]
    assert [p["step"] for p in plain["curve"]] == [p["step"] for p in mine["curve"]] == [0, 1, 2]
    assert plain["per_step"][0]["length"] == mine["per_step"][0]["length"]
    cost = plain["per_step"][0]["reward"] - mine["per_step"][0]["reward"]  # 0.001 a token, 0.1 more a cut response
    assert 0.001 * plain["per_step"][0]["length"] - 1e-9 <= cost <= 0.001 * plain["per_step"][0]["length"] + 0.1 + 1e-9
    assert (tmp_path / "out" / "method.png").stat().st_size > 0 and (tmp_path / "out" / "method.md").exists()


# ----------------------------------------------------------------------------------------------
# A method beside remix.py: its own flags, the early check, the probe, the verdict in words, the machine recorded
# ----------------------------------------------------------------------------------------------
def fork_with_a_flag(folder):
    """remix.py with a flag of its own, off by default (0): --extra-entropy, added to the entropy bonus's coefficient
    in the policy's objective, and --extra-switch, a bool that nothing reads."""
    from tests.common import ROOT

    source = (ROOT / "remix.py").read_text()
    field = '    ent_coef: float = 0.001\n    """in [0, 1e6]: coefficient of the entropy bonus"""\n'
    term = "- args.ent_coef * entropy"  # in objective(), Eq. 6's entropy bonus
    assert source.count(field) == 1 and source.count(term) == 1
    source = source.replace(field, field + '    extra_entropy: float = 0.0\n    """in [0, 10]: added to --ent-coef"""\n'
                            '    extra_switch: bool = False\n    """read by nothing"""\n')
    source = source.replace(term, "- (args.ent_coef + args.extra_entropy) * entropy")
    path = folder / "remix_mine.py"
    path.write_text(source)
    return path


def load_args(path, name: str):
    """The Args of a method file imported under a module name of its own."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Args


def refused(capsys, call) -> str:
    """call() ends with exit code 2 and one stderr line, which is returned."""
    with pytest.raises(SystemExit) as exit_:
        call()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("toy: error: "), lines
    return lines[0]


def test_method_args_are_read_by_the_methods_own_args(tmp_path, capsys):
    """--method-args as on the method's command line: the fork's own flags (a number, a switch) and remix.py's flags
    the toy leaves to the method, each of its field's type; a tuple takes the values up to the next flag."""
    Args = load_args(fork_with_a_flag(tmp_path), "remix_mine_args")
    assert toy.parse_method_args(Args, "--extra-entropy 0.3 --extra-switch") == {"extra_entropy": 0.3,
                                                                                 "extra_switch": True}
    assert toy.parse_method_args(Args, "--extra-entropy=1e-2 --no-extra-switch --clip-eps 0.1 --no-grpo-vtrace "
                                       "--system-prompt None --precision fp32 --eval-benchmarks aime24 amc23") == {
        "extra_entropy": 0.01, "extra_switch": False, "clip_eps": 0.1, "grpo_vtrace": False, "system_prompt": None,
        "precision": "fp32", "eval_benchmarks": ("aime24", "amc23")}
    assert toy.parse_method_args(Args, "--prompt-suffix ' Answer in \\boxed{}.'") == {
        "prompt_suffix": " Answer in \\boxed{}."}
    assert toy.parse_method_args(Args, "") == {}
    assert "--extra-entropy" in refused(capsys, lambda: toy.parse_method_args(remix.Args, "--extra-entropy 0.3",
                                                                               "remix.py"))  # remix.py has none


def test_method_args_refuse_each_flag_the_toy_sets_for_both_arms_naming_the_toys_own(monkeypatch, capsys):
    """Every field the toy gives a run's settings (spied on at run_args, for every configuration) is refused in one
    line that says what to give instead: the toy's --steps, --lr, --configs, ... or that the toy fixes it."""
    from machinery import console

    given = set()
    monkeypatch.setattr(console, "settings", lambda cls, **fields: given.update(fields))
    for config in toy.CONFIGS:
        toy.run_args(config, 1, 3e-5, 24, 12, "toy", toy.Path("out"))
    monkeypatch.undo()
    assert {"steps", "actor_lr", "algo", "prompts_per_step", "group_size", "sampler", "model", "out", "seed"} <= given
    instead = {"steps": "--steps", "actor_lr": "--lr", "reincarnate_step": "--reincarnate-step", "seed": "--seeds",
               "algo": "--configs", "prompts_per_step": "--configs", "utd": "--configs", "out": "--out",
               "model": "--cache", "dataset": "--cache", "sampler": "--configs"}  # remix-ppo/vllm and ppo/vllm
    for field in given:
        flag = "--" + field.replace("_", "-")
        line = refused(capsys, lambda: toy.parse_method_args(remix.Args, f"{flag} 1"))
        assert f"{flag} is set by the toy for both arms" in line and instead.get(field, "") in line, line
    for flag in ("--on-policy", "--no-reincarnation", "--no-kl-convex"):  # switches of the configurations
        assert "--configs" in refused(capsys, lambda: toy.parse_method_args(remix.Args, flag))


def test_method_args_refuse_unknown_and_malformed_flags_in_one_line(tmp_path, capsys):
    Args = load_args(fork_with_a_flag(tmp_path), "remix_mine_bad_args")
    for text, said in (("--extra-entropi 0.3", "remix_mine.py has no flag --extra-entropi (did you mean "
                                               "--extra-entropy?)"),
                       ("--lr 1e-4", "has no flag --lr (--lr is the toy's own: give it outside --method-args)"),
                       ("--extra-entropy", "--extra-entropy needs a value"),
                       ("--extra-entropy high", "--extra-entropy takes a number, not 'high'"),
                       ("--extra-switch=1", "--extra-switch takes no value"),
                       ("--precision fp16", "--precision is one of bf16, fp32, not 'fp16'"),
                       ("extra-entropy 0.3", "'extra-entropy' is not a flag"),
                       ("--extra-entropy 0.1 --extra-entropy 0.2", "--extra-entropy is given twice"),
                       ("--system-prompt 'unclosed", "does not split into flags")):
        assert said in refused(capsys, lambda: toy.parse_method_args(Args, text, "remix_mine.py")), text


def test_method_args_given_as_two_words_reach_the_parser_as_one_value():
    assert toy.joined_method_args(["--method", "m.py", "--method-args", "--x 1 --y", "--seeds", "2"]) == \
        ["--method", "m.py", "--method-args=--x 1 --y", "--seeds", "2"]
    assert toy.joined_method_args(["--method-args=--x 1"]) == ["--method-args=--x 1"]


def test_a_methods_runs_are_named_by_its_code_its_flags_the_machinery_and_the_base(tmp_path):
    """Runs under --out are read back only under the same label: other flags, an edited file or another base model
    train anew; remix.py's arm runs in place, a method's from a folder holding its code as remix.py."""
    cache = tmp_path / "toy"
    cache.mkdir()
    (cache / "meta.json").write_text('{"version": [5, 1500, 1000]}')
    code = b"# a method\n"
    named = lambda code, flags: toy.name_arm(toy.Arm("m.py", "m.py", code, ("remix-grpo",), flags=flags), "m",  # noqa
                                             str(cache))
    arm = named(code, {})
    assert arm.label.startswith("m-") and len(arm.label) == 10 and named(code, {}).label == arm.label
    assert (arm.project / "remix.py").read_bytes() == code and (arm.project / "machinery" / "runner.py").exists()
    assert named(code, {"extra_entropy": 0.3}).label != arm.label != named(code + b"\n", {}).label
    (cache / "meta.json").write_text('{"version": [5, 300, 200]}')
    assert named(code, {}).label != arm.label
    reference = toy.reference_arm(("remix-grpo",), str(cache))
    assert reference.project is None and reference.label.startswith("remix-")
    assert reference.code == (toy.ROOT / "remix.py").read_bytes()


def runs_of(config: str, finals: list[float], rollouts: int = 1248, weights: str = "w") -> list[dict]:
    """Recorded runs, one a seed (1, 2, ...), whose curves end at these final accuracies."""
    return [{"config": config, "seed": seed, "weights_sha256": weights,
             "curve": [{"step": 0, "accuracy": 0.525, "rollouts": 0}, {"step": 24, "accuracy": a, "rollouts": rollouts}]}
            for seed, a in enumerate(finals, 1)]


def test_the_verdict_word_on_recorded_curves_by_hand():
    """Paired by seed, the mean of (method - remix.py) final Pass@1 with a percentile bootstrap 90% interval of that
    mean over 4,000 resamples of the seeds. Three seeds' differences take a mean of three draws, each 1/3 likely:
    (0.03, 0.04, 0.03): the lowest mean, 0.03, has P = (2/3)^3 = 0.30, so it is the 5th percentile; the highest, 0.04,
    has P = 1/27 = 0.037 < 0.05, so the 95th is the next, (0.04 + 0.04 + 0.03) / 3: [0.030, 0.0367], better.
    (-0.02, 0.01, 0.03): P(-0.02) = 1/27, then (-0.02 - 0.02 + 0.01) / 3 = -0.01 with 3/27; at the top 0.03 with 1/27,
    then (0.03 + 0.03 + 0.01) / 3 with 3/27: [-0.01, 0.0233], which holds 0: not resolved."""
    remix_runs = runs_of("remix-grpo", [0.70, 0.72, 0.74])
    v = toy.verdict(runs_of("remix-grpo+m", [0.73, 0.76, 0.77], rollouts=1368), remix_runs)
    assert v["word"] == "better" and v["seeds"] == 3 and v["difference"] == pytest.approx(0.1 / 3)
    assert (v["lo"], v["hi"]) == (pytest.approx(0.03), pytest.approx(0.11 / 3))
    assert v["rollouts_ratio"] == pytest.approx(1368 / 1248)
    v = toy.verdict(runs_of("remix-grpo+m", [0.68, 0.70, 0.71]), remix_runs)  # (-0.02, -0.02, -0.03)
    assert v["word"] == "worse" and (v["lo"], v["hi"]) == (pytest.approx(-0.08 / 3), pytest.approx(-0.02))
    v = toy.verdict(runs_of("remix-grpo+m", [0.68, 0.73, 0.77]), remix_runs)  # (-0.02, 0.01, 0.03)
    assert v["word"] == "not resolved" and (v["lo"], v["hi"]) == (pytest.approx(-0.01), pytest.approx(0.07 / 3))
    assert "not resolved (the 90% interval holds 0; more seeds narrow it)" in toy.verdict_words(v)
    assert toy.verdict_words(v).startswith("+0.007 [-0.010, +0.023] over 3 seeds, rollouts 1.00x")
    # the seeds are paired by their number, not by their order
    v = toy.verdict(runs_of("remix-grpo+m", [0.73, 0.76, 0.77])[::-1], remix_runs)
    assert v["each"] == pytest.approx([0.03, 0.04, 0.03])
    # the same runs at every seed: nothing to compare; the same curves but other final weights: a difference of 0
    assert toy.verdict(runs_of("remix-grpo+m", [0.70, 0.72, 0.74]), remix_runs)["word"] == "identical runs"
    v = toy.verdict(runs_of("remix-grpo+m", [0.70, 0.72, 0.74], weights="other"), remix_runs)
    assert v["word"] == "not resolved" and (v["lo"], v["hi"]) == (0.0, 0.0)
    assert toy.verdict_words(toy.verdict(remix_runs, remix_runs)).startswith("identical runs at all 3 seeds")


def test_results_json_names_the_machine_and_a_replot_invents_none(tmp_path, monkeypatch):
    """results.json records the CPU's model name and count, torch's version and CPU capability, the threads of a run,
    the runs at a time and the OS, each read here independently; a replot keeps what its record held, and a record
    made before the machine was recorded (the committed study's) gets none."""
    import json
    import platform

    import torch

    runs = [{"config": config, "seed": 1, "lr": 3e-5, "steps": 20, "T": 12, "curve": curve([0.5, 0.6, 0.65])}
            for config in ("grpo", "ppo")]
    cli = toy.ToyArgs(out=str(tmp_path), configs=("grpo", "ppo"), workers=2, steps=20)
    monkeypatch.setattr(toy, "plot", lambda *args: None)  # the plots are not what this test reads (seconds of them)
    toy.write_outputs(runs, cli, tmp_path)
    record = json.loads((tmp_path / "results.json").read_text())
    with open("/proc/cpuinfo") as cpuinfo:
        model = [line.split(":")[1].strip() for line in cpuinfo if line.startswith("model name")][0]
    assert record["machine"] == {"cpu": model, "cpus": os.cpu_count(), "torch": torch.__version__,
                                 "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads_per_run": 1,
                                 "workers": 2, "os": platform.platform(), "python": platform.python_version()}
    (tmp_path / "again").mkdir()
    toy.write_outputs(runs, cli, tmp_path / "again", saved={"cpu_capability": "AVX512"})
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert again["cpu_capability"] == "AVX512" and "machine" not in again


@pytest.mark.long
@pytest.mark.slow
def test_a_broken_method_file_is_one_line_naming_its_line_before_anything_is_built(tmp_path):
    """toy.py --method imports the file first, in a child process, as its jobs will: a syntax error, an exception at
    import, a file that is not a fork of remix.py, and a flag of its own out of its range or misspelled are each one
    line naming the file (and the line), exit 2, within a minute, with no cache or output folder made."""
    import concurrent.futures
    import subprocess
    import sys
    import time

    from tests.common import ROOT

    fork = fork_with_a_flag(tmp_path)
    lines = fork.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("METHOD = runner.Method("))
    (tmp_path / "raises.py").write_text("".join(lines[:at] + ["STEPS = {}['steps']\n"] + lines[at:]))
    (tmp_path / "syntax.py").write_text("import math\n\ndef train(args:\n    pass\n")
    (tmp_path / "other.py").write_text("def train(args):\n    return {}\n")
    cases = [("syntax.py", "", "syntax.py line 3: SyntaxError: "),
             ("raises.py", "", f"raises.py line {at + 1}: KeyError: 'steps' (raised while importing it)"),
             ("other.py", "", "other.py is not a fork of remix.py: it has no Args, build_prompt, METHOD"),
             ("remix_mine.py", "--extra-entropy 20", "--extra-entropy must be in [0, 10], got 20.0"),
             ("remix_mine.py", "--extra-entropi 2", "remix_mine.py has no flag --extra-entropi (did you mean "
                                                   "--extra-entropy?)")]

    def toy_run(case):
        name, method_args, _ = case
        started = time.perf_counter()
        done = subprocess.run([sys.executable, str(ROOT / "toy" / "toy.py"), "--method", str(tmp_path / name),
                               "--method-args", method_args, "--cache", str(tmp_path / f"cache-{name}"),
                               "--out", str(tmp_path / f"out-{name}")], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, HF_HUB_OFFLINE="1"))
        return done, time.perf_counter() - started

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for (name, _, said), (done, seconds) in zip(cases, pool.map(toy_run, cases)):
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("toy: error: ") and \
                said in lines[0], (name, done.stderr[-3000:])
            assert seconds < 60 and not (tmp_path / f"cache-{name}").exists() and not (tmp_path / f"out-{name}").exists()


@pytest.mark.long
@pytest.mark.slow
def test_a_fork_with_a_flag_of_its_own_is_identical_without_it_and_differs_by_a_verdict_with_it(tmp_path, capsys):
    """toy.py --method in small (a base of 20 supervised steps, 40 held-out problems, 2 steps of ReMix-GRPO, one
    seed) with a fork whose change sits behind a flag of its own, off by default. Without the flag the probe (its first
    2 steps beside remix.py's) warns in one line that the weights are the same bit for bit, and the verdict is
    identical runs; with --method-args turning it on, the probe says they differ, the runs differ, and the verdict
    gives the difference of the two final accuracies (one seed: the interval is that number) and its word. remix.py's
    runs are made once: the second call reads them back."""
    import json

    fork = fork_with_a_flag(tmp_path)
    cache = toy.build_toy(tmp_path / "cache", supervised_steps=20, test=40)
    out = tmp_path / "out"
    out.mkdir()
    cli = toy.ToyArgs(out=str(out), cache=str(cache), method=str(fork), configs=("remix-grpo",), seeds=1, steps=2,
                      reincarnate_step=1, eval_every=1, workers=2, lr=1e-3)
    capsys.readouterr()
    arm = toy.method_arms(cli)[0]
    text, line = toy.compare_method(cli, str(cache), arm)
    warnings = [x for x in capsys.readouterr().out.splitlines() if x.startswith("toy: warning:")]
    assert len(warnings) == 1 and "remix_mine.py computed what remix.py computes in the first 2 steps of remix-grpo" \
        in warnings[0] and "--method-args" in warnings[0]
    assert line == "toy: remix_mine.py against remix.py: remix-grpo: identical runs at all 1 seeds (every evaluation " \
                   "and the final weights the same)" and "**identical runs**" in text
    first = json.loads((out / "method.json").read_text())
    assert first["flags"] == {} and first["probe"] == {"steps": 2, "same_weights": True}
    remix_run = toy.run_dir(str(out), toy.job_name(f"remix-grpo+{first['remix_label']}", 1, 1e-3, 2, 1), 1)
    made = (remix_run / "curve.json").stat().st_mtime_ns

    cli = toy.dataclasses.replace(cli, method_args="--extra-entropy 5")
    arm = toy.method_arms(cli)[0]
    assert arm.flags == {"extra_entropy": 5.0}
    text, line = toy.compare_method(cli, str(cache), arm)
    assert "toy: remix_mine.py and remix.py differ after the first 2 steps of remix-grpo at seed 1 (the policy's " \
           "weights; probed in" in capsys.readouterr().out
    record = json.loads((out / "method.json").read_text())
    assert record["method_args"] == "--extra-entropy 5" and record["flags"] == {"extra_entropy": 5.0}
    assert record["label"] != first["label"] and record["remix_label"] == first["remix_label"]
    assert (remix_run / "curve.json").stat().st_mtime_ns == made  # read back, not trained again
    runs = {r["config"]: r for r in record["runs"]}
    plain, mine = runs[f"remix-grpo+{record['remix_label']}"], runs[f"remix-grpo+{record['label']}"]
    assert plain["per_step"][0]["length"] == mine["per_step"][0]["length"]  # step 1 samples with the same weights
    assert plain["weights_sha256"] != mine["weights_sha256"]
    difference = mine["curve"][-1]["accuracy"] - plain["curve"][-1]["accuracy"]
    v = record["comparison"]["remix-grpo"]["verdict"]
    assert v["difference"] == v["lo"] == v["hi"] == pytest.approx(difference) and v["seeds"] == 1
    assert v["word"] == ("better" if difference > 0 else "worse" if difference < 0 else "not resolved")
    assert line == f"toy: remix_mine.py against remix.py: remix-grpo: {toy.verdict_words(v)}"
    assert "| remix-grpo | 1 |" in text and record["machine"]["cpu_capability"]
