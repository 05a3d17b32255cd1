"""ReMix: Reincarnating Mix-policy Proximal Policy Gradient, in one file.

Paper: Liang et al., "Squeeze the Soaked Sponge: Efficient Off-policy Reinforcement Finetuning for Large
Language Model", arXiv 2507.06892. Read this file beside the paper, top to bottom:

    Args -> reward (answer verification) -> ALGO LOGIC (one function per equation)
    -> models and samplers -> the training step's phases -> the loop, in the paper's order.

Each step k: sample (1-p)*B fresh responses from pi_k with vLLM, score them, store them with their
behaviour log-probs in a deque of the last N policies' batches, mix in p*B historical samples, compute
advantages (V-trace for PPO), take `utd` passes of Mix-PPG + KL-Convex updates, push the weights into
vLLM. After step T, reincarnate: the reference becomes pi_T and training is plain on-policy PPO/GRPO.

    python remix.py --model deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --steps 350
    torchrun --nproc-per-node 8 remix.py --model deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --steps 350
"""

import collections
import dataclasses
import functools
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Annotated, Literal

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: weights sync by reference
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # set VLLM_LOGGING_LEVEL=INFO to see the engine's log

import numpy as np
import torch
import tyro
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm

from remix_utils import (all_reduce, backward_share, catch_interrupts, check_args, check_hub, check_interrupted,
                         check_model_path, close_pool, collate, fail, finish_distributed, full_tensors, hf_generate,
                         init_distributed, Interrupted, interrupted, is_hub_id, join_collectives, load_optimizers,
                         load_problems, load_trainer_state, make_vllm, map_with_deadline, micro_batches, mini_batches,
                         offline_hint, optimizer_step, per_rank, prepare_out, prompt_shares, prompt_stream, rank,
                         request_seed, resume_args, RunLog, save_checkpoint, say, set_rng_state, shard, step_metrics,
                         use_logprob_head, wake, without_dropout, world)


@dataclass
class Args:
    algo: Literal["ppo", "grpo"] = "ppo"
    """PPO (critic, V-trace GAE) or GRPO (group-normalised outcome advantage, no critic)"""
    model: str = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    """hub id or local folder of the base policy (also the reference and, for PPO, the critic's trunk)"""
    dataset: str = "agentica-org/DeepScaleR-Preview-Dataset"
    """hub id, or a local .jsonl/.json/.parquet file of math problems"""
    problem_key: str = "problem"
    """the dataset column holding the problem text"""
    answer_key: str = "answer"
    """the dataset column holding the gold answer"""
    steps: int = 350
    """number of training steps (rollout batches); with --resume, a larger value extends a run"""
    prompts_per_step: Annotated[int | None, tyro.conf.arg(help_behavior_hint="(default: 256 for PPO, 128 for GRPO)")] \
        = None
    """B / group size, prompts per step over all processes (fresh ones plus historical ones)"""
    group_size: Annotated[int | None, tyro.conf.arg(help_behavior_hint="(default: 1 for PPO, 8 for GRPO)")] = None
    """responses per prompt"""
    off_policy_p: float = 0.4
    """p: the share of each batch's prompts drawn from the replay deque during the mix stage"""
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
    on_policy: bool = False
    """plain on-policy PPO/GRPO, the baseline: p = 0, m = 1, no reincarnation, lambda fixed at 1"""
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
    grpo_vtrace: bool = False
    """GRPO: scale A_hat by the product of later trace coefficients (vanishes on long responses; README)"""
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
    max_grad_norm: float = 1.0
    """gradient-norm clip of both models"""
    mini_batch_prompts: int = 32
    """prompts whose responses form one mini-batch (one optimizer step), over all processes"""
    max_tokens_per_micro_batch: int = 16384
    """padded tokens per forward/backward; responses of similar length share one, a longer one runs alone"""
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
    """GPU only: free vLLM's weights and KV cache while training (sleep level 2: no host copy; the push refills it)"""
    vllm_tp: int = 1
    """ranks that share one vLLM engine (tensor parallel), for models too large for one GPU's engine"""
    precision: Annotated[Literal["bf16", "fp32"] | None, tyro.conf.arg(help_behavior_hint="(default: bf16 on GPU, "
                                                                                          "fp32 on CPU)")] = None
    """dtype of every forward pass (policy, critic, frozen reference, vLLM); weights and optimizer state stay fp32"""
    sampler_is_cap: float | None = None
    """C: weight each fresh token's Mix-PPG term by min(pi_trainer / pi_vllm, C); off by default (README Decision 18)"""
    gradient_checkpointing: Annotated[bool | None, tyro.conf.arg(help_behavior_hint="(default: on GPU)")] = None
    """recompute activations in the backward pass of both models (saves memory on long responses)"""
    grader_workers: int = 2
    """processes (per rank) that grade answers with math-verify"""
    grade_timeout: float = 20.0
    """seconds an answer may take to grade; past it the answer scores 0 and counts as a grader failure"""
    seed: int = 1
    """seed of python, numpy, torch and of every vLLM request"""
    dist_timeout: float = 60.0
    """minutes a collective may wait for the other ranks (they wait while rank 0 writes a checkpoint's models)"""
    out: str = "runs/remix"
    """output folder: metrics.jsonl, TensorBoard events, checkpoints"""
    overwrite: bool = False
    """replace the logs and checkpoints of an earlier run in --out"""
    save_every: int = 50
    """save a checkpoint every this many steps (and at the end); 0 saves only at the end"""
    keep_last: int = 3
    """keep only the newest this many checkpoints (0 keeps all)"""
    resume: str | None = None
    """continue the run in this folder from its newest checkpoint, with the run's saved arguments"""
    track: bool = False
    """log to Weights & Biases as well"""


def finalize_args(args: Args) -> Args:
    """Fill the algorithm- and device-dependent defaults; check_args rejects impossible combinations."""
    if args.on_policy:  # nothing of ReMix is left: no replay, no extra passes, no switch, KL to the base only
        args.off_policy_p, args.utd, args.reincarnation, args.kl_convex = 0.0, 1, False, False
    if args.prompts_per_step is None:
        args.prompts_per_step = 256 if args.algo == "ppo" else 128
    if args.group_size is None:
        args.group_size = 1 if args.algo == "ppo" else 8
    if args.precision is None:
        args.precision = "bf16" if torch.cuda.is_available() else "fp32"
    check_args(args)
    return args


# ----------------------------------------------------------------------------------------------
# Reward: answer verification with math-verify
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
    """The answer check: (1.0 if right else 0.0, status), status in ok | no_boxed | unparsable | error. What
    eval.py's Pass@1 counts; the training reward builds on it. Runs in a grader worker's main thread, where
    math-verify's alarm-based timeouts work."""
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
    raises; grades in a worker process with a 4 s deadline. Works from any caller (scripts with or without
    a __main__ guard, python -c, stdin, a notebook)."""
    return grade_many([(response, [answer])], timeout=4.0)[0][0]


def grade_any(response: str, answers: list[str]) -> tuple[float, str]:
    """The best grade over the accepted forms of the answer (Minerva lists several)."""
    graded = [grade_response(response, answer) for answer in answers]
    return max(graded, key=lambda g: g[0])


def training_reward(response: str, answer: str) -> tuple[dict[str, float], str]:
    """The training reward by its parts (the reward is their sum; each part is logged as reward/NAME), and the
    answer check's status. ReMix's reward is correctness alone; a fork may add parts (a format bonus) without
    touching the answer check that eval.py reports. It runs in a grader worker process, like the answer check,
    so it must be a module-level function."""
    correct, status = grade_response(response, answer)
    return {"correct": correct}, status


def grade_many(items: list[tuple[str, list[str]]], workers: int = 2, timeout: float = 20.0) -> list[tuple]:
    """grade_any over (response, answers) items in worker processes with a hard limit per answer: some
    answers hang math-verify inside C code, where its own alarm never fires. Past it: (0.0, "timeout")."""
    return map_with_deadline(grade_any, items, workers, timeout, (0.0, "timeout"), warm=parse_boxed, warm_args=("1",))


# ==============================================================================================
# ALGO LOGIC: the paper's equations, each a pure function over [batch, seq] tensors and masks
# (masks may be bool or float 0/1).
#   paper          code                       what
#   mu             behaviour_logp             the policy that sampled a response: pi_{k-i}, i steps ago
#   pi_k           prox_logp                  the policy at the start of step k (frozen for the step)
#   pi_theta       logp                       the policy being optimised
#   pi_ref         ref_logp                   the KL anchor: the base model, pi_T after reincarnation
#   B, G           prompts_per_step, group_size   prompts per step (fresh + historical), responses per prompt
#   p, N, m, T     off_policy_p, window, utd, reincarnate_step
#   r, c           ratio = pi_theta/mu, centre = pi_k/mu (Eq. 4); c_t = min(c_bar, pi_k/mu) (V-trace)
# Tensors are [B, T] = [responses, response tokens]; a sample (one response) is a dict (its fields: the
# banner of ONE TRAINING STEP).
# ==============================================================================================
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(a_t|s_t) and the entropy of pi(.|s_t), [N, 2], from the logits [N, V] at each response position
    and the tokens [N] that were sampled there: a log-softmax at the sampling temperature (vLLM samples from
    softmax(logits / T)), gathered. The trainer computes it in chunks of the vocabulary's logits
    (remix_utils.chunked_logprobs), to the same numbers."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)  # [N, V]
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # [N]
    return torch.stack([log_probs.gather(-1, tokens[:, None])[:, 0], entropy], dim=-1)  # [N, 2]


def aggregation(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How every loss term is averaged (Decision 3), in this one place: weights per token [B, T] and the size
    they sum to. The token mean: weight 1 per token, size = tokens. update() divides by the mini-batch's size
    over all micro-batches and ranks, and logs the same mean. (A sequence mean would be mask / length and
    rows; a constant normaliser mask and rows * L.)"""
    weights = mask.float()  # [B, T]
    return weights, weights.sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The aggregated mean of x over the mask: sum of weight * x / size (aggregation)."""
    weights, size = aggregation(mask)
    return (torch.where(weights > 0, x, 0.0) * weights).sum() / size.clamp(min=1e-12)


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
    """Eq. 5: lambda * KL(pi_theta || pi_ref) + (1 - lambda) * KL(pi_theta || pi_k), token mean. The paper's
    "precedent model" is pi_k, whose log-probs the step has already (Decision 5)."""
    per_token = lam * k3_kl(logp, ref_logp) + (1.0 - lam) * k3_kl(logp, prox_logp)  # [B, T]
    return masked_mean(per_token, mask)


def truncated_trace(prox_logp, behaviour_logp, mask, c_bar: float = 1.0) -> torch.Tensor:
    """V-trace coefficients c_t = min(c_bar, pi_k(a_t|s_t) / mu(a_t|s_t)); exactly 1 on fresh samples."""
    ratio = torch.exp(prox_logp - behaviour_logp)  # [B, T]
    return torch.where(mask.bool(), ratio.clamp(max=c_bar), 1.0)  # [B, T]


def vtrace_advantages(rewards, values, trace_c, mask, gamma: float = 1.0, lam: float = 1.0):
    """V-trace-corrected GAE (paper Sec. 3, after GePPO), backward over each response's tokens.

        delta_t    = r_t + gamma * V(s_{t+1}) - V(s_t)          (V after the last token = 0)
        A_t        = delta_t + gamma * lam * c_{t+1} * A_{t+1}
        V_target_t = c_t * A_t + V(s_t)

    The target is V-trace's v_t with rho = c: A_t = sum_{j>=t} (gamma lam)^(j-t) (prod_{i=t+1..j} c_i) delta_j,
    so v_t - V(s_t) = sum_j ... (prod_{i=t..j} c_i) delta_j = c_t * A_t.

    Example, one response of 3 tokens, reward 1 at the end, V = (0.5, 0.6, 0.7), c = (1, 0.5, 0.8),
    gamma = lam = 1: A_3 = 1 - 0.7 = 0.3; A_2 = (0.7 - 0.6) + 0.8 * 0.3 = 0.34;
    A_1 = (0.6 - 0.5) + 0.5 * 0.34 = 0.27. With every c = 1 this is GAE(gamma, lam).
    All inputs [B, T]; mask marks response tokens (a prefix of each row). No whitening here.
    """
    mask = mask.bool()
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


def grpo_token_advantages(a_hat, trace_c, mask, product: bool = False) -> torch.Tensor:
    """GRPO's advantage per response token [B, T] from A_hat [B]. Default: A_hat on every token; the
    Mix-PPG ratio is the off-policy correction. product (--grpo-vtrace): the V-trace recursion with V = 0,
    A_t = (prod_{i>t} c_i) * A_hat, which vanishes over long responses (README, Decision 4)."""
    if not product:
        return torch.where(mask.bool(), a_hat[:, None], 0.0)  # [B, T]
    last = mask.long().sum(-1) - 1  # [B] index of each response's last token
    rewards = torch.zeros_like(trace_c).scatter_(1, last[:, None], a_hat[:, None].to(trace_c.dtype))  # [B, T]
    return vtrace_advantages(rewards, torch.zeros_like(trace_c), trace_c, mask)[0]


def whiten(x: torch.Tensor, mask: torch.Tensor, sum_over_ranks=lambda t: t) -> torch.Tensor:
    """Zero mean, unit variance over the masked tokens of the whole batch (PPO advantages); with several
    processes the moments are those of the global batch."""
    mask = mask.bool()
    total = sum_over_ranks(torch.stack([torch.where(mask, x, 0.0).sum(), mask.sum().to(x.dtype)]))
    mean = total[0] / total[1].clamp(min=1)
    var = sum_over_ranks(torch.where(mask, (x - mean) ** 2, 0.0).sum()) / total[1].clamp(min=1)
    return torch.where(mask, (x - mean) * torch.rsqrt(var + 1e-8), 0.0)


def mix_ppg_loss(logp, behaviour_logp, prox_logp, advantages, mask, eps: float = 0.2, weights=None):
    """Eq. 4, Mix-PPG (GePPO's clipped objective), token mean:

        L = - mean[ min( r * A,  clip(r, c - eps, c + eps) * A ) ],  r = pi_theta / mu,  c = pi_k / mu

    The ratio is taken against each sample's behaviour policy mu and the clip interval is centred at
    c, not 1. On fresh samples mu = pi_k, c = 1 and this is PPO-clip. clipfrac counts the tokens where
    the clip changes the objective (A > 0 above c + eps, A < 0 below c - eps), as verl and TRL do.
    weights [B, T] (not in the paper; --sampler-is-cap) scale each token's term: sampler_is_weight.
    """
    ratio = torch.exp(logp - behaviour_logp)  # [B, T]  r
    centre = torch.exp(prox_logp - behaviour_logp).detach()  # [B, T]  c, a constant of the step
    unclipped = ratio * advantages  # [B, T]
    clipped = torch.clamp(ratio, centre - eps, centre + eps) * advantages  # [B, T]
    per_token = torch.minimum(unclipped, clipped)  # [B, T]
    loss = -masked_mean(per_token if weights is None else per_token * weights, mask)
    with torch.no_grad():
        cut = ((advantages > 0) & (ratio > centre + eps)) | ((advantages < 0) & (ratio < centre - eps))  # [B, T]
        stats = {"clipfrac": masked_mean(cut.float(), mask), "ratio_mean": masked_mean(ratio, mask)}
    return loss, stats


def sampler_is_weight(trainer_logp, sampler_logp, cap: float) -> torch.Tensor:
    """Not in the paper (README Decision 18): truncated importance weight min(pi_trainer / pi_sampler, cap) per
    token, for the gap between the tokens' sampler (vLLM's kernels) and the trainer that recomputes mu (TRL's
    vLLM correction). trainer -1.0, sampler -1.5: e^0.5 = 1.65; trainer -0.2, sampler -1.5, cap 2: 2."""
    return torch.exp(trainer_logp - sampler_logp).clamp(max=cap)  # [T]


def clipped_value_loss(values, old_values, value_targets, mask, clip: float = 0.5) -> torch.Tensor:
    """PPO's clipped value loss: 0.5 * mean max((V - target)^2, (clip(V, V_old +- clip) - target)^2)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)  # [B, T]
    return 0.5 * masked_mean(torch.maximum((values - value_targets) ** 2, (clipped - value_targets) ** 2), mask)


def policy_objective(mix_ppg, entropy, kl_convex, ent_coef: float, beta: float) -> torch.Tensor:
    """Eq. 6, the policy's loss: L_mix - ent_coef * entropy + beta * L_klc (after T, L_mix is PPO's
    L_clip: on fresh samples they are the same function). The critic's value loss is separate."""
    return mix_ppg - ent_coef * entropy + beta * kl_convex


# ======================================= end of ALGO LOGIC ====================================


# ----------------------------------------------------------------------------------------------
# The replay deque: one entry per past step, holding that step's fresh groups
# ----------------------------------------------------------------------------------------------
def draw_history(replay: collections.deque, n_groups: int) -> list[list[dict]]:
    """n_groups whole groups drawn uniformly, without replacement, from all the groups the deque holds (the
    batches of the last N policies, pooled). Whole groups (Decision 2), so group statistics never mix fresh and
    old responses. Fewer are returned when the deque holds fewer (it is empty on the first step). The loop draws
    before it appends this step's fresh groups: those are pi_k's own, not history."""
    stored = [group for batch in replay for group in batch]
    return random.sample(stored, min(n_groups, len(stored)))


# ----------------------------------------------------------------------------------------------
# Models: the policy, the frozen reference, the critic; per-token log-probs and values
# ----------------------------------------------------------------------------------------------
def load_models(args: Args, device: torch.device, checkpoint: str | None = None):
    """Policy and critic keep fp32 master weights: at lr 1e-6 a bf16 weight would round most updates away
    (Decision 7); with --precision bf16 they compute with bf16 copies (FSDP2's mixed precision, one process
    too), and the frozen reference is stored in bf16, so before the first update it computes exactly as the
    policy does. A resumed run loads all three from its checkpoint (the reference only once reincarnated).
    Each loads on the CPU and is sharded before the next loads: no host ever holds two whole models."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    checkpointing = device.type == "cuda" if args.gradient_checkpointing is None else args.gradient_checkpointing

    def trainable(model):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        without_dropout(model)  # updates run in training mode (Decision 12)
        return shard(model, device, dtype)

    source = checkpoint or args.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        policy = trainable(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32))
    except (OSError, ValueError) as error:  # a folder without a model: OSError, or ValueError from the tokenizer
        fail(f"cannot load model {source!r}: {str(error).splitlines()[0]}{offline_hint()}")
    ref_source = os.path.join(checkpoint, "reference") if checkpoint and os.path.isdir(
        os.path.join(checkpoint, "reference")) else args.model
    reference = None if args.kl_beta == 0 else shard(  # no KL term, no reference
        AutoModelForCausalLM.from_pretrained(ref_source, dtype=dtype).eval().requires_grad_(False), device, dtype)
    critic = None
    if args.algo == "ppo":  # the paper's critic: the base model with a scalar head
        critic_source = os.path.join(checkpoint, "critic") if checkpoint else args.model
        config = AutoConfig.from_pretrained(critic_source, num_labels=1)
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # its load report lists the new head as MISSING
        critic = trainable(AutoModelForTokenClassification.from_pretrained(critic_source, config=config,
                                                                           dtype=torch.float32))
        transformers.logging.set_verbosity(verbosity)
        if not checkpoint:
            say("critic: the base model with a new scalar value head (score.*), initialised at random")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, policy, reference, critic


def policy_forward(model, batch: dict, temperature: float):
    """token_logprobs of each response token under model: log pi(a_t|s_t) and the entropy, [B, R] each. The
    output layer computes them chunk by chunk (use_logprob_head). The model's own dtype (FSDP2's mixed
    precision, --precision) sets the precision: no autocast, so policy and reference compute alike."""
    head, resp_len = model.get_output_embeddings(), batch["response_mask"].shape[1]
    if not hasattr(head, "targets"):
        use_logprob_head(model)
    head.targets = (batch["input_ids"][:, batch["prompt_len"]:], functools.partial(token_logprobs,
                                                                                    temperature=temperature))
    try:  # the prompt positions never reach the output layer
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                    position_ids=batch["position_ids"], logits_to_keep=resp_len + 1).logits  # [B, R, 2]
    finally:
        head.targets = None
    return out[..., 0], out[..., 1]


def critic_forward(critic, batch: dict) -> torch.Tensor:
    """V(s_t) for each response token t, read at the position that predicts token t: [B, R]. V(s_0) is the
    value at the last prompt token. No KV cache: nothing is generated from it."""
    out = critic(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                 position_ids=batch["position_ids"]).logits  # [B, P + R, 1]
    return out[:, batch["prompt_len"] - 1 : -1, 0].float()  # [B, R]


@torch.no_grad()
def per_token(fn, model, samples: list[dict], args: Args, device, work) -> list[torch.Tensor]:
    """A no-grad per-token pass (log-probs or values) in micro-batches; one unpadded [R_i] CPU vector per
    sample."""
    results = {}
    for micro in micro_batches(samples, args.max_tokens_per_micro_batch, work):
        out = fn(model, collate(micro, device))  # [b, R]
        # keyed by id(): micro_batches reorders the samples by length, and a dict is not hashable
        results.update({id(s): out[j, : len(s["response_ids"])].float().cpu() for j, s in enumerate(micro)})
    return [results[id(s)] for s in samples]


def logprob_pass(args: Args):
    """per_token's function for log pi(a_t|s_t) at the run's temperature."""
    return lambda model, batch: policy_forward(model, batch, args.temperature)[0]


# ----------------------------------------------------------------------------------------------
# Samplers: vLLM with a weight push after every update, or transformers' generate
# ----------------------------------------------------------------------------------------------
def vllm_generate(llm, prompts: list[list[int]], n: int, args: Args, seeds: list[int], use_tqdm: bool = False):
    """n responses per prompt, each request with its own seed (request_seed): [[(token_ids, finish_reason,
    sampler log-probs [R]), ...] per prompt]; EOS stays in token_ids."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(n=n, temperature=args.temperature, top_p=args.top_p, top_k=0, seed=seed, logprobs=0,
                             max_tokens=args.max_response_tokens) for seed in seeds]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=use_tqdm)
    return [[(list(c.token_ids), c.finish_reason, torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]))
             for c in o.outputs] for o in outputs]


def push_weights(llm, policy, vllm_sleep: bool) -> float:
    """Load the trainer's weights into the engine, one full tensor at a time; returns the seconds it took.
    vLLM warns 'RotaryEmbedding: Failed to load weights': its rotary cache is derived from the config,
    is not in a state dict and keeps its value, which is right (README)."""
    start = time.perf_counter()
    if vllm_sleep:
        wake(llm, "weights")  # the KV cache stays asleep until sampling starts
    dtype = llm.llm_engine.model_config.dtype
    weights = ((name, tensor.to(dtype)) for name, tensor in full_tensors(policy))  # gathered from the shards
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
    return time.perf_counter() - start


def padded(samples: list[dict], key: str) -> torch.Tensor:
    """A per-token vector stored with each sample, right-padded into [B, R]."""
    return pad_sequence([s[key] for s in samples], batch_first=True)


def response_mask(samples: list[dict]) -> torch.Tensor:
    """[B, R], True on each sample's response tokens (right-padded, as padded() lays them out)."""
    if not samples:
        return torch.zeros(0, 0, dtype=torch.bool)
    return pad_sequence([torch.ones(len(s["response_ids"]), dtype=torch.bool) for s in samples], batch_first=True)


# ==============================================================================================
# ONE TRAINING STEP, phase by phase in the paper's order; each is a function a fork can replace.
# Every rank runs each phase on its own share of the batch; `all_reduce`/`all_gather` mark where the
# ranks combine their parts. A sample is one response, a dict whose fields the phases fill in:
#   phase               fields ([R] = one value per response token)                      in the deque
#   1 sample            prompt_ids, response_ids, answer, version (its policy's step k),  stored
#                       group, truncated, sampler_logp [R] (vLLM's, None with hf)
#   2 score             reward, reward_parts, reflects                                   stored
#   3 behaviour/ref     behaviour_logp [R] (mu), ref_logp [R], sampler_weight [R]        stored
#   4 prox/values       prox_logp [R] (pi_k), values [R] (PPO)                           recomputed
#   5 advantages        advantages [R], value_targets [R] (PPO)                          recomputed
# A historical sample keeps what it was stored with and gets 4 and 5 anew every step; the loop drops them
# at the step's end.
# ==============================================================================================
def stage(step: int, args: Args) -> tuple[bool, float, int]:
    """Mix stage (p, m) through step T; after it, plain on-policy: p = 0 and m = 1 (Eq. 6, Decision 6)."""
    mixing = not args.reincarnation or step <= args.reincarnate_step
    return mixing, (args.off_policy_p if mixing else 0.0), (args.utd if mixing else 1)


def sample(llm, policy, tokenizer, prompts: list[tuple], step: int, args: Args, device) -> list[list[dict]]:
    """1. Sample group_size responses from pi_k for this rank's share of the step's fresh prompts: one
    group of samples per prompt. Each vLLM request carries its own seed, made from the prompt's index in
    the step, so the ranks of one engine (--vllm-tp), which generate its prompts together and each keep
    their share, draw the same tokens, and a resumed run draws what an uninterrupted one would."""
    mine, engine, first, offset = prompt_shares(prompts, args.vllm_tp)  # this rank's prompts; its engine's
    if llm is not None:
        if args.vllm_sleep:
            wake(llm, "kv_cache")
        seeds = [request_seed(args.seed, step, first + i, args.group_size) for i in range(len(engine))]
        generations = vllm_generate(llm, [p.ids for p in engine], args.group_size, args, seeds)[offset:]
        if args.vllm_sleep:  # level 2 keeps no copy of the weights: the next push replaces them
            llm.sleep(level=2)
    else:
        generations = hf_generate(policy, tokenizer, [p.ids for p in mine], args.group_size, args, device)
    # a group id unique over the run: a step's groups never exceed a million
    return [[{"prompt_ids": prompt.ids, "response_ids": response or [tokenizer.pad_token_id], "answer": prompt.answer,
              "version": step, "group": step * 1_000_000 + i, "truncated": finish == "length",
              "sampler_logp": None if logps is None or not response else logps}
             for response, finish, logps in group]
            for i, (prompt, group) in enumerate(zip(mine, generations))]


def score(fresh: list[dict], tokenizer, args: Args) -> collections.Counter:
    """2. Score: training_reward of each response (1.0 if its final answer is right under math-verify, else
    0.0), graded in worker processes with a deadline (a timeout scores 0). Returns the grader's status counts."""
    texts = [tokenizer.decode(s["response_ids"], skip_special_tokens=True) for s in fresh]
    grades = map_with_deadline(training_reward, [(text, s["answer"]) for text, s in zip(texts, fresh)],
                               args.grader_workers, args.grade_timeout, ({}, "timeout"), warm=parse_boxed,
                               warm_args=("1",))
    for s, text, (parts, _) in zip(fresh, texts, grades):
        s["reward"], s["reward_parts"] = sum(parts.values(), 0.0), parts
        s["reflects"] = any(word in text.lower() for word in SELF_REFLECTION_WORDS)
    return collections.Counter(status for _, status in grades)


def behaviour_and_reference(fresh: list[dict], policy, reference, args: Args, device, work):
    """3. Store with each fresh sample its behaviour log-probs, recomputed by the trainer (Decision 1), and
    the reference's. pi_ref is fixed until reincarnation, which empties the deque, so stored reference
    log-probs stay exact for as long as a sample can be replayed."""
    for key, model in (("behaviour_logp", policy), ("ref_logp", reference)):
        for s, logp in zip(fresh, per_token(logprob_pass(args), model, fresh, args, device, work) if model else ()):
            s[key] = logp  # [R_i]
    if args.sampler_is_cap is not None:  # stored with the sample: a replayed sample keeps its weight
        for s in fresh:
            s["sampler_weight"] = sampler_is_weight(s["behaviour_logp"], s["sampler_logp"], args.sampler_is_cap)


def prox_and_values(fresh: list[dict], history: list[dict], policy, critic, args: Args, device, work):
    """4. log pi_k on the historical samples (on fresh ones pi_k = mu), and the critic's values on all."""
    for s in fresh:
        s["prox_logp"] = s["behaviour_logp"]
    for s, logp in zip(history, per_token(logprob_pass(args), policy, history, args, device, work)):
        s["prox_logp"] = logp
    if critic is not None:
        for s, values in zip(fresh + history, per_token(critic_forward, critic, fresh + history, args, device, work)):
            s["values"] = values


def compute_advantages(batch: list[dict], args: Args) -> dict:
    """5. Advantages per response token, recomputed every step with the current pi_k and critic: V-trace
    GAE whitened over the global batch (PPO), or the group advantage (GRPO, Decision 4)."""
    mask = response_mask(batch)  # [B, R]
    behaviour, prox = padded(batch, "behaviour_logp"), padded(batch, "prox_logp")  # [B, R]
    trace_c = truncated_trace(prox, behaviour, mask, args.vtrace_c_bar)  # [B, R]
    scores = torch.tensor([s["reward"] for s in batch])  # [B]
    if args.algo == "ppo":
        values = padded(batch, "values")  # [B, R]
        last = mask.sum(-1) - 1  # [B] each response's last token carries the outcome reward
        rewards = torch.zeros_like(values).scatter_(1, last[:, None], scores[:, None])  # [B, R]
        advantages, targets = vtrace_advantages(rewards, values, trace_c, mask, args.gamma, args.gae_lambda)
        advantages = whiten(advantages, mask, all_reduce)  # [B, R]
        for s, target in zip(batch, targets):
            s["value_targets"] = target[: len(s["response_ids"])]
    else:
        a_hat = group_advantages(scores, torch.tensor([s["group"] for s in batch]))  # [B]
        advantages = grpo_token_advantages(a_hat, trace_c, mask, args.grpo_vtrace)  # [B, R]
    for s, adv in zip(batch, advantages):
        s["advantages"] = adv[: len(s["response_ids"])]
    return {"mask": mask, "trace_c": trace_c, "log_ratio": prox - behaviour, "advantages": advantages}


def update(batch: list[dict], policy, critic, optimizers, lam: float, utd: int, step: int, args: Args, device,
           progress: dict, work) -> dict:
    """6. utd passes over the batch (Decision 13); each pass cuts a new random order of it into mini-batches of
    mini_batch_prompts prompts' responses, one optimizer step each, on Mix-PPG - entropy + beta * KL-Convex
    (Eq. 6) and the critic's clipped value loss. Every term is aggregated over the whole mini-batch
    (`aggregation`, Decision 3), however it is split into micro-batches and ranks."""
    stats = collections.defaultdict(list)  # one entry per optimizer step (README: Metrics)
    names = ["losses/policy_loss", "losses/entropy", "losses/clipfrac", "kl/prox"]
    names += (["losses/kl_convex", "kl/ref"] if args.kl_beta else []) + (["losses/value_loss"] if critic else [])
    models = [m for m in (policy, critic) if m is not None]
    for model in models:  # training mode: transformers checkpoints activations only then (no dropout here)
        model.train()
    for epoch in range(utd):
        for rows in mini_batches(batch, args.mini_batch_prompts * args.group_size, args.seed, step, epoch):
            size = all_reduce(aggregation(response_mask(rows))[1])  # what the mini-batch's means divide by
            logged = dict.fromkeys(names, 0.0)  # each term summed with its micro-batch's share
            for optim in filter(None, optimizers):
                optim.zero_grad(set_to_none=True)
            for micro in micro_batches(rows, args.max_tokens_per_micro_batch, work):
                mb = collate(micro, device)
                mask = mb["response_mask"]  # [b, r]
                share = aggregation(mask)[1] / size  # this micro-batch's part of the mini-batch's mean
                logp, entropy = policy_forward(policy, mb, args.temperature)  # [b, r] log pi_theta, H(pi_theta)
                if not micro:  # this rank has no sample here, but must join the others' FSDP collectives, in order
                    join_collectives(logp)
                    if critic is not None:
                        join_collectives(critic_forward(critic, mb))
                    continue
                behaviour, prox, adv = (padded(micro, key).to(device) for key in
                                        ("behaviour_logp", "prox_logp", "advantages"))  # [b, r] mu, pi_k, A
                weights = padded(micro, "sampler_weight").to(device) if args.sampler_is_cap is not None else None
                pg_loss, pg_stats = mix_ppg_loss(logp, behaviour, prox, adv, mask, args.clip_eps, weights)
                entropy = masked_mean(entropy, mask)
                terms = {"losses/policy_loss": pg_loss, "losses/entropy": entropy,
                         "losses/clipfrac": pg_stats["clipfrac"], "kl/prox": masked_mean(k3_kl(logp, prox), mask)}
                klc = torch.zeros((), device=device)
                if args.kl_beta:
                    ref = padded(micro, "ref_logp").to(device)  # [b, r] pi_ref
                    klc = kl_convex_loss(logp, ref, prox, lam, mask)
                    terms.update({"losses/kl_convex": klc, "kl/ref": masked_mean(k3_kl(logp, ref), mask)})
                backward_share(policy_objective(pg_loss, entropy, klc, args.ent_coef, args.kl_beta), share)
                if critic is not None:
                    values = critic_forward(critic, mb)  # [b, r]
                    value_loss = clipped_value_loss(values, padded(micro, "values").to(device),
                                                    padded(micro, "value_targets").to(device), mask, args.value_clip)
                    backward_share(value_loss, share)
                    terms["losses/value_loss"] = value_loss
                for name, term in terms.items():
                    logged[name] += float(term.detach()) * float(share)
            optimizer_step(models, optimizers, logged, args.max_grad_norm, stats, progress, step, args.out)
    for model, optim in zip(models, filter(None, optimizers)):
        optim.zero_grad(set_to_none=True)  # no gradients held through the push, generation and no-grad passes
        model.eval()
    return stats


def reincarnate(policy, reference, replay: collections.deque):
    """8. Policy reincarnation at T (Eq. 6): the reference takes pi_T's weights and the deque is emptied;
    stage() returns p = 0 and m = 1 from now on. Optimizers, critic and lambda(t) carry on."""
    if reference is not None:  # none without a KL term (--kl-beta 0)
        reference.load_state_dict(policy.state_dict())
    replay.clear()


# ----------------------------------------------------------------------------------------------
# The training loop
# ----------------------------------------------------------------------------------------------
def train(args: Args, on_step=None) -> dict:
    """The whole run. on_step(step, record, policy, tokenizer, batch), if given, runs after each step and may
    add entries to the step's metrics record (the toy experiment logs held-out accuracy this way)."""
    device = init_distributed(args.dist_timeout)
    checkpoint = state = None
    if args.resume:  # the run's saved arguments and newest checkpoint; --steps may extend it
        checkpoint, state = load_trainer_state(args.resume)
        args = resume_args(args, state["args"], state["progress"]["step"])
        if state["progress"]["step"] >= args.steps:
            say(f"{args.out} has finished all {args.steps} steps; give --resume a larger --steps to extend it")
            return {}
        say(f"resuming {args.out} after step {state['progress']['step']} from {checkpoint}")
    args = finalize_args(args)
    check_model_path(args.model)  # then everything that needs the hub, in seconds
    check_hub({f"--{k}": getattr(args, k) for k in ("model", "dataset") if is_hub_id(getattr(args, k))
               and not getattr(args, k).endswith((".jsonl", ".json", ".parquet"))})
    problems = load_problems(args.dataset, args.problem_key, args.answer_key)
    if not args.resume:
        prepare_out(args.out, args.overwrite)
    torch.manual_seed(args.seed)  # the critic's new head starts alike on every rank
    tokenizer, policy, reference, critic = load_models(args, device, checkpoint)
    actor_optim = torch.optim.AdamW(policy.parameters(), lr=args.actor_lr, weight_decay=args.weight_decay)
    critic_optim = None if critic is None else torch.optim.AdamW(
        critic.parameters(), lr=args.critic_lr, weight_decay=args.weight_decay)
    if state is not None:
        load_optimizers(checkpoint, {"policy": policy, "critic": critic},
                        {"policy": actor_optim, "critic": critic_optim})
    args.vllm_sleep = args.vllm_sleep and device.type == "cuda"  # the CPU engine has no sleep mode
    vllm_dtype = "bfloat16" if args.precision == "bf16" else "float32"
    llm = make_vllm(args, device, vllm_dtype) if args.sampler == "vllm" else None
    for seed_fn in (random.seed, np.random.seed, torch.manual_seed):  # after vLLM's start, which reseeds
        seed_fn(args.seed + rank())
    replay: collections.deque = collections.deque(maxlen=args.window)
    progress = {"step": 0, "rollouts": 0, "tokens": 0, "data_position": 0, "bad_updates": 0}
    if state is not None:
        replay.extend(state["replay"])
        progress = state["progress"]
        set_rng_state(state["rng"])
        if llm is not None:
            push_weights(llm, policy, args.vllm_sleep)  # the engine started from the base weights
    os.makedirs(args.out, exist_ok=True)
    log = RunLog(args.out, dataclasses.asdict(args), progress["step"], args.track)
    prompts_source = prompt_stream(problems, functools.partial(build_prompt, tokenizer), args.max_prompt_tokens,
                                   args.seed, progress["data_position"])
    bar = tqdm(total=args.steps, initial=progress["step"], desc="remix", dynamic_ncols=True, disable=rank() != 0)
    step = progress["step"]
    try:
        for step in range(progress["step"] + 1, args.steps + 1):
            check_interrupted()
            step_start, work = time.perf_counter(), collections.Counter()
            mixing, p, utd = stage(step, args)
            n_fresh = round((1.0 - p) * args.prompts_per_step)  # prompts over all ranks; the rest from the deque

            # 1. sample (1-p)*B fresh responses from pi_k, and 2. score them
            prompts = [next(prompts_source) for _ in range(n_fresh)]
            progress["data_position"] = prompts[-1].position  # problems consumed, for --resume
            groups = sample(llm, policy, tokenizer, prompts, step, args, device)
            gen_seconds = time.perf_counter() - step_start
            fresh = [s for group in groups for s in group]
            grader = score(fresh, tokenizer, args)

            # 3. behaviour and reference log-probs; 4. mix in p*B historical samples: whole groups drawn
            # uniformly from the last N batches (each rank from its own deque, Decision 17), then pi_k and values
            trainer_start = time.perf_counter()
            behaviour_and_reference(fresh, policy, reference, args, device, work)
            history = [s for g in draw_history(replay, per_rank(args.prompts_per_step - n_fresh)) for s in g]
            if mixing:
                replay.append(groups)  # the deque stores fresh batches only and drops the oldest
            batch = fresh + history
            prox_and_values(fresh, history, policy, critic, args, device, work)

            # 5. advantages, 6. utd passes of Mix-PPG + KL-Convex updates
            advantages = compute_advantages(batch, args)
            lam = kl_convex_lambda(step, args.kl_convex_start, args.kl_convex_every) if args.kl_convex else 1.0
            stats = update(batch, policy, critic, (actor_optim, critic_optim), lam, utd, step, args, device,
                           progress, work)
            trainer_seconds = time.perf_counter() - trainer_start

            # 7. push pi_{k+1} into the sampler; 8. reincarnation at T
            sync_seconds = push_weights(llm, policy, args.vllm_sleep) if llm is not None else 0.0
            if args.reincarnation and step == args.reincarnate_step:
                reincarnate(policy, reference, replay)

            # 9. log (from the first rank) and save
            record = {"step": step, "phase": "mix" if mixing else "on-policy", "kl_convex/lambda": lam,
                      "train/utd": utd, **step_metrics(step, fresh, history, grader, advantages, stats,
                                                       {"gen": gen_seconds, "trainer": trainer_seconds}, work,
                                                       args.group_size, args.vtrace_c_bar),
                      "replay/deque_size": len(replay), "perf/weight_sync_s": sync_seconds}
            progress["rollouts"] += record["batch/fresh"]
            progress["tokens"] += round(record["response/length_mean"] * record["batch/fresh"])
            record.update({"rollouts/total": progress["rollouts"], "rollouts/generated_tokens": progress["tokens"],
                           "perf/step_s": time.perf_counter() - step_start})
            if on_step is not None:
                on_step(step, record, policy, tokenizer, batch)
            for s in batch:  # what is recomputed every step is not kept in the deque
                for key in ("prox_logp", "values", "advantages", "value_targets"):
                    s.pop(key, None)
            log.write(record)
            bar.set_postfix(reward=f"{record['reward/mean']:.3f}", rollouts=progress["rollouts"], phase=record["phase"],
                            refresh=False)
            bar.update(1)
            progress["step"] = step
            if (args.save_every and step % args.save_every == 0) or step == args.steps:
                reincarnated = args.reincarnation and step >= args.reincarnate_step
                save_checkpoint(args.out, step, {"policy": policy, "critic": critic,
                                                 "reference": reference if reincarnated else None}, tokenizer,
                                {"policy": actor_optim, "critic": critic_optim},
                                {"args": dataclasses.asdict(args), "progress": progress, "replay": list(replay)},
                                args.keep_last)
        check_interrupted()
    except BaseException as error:  # what breaks after a Ctrl-C (DCP wraps it in its own error) is that Ctrl-C
        if not (isinstance(error, KeyboardInterrupt) or interrupted()):
            raise
        close_pool()
        raise Interrupted(step, args.out) from None
    finally:
        bar.close()
        log.close()
    return {"policy": policy, "reference": reference, "critic": critic, "replay": replay, "llm": llm,
            "tokenizer": tokenizer}


def main():
    args = tyro.cli(Args)
    catch_interrupts()
    try:
        train(args)
    except KeyboardInterrupt as interrupt:  # Ctrl-C: one line, no tracebacks, no workers left, exit 130
        close_pool()
        if rank() == 0:
            print(f"\nremix: {getattr(interrupt, 'line', 'interrupted while starting; nothing to resume')}",
                  file=sys.stderr, flush=True)
        os._exit(130)
    if world() > 1:
        finish_distributed()


if __name__ == "__main__":
    main()
