"""Every piece of advice the plan prints, followed, gives a run the plan accepts (plan.remedies). For each kind of
advice, a run on a machine (its readings patched at their one reading: the GPU's free and total memory, the host's
available memory, each file system's free bytes) that does not fit and is told that kind; then each alternative the
line names is read off the line, added to the run's flags as a user would type it (a launcher's process count by
torchrun's variables and a modelled world), and the run is checked again from its flags: finalized, its flags
checked, planned. Every one must be accepted. Also the issue-43 repro: a small run the plan refused at the defaults.

    pytest -q tests/test_advice.py
"""

import dataclasses
import functools
import os
import re
import sys
import typing
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import remix  # noqa: E402
from machinery import console, data, dist, plan, runner  # noqa: E402
from tests.common import ROOT, tiny_args, unlock  # noqa: E402

R1_15B = str(ROOT / "benchmarks" / "configs" / "deepseek-r1-distill-qwen-1.5b.json")
GB = 1e9
SHAPE_OF = functools.cache(plan.shape_of)  # the configs these tests plan do not change


@pytest.fixture
def machine(monkeypatch):
    """Set the machine: set(gpu=(free, total) or None, host=bytes, disk=bytes or {path: bytes}); each reading patched
    where the plan takes it."""
    monkeypatch.setattr(plan, "shape_of", SHAPE_OF)

    def set_machine(gpu=None, host=1e13, disk=1e15, gpus=8):
        monkeypatch.setattr(plan, "device_memory", lambda: gpu)
        monkeypatch.setattr(plan, "host_available", lambda: host)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus if gpu else 0)
        if isinstance(disk, dict):  # one file system per path given
            monkeypatch.setattr(plan, "file_system", lambda path: max((p for p in disk if path.startswith(p)), key=len))
            monkeypatch.setattr(plan, "free_bytes", lambda path: disk[plan.file_system(path)])
        else:
            monkeypatch.setattr(plan, "free_bytes", lambda path: disk)

    return set_machine


def judge(given: dict, monkeypatch, capsys, world: int = 1, source: str = R1_15B, lengths=None) -> str | None:
    """The run of these flags (as typed: finalized, then checked) planned on the machine set: None where the plan
    accepts it, else its one error line. world > 1 models `torchrun --nproc-per-node world` on this node."""
    monkeypatch.setattr(dist, "world", lambda: world)
    monkeypatch.setattr(dist, "broadcast", lambda obj: obj)
    monkeypatch.setattr(dist, "all_gather", lambda obj: [obj] * world)
    if world > 1:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    else:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    args = remix.finalize_args(console.settings(remix.Args, **given))
    try:
        console.check_args(args, world)
        plan.check(args, source, lengths=lengths)
        return None
    except SystemExit as stop:
        assert stop.code == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("remix: error: "), err
        return err[0]


def alternatives(line: str) -> list[tuple[dict, int]]:
    """Each alternative the line advises, as (flags to add, processes): 'it fits with A, or B', or 'these together
    do: A B'. A parenthesis after a flag is read as a remark."""
    if "it fits with " in line:
        texts = line.split("it fits with ", 1)[1].split(", or ")
    elif "these together do: " in line:
        texts = [line.split("these together do: ", 1)[1]]
    else:
        return []
    hints = typing.get_type_hints(console.settings_type(remix.Args))
    found = []
    for text in texts:
        words, added, world = re.sub(r"\([^)]*\)", "", text).split(), {}, 1
        while words:
            word = words.pop(0)
            if word == "torchrun":
                assert words[:1] == ["--nproc-per-node"], text
                world = int(words[1])
                words = words[2:]
                continue
            name = word.removeprefix("--").replace("-", "_")
            kind = hints[name]
            if kind in (bool, bool | None):
                added[name] = True
            else:
                value = words.pop(0)
                added[name] = int(value) if int in typing.get_args(kind) + (kind,) else \
                    float(value) if float in typing.get_args(kind) + (kind,) else value
        found.append((added, world))
    return found


def followed(given: dict, line: str, monkeypatch, capsys, **kwargs) -> list[str]:
    """Every alternative of the line, followed: the lines of those the plan still refuses ([] when all are accepted)."""
    refused = []
    for added, world in alternatives(line):
        verdict = judge({**given, **added}, monkeypatch, capsys, world, **kwargs)
        if verdict is not None:
            refused.append(f"{added} x{world}: {verdict}")
    return refused


GPU = dict(precision="bf16")  # what finalize_args fills on a GPU; the rest of a run's defaults as they are


@pytest.mark.parametrize("advice, given, card, offer", [
    ("--sampler vllm", dict(algo="grpo", sampler="hf"), 80, "--sampler vllm"),
    ("--hf-batch-prompts", dict(algo="grpo", sampler="hf"), 80, "--hf-batch-prompts "),
    ("--sampler vllm (offloaded)", dict(algo="grpo", sampler="hf", offload=True), 24, "--sampler vllm"),
    ("--hf-batch-prompts (offloaded)", dict(algo="grpo", sampler="hf", offload=True), 24, "--hf-batch-prompts "),
    ("--offload", dict(algo="ppo"), 40, "--offload"),
    ("torchrun", dict(algo="grpo", prompts_per_step=120), 40, "torchrun --nproc-per-node 2"),
    ("--vllm-gpu-memory-utilization", dict(algo="grpo", offload=True, vllm_gpu_memory_utilization=0.9), 24,
     "--vllm-gpu-memory-utilization 0.54"),
    ("--gradient-checkpointing", dict(algo="grpo", offload=True, gradient_checkpointing=False,
                                      max_prompt_tokens=4096, max_response_tokens=28672), 40,
     "--gradient-checkpointing"),
    ("--max-tokens-per-micro-batch", dict(algo="grpo", offload=True, max_tokens_per_micro_batch=65536), 30,
     "--max-tokens-per-micro-batch 32768"),
    ("--algo grpo", dict(algo="ppo", group_size=2), 48, "--algo grpo (a method setting"),
    ("together", dict(algo="grpo", sampler="hf"), 24, "these together do: "),
])
def test_each_gpu_memory_advice_followed_is_accepted(advice, given, card, offer, machine, monkeypatch, capsys):
    """The paper's model on one GPU of `card` GB, all of it free: the run does not fit, the line offers the advice
    under test, and every alternative the line names, followed, is accepted."""
    machine(gpu=(card * GB, card * GB))
    line = judge({**GPU, **given}, monkeypatch, capsys)
    assert line is not None and "GPU memory per rank" in line and offer in line, line
    assert alternatives(line) and followed({**GPU, **given}, line, monkeypatch, capsys) == [], line


def test_the_default_grpo_run_with_transformers_sampler_does_not_fit_80_gb_and_vllms_does(machine, monkeypatch,
                                                                                           capsys):
    """Issue 42: at the GRPO defaults (128 prompts x 8 responses of up to 8,192 tokens; 32 prompts per generate
    call) transformers' KV cache of 256 rows x 9,216 positions is about 68 GB: the hf run is refused on an 80 GB card,
    naming the run-level settings first, the vLLM run fits; with --offload, the hf run no longer fits a 24 GB card."""
    machine(gpu=(80 * GB, 80 * GB))
    line = judge({**GPU, "algo": "grpo", "sampler": "hf"}, monkeypatch, capsys)
    assert line is not None and "GPU memory per rank" in line, line
    assert line.split("it fits with ")[1].startswith("--sampler vllm, or --hf-batch-prompts "), line
    assert judge({**GPU, "algo": "grpo"}, monkeypatch, capsys) is None
    machine(gpu=(24 * GB, 24 * GB))
    assert judge({**GPU, "algo": "grpo", "offload": True}, monkeypatch, capsys) is None
    assert "GPU memory per rank" in judge({**GPU, "algo": "grpo", "sampler": "hf", "offload": True}, monkeypatch,
                                          capsys)


def test_the_gpu_verdict_is_against_free_memory_not_the_cards_total(machine, monkeypatch, capsys):
    """An 80 GB card of which another process holds 30 GB: the vLLM GRPO run (54.4 GB) fits the total, not what is
    free; the line says 50 GB there, and its advice, followed, is accepted on that card."""
    machine(gpu=(50 * GB, 80 * GB))
    line = judge({**GPU, "algo": "grpo"}, monkeypatch, capsys)
    assert line is not None and "GPU memory per rank" in line and "50.0 GB there" in line, line
    assert alternatives(line) and followed({**GPU, "algo": "grpo"}, line, monkeypatch, capsys) == [], line


@pytest.mark.parametrize("advice, given, host, offer", [
    ("--gradient-checkpointing", dict(algo="grpo", sampler="vllm"), 110, "--gradient-checkpointing"),
    ("--max-tokens-per-micro-batch", dict(algo="grpo", sampler="vllm", gradient_checkpointing=True), 60,
     "--max-tokens-per-micro-batch 9216"),
])
def test_each_cpu_memory_advice_followed_is_accepted(advice, given, host, offer, machine, monkeypatch, capsys):
    """The paper's model on a CPU machine with `host` GB available (fp32; checkpointing off by default there):
    refused, the advice under test offered, every alternative followed accepted. (More processes never help on one
    host: each holds an engine and a runtime of its own, so the plan never offers torchrun there.)"""
    machine(gpu=None, host=host * GB)
    line = judge(given, monkeypatch, capsys)
    assert line is not None and "host memory" in line and offer in line, line
    assert followed(given, line, monkeypatch, capsys) == [], line


@pytest.mark.parametrize("advice, given, free, offer", [
    ("--keep-last", dict(algo="grpo", keep_last=3), 55, "--keep-last 2"),
    ("--save-every", dict(algo="grpo", keep_last=0, save_every=10), 100, "--save-every 40"),
    ("--eval-every", dict(algo="grpo", keep_last=1, eval_every=1, eval_max_tokens=32768), 80, "--eval-every 4"),
    ("--algo grpo", dict(algo="ppo", group_size=2, keep_last=1), 60, "--algo grpo (a method setting"),
    ("together", dict(algo="grpo", keep_last=3, eval_every=1, eval_max_tokens=32768), 55, "these together do: "),
])
def test_each_disk_advice_followed_is_accepted(advice, given, free, offer, machine, monkeypatch, capsys):
    """The paper's model's checkpoints (and 1,000 evaluation problems a time) on a disk with `free` GB: refused, the
    advice under test offered, every alternative followed accepted."""
    machine(gpu=(80 * GB, 80 * GB), disk=free * GB)
    lengths = plan.Lengths(eval_problems=1000)
    line = judge({**GPU, **given}, monkeypatch, capsys, lengths=lengths)
    assert line is not None and "the run does not fit: disk" in line and offer in line, line
    assert followed({**GPU, **given}, line, monkeypatch, capsys, lengths=lengths) == [], line


def test_evaluations_on_another_file_system_are_counted_there(machine, monkeypatch, capsys, tmp_path):
    """A resumed run's OUT/eval on a file system of its own (patched at the one reading of each): the checkpoints
    are judged against --out's free space, the evaluations against OUT/eval's, each a row of its own; the advice
    for the short one, followed, is accepted."""
    out = str(tmp_path / "run")
    given = {**GPU, "algo": "grpo", "keep_last": 1, "eval_every": 1, "eval_max_tokens": 32768, "out": out}
    lengths = plan.Lengths(eval_problems=1000)
    need = plan.evaluation_bytes(remix.finalize_args(console.settings(remix.Args, **given)), lengths)
    machine(gpu=(80 * GB, 80 * GB), disk={out: 1e15, os.path.join(out, "eval"): need / 2})
    line = judge(given, monkeypatch, capsys, lengths=lengths)
    assert line is not None and f"the run does not fit: disk of {out}/eval" in line and "--eval-every" in line, line
    assert followed(given, line, monkeypatch, capsys, lengths=lengths) == [], line
    machine(gpu=(80 * GB, 80 * GB), disk={out: 60 * GB, os.path.join(out, "eval"): 1e15})
    assert judge(given, monkeypatch, capsys, lengths=lengths) is None  # on one file system 60 GB would not hold both
    machine(gpu=(80 * GB, 80 * GB), disk=60 * GB)
    assert "the run does not fit: disk " in judge(given, monkeypatch, capsys, lengths=lengths)


def test_a_resumed_run_is_told_no_flag(machine, monkeypatch, capsys, tmp_path):
    """A resume continues with the run's saved flags (checkpoints.resume_args): the advice names none."""
    machine(gpu=(80 * GB, 80 * GB))
    args = remix.finalize_args(console.settings(remix.Args, **GPU, algo="grpo", sampler="hf", out=str(tmp_path),
                                              resume=str(tmp_path)))
    monkeypatch.setattr(dist, "world", lambda: 1)
    with pytest.raises(SystemExit):
        plan.check(args, R1_15B)
    line = capsys.readouterr().err.strip()
    assert line.endswith("a resumed run keeps its saved flags: a larger device") and "--" not in line, line


# ----------------------------------------------------------------------------------------------
# Issue 43's repro: a micro-batch holds no more than its mini-batch, nor a mini-batch more than the step
# ----------------------------------------------------------------------------------------------
SMOLLM_135M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
               "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
               "vocab_size": 49152, "max_position_embeddings": 2048, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
               "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 0}


def test_a_small_run_of_a_large_vocabulary_model_fits_a_24_gb_cpu_machine(tiny_model, train_file, tmp_path,
                                                                          monkeypatch, capsys):
    """Issue 43's repro: SmolLM-135M's shape (config only, built on the meta device; the tiny tokenizer beside it), 4
    prompts x 4 responses of 24 tokens, the default 16,384-token micro-batch and 1,024-token prompts, on a CPU
    machine with 24 GB available. Its activations had been planned for 16,384 tokens (25.9 GB of 33.6 GB); a
    mini-batch holds 16 rows of the data's longest prompt plus 24 tokens, and the run is accepted."""
    import json

    folder = tmp_path / "smollm"
    folder.mkdir()
    for name in os.listdir(tiny_model):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            (folder / name).write_bytes((Path(tiny_model) / name).read_bytes())
    (folder / "config.json").write_text(json.dumps(SMOLLM_135M))
    monkeypatch.setattr(plan, "device_memory", lambda: None)
    monkeypatch.setattr(plan, "host_available", lambda: 24 * GB)
    monkeypatch.setattr(data, "check_weight_files", lambda *args: None)  # a config without weights: the plan reads no more
    args = tiny_args(str(folder), train_file, tmp_path / "run", prompts_per_step=4, group_size=4,
                     max_response_tokens=24, mini_batch_prompts=32, max_tokens_per_micro_batch=16384, steps=1)
    session = runner.Session(args, remix.METHOD)
    try:
        kept = session.plan
        assert 130e6 < kept["shape"]["params"] < 140e6 and kept["shape"]["vocab"] == 49152
        longest = kept["lengths"]["prompt"]
        assert longest < 300 and kept["memory"]["tokens"] == 16 * (longest + 24)
        assert kept["host"] < 24 * GB
    finally:
        unlock()
    old = plan.memory(plan.shape_of(str(folder)), dataclasses.replace(session.args, mini_batch_prompts=10**4,
                                                                      prompts_per_step=10**4), 1, False,
                      False, 0.0)
    assert abs(old["parts"]["activations"] - 25.9e9) < 0.05e9  # the figure the issue saw, where a batch is large
