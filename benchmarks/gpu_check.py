"""The GPU paths of remix.py, measured on a model shaped like DeepSeek-R1-Distill-Qwen-1.5B (random weights,
built offline: no hub needed), and the checks of the GPU review. The first thing to run on a GPU machine.

    python benchmarks/gpu_check.py OUT_DIR                  # the quick check (default)
    python benchmarks/gpu_check.py --full OUT_DIR           # longer responses and micro-batches, no checkpointing
    python benchmarks/gpu_check.py OUT_DIR --parts attention,fp32,micro,reshard,grpo,ppo,save,tp --budget-s 330
    torchrun --nproc-per-node 1 benchmarks/gpu_check.py OUT_DIR     # the same under torchrun, world size 1

What it needs: torch and transformers (2.11 and 5.17 on the lent H200 machine do), numpy, sympy, tokenizers,
tensorboard. Without more, the parts that need neither math-verify nor vLLM run. The end-to-end parts (grpo,
ppo, save) grade rewards with math-verify: where it is missing they are reported as skipped, and
`python benchmarks/device_wheels.py .whl` builds the folder of wheels to carry to that machine (tyro, math-verify
and its parsers; pure Python, about 1 MiB), installed there with
`pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site`. vLLM is used where
it is installed (the sleep, push and wake cycle then runs every step); else transformers' generate.

How long: on one H200 the quick check took 119 s (docs/gpu/run6: the micro-batch part 13 s, a three-step GRPO run of
128-token responses 42 s, PPO 50 s) and --full --parts micro,ppo 180 s (run8). --budget-s (330 s by default) stops
it starting a part once it is past that, recording the part as skipped, and --limit-s (400 s by default) stops a
part that is still running then (an alarm; also --part-limit-s, 240 s, for any one part), recording it as timed out.
The worst case is so --limit-s plus the cleanup of the part that was stopped (its engine shut down, its folders
removed): under 7 minutes. Each part is guarded: one that raises, calls fail() (SystemExit) or times out is recorded
with its error and the rest still run, and the check exits 1 at the end if any part failed; a SIGTERM or Ctrl-C ends
the check (143, 130), also once a remix run has put its own handlers in place. After each part, every model it
loaded must be gone (weak references; on a GPU also the memory still allocated, in the report's "leftovers"): one
still alive fails the check. OUT_DIR/gpu_check.json is rewritten as each part finishes, every engine is shut down
before the next part, and nothing large is left under OUT_DIR whatever happens (a part's run folders go with it,
failed or not, and the 1.5B model folder goes at the end, also after a failure or a SIGTERM): OUT_DIR ends with
gpu_check.json and problems.jsonl. No checkpoint of the 1.5B models is written (about 43 GB for PPO, 25 GB for GRPO:
a 64 GiB disk holds neither twice); the save part saves and resumes a small model instead. Without CUDA it runs the
same code on the CPU with a tiny model and short lengths, as a dry run (a test runs it, and one with a planted
fail() in a part).

1. micro: the memory a run holds between updates (policy and critic with their fp32 masters and AdamW states,
   the bf16 reference), read after a real `remix.update` has released its gradients; then one policy and one
   critic micro-batch (forward, loss, backward, as in an update) of 1,024 prompt + R response tokens (R: 2k and 8k;
   --full: 2k, 4k, 8k and 2k without gradient checkpointing): peak memory above that, and seconds per micro-batch
   (median of 3). Every model is FSDP2-sharded (one process is a group of one) with bf16 mixed precision.
2. grpo, ppo: `remix.train` for 3 steps each with reincarnation after step 2 (mix stage, switch, on-policy
   stage), --precision bf16, and evaluations before step 1 and after step 3 (4 AIME problems, 64 tokens): the
   evaluation at step 0, sampling, the push and the steps after it, in the order a default run makes them.
   Random weights rarely emit EOS, so every response runs to the length limit (128 tokens; --full: PPO 512).
   Reports kl/ref at step 1 (0 before any update) and the checkpoint the run would have written; the checkpoint
   is stubbed, and so is its share of the run's disk plan (its figures are 0: the check needs no room for one).
   Each run records the peak memory of its phases beside the plan's figure for that phase (machinery/plan.py, as
   the run computed it): generation (sampling, the weight push, the evaluations: the engine awake) and the update
   (the no-grad passes before it counted with it: the engine asleep). A peak above the plan's fails the check.
3. save: a small model's GRPO run of 3 steps against the same run saved after step 2 and resumed: the CUDA and
   CPU random generators, the optimizer shards and the deque come back, and the two log the same step 3.
4. tp (two or more GPUs and vLLM): `torchrun --nproc-per-node 2` of one engine sharded over both ranks
   (--vllm-tp 2): the two ranks must hold identical token ids for the engine's prompts.

The GPU review's checks, each a short measurement that would have caught its defect (JSON key in brackets):
5. attention [cudnn_attention]: with `models.use_safe_attention()` in effect (cuDNN's SDPA off, as `models.load`
   sets it on CUDA), a 2-layer bf16 Qwen2 of the 1.5B's width: for key lengths 64, 192 and 320 (64 mod 128,
   where cuDNN's backward NaNs the query gradient under an explicit mask), a left-padded pair of samples in one
   `models.collate` batch against each sample alone, through `remix.policy_forward` and a backward: log-probs
   equal within bf16 tolerance, gradients finite and equal within tolerance. For information only: whether the
   same padded backward gives NaN with cuDNN's SDPA enabled and preferred. On the CPU: the same code, CPU attention.
6. reshard [reference_reshard]: memory allocated before and after a no-grad reference pass
   (`models.per_token(remix.logp_of(args), reference, ...)`): the root's weights must be sharded (DTensor) again
   after it and the memory back near its level before (GiB; 0 on the CPU). Runs with micro's models.
7. [threads] (vLLM): torch's CPU thread count before and after `engines.start` inside the first end-to-end run
   (vLLM sets it to 1 on GPU unless OMP_NUM_THREADS is set, which is unset for the start): must be equal.
8. [push_check] (vLLM): after that run, a state dict with one layer's weight left out pushed through
   `collective_rpc("reload_weights")` under `engines.warnings_from(engines.RELOAD_LOG)`: vLLM's "not loaded"
   warning must be heard (what `engines.push_weights` stops on), and a full push must hear none.
9. fp32 [fp32_head_grad]: `models._matmul_fp32` of a [4096, 1024] x [1024, 1536] bf16 product (the output
   layer's gradient; `torch.mm(..., out_dtype=torch.float32)` on CUDA, the fp32 fallback elsewhere) against
   the product in float64: an fp32 result within fp32 rounding.
On the CPU, 7 and 8 run as a dry run of the same code when vLLM is installed; what needs CUDA alone (the cuDNN
comparison) is reported as "skipped: needs CUDA". Each part's seconds are in the report's "seconds".

Writes OUT_DIR/gpu_check.json and prints each figure as it is measured.
"""

import argparse
import gc
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import remix  # noqa: E402
from machinery import checkpoints, console, dist, engines, models, plan, report  # noqa: E402
from tests.tiny_model import build_tokenizer  # noqa: E402

GIB = 2**30
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
VLLM = importlib.util.find_spec("vllm") is not None
GRADER = importlib.util.find_spec("math_verify") is not None
NEEDS_CUDA = "skipped: needs CUDA"
NEEDS_GRADER = "skipped: needs math-verify (carry the wheels: python benchmarks/device_wheels.py .whl)"
PARTS = ["attention", "fp32", "micro", "reshard", "grpo", "ppo", "save", "tp"]


FAILED = []  # the parts and checks that raised, called fail() or timed out: the check then exits 1


class PartTimeout(Exception):
    """A part still running at its limit (--part-limit-s, --limit-s), raised by an alarm."""


class Terminated(BaseException):
    """A SIGTERM, raised by its handler: not a part's failure (guarded lets it through); it ends the check, exit 143."""


def terminated(signum, frame):
    raise Terminated()


def guarded(name: str, fn, *args) -> dict:
    """fn(*args), one part or check. One that raises, calls machinery.console.fail (a SystemExit) or times out is
    recorded with its error and the rest still run (a GPU session's minutes are few); the failure is remembered, so
    the check exits 1 at the end (the CPU dry run's test sees a broken part). A signal (Ctrl-C, SIGTERM) ends it."""
    try:
        return fn(*args)
    except (Exception, SystemExit) as error:
        import traceback

        FAILED.append(name)
        print(f"gpu_check: {name} failed: {error!r}", flush=True)
        return {"ok": False, "error": f"{type(error).__name__}: {error}"[:500],
                "traceback": traceback.format_exc()[-2000:]}


def memory(peak: bool = False) -> int:
    if not CUDA:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()


def reset_peak() -> None:
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


# Each end-to-end run's phases, as the plan counts them (machinery/plan.py): generation with the engine awake
# (sampling, the weight push that wakes it, the evaluations) and the update with the engine asleep, the no-grad
# passes before it counted with it (the reference's, pi_k's and the values' forwards: they hold the update's resident
# state and less than its activations, with the engine asleep). (module, function name, phase)
PHASES = [(remix, "sample", "generation"), (engines, "push_weights", "generation"),
          (report, "during_training", "generation"), (remix, "behaviour_and_reference", "update"),
          (remix, "prox_and_values", "update"), (remix, "update", "update")]


def measured_phases(peaks: dict):
    """The PHASES' functions wrapped, for one run, so that each call's peak allocation goes to peaks[phase] (its
    maximum); the outermost call measures (a phase's function called inside another's counts with that one).
    peaks["run"] keeps the whole run's peak across the resets. Returns the function that puts the real ones back."""
    depth, real = [0], [(module, name, getattr(module, name)) for module, name, _ in PHASES]

    def measured(fn, phase):
        def call(*args, **kwargs):
            depth[0] += 1
            if depth[0] == 1:
                peaks["run"] = max(peaks.get("run", 0), memory(peak=True))
                reset_peak()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    peaks[phase] = max(peaks.get(phase, 0), memory(peak=True))
                    peaks["run"] = max(peaks["run"], peaks[phase])
        return call

    for (module, name, fn), (_, _, phase) in zip(real, PHASES):
        setattr(module, name, measured(fn, phase))
    return lambda: [setattr(module, name, fn) for module, name, fn in real]


def against_plan(peaks: dict, planned: dict | None) -> dict:
    """Each phase's measured peak beside the plan's figure for it; a peak above the plan's fails the check."""
    rows = {}
    for phase in ("generation", "update"):
        figure = planned["memory"][phase] if planned else None
        rows[phase] = {"peak_gib": peaks.get(phase, 0) / GIB, "plan_gib": figure and figure / GIB,
                       "ok": figure is not None and peaks.get(phase, 0) <= figure}
    return rows


def track_loaded(loaded: weakref.WeakSet):
    """Every model the check loads (models.load: the micro part's, each remix run's) remembered weakly: one still
    alive after its part has ended (and a collection) is a leftover, held by something outside the part."""
    real = models.load

    def load(*args, **kwargs):
        nets = real(*args, **kwargs)
        loaded.update(net for net in nets if net is not None)
        return nets

    models.load = load


def leftovers(loaded: weakref.WeakSet, before: int) -> dict:
    """What a part left behind: the models it loaded that are still alive, and the GPU memory still allocated above
    the level before it (GiB; 0 on the CPU; for information: CUDA's own workspaces may stay)."""
    gc.collect()
    alive = sorted(type(net).__name__ for net in loaded)
    return {"models_alive": alive, "allocated_above_before_gib": (memory() - before) / GIB}


def build_model(path: Path, small: bool = False) -> None:
    """The published R1-Distill-Qwen-1.5B config (Qwen2 architecture), random weights, the byte tokenizer; small
    (and on the CPU): the same architecture at a tiny size."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    shape = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2) if CUDA and not small else \
        dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)
    config = Qwen2Config(**shape, max_position_embeddings=131072,
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with DEVICE:
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    print(f"gpu_check: built {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", flush=True)


def run_args(algo: str, model: Path, data: Path, out: Path, response_tokens: int, **overrides):
    """A three-step run with reincarnation after step 2 and evaluations at steps 0 and 3, on vLLM where it is."""
    extra = dict(prompts_per_step=10, group_size=1, mini_batch_prompts=5) if algo == "ppo" else \
        dict(prompts_per_step=5, group_size=4, mini_batch_prompts=3)
    return console.settings(remix.Args, **{**dict(
        algo=algo, model=str(model), dataset=str(data), out=str(out), steps=3, reincarnate_step=2,
        max_response_tokens=response_tokens, max_prompt_tokens=256, sampler="vllm" if VLLM else "hf", save_every=0,
        grader_workers=2, overwrite=True, precision="bf16", eval_every=3, eval_benchmarks=("aime24",), eval_limit=4,
        eval_max_tokens=64 if CUDA else 8, vllm_gpu_memory_utilization=0.3, **extra), **overrides})


def shut_down(state: dict):
    """The run's engine stopped and its models freed, before the next part starts its own."""
    if state.get("llm") is not None:
        state["llm"].llm_engine.engine_core.shutdown()
    state.clear()
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def end_to_end(model: Path, data: Path, out: Path, algo: str, response_tokens: int, report: dict | None = None) -> dict:
    """With report (the first end-to-end run, vLLM installed): the threads and push_check checks too. The run's
    checkpoint is not written (checkpoints.save records what it was handed instead), and its folder is removed,
    whether the run finishes, fails or times out."""
    try:
        return run_end_to_end(model, data, out, algo, response_tokens, report)
    finally:
        shutil.rmtree(out / algo, ignore_errors=True)


def run_end_to_end(model: Path, data: Path, out: Path, algo: str, response_tokens: int, report: dict | None):
    reset_peak()
    args = run_args(algo, model, data, out / algo, response_tokens)
    sampler = args.sampler
    threads, real_start, real_save, saves = {}, engines.start, checkpoints.save, []
    real_check, real_disk, plans, peaks = plan.check, plan.disk, [], {}
    if report is not None and sampler == "vllm":
        engines.start = lambda *a, **k: counted_start(real_start, threads, *a, **k)
    checkpoints.save = lambda out, step, nets, *rest: saves.append(
        {"step": step, "models": sorted(name for name, net in nets.items() if net is not None)})
    # what the check stubs, the plan does not count: no checkpoint is written, so its disk figures are all 0 (a 1.5B
    # PPO checkpoint is 43 GB; the H200 machine had 65 GB free)
    plan.disk = lambda *a, **k: dict.fromkeys(real_disk(*a, **k), 0)
    plan.check = lambda *a, **k: plans.append(real_check(*a, **k)) or plans[-1]
    restore_phases = measured_phases(peaks)
    start = time.perf_counter()
    try:
        state = remix.train(args)
    finally:
        engines.start, checkpoints.save, plan.check, plan.disk = real_start, real_save, real_check, real_disk
        restore_phases()
    seconds = time.perf_counter() - start
    rows = metrics(out / algo)
    keys = ("phase", "perf/step_s", "perf/weight_sync_s", "train/optimizer_steps", "response/length_mean",
            "losses/policy_loss", "kl/ref", "rollouts/total", "mismatch/abs_log_ratio_mean", "mismatch/k3_kl",
            "mismatch/ratio_outside_0.5_2")
    result = {"sampler": sampler, "seconds": seconds, "peak_gib": max(peaks.get("run", 0), memory(peak=True)) / GIB,
              "evaluated_at": [r["step"] for r in rows if "eval/aime24/pass@1" in r], "checkpoints_not_written": saves,
              "steps": [{k: r[k] for k in keys if k in r} for r in rows if r["step"] > 0],
              "finite": all(all(isinstance(v, (int, float)) and v == v for v in r.values()
                                if isinstance(v, (int, float))) for r in rows),
              "phases": against_plan(peaks, plans[-1] if plans else None)}
    print(f"gpu_check: {algo} end to end {json.dumps(result)}", flush=True)
    for phase, row in result["phases"].items():
        if not row["ok"]:
            FAILED.append(f"{algo} {phase} peak")
            print(f"gpu_check: {algo}: the {phase} peak {row['peak_gib']:.2f} GiB is above the plan's "
                  f"{row['plan_gib'] or 0:.2f} GiB (machinery/plan.py)", flush=True)
    if report is not None and sampler == "vllm":  # after the timing: the run's own engine and pushed policy
        report["threads"] = {**threads, "after_run": torch.get_num_threads(),  # after_run: for information
                             "ok": "before" in threads and threads["before"] == threads["after"],
                             **({} if CUDA else {"mode": "cpu dry run"})}
        print(f"gpu_check: threads {json.dumps(report['threads'])}", flush=True)
        report["push_check"] = guarded("push check", push_check, state["llm"], state["policy"])
    shut_down(state)
    return result


def save_and_resume(data: Path, out: Path) -> dict:
    """A small model's GRPO run of 3 steps, and the same run saved after step 2 and resumed: step 3 alike. Its
    folders are removed whether it finishes, fails or times out."""
    try:
        return run_save_and_resume(data, out)
    finally:
        for folder in ("straight", "resumed", "small-model"):
            shutil.rmtree(out / folder, ignore_errors=True)


def run_save_and_resume(data: Path, out: Path) -> dict:
    model = out / "small-model"
    build_model(model, small=True)
    quiet = dict(eval_every=0, **({} if CUDA else {"sampler": "hf"}))  # the CPU's resume on vLLM is a test's
    shut_down(remix.train(run_args("grpo", model, data, out / "straight", 32, **quiet)))
    shut_down(remix.train(run_args("grpo", model, data, out / "resumed", 32, **quiet, steps=2, save_every=2)))
    shut_down(remix.train(console.settings(remix.Args, resume=str(out / "resumed"), steps=3)))
    a, b = metrics(out / "straight")[-1], metrics(out / "resumed")[-1]
    figures = [k for k, v in a.items() if isinstance(v, float) and not k.startswith("perf/")]
    gap = max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-8) for k in figures)
    result = {"steps": [metrics(out / "straight")[-1]["step"], b["step"]], "figures": len(figures),
              "max_relative_difference_at_step_3": gap, "ok": b["step"] == 3 and gap < 1e-3}
    print(f"gpu_check: save and resume {json.dumps(result)}", flush=True)
    return result


def counted_start(real_start, seen: dict, *args, **kwargs):
    """engines.start with torch's CPU thread count read before and after it. OMP_NUM_THREADS is unset for the start:
    vLLM leaves the count alone where it is set, and then the check would test nothing."""
    omp = os.environ.pop("OMP_NUM_THREADS", None) if CUDA else os.environ.get("OMP_NUM_THREADS")
    seen["before"] = torch.get_num_threads()
    try:
        llm = real_start(*args, **kwargs)
    finally:
        if CUDA and omp is not None:
            os.environ["OMP_NUM_THREADS"] = omp
    seen.update(after=torch.get_num_threads(), omp_num_threads=omp)
    return llm


def push_check(llm, policy) -> dict:
    """A push that leaves one layer's weight out must be heard as vLLM's "not loaded" warning (what
    engines.push_weights stops on); a full push must hear none. The engine ends with the policy's full weights."""
    assert not llm.llm_engine.is_sleeping()  # the run's last push woke it whole
    dtype = llm.llm_engine.model_config.dtype
    weights = [(name, tensor.to(dtype)) for name, tensor in dist.full_tensors(policy)]
    names = [name for name, _ in weights]
    left_out = next((n for n in names if ".layers.0." in n and n.endswith("down_proj.weight")),
                    next(n for n in names if ".layers." in n))
    heard = {}
    for label, push in (("partial", [(n, t) for n, t in weights if n != left_out]), ("full", weights)):
        with engines.warnings_from(engines.RELOAD_LOG) as messages:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(push)})
        heard[label] = [m[:300] for m in messages if "not loaded" in m]
    llm.reset_prefix_cache()
    result = {"left_out": left_out, "partial_push_heard": bool(heard["partial"]),
              "full_push_heard": bool(heard["full"]), "ok": bool(heard["partial"]) and not heard["full"],
              "messages": heard["partial"][:1] + heard["full"][:1], **({} if CUDA else {"mode": "cpu dry run"})}
    print(f"gpu_check: push check {json.dumps(result)}", flush=True)
    return result


def resident_after_update(policy, critic, optimizers) -> float:
    """GiB held between updates: one real update() of a small PPO batch, after which no gradient is kept."""
    samples = []
    for i in range(2):
        ids = torch.randint(300, policy.config.vocab_size, (96,)).tolist()
        zeros = torch.zeros(64)
        samples.append({"prompt_ids": ids[:32], "response_ids": ids[32:], "group": i, "behaviour_logp": zeros - 5,
                        "prox_logp": zeros - 5, "ref_logp": zeros - 5, "advantages": zeros + 1, "values": zeros,
                        "value_targets": zeros + 1, "sampler_logp": None})
    args = console.settings(remix.Args, algo="ppo", mini_batch_prompts=2, group_size=1)
    remix.update(samples, policy, critic, optimizers, 1.0, 1, 1, args)
    held = memory() / GIB
    print(f"gpu_check: resident between updates {held:.2f} GiB (gradients: "
          f"{sum(p.grad is not None for m in (policy, critic) for p in m.parameters())} tensors)", flush=True)
    return held


def load_models(model_path: Path, checkpointing: bool):
    # the models exactly as training builds them: fp32 masters, bf16 reference, no dropout, the chunked
    # log-prob head, FSDP2 (a group of one in one process)
    args = remix.finalize_args(console.settings(remix.Args, model=str(model_path), algo="ppo", precision="bf16",
                                              gradient_checkpointing=checkpointing))
    return (*models.load(args), args)


def micro_batch(model_path: Path, lengths: list[int], checkpointing: bool, report: dict | None = None):
    """Peak memory and time of one update micro-batch for the policy (Mix-PPG + KL + entropy) and the critic.
    With report, the reference_reshard check first, on the freshly loaded reference."""
    policy, reference, critic, args = load_models(model_path, checkpointing)
    if report is not None:
        report["reference_reshard"] = guarded("reference reshard", reference_reshard, reference, args)
    nets = (policy, critic)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-6, weight_decay=0.01) for m in nets]
    held = resident_after_update(policy, critic, optimizers)
    results = []
    for m in nets:
        m.train()
    for length in lengths:
        prompt = 1024 if CUDA else 32
        ids = torch.randint(300, policy.config.vocab_size, (1, prompt + length))
        sample = {"prompt_ids": ids[0, :prompt].tolist(), "response_ids": ids[0, prompt:].tolist()}
        batch = models.collate([sample], DEVICE)
        mask = batch["response_mask"]
        for name, model, optim in (("policy", policy, optimizers[0]), ("critic", critic, optimizers[1])):
            seconds = []
            for _ in range(3):
                optim.zero_grad(set_to_none=True)
                resident = memory()
                reset_peak()
                start = time.perf_counter()
                if name == "policy":
                    logp, entropy = remix.policy_forward(model, batch, 1.0)
                    old = logp.detach() - 0.01
                    loss = remix.mix_ppg_loss(logp, old, old, torch.ones_like(logp), mask)[0] \
                        - 0.001 * remix.masked_mean(entropy, mask) \
                        + 0.001 * remix.kl_convex_loss(logp, old, old, 1.0, mask)
                else:
                    values = remix.critic_forward(model, batch)
                    loss = remix.clipped_value_loss(values, values.detach(), values.detach() + 1, mask)
                loss.backward()
                optim.step()
                memory()  # waits for the GPU
                seconds.append(time.perf_counter() - start)
            peak = memory(peak=True)
            row = {"model": name, "response_tokens": length, "checkpointing": checkpointing,
                   "seconds_median": statistics.median(seconds[1:]), "peak_above_resident_gib": (peak - resident) / GIB,
                   "resident_gib": resident / GIB, "peak_gib": peak / GIB}
            print(f"gpu_check: micro-batch {json.dumps(row)}", flush=True)
            results.append(row)
        del batch
    del policy, critic, reference, optimizers, nets
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    return held, results


def reference_reshard(reference, args) -> dict:
    """A no-grad reference pass (models.per_token) must leave the root's weights sharded again and the memory where
    it was: FSDP2 keeps the root's embeddings and output layer whole after a forward, for a backward that never
    comes, unless the pass reshards (about 0.9 GB per GPU at 1.5B)."""
    from torch.distributed.tensor import DTensor

    vocab, length = reference.config.vocab_size, (512 if CUDA else 32)
    g = torch.Generator().manual_seed(1)
    samples = [{"prompt_ids": torch.randint(300, vocab, (length,), generator=g).tolist(),
                "response_ids": torch.randint(300, vocab, (length - 8 * i,), generator=g).tolist()} for i in range(2)]
    sharded_before = isinstance(reference.get_input_embeddings().weight, DTensor)
    before = memory()
    reset_peak()
    logp = models.per_token(remix.logp_of(args), reference, samples, args.max_tokens_per_micro_batch)
    after, peak = memory(), memory(peak=True)
    sharded_after = isinstance(reference.get_input_embeddings().weight, DTensor)
    result = {"sharded_before": sharded_before, "sharded_after": sharded_after, "before_gib": before / GIB,
              "after_gib": after / GIB, "peak_gib": peak / GIB, "finite": all(bool(x.isfinite().all()) for x in logp),
              "ok": sharded_after and (after - before) / GIB < 0.1}
    print(f"gpu_check: reference reshard {json.dumps(result)}", flush=True)
    return result


def attention_model():
    """A 2-layer Qwen2 in bf16: the 1.5B's width and heads (head size 128) on CUDA, the dry run's tiny shape else."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2) if CUDA \
        else dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    config = Qwen2Config(vocab_size=2048, num_hidden_layers=2, max_position_embeddings=4096, rope_theta=10000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa", **shape)
    torch.manual_seed(0)
    with DEVICE:
        return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


def padded_pass(model, samples: list[dict]) -> tuple[torch.Tensor, dict]:
    """Log-probs [n, l] of the samples in one collated (left-padded) batch through remix.policy_forward, and the
    parameters' gradients of the sum of their response log-probs."""
    model.zero_grad(set_to_none=True)
    batch = models.collate(samples, DEVICE)
    logp, _ = remix.policy_forward(model, batch, 1.0)
    torch.where(batch["response_mask"], logp, 0.0).sum().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logp.detach().float(), grads


def cudnn_attention() -> dict:
    """With use_safe_attention(), a left-padded pair in one batch against each sample alone, at key lengths of 64
    modulo 128: equal log-probs, finite and equal gradients. Then, for information only, the padded pair with
    cuDNN's SDPA enabled and preferred (the kernel the trainer turns off): are its gradients NaN?"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    models.use_safe_attention()
    model = attention_model()
    g = torch.Generator().manual_seed(2)
    rows = []
    for width in (64, 192, 320):
        half = width // 2
        pair = [{"prompt_ids": torch.randint(0, 2048, (p,), generator=g).tolist(),
                 "response_ids": torch.randint(0, 2048, (r,), generator=g).tolist()}
                for p, r in ((half, half), (half - 16, half - 16))]  # one batch of width P + L = width
        logp, grads = padded_pass(model, pair)
        alone = [padded_pass(model, [s]) for s in pair]
        logp_gap = max(float((logp[i, : len(s["response_ids"])] - alone[i][0][0]).abs().max())
                       for i, s in enumerate(pair))
        summed = {n: alone[0][1][n] + alone[1][1][n] for n in grads}
        finite = all(bool(t.isfinite().all()) for t in grads.values())
        num = sum(float((grads[n] - summed[n]).pow(2).sum()) for n in grads) ** 0.5
        den = sum(float(summed[n].pow(2).sum()) for n in grads) ** 0.5
        row = {"width": width, "logp_max_abs_diff": logp_gap, "grad_rel_diff": num / max(den, 1e-30),
               "grads_finite": finite}
        row["ok"] = finite and logp_gap < 0.05 and row["grad_rel_diff"] < 0.05
        if CUDA:  # for information: the kernel the trainer keeps off, on the same padded batch
            torch.backends.cuda.enable_cudnn_sdp(True)
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                  SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True):
                    cudnn_logp, cudnn_grads = padded_pass(model, pair)
                row["cudnn_enabled_grads_nan"] = any(bool(t.isnan().any()) for t in cudnn_grads.values())
                row["cudnn_enabled_logp_finite"] = bool(cudnn_logp.isfinite().all())
            except RuntimeError as error:
                row["cudnn_enabled_error"] = str(error).splitlines()[0][:200]
            finally:
                models.use_safe_attention()
        rows.append(row)
    result = {"mode": "cuda" if CUDA else "cpu dry run", "widths": rows, "ok": all(r["ok"] for r in rows),
              "cudnn_sdp_enabled_after": torch.backends.cuda.cudnn_sdp_enabled()}
    if not CUDA:
        result["cudnn_enabled"] = NEEDS_CUDA
    print(f"gpu_check: cudnn attention {json.dumps(result)}", flush=True)
    del model
    return result


def fp32_head_grad() -> dict:
    """models._matmul_fp32 of bf16 inputs (the output layer's gradient in chunked_logprobs' backward): an fp32 result
    within fp32 rounding of the exact product (float64), far closer than a bf16 product's."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    a = torch.randn(4096, 1024, generator=g, device=DEVICE).to(torch.bfloat16)
    b = torch.randn(1024, 1536, generator=g, device=DEVICE).to(torch.bfloat16)
    exact = a.double() @ b.double()
    scale = float(exact.pow(2).mean().sqrt())
    error = lambda out: float((out.double() - exact).abs().max()) / scale  # noqa: E731
    out = models._matmul_fp32(a, b)
    transposed = models._matmul_fp32(a.T.contiguous().T, b)  # a transposed view, as grad_logits.T is there
    result = {"path": "torch.mm out_dtype=float32" if a.is_cuda else "fp32 fallback (cpu)", "dtype": str(out.dtype),
              "max_abs_error_over_rms": error(out), "transposed_view_error_over_rms": error(transposed),
              "bf16_product_error_over_rms": error(a @ b)}
    result["ok"] = out.dtype == transposed.dtype == torch.float32 and tuple(out.shape) == (4096, 1536) and \
        max(result["max_abs_error_over_rms"], result["transposed_view_error_over_rms"]) < 1e-5
    print(f"gpu_check: fp32 head grad {json.dumps(result)}", flush=True)
    return result


def tensor_parallel(model: Path, data: Path, out: Path) -> dict:
    """Two ranks of one vLLM engine (--vllm-tp 2): identical token ids on both (tests/test_runs.py's own driver)."""
    argv = ["--model", str(model), "--dataset", str(data), "--out", str(out / "tp"), "--algo", "grpo", "--steps", "2",
            "--prompts-per-step", "10", "--group-size", "2", "--max-response-tokens", "128", "--sampler", "vllm",
            "--vllm-tp", "2", "--save-every", "0", "--eval-every", "0", "--vllm-gpu-memory-utilization", "0.3"]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             str(ROOT / "tests" / "test_runs.py"), "engine-tokens", str(out / "tp"), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        _, stderr = proc.communicate()
        if proc.returncode != 0:
            return {"ok": False, "error": stderr[-2000:]}
        ranks = [torch.load(out / "tp" / f"engine-tokens-rank{r}.pt") for r in (0, 1)]
        return {"ok": ranks[0] == ranks[1], "calls": len(ranks[0])}
    finally:
        if proc.poll() is None:  # a timeout: torchrun and both ranks (its session) go with the part
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(out / "tp", ignore_errors=True)  # with the run's final checkpoint


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="a folder for gpu_check.json (nothing large is left in it)")
    parser.add_argument("--full", action="store_true", help="longer responses and micro-batches")
    parser.add_argument("--quick", action="store_true", help="the default check (named for the command line)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--budget-s", type=float, default=330.0, help="no part starts after this many seconds")
    parser.add_argument("--limit-s", type=float, default=400.0, help="a part still running then is stopped")
    parser.add_argument("--part-limit-s", type=float, default=240.0, help="the most seconds one part may run")
    args = parser.parse_args(argv)
    if args.full and args.quick:
        parser.error("--full and --quick: give one")
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {', '.join(sorted(unknown))}; valid: {', '.join(PARTS)}")
    return args


def on_alarm(signum, frame):
    raise PartTimeout("the part ran past its time limit (--part-limit-s, --limit-s)")


def main(argv=None):
    cli = parse(argv)
    out, full, parts, budget = Path(cli.out), cli.full, cli.parts.split(","), cli.budget_s
    out.mkdir(parents=True, exist_ok=True)
    model, data = out / "r1-distill-1.5b-shaped", out / "problems.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10)))
    console._state["prog"] = "gpu_check"  # torchrun's numbers and the torch check speak in the check's name
    dist.init()  # a group of one, or torchrun's: the models are FSDP2-sharded either way
    console._state["prog"] = "remix"  # the runs' own lines, as remix.py's
    report = {"device": torch.cuda.get_device_name() if CUDA else "cpu (dry run)", "torch": torch.__version__,
              "world_size": dist.world(), "vllm": VLLM, "math_verify": GRADER, "gpus": torch.cuda.device_count(),
              "mode": "full" if full else "quick", "seconds": {}, "leftovers": {}}
    began, loaded = time.perf_counter(), weakref.WeakSet()
    track_loaded(loaded)

    def part(name: str, key: str, fn, *args, needs_grader: bool = False):
        """One part, guarded, its seconds recorded, the report written after it; skipped past the budget."""
        if name not in parts:
            return
        if needs_grader and not GRADER:
            report[key] = NEEDS_GRADER
        elif time.perf_counter() - began > budget:
            report[key] = f"skipped: past the {budget:.0f} s budget (--budget-s)"
        else:
            start, before = time.perf_counter(), memory()
            loaded.clear()  # this part's models only: an earlier part's leftover was named with that part
            limit = min(cli.part_limit_s, cli.limit_s - (start - began))
            signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, max(limit, 1.0))
            try:
                report[key] = guarded(name, fn, *args)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            report["seconds"][name] = round(time.perf_counter() - start, 1)
            if isinstance(report[key], dict) and report[key].get("ok") is False and "traceback" in report[key]:
                from machinery import grader

                grader.close_pool()  # a part stopped midway leaves no grading workers to the next
            report["leftovers"][name] = left = leftovers(loaded, before)  # nothing of the part outlives it
            if left["models_alive"]:
                FAILED.append(f"{name} leftovers")
                print(f"gpu_check: {name} left {', '.join(left['models_alive'])} alive after it", flush=True)
        print(f"gpu_check: {key} {json.dumps(report[key]) if isinstance(report[key], str) else 'done'}", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))

    signal.signal(signal.SIGTERM, terminated)  # the cleanup below runs on a SIGTERM too
    try:
        part("attention", "cudnn_attention", cudnn_attention)
        part("fp32", "fp32_head_grad", fp32_head_grad)
        if {"micro", "reshard", "grpo", "ppo"} & set(parts):
            report["build"] = guarded("build", build_model, model) or "done"
        lengths = ([2048, 4096, 8192] if full else [2048, 8192]) if CUDA else [64]

        def micro():
            held, rows = micro_batch(model, lengths, True, report if "reshard" in parts else None)
            report["resident_between_updates_gib"] = held
            return rows + (micro_batch(model, lengths[:1], False)[1] if full or not CUDA else [])

        def reshard_alone():
            policy, reference, critic, args = load_models(model, True)
            return reference_reshard(reference, args)

        part("micro", "micro_batch", micro)
        if "micro" not in parts:
            part("reshard", "reference_reshard", reshard_alone)
        checks = [a for a in ("grpo", "ppo") if a in parts][:1]  # threads and push_check ride on the first run
        for algo in ("grpo", "ppo"):
            tokens = (512 if full and algo == "ppo" else 128) if CUDA else 32
            part(algo, f"end_to_end_{algo}", end_to_end, model, data, out, algo, tokens,
                 report if algo in checks else None, needs_grader=True)
        for key in ("threads", "push_check"):
            if key not in report and checks:
                report[key] = "skipped: needs vLLM"
        if VLLM and torch.cuda.device_count() >= 2 and dist.world() == 1:
            part("tp", "tensor_parallel", tensor_parallel, model, data, out)
        elif "tp" in parts:
            report["tensor_parallel"] = "skipped: needs vLLM and two GPUs"
        shutil.rmtree(model, ignore_errors=True)
        part("save", "save_and_resume", save_and_resume, data, out, needs_grader=True)
    except (Terminated, KeyboardInterrupt) as stop:
        # Terminated: a SIGTERM before any remix run. After one, its handlers (console.catch_interrupts) have replaced
        # ours: their KeyboardInterrupt names the signal (seen()), during a run or between runs; else it is Ctrl-C
        signum = console.seen() or (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)
        print(f"gpu_check: stopped by {signal.Signals(signum).name}; the parts done so far are in gpu_check.json",
              flush=True)
        raise SystemExit(console.EXIT_CODES[signum]) from None
    finally:
        shutil.rmtree(model, ignore_errors=True)  # 3 GB at 1.5B: never left under OUT_DIR, whatever stopped the check
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"gpu_check: done in {time.perf_counter() - began:.0f} s" + (f"; failed: {', '.join(FAILED)}" if FAILED
                                                                        else ""), flush=True)
    if FAILED:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
