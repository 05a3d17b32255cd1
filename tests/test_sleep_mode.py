"""The engine's sleep contract, on the CPU: vLLM's GPU sleep mode modelled around the real CPU engine
(tests/sleep_mode.py, read from vLLM 0.33's sources), first checked against what those sources do, then driven
through every sequence of calls training and eval.py make: the evaluation before step 1, sample, sleep, push, an
evaluation after a push, save, resume (the push after it), reincarnation, two processes, the end of the run.

    pytest -q tests/test_sleep_mode.py
"""

import json
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import remix  # noqa: E402
from machinery import console, engines  # noqa: E402
from tests import sleep_mode  # noqa: E402
from tests.common import ROOT, read_metrics, tiny_args  # noqa: E402

pytestmark = pytest.mark.slow  # every test here starts vLLM


@pytest.fixture
def stand_in(monkeypatch):
    """vllm.LLM with GPU sleep mode for this test; the engines it built, shut down after it."""
    built = sleep_mode.install(monkeypatch.setattr)
    yield built
    for llm in built:
        llm.llm_engine.engine_core.shutdown()


def shut(state: dict):
    if state.get("llm") is not None:
        state["llm"].llm_engine.engine_core.shutdown()


def tokens(llm, prompts):
    """Greedy and sampled token ids of two prompts, through the code training samples with."""
    return [engines.vllm_generate(llm, prompts, n, [7, 9], temperature, 1.0, 12, logprobs=False)
            for n, temperature in ((1, 0.0), (2, 1.0))]


def test_the_stand_in_sleeps_and_wakes_as_vllm_does(tiny_model, stand_in, caplog):
    from transformers import AutoModelForCausalLM

    args = remix.finalize_args(console.settings(remix.Args, model=tiny_model, sampler="vllm", precision="fp32"))
    llm = engines.start(args, 256)
    assert engines.sleeps(llm) and llm is stand_in[0]
    prompts = [[72, 105, 33], [50, 43, 50, 61]]
    before = tokens(llm, prompts)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model)  # the engine's own weights, to push back

    def raw_generate():
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        return llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(max_tokens=4), use_tqdm=False)

    # level 2: asleep, nothing generates (vLLM would queue and spin); waking one tag leaves it paused
    llm.sleep(level=2)
    assert llm.llm_engine.is_sleeping()
    with pytest.raises(sleep_mode.WouldHang, match="sleeping engine"):
        raw_generate()
    with pytest.raises(SystemExit):  # remix's own guard: one line, not the hang
        tokens(llm, prompts)
    assert llm.wake_up(tags=["kv_cache"]) is False and llm.llm_engine.is_sleeping()  # the hang
    with pytest.raises(sleep_mode.WouldHang, match="sleeping engine"):
        raw_generate()
    with caplog.at_level("WARNING", "sleep_mode"):
        assert llm.wake_up(tags=["kv_cache"]) is False  # waking an awake tag: a warning, nothing else
    assert "not in sleeping tags" in caplog.text and llm.sleeping_tags == {"weights"}
    with pytest.raises(sleep_mode.WouldHang, match="unmapped"):  # a load into sleeping weights
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(policy.state_dict().items())})
    assert llm.wake_up(tags=["weights"]) is True and not llm.llm_engine.is_sleeping()
    with pytest.raises(sleep_mode.WouldHang, match="garbage"):  # level 2 kept no copy of the weights
        raw_generate()
    engines.push_weights(llm, policy)
    assert tokens(llm, prompts) == before  # the push made it the same engine again
    # the noise is real: past the stand-in's check, the weights it left give other tokens
    llm.sleep(level=2)
    llm.wake_up()
    llm.weights_lost = False
    assert tokens(llm, prompts) != before
    engines.push_weights(llm, policy)
    assert tokens(llm, prompts) == before
    # level 1 keeps a host copy: a full wake needs no push
    llm.sleep(level=1)
    assert llm.wake_up() is True and tokens(llm, prompts) == before
    with caplog.at_level("WARNING", "sleep_mode"):
        llm.wake_up()
    assert "Executor is not sleeping" in caplog.text
    # push_weights wakes a sleeping engine whole, in vLLM's order: weights, the load, then the KV cache
    llm.sleep(level=2)
    llm.calls.clear()
    engines.push_weights(llm, policy)
    assert llm.calls == [("wake_up", ("weights",)), ("reload_weights",), ("wake_up", ("kv_cache",))]
    assert not llm.llm_engine.is_sleeping() and tokens(llm, prompts) == before


def sleep_run(tiny_model, train_file, out, **overrides):
    """A short GRPO run on vLLM: evaluations at steps 0, 2 and 3, reincarnation after step 2, a checkpoint at 2."""
    base = dict(algo="grpo", group_size=2, prompts_per_step=4, steps=3, sampler="vllm", reincarnate_step=2,
                save_every=2, eval_every=2, eval_limit=2, eval_max_tokens=8, eval_benchmarks=("aime24",),
                actor_lr=1e-3, precision="fp32")
    return tiny_args(tiny_model, train_file, out, **{**base, **overrides})


def same_run(a: list[dict], b: list[dict]):
    """Every logged figure equal, but the timings."""
    def figures(rows):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]

    assert figures(a) == figures(b)


def test_training_with_sleep_mode_runs_every_sequence_and_changes_nothing(tiny_model, train_file, tmp_path, stand_in):
    """With sleep on, the run makes each sequence (evaluation at 0, sample, sleep, push, evaluation after a push,
    save, reincarnation, resume) and logs exactly what the same run without sleep mode report."""
    state = remix.train(sleep_run(tiny_model, train_file, tmp_path / "sleep"))
    llm = state["llm"]
    assert llm is stand_in[0] and not llm.llm_engine.is_sleeping()  # awake at the end, for whatever comes next
    calls = [c[0] for c in llm.calls]
    assert calls.count("sleep") == 3 and calls.count("reload_weights") == 3
    assert calls.count("generate") == 3 + 3  # a sample each step; evaluations at 0, 2 and 3
    state["llm"] = None  # the fixture shuts it down
    awake = remix.train(sleep_run(tiny_model, train_file, tmp_path / "awake", vllm_sleep=False))
    assert not engines.sleeps(awake["llm"]) and len(stand_in) == 1
    shut(awake)
    sleepy, plain = read_metrics(tmp_path / "sleep"), read_metrics(tmp_path / "awake")
    assert [r["step"] for r in sleepy] == [0, 1, 2, 3] and "eval/aime24/pass@1" in sleepy[2]
    same_run(sleepy, plain)
    # the resume pushes the checkpoint's weights into a new engine, which samples step 3 alike
    resumed = tmp_path / "resumed"
    remix.train(sleep_run(tiny_model, train_file, resumed, steps=2))["llm"] = None
    state = remix.train(console.settings(remix.Args, resume=str(resumed), steps=3))
    assert [c[0] for c in stand_in[-1].calls][:2] == ["reload_weights", "generate"]
    state["llm"] = None
    same_run(read_metrics(resumed), sleepy)


def test_ppo_with_sleep_mode_matches_ppo_without(tiny_model, train_file, tmp_path, stand_in):
    runs = {}
    for name, sleep in (("sleep", True), ("awake", False)):
        state = remix.train(sleep_run(tiny_model, train_file, tmp_path / name, algo="ppo", group_size=1,
                                      prompts_per_step=6, vllm_sleep=sleep, save_every=0))
        if not sleep:
            shut(state)
        runs[name] = read_metrics(tmp_path / name)
    same_run(runs["sleep"], runs["awake"])


@pytest.mark.long
def test_the_command_line_and_two_processes_under_sleep_mode(tiny_model, train_file, tmp_path):
    """remix.py and eval.py as a user runs them, with GPU sleep mode: one process, then torchrun with two (each rank
    its own engine), evaluations included; then eval.py of the checkpoint. Each ends with exit 0 and no traceback."""
    stand_in = str(ROOT / "tests" / "sleep_mode.py")
    flags = ["--model", tiny_model, "--dataset", train_file, "--algo", "grpo", "--group-size", "2",
             "--prompts-per-step", "4", "--steps", "2", "--max-response-tokens", "8", "--sampler", "vllm",
             "--eval-every", "1", "--eval-limit", "2", "--eval-max-tokens", "8", "--eval-benchmarks", "aime24",
             "--save-every", "2", "--precision", "fp32"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    one = subprocess.run([sys.executable, stand_in, str(ROOT / "remix.py"), *flags, "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert one.returncode == 0 and "Traceback" not in one.stderr, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(29500 + os.getpid() % 1000 + 7), stand_in, str(ROOT / "remix.py"), *flags,
                          "--out", str(tmp_path / "two")], capture_output=True, text=True, timeout=600, env=env)
    assert two.returncode == 0 and "Traceback" not in two.stderr, two.stderr[-3000:]
    for name in ("one", "two"):
        rows = read_metrics(tmp_path / name)
        assert [r["step"] for r in rows] == [0, 1, 2] and all("eval/aime24/pass@1" in r for r in rows)
    evaluated = subprocess.run([sys.executable, stand_in, str(ROOT / "eval.py"), "--model",
                                str(tmp_path / "one" / "checkpoint-2"), "--benchmarks", "aime24", "--limit", "2",
                                "--max-tokens", "8", "--out", str(tmp_path / "eval")],
                               capture_output=True, text=True, timeout=600, env=env)
    assert evaluated.returncode == 0 and "Traceback" not in evaluated.stderr, evaluated.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["greedy"]["aime24"]["samples"] == 2


def test_a_gpu_engine_generates_on_one_thread_and_the_trainer_keeps_its_own(tiny_model, stand_in, monkeypatch):
    """vLLM serves with one torch CPU thread; start() keeps the trainer's count (kept_threads), so each generate
    on a GPU engine runs on one and gives the count back. The CPU engine's threads are left alone."""
    from machinery import dist

    llm = engines.start(remix.finalize_args(console.settings(remix.Args, model=tiny_model, sampler="vllm",
                                                           precision="fp32")), 256)
    seen, real = [], llm._llm.generate
    llm._llm.generate = lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k))[1]
    engines._set_threads(2)
    tokens(llm, [[72, 105, 33], [50, 43]])
    monkeypatch.setattr(dist, "device", lambda: torch.device("cuda"))  # what the engine's GPU path reads
    tokens(llm, [[72, 105, 33], [50, 43]])
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # set by the user: vLLM keeps it, and so does remix
    tokens(llm, [[72, 105, 33], [50, 43]])
    assert seen == [2, 2, 1, 1, 2, 2] and torch.get_num_threads() == 2
