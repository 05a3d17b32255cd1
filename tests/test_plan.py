"""Tests of the plan before step 1 (machinery.plan) and of --offload: the figures against hand-worked arithmetic for the
paper's model, against real checkpoints and against the measured host memory of a real update (tests/plan_step.py);
a run that cannot fit stops in one line with nothing written (the free space patched at its one reading, and a real
3 MB file system); a close one is warned about and runs; --offload trains, saves and resumes as a run without it.

    pytest -q tests/test_plan.py
"""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import remix  # noqa: E402
from machinery import console, data, plan, runner  # noqa: E402
from tests.common import ROOT, full_state, read_metrics, tiny_args, unlock  # noqa: E402

CONFIGS = ROOT / "benchmarks" / "configs"
R1_15B = str(CONFIGS / "deepseek-r1-distill-qwen-1.5b.json")


def paper_args(**changes):
    """The defaults of a GPU run (bf16, checkpointing), as remix.finalize_args fills them on a GPU."""
    args = remix.finalize_args(console.settings(remix.Args, **changes))
    args.precision = "bf16"
    return args


# ----------------------------------------------------------------------------------------------
# The arithmetic, by hand, for DeepSeek-R1-Distill-Qwen-1.5B
# ----------------------------------------------------------------------------------------------
def test_the_paper_models_parameters_and_checkpoint_by_hand():
    """Qwen2: untied embeddings and head (2VH), per layer q/k/v with biases, o, the MLP's three matrices, two norms;
    the final norm. The critic has a one-output score head (weights and bias) for the output layer. A full PPO
    checkpoint: fp32 policy and critic, the bf16 reference (after step 100), AdamW's two fp32 moments of both: the
    issue's 'about 43 GB'."""
    shape = plan.shape_of(R1_15B)
    V, H, L, I, KV = 151936, 1536, 28, 8960, 256
    layer = (H * H + H) + 2 * (H * KV + KV) + H * H + 3 * H * I + 2 * H
    assert shape.params == 2 * V * H + L * layer + H == 1_777_088_000
    assert shape.critic_params == V * H + L * layer + H + H + 1  # the score head: H weights and a bias
    disk = plan.disk(shape, paper_args(), 1)
    by_hand = 4 * shape.params + 4 * shape.critic_params + 2 * shape.params + 8 * (shape.params + shape.critic_params)
    assert abs(disk["full"] - by_hand) / by_hand < 0.002 and 43e9 < disk["full"] < 44e9
    assert disk["saves"] == 7 and disk["kept_folders"] == 2  # 50, ..., 350; --keep-last 3
    assert disk["peak"] == 2 * disk["full"] + 2 * disk["model_folder"]
    assert abs(disk["policy"] - 4 * shape.params) < 0.01 * disk["policy"]  # the newest's fp32 master weights
    assert abs(disk["model_folder"] - 2 * shape.params) < 0.01 * disk["model_folder"]  # older ones: the base's bf16
    assert plan.disk(shape, paper_args(keep_last=0), 1)["peak"] == 2 * disk["full"] + 6 * disk["model_folder"]
    grpo = plan.disk(shape, paper_args(algo="grpo"), 1)
    assert grpo["critic"] == 0 and grpo["optimizer"] < disk["optimizer"] / 1.8


def test_the_paper_models_memory_per_gpu_by_hand():
    """Per rank: the states sharded over the ranks; the activations of a 16,384-token micro-batch with checkpointing
    (each layer's bf16 input, one layer recomputed with its mask bias of the 9,216-token row), and the critic's
    forward's kept beside them; the engine's share."""
    shape = plan.shape_of(R1_15B)
    P, Pc, H, I, L, V = shape.params, shape.critic_params, 1536, 8960, 28, 151936
    for world in (1, 2, 8):
        m = plan.memory(shape, paper_args(), world, False, True, 80e9)
        parts = m["parts"]
        assert parts["weights (fp32 masters)"] == 4 * (P + Pc) / world
        assert parts["AdamW moments (fp32)"] == 8 * (P + Pc) / world and parts["reference"] == 2 * P / world
        assert parts["engine"] == 0.35 * 80e9
    layer = 8 * H + 8 * 2 * H + 4 * 2 * I + 2 * 9216 + 24
    per_token = L * 2 * H + layer + (4 + 3) * H + 9216 + 4 * (H + I)
    assert parts["activations"] == 16384 * per_token
    # PPO's critic: its forward's layer inputs, embeddings, final norm and mask, kept through the policy's backward
    assert parts["critic activations"] == 16384 * (L * 2 * H + (4 + 3) * H + 9216)
    assert plan.memory(shape, paper_args(algo="grpo"), 1, False, True, 80e9)["parts"]["critic activations"] == 0
    assert parts["output layer"] == 5 * 1024 * V * 4 + 2 * 16384 * H * 2 + 4 * V * H
    m = plan.memory(shape, paper_args(), 1, False, True, 80e9)  # one GPU from here on
    parts = m["parts"]
    assert m["tokens"] == 16384 and m["width"] == 9216  # 256 rows of a mini-batch hold more: the flag bounds it
    assert parts["optimizer step (fp32)"] == 4 * P  # the foreach AdamW's intermediate over the larger model
    backward = parts["gathered weights"] + parts["activations"] + parts["critic activations"] + parts["output layer"]
    resident = parts["weights (fp32 masters)"] + parts["AdamW moments (fp32)"] + parts["reference"] + 1.5e9
    assert m["update"] == resident + parts["gradients (fp32)"] + max(backward, 4 * P)
    offloaded = plan.memory(shape, paper_args(), 1, True, True, 80e9)
    assert offloaded["parts"]["weights (fp32 masters)"] == offloaded["parts"]["AdamW moments (fp32)"] == 0
    assert offloaded["host_parts"]["AdamW moments (fp32)"] == 8 * (P + Pc)
    # the offloaded step's intermediate is on the host; on the GPU, the root's shards (embeddings, head, final norm)
    # in fp32 on their way in and their fp32 gradients on their way out: 3.7 GB, within the 2-4 GB
    root = 2 * V * H + H
    assert offloaded["host_parts"]["optimizer step (fp32)"] == 4 * P
    assert offloaded["parts"]["optimizer step (fp32)"] == 0
    assert offloaded["parts"]["offload copies (fp32)"] == 8 * root and 3.7e9 < 8 * root < 3.8e9
    assert offloaded["update"] == 1.5e9 + parts["reference"] + backward + 8 * root
    host = plan.host(shape, paper_args(), 1, 1, True)
    # the process and its 2 grader workers (0.65 + 2 x 0.3 GB), offloaded states, the step, a save's whole model
    assert host == pytest.approx(1.25e9 + 16 * (P + Pc) + 4 * P + 4 * P, rel=1e-12)


def test_the_paper_models_kv_cache_under_transformers_sampler_by_hand():
    """GRPO's defaults with --sampler hf on one GPU: a generate call of 32 prompts x 8 responses, 1,024 + 8,192
    positions, bf16 keys and values of 2 KV heads x 128 in each of 28 layers, one layer more for the decode step's
    torch.cat, and the step's four fp32 [256, V] logits blocks: the issue's 67.6 GB for the 28 layers."""
    shape = plan.shape_of(R1_15B)
    m = plan.memory(shape, paper_args(algo="grpo", sampler="hf"), 1, False, True, 80e9)
    rows, positions, layer = 32 * 8, 1024 + 8192, 2 * 256 * 2  # keys and values of one position, bytes
    assert abs(28 * layer * rows * positions - 67.6e9) < 0.1e9
    assert m["parts"]["generation cache"] == 29 * layer * rows * positions + 4 * 4 * rows * 151936
    assert m["parts"]["engine"] == 2 * shape.params  # the policy gathered whole to generate
    assert m["generation"] > 80e9 > plan.memory(shape, paper_args(algo="grpo"), 1, False, True, 80e9)["peak"]
    by_batch = plan.memory(shape, paper_args(algo="grpo", sampler="hf", hf_batch_prompts=8), 1, False, True, 80e9)
    assert by_batch["parts"]["generation cache"] == 29 * layer * 64 * positions + 4 * 4 * 64 * 151936


@pytest.mark.parametrize("algo, gb, fits, with_offload", [("ppo", 80, True, True), ("ppo", 40, False, True),
                                                           ("grpo", 24, False, True), ("ppo", 24, False, True)])
def test_which_cards_fit_the_paper_model_as_the_docs_say(algo, gb, fits, with_offload):
    """docs/memory.md's verdicts for one GPU: PPO fits 80 GB; with --offload, PPO fits 40 GB and GRPO 24 GB."""
    shape = plan.shape_of(R1_15B)
    args = paper_args(algo=algo)
    assert (plan.memory(shape, args, 1, False, True, gb * 1e9)["peak"] <= gb * 1e9) == fits
    assert (plan.memory(shape, args, 1, True, True, gb * 1e9)["peak"] <= gb * 1e9) == with_offload


# ----------------------------------------------------------------------------------------------
# A run that cannot fit, or is close
# ----------------------------------------------------------------------------------------------
def one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("remix: error: "), err
    return err[0]


def test_a_run_whose_checkpoints_do_not_fit_stops_in_one_line_before_writing(tiny_model, train_file, tmp_path,
                                                                              monkeypatch, capsys):
    """The free space patched at its one reading: between the peak under --keep-last 1 and under 2, so the line
    says by how much and names --keep-last 1 alone; --out is never created."""
    args = tiny_args(tiny_model, train_file, tmp_path / "run", algo="grpo", group_size=2, save_every=1)
    figures = plan.disk(plan.shape_of(tiny_model), remix.finalize_args(tiny_args(tiny_model, train_file, tmp_path,
                                                                                 algo="grpo", group_size=2,
                                                                                 save_every=1)), 1)
    free = 2 * figures["full"] + figures["model_folder"] // 2
    monkeypatch.setattr(plan, "free_bytes", lambda path: free)
    with pytest.raises(SystemExit) as stop:
        remix.train(args)
    assert stop.value.code == 2
    line = one_line(capsys)
    short = (2 * figures["full"] + 2 * figures["model_folder"] - free) / 1e6
    assert "disk" in line and f"({short:.1f} MB short)" in line, line
    assert "it fits with --keep-last 1" in line and "--keep-last 2" not in line, line
    assert not (tmp_path / "run").exists()


def test_a_real_3_mb_file_system_stops_the_run_before_writing(tiny_model, train_file, tmp_path, capsys):
    """A tmpfs of 3 MB (a tiny PPO checkpoint is about 8 MB): the plan reads the real free space and stops."""
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount is not permitted here: {mounted.stderr.decode().strip()[:200]}")
    try:
        with pytest.raises(SystemExit) as stop:
            remix.train(tiny_args(tiny_model, train_file, disk / "run", algo="ppo"))
        assert stop.value.code == 2
        line = one_line(capsys)
        assert "the run does not fit: disk" in line and "MB there" in line, line
        assert os.listdir(disk) == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_close_run_is_warned_about_and_goes_on_and_its_plan_is_kept(tiny_model, train_file, tmp_path,
                                                                     monkeypatch, capsys):
    out = tmp_path / "run"
    args = remix.finalize_args(tiny_args(tiny_model, train_file, out, algo="grpo", group_size=2))
    need = plan.disk(plan.shape_of(tiny_model), args, 1)["peak"]
    monkeypatch.setattr(plan, "free_bytes", lambda path: need / 0.95)
    session = runner.Session(args, remix.METHOD)
    try:
        printed = capsys.readouterr().out
        assert "remix: warning: disk is close" in printed and "(95%)" in printed, printed
        assert "remix: plan: checkpoints:" in printed and not out.exists()  # checked before anything is written
        session.start(*remix.models.load(args), [], collections.deque(), None)  # the run goes on: --out written
        kept = json.loads((out / "plan.json").read_text())
        assert kept["disk"]["peak"] == need and kept["rows"][0][0] == "disk"
        assert session.plan["disk"]["peak"] == need
    finally:
        unlock()


def test_a_gpu_that_cannot_hold_the_run_names_offload(tiny_model, train_file, tmp_path, monkeypatch, capsys):
    """The paper's model on one 40 GB GPU (the device's size patched at its one reading; the config beside the tiny
    tokenizer): PPO does not fit, and the line names --offload, which does."""
    folder = tmp_path / "r1"
    folder.mkdir()
    for name in os.listdir(tiny_model):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            (folder / name).write_bytes((Path(tiny_model) / name).read_bytes())
    (folder / "config.json").write_text(Path(R1_15B).read_text())
    monkeypatch.setattr(plan, "device_memory", lambda: (40e9, 40e9))  # (free, total)
    monkeypatch.setattr(plan, "free_bytes", lambda path: 1e15)
    monkeypatch.setattr(plan, "host_available", lambda: 1e12)
    monkeypatch.setattr(data, "check_weight_files", lambda *args: None)  # a config without weights: the plan reads no more
    with pytest.raises(SystemExit):
        remix.train(tiny_args(str(folder), train_file, tmp_path / "run", algo="ppo", precision="bf16",
                              sampler="vllm"))
    line = one_line(capsys)
    assert "GPU memory per rank" in line and "--offload" in line.split("it fits with")[1], line
    assert not (tmp_path / "run").exists()


def test_the_machine_is_read_for_what_is_free(tmp_path, monkeypatch):
    """Each reading at its source: the host's MemAvailable, no more than a cgroup v2 limit leaves (and all of it
    without one); the GPU's free and total memory from torch.cuda.mem_get_info; every rank's GPU, the least free."""
    (tmp_path / "meminfo").write_text("MemTotal:       64000000 kB\nMemAvailable:   20000000 kB\n")
    limited = tmp_path / "limited"
    limited.mkdir()
    (limited / "memory.max").write_text("8000000000\n")
    (limited / "memory.current").write_text("3000000000\n")
    unlimited = tmp_path / "unlimited"
    unlimited.mkdir()
    (unlimited / "memory.max").write_text("max\n")
    (unlimited / "memory.current").write_text("3000000000\n")
    meminfo = str(tmp_path / "meminfo")
    assert plan.host_available(meminfo, str(limited)) == 5e9
    assert plan.host_available(meminfo, str(unlimited)) == plan.host_available(meminfo, str(tmp_path)) == 20000000 * 1024
    assert plan.host_available(str(tmp_path / "none"), str(tmp_path)) == float("inf")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * 2**30, 80 * 2**30))
    assert plan.device_memory() == (30.0 * 2**30, 80.0 * 2**30)
    from machinery import dist

    monkeypatch.setattr(dist, "all_gather", lambda obj: [(50e9, 80e9), obj, (45e9, 80e9)])
    monkeypatch.setattr(plan, "device_memory", lambda: (30e9, 80e9))
    assert plan.readings(console.settings(remix.Args, out=str(tmp_path / "out")))["device"] == (30e9, 80e9)


# ----------------------------------------------------------------------------------------------
# Against measurements: real checkpoints, the host memory of a real update
# ----------------------------------------------------------------------------------------------
def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_the_plans_checkpoint_bytes_match_a_real_runs(tiny_bf16_model, train_file, tmp_path):
    """A PPO run of a bf16 base reincarnated at step 1 saves policy, critic, reference, optimizer shards and trainer
    state; each part's real bytes within 2% of the plan's (the trainer state, the deque at its longest, is an upper
    bound): the newest policy's fp32 folder, and checkpoint-1 reduced to a model folder in the base's bf16."""
    out = tmp_path / "run"
    args = tiny_args(tiny_bf16_model, train_file, out, algo="ppo", steps=2, save_every=1, reincarnate_step=1,
                     keep_last=0)
    remix.train(args)
    figures = plan.disk(plan.shape_of(tiny_bf16_model), remix.finalize_args(args), 1)
    saved = out / "checkpoint-2"
    policy = sum(p.stat().st_size for p in saved.iterdir() if p.is_file() and p.name != "trainer_state.pt")
    real = {"policy": policy, "model_folder": tree_bytes(out / "checkpoint-1"), "critic": tree_bytes(saved / "critic"),
            "reference": tree_bytes(saved / "reference"), "optimizer": tree_bytes(saved / "optim"),
            "full": tree_bytes(saved)}
    for part, size in real.items():
        assert abs(figures[part] - size) / size < 0.02, (part, figures[part], size)
    assert (saved / "trainer_state.pt").stat().st_size <= figures["trainer_state"]
    assert real["model_folder"] < 0.6 * real["policy"]  # bf16 against fp32: about half


def measure_step(model: str, algo: str, tokens: int, checkpointing: bool) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "plan_step.py"), model, algo, str(tokens)]
                          + (["--checkpointing"] if checkpointing else []), capture_output=True, text=True, env=env,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [pytest.param(False, marks=pytest.mark.long), True])
def test_the_plan_bounds_the_measured_host_memory_of_a_tiny_update(tiny_model, checkpointing):
    """Two PPO update passes over a 4,096-token micro-batch (two padded rows), in a process of their own: the peak
    resident memory they add is at most the plan's figure and at least 70% of it (docs/memory.md)."""
    result = measure_step(tiny_model, "ppo", 4096, checkpointing)
    assert 0.7 * result["plan"] <= result["measured"] <= result["plan"], result


@pytest.mark.slow
@pytest.mark.long
def test_the_plan_bounds_the_measured_host_memory_of_a_100m_update(tmp_path):
    """A 99M-parameter Qwen2 (hidden 768, 8 layers, 32,768-token vocabulary, untied), GRPO over 2,048 tokens:
    states and the output layer matter here, not only the trunk's activations."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=False,
                         max_position_embeddings=16384, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "m100")
    tokenizer.save_pretrained(tmp_path / "m100")
    result = measure_step(str(tmp_path / "m100"), "grpo", 2048, False)
    assert 90e6 < result["params"] < 110e6
    assert 0.7 * result["plan"] <= result["measured"] <= result["plan"], result


# ----------------------------------------------------------------------------------------------
# --sampler hf: transformers' KV cache, against a real generate's
# ----------------------------------------------------------------------------------------------
def sliding_model(folder: Path) -> str:
    """A tiny Qwen2 whose last two of three layers attend within a window of 6 (transformers' sliding layers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         use_sliding_window=True, sliding_window=6, max_window_layers=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "sliding"])
def test_the_kv_cache_the_plan_counts_is_a_real_generates(kind, tiny_model, tmp_path):
    """transformers' generate as hf_generate calls it (left-padded prompts of 3, 7 and 1 tokens, 2 responses each,
    10 new tokens, none ending early), its DynamicCache's tensors summed: the plan's hf_cache at the positions the
    cache holds (prompt + new - 1: the last token is never fed back) is those bytes, plus one whole layer (a decode
    step's torch.cat holds a layer twice) and, per sliding layer, the one position its window keeps only inside
    that cat."""
    from transformers import AutoModelForCausalLM

    from machinery import models

    source = sliding_model(tmp_path / "sliding") if kind == "sliding" else tiny_model
    shape = plan.shape_of(source)
    assert (shape.cache_layers, shape.windowed_layers, shape.window) == ((3, 2, 6) if kind == "sliding" else (2, 0, 0))
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    b = 2 if kind == "bf16" else 4
    model = model.to(torch.bfloat16) if kind == "bf16" else model
    prompts, n, new = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15]], 2, 10
    batch = models.collate([{"prompt_ids": p, "response_ids": []} for p in prompts], torch.device("cpu"))
    torch.manual_seed(0)
    out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], num_return_sequences=n,
                         max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0, return_dict_in_generate=True,
                         pad_token_id=model.config.pad_token_id)
    layers = out.past_key_values.layers
    measured = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
    rows, positions = len(prompts) * n, 7 + new - 1
    assert out.sequences.shape == (rows, positions + 1) and all(layer.keys.dtype == model.dtype for layer in layers)
    position = 2 * shape.kv * b * rows  # one position of one layer, keys and values
    assert plan.hf_cache(shape, rows, positions, b) == measured + position * positions + \
        shape.windowed_layers * position


def test_the_plan_counts_the_batches_a_run_uses(tiny_model, train_file, tmp_path, monkeypatch):
    """A real GRPO step and evaluations with --sampler hf and --hf-batch-prompts 3, spied on: every transformers
    generate call's rows (prompts x responses) are at most the plan's, the largest of them is the plan's (training
    and evaluation alike); and every update micro-batch's padded tokens are at most the plan's micro-batch, which is
    a mini-batch's rows (4 prompts x 2) times the data's longest prompt plus the response budget, far under the
    16,384-token flag (issue 43's bound)."""
    from transformers import GenerationMixin

    from machinery import data, dist

    calls, micro, generate, cut = [], [], GenerationMixin.generate, dist.micro_batches

    def spy_generate(self, *args, **kwargs):
        calls.append((kwargs["input_ids"].shape[0] * kwargs.get("num_return_sequences", 1), kwargs["max_new_tokens"]))
        return generate(self, *args, **kwargs)

    def spy_micro_batches(samples, max_tokens):
        plans = cut(samples, max_tokens)
        if torch.is_grad_enabled():  # the update's (the no-grad passes run over whole batches)
            micro.extend(len(p) * (max(len(s["prompt_ids"]) for s in p) + max(len(s["response_ids"]) for s in p))
                         for p in plans)
        return plans

    monkeypatch.setattr(GenerationMixin, "generate", spy_generate)
    monkeypatch.setattr(dist, "micro_batches", spy_micro_batches)
    args = tiny_args(tiny_model, train_file, tmp_path / "run", algo="grpo", group_size=2, prompts_per_step=8, steps=1,
                     hf_batch_prompts=3, eval_every=1, eval_benchmarks=("aime24",), eval_limit=2, eval_max_tokens=8,
                     grader_workers=1)
    remix.train(args)
    training, evaluation = [r for r, new in calls if new == 24], [r for r, new in calls if new == 8]
    assert max(training) == min(3, 8) * 2 and max(evaluation) == min(3, 2) * 1, calls
    shape, finalized = plan.shape_of(tiny_model), remix.finalize_args(args)
    session = json.loads((tmp_path / "run" / "plan.json").read_text())
    lengths = plan.Lengths(eval_prompt=session["lengths"]["eval_prompt"], eval_problems=2)
    assert plan.sampler_cache(shape, finalized, 1, 4, lengths) == max(
        plan.hf_generation(shape, 6, args.max_prompt_tokens, 24, 4),
        plan.hf_generation(shape, 2, lengths.eval_prompt, 8, 4))
    tokenizer = data.load_tokenizer(tiny_model)
    problems = [(json.loads(line)["problem"], "") for line in open(train_file)]
    longest = runner.longest_prompt(problems, lambda p: remix.build_prompt(tokenizer, p), args.max_prompt_tokens)
    tokens, width = plan.micro_batch(finalized, 1, longest)
    assert micro and max(micro) <= tokens == 4 * 2 * width < 16384, (micro, tokens)


# ----------------------------------------------------------------------------------------------
# --offload: the same run, its state on the host
# ----------------------------------------------------------------------------------------------
def test_an_offloaded_model_steps_exactly_as_one_without_offload(tiny_model):
    """dist.shard with offload: every shard FSDP2 holds is marked for the host, and a forward, backward, clip and
    AdamW step give the weights (gathered by dist.full_tensors, as the push does) of the same model without it. The
    offloaded model steps with the run's optimizer (models.optimizer: torch's foreach AdamW), the other with torch's
    per-tensor AdamW: the same arithmetic, bit for bit."""
    from transformers import AutoModelForCausalLM

    from machinery import dist, models

    device = dist.init()
    weights = []
    for offload in (False, True):
        model = dist.shard(AutoModelForCausalLM.from_pretrained(tiny_model), device, torch.float32, offload)
        groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
                  for g in dist._param_groups(m._get_fsdp_state())]
        assert groups and all(p.offload_to_cpu == offload for g in groups for p in g.fsdp_params)
        optim = models.optimizer(model, 1e-2, 0.01, offload=True) if offload else \
            torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
        assert optim.defaults["foreach"] is offload
        ids = torch.arange(3, 40).view(1, -1)
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            dist.clip_grad_norm(model, 0.5)
            optim.step()
            optim.zero_grad(set_to_none=True)
        weights.append(dict(dist.full_tensors(model)))
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", pytest.param("ppo", marks=pytest.mark.long)])
def test_offload_trains_saves_and_resumes_exactly_as_a_run_without_it(algo, tiny_model, train_file, tmp_path):
    """On a CPU FSDP2's CPU offload runs its own code paths (offloaded shards, gradients to the host, the optimizer
    step there) on the one device: a run with it logs the numbers and ends at the weights of a run without it, and
    stopped after step 2 and resumed, its third step too."""
    small = dict(algo=algo, group_size=2 if algo == "grpo" else 1, actor_lr=1e-3, critic_lr=1e-3)
    plain = remix.train(tiny_args(tiny_model, train_file, tmp_path / "plain", **small))
    out = tmp_path / "offload"
    remix.train(tiny_args(tiny_model, train_file, out, steps=2, save_every=1, offload=True, **small))
    resumed = remix.train(tiny_args(tiny_model, train_file, out, steps=3, resume=str(out), offload=True, **small))
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]  # noqa: E731
    assert strip(read_metrics(out)) == strip(read_metrics(tmp_path / "plain"))
    for name in ("policy", "critic"):
        if plain[name] is not None:
            want, got = full_state(plain[name]), full_state(resumed[name])
            assert all(torch.equal(want[k], got[k]) for k in want), name
    from machinery import dist

    groups = dist._param_groups(resumed["policy"]._get_fsdp_state())  # the root's: embeddings, head, final norm
    assert groups and all(p.offload_to_cpu for g in groups for p in g.fsdp_params)
