"""ReMix: Reincarnating Mix-policy Proximal Policy Gradient, the method in one file.

Liang et al., "Squeeze the Soaked Sponge: Efficient Off-policy Reinforcement Finetuning for Large
Language Model", arXiv 2507.06892. Calls into the package it runs on, machinery/, name their module
(dist., runner., ...): skip them.

    replay = deque(maxlen=N)                                  the last N policies' fresh batches
    for k = 1, 2, ...:
        p, m = (p, m) if k <= T else (0, 1)                   stage
        fresh = G responses of pi_k to each of (1-p)*B prompts  sample (vLLM, a seed per request)
        reward = [last \\boxed{} == gold]  (math-verify)      score (training_reward)
        mu, ref = log pi_k, log pi_ref of each fresh token    behaviour_and_reference
        history = p*B prompts' groups, whole, from replay     draw_history
        replay.append(fresh)
        log pi_k of history; V(s_t) of all (PPO)              prox_and_values
        A = V-trace GAE, c_t = min(c_bar, pi_k/mu) (PPO)      compute_advantages (vtrace_advantages,
            or (R - mean_group R) / std_group R (GRPO)          group_advantages)
        m passes, mini-batches: Mix-PPG (Eq. 4) - entropy     update, objective (mix_ppg_loss,
            + beta * KL-Convex (Eq. 5, lambda(t)), value loss  kl_convex_loss, clipped_value_loss)
        push pi_{k+1}'s weights into vLLM                     engines.push_weights
        if k == T: pi_ref <- pi_T, empty replay               reincarnate (Eq. 6)
"""

if __name__ == "__main__":  # first: a Ctrl-C while torch imports (seconds) ends in one line too
    from machinery import console
    console.one_line_interrupts("remix")

import collections
import functools
import math
import random
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from machinery import console, dist, engines, grader, models, overlap, report, runner


@dataclass
class Args:
    """the method: what a reader of the paper sets (the run's settings: console.RunArgs)"""
    algo: Literal["ppo", "grpo"] = "ppo"
    """PPO (critic, V-trace GAE) or GRPO (group-normalised outcome advantage, no critic)"""
    steps: int = 350
    """steps (rollout batches), in [1, 1000000]; with --resume, a larger value extends the run"""
    prompts_per_step: Annotated[int | None, console.hint("(default: 256 PPO, 128 GRPO)")] = None
    """B, in [1, 65536]: prompts per step on all processes, fresh + historical (G responses each)"""
    group_size: Annotated[int | None, console.hint("(default: 1 for PPO, 8 for GRPO)")] = None
    """G, responses per prompt, in [1, 1024] (>= 2 for GRPO)"""
    off_policy_p: float = 0.4
    """p, in [0, 1): the share of a batch's prompts drawn from the replay deque in the mix stage"""
    window: int = 2
    """N, in [1, 1000]: how many previous policies' batches the replay deque keeps"""
    utd: int = 2
    """m, in [1, 1000]: update-to-data ratio, passes over a mix-stage batch (1: 'no higher UTD')"""
    reincarnate_step: int = 100
    """T, in [0, 1000000]: the last mix-stage step; after it pi_ref = pi_T, training on-policy"""
    reincarnation: bool = True
    """switch to on-policy training after T (--no-reincarnation is the paper's ablation)"""
    kl_convex: bool = True
    """Eq. 5 schedule for lambda(t) (--no-kl-convex fixes lambda = 1: plain KL to the reference)"""
    on_policy: bool = False
    """plain on-policy PPO/GRPO, the baseline: p = 0, m = 1, no reincarnation, lambda fixed at 1"""
    kl_convex_start: int = 50
    """in [0, 1000000]: the step after which lambda(t) starts to fall (Eq. 5: 50)"""
    kl_convex_every: int = 10
    """in [1, 1000000]: lambda(t) falls by 0.1 every this many steps (Eq. 5: 10)"""
    kl_beta: float = 0.001
    """beta, in [0, 1e6]: the coefficient of the KL-Convex term (0 loads no reference model)"""
    ent_coef: float = 0.001
    """in [0, 1e6]: coefficient of the entropy bonus"""
    clip_eps: float = 0.2
    """eps, in (0, 1): the clip range of Mix-PPG around pi_k/mu"""
    value_clip: float = 0.5
    """in (0, 1e6]: clip range of the value loss"""
    vtrace_c_bar: float = 1.0
    """c_bar, in (0, 1e6]: the truncation of the V-trace coefficients"""
    grpo_vtrace: bool = False
    """GRPO: A_hat times the product of the later c_t (vanishes on long responses; Decision 4)"""
    gamma: float = 1.0
    """discount factor, in (0, 1]"""
    gae_lambda: float = 1.0
    """the lambda of GAE / V-trace, in [0, 1]"""
    actor_lr: float = 1e-6
    """in (0, 1]: policy learning rate (constant)"""
    critic_lr: float = 1e-5
    """in (0, 1]: critic learning rate (constant)"""
    weight_decay: float = 0.01
    """in [0, 1e6]: AdamW weight decay of both optimizers (verl's default)"""
    max_grad_norm: float = 1.0
    """in (0, 1e6]: gradient-norm clip of both models"""
    mini_batch_prompts: int = 32
    """in [1, 65536]: prompts per mini-batch (one optimizer step), over all processes"""
    temperature: float = 1.0
    """in [0.01, 100]: sampling temperature of training rollouts (log-probs use it too)"""
    top_p: float = 1.0
    """nucleus sampling, in (0, 1]; keep 1.0, truncated sampling biases the importance ratios"""
    max_prompt_tokens: int = 1024
    """in [1, 1048576]: longer prompts are skipped"""
    max_response_tokens: int = 8192
    """in [1, 1048576]: generation budget per response"""
    prompt_suffix: str = " Let's think step by step and output the final answer within \\boxed{}."
    """appended to every problem (the paper's prompt)"""
    system_prompt: str | None = None
    """a system turn before the problem (the paper has none)"""
    sampler_is_cap: float | None = None
    """C in (0, 1e6]: fresh tokens' Mix-PPG terms times min(pi_trainer/pi_vllm, C) (Decision 18)"""


def finalize_args(args: Args) -> Args:
    """Fill the algorithm-dependent defaults; console.check_args rejects bad values."""
    if args.on_policy:  # no ReMix: no replay, no extra passes, no switch, KL to the base only
        args.off_policy_p, args.utd, args.reincarnation, args.kl_convex = 0.0, 1, False, False
    if args.prompts_per_step is None:
        args.prompts_per_step = 256 if args.algo == "ppo" else 128
    if args.group_size is None:
        args.group_size = 1 if args.algo == "ppo" else 8
    return args


# ---- The prompt and the reward: answers verified with math-verify (spec Sec. 7) -------------
# METHOD (after the step's table) hands them to machinery
SELF_REFLECTION_WORDS = ("verify", "re-examine", "double-check", "why", "root cause", "validate",
                         "abduct", "question", "check", "but", "wait", "confirm", "scrutinize",
                         "analyze", "investigate", "probe")


def build_prompt(tokenizer, problem: str, suffix: str = Args.prompt_suffix,
                 system: str | None = None) -> list[int]:
    """One user turn through the chat template, generation prompt added; plain text without one."""
    if not tokenizer.chat_template:
        return tokenizer((system + "\n\n" if system else "") + problem + suffix).input_ids
    turns = [{"role": "system", "content": system}] if system else []
    turns.append({"role": "user", "content": problem + suffix})
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids  # the template already holds any BOS


def final_answer(response: str) -> str | None:
    """The content of the last balanced \\boxed{...} (or \\fbox) of the text after the first
    </think>, or of the whole text without one: 'so \\boxed{\\frac{1}{2}}.' -> '\\frac{1}{2}'."""
    after_thought = response.partition("</think>")[2] if "</think>" in response else response
    return grader.last_boxed(after_thought)


@functools.lru_cache(maxsize=200_000)
def parse_boxed(expression: str):
    """math-verify's parse of one answer, rewritten in notation it reads; raises on failure."""
    from math_verify import parse

    return parse("\\boxed{" + grader.rewrite(expression) + "}", raise_on_error=True)


def grade_response(response: str, answer: str) -> tuple[float, str]:
    """The answer check, what eval.py's Pass@1 counts: (1.0 if right else 0.0, ok | no_boxed |
    unparsable | error), in a grader worker's main thread (math-verify's timeouts need it)."""
    from math_verify import errors, verify

    predicted = final_answer(response)
    if predicted is None:
        return 0.0, "no_boxed"
    try:
        gold, pred = parse_boxed(answer), parse_boxed(predicted)
        if not gold or not pred:
            return 0.0, "unparsable"
        return float(verify(gold, pred, raise_on_error=True)), "ok"  # gold first: the order matters
    except (Exception, errors.TimeoutException):  # its timeout: a BaseException; wrong, counted
        return 0.0, "error"


def training_reward(response: str, answer: str, tokens: int,
                    truncated: bool) -> tuple[dict[str, float], str]:
    """The training reward by its parts (their sum; each logged as reward/NAME) and the answer
    check's status. ReMix's is correctness alone; a fork may add parts (format, length)."""
    correct, status = grade_response(response, answer)
    return {"correct": correct}, status


# ==============================================================================================
# ALGO LOGIC: the paper's equations, each a pure function over [N, L] tensors and masks (bool, 0/1)
#   paper       code                 what
#   mu          behaviour_logp       the policy that sampled a response: pi_{k-i}, i steps ago
#   pi_k        prox_logp            the policy at the start of step k (frozen for the step)
#   pi_theta    logp                 the policy being optimised
#   pi_ref      ref_logp             the KL anchor: the base model, pi_T after reincarnation
#   B, G        prompts_per_step,    prompts per step (fresh + historical),
#               group_size           responses per prompt
#   p, N, m, T  off_policy_p, window, utd, reincarnate_step
#   r, c        r = pi_theta/mu, centre = pi_k/mu (Eq. 4, by ratio());
#               c_t = min(c_bar, pi_k/mu) (V-trace)
# Shapes: [N, L] = [responses, response tokens]; [V] the vocabulary; [H] the hidden size
# (a sample's fields: ONE TRAINING STEP)
# ==============================================================================================
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(a_t|s_t) and the entropy of pi(.|s_t), [n, 2], from the logits [n, V] and the tokens
    [n] sampled there: a log-softmax at the sampling temperature (vLLM samples from it)."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)  # [n, V]
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # [n]
    return torch.stack([log_probs.gather(-1, tokens[:, None])[:, 0], entropy], dim=-1)  # [n, 2]


def aggregation(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How every loss term is averaged (Decision 3), in this one place: weights per token [N, L] and
    the size they sum to. The token mean: weight 1 per token, size = tokens; update() divides by the
    mini-batch's size. (A sequence mean: mask / length and rows; a constant: mask, rows * L.)"""
    weights = mask.float()  # [N, L]
    return weights, weights.sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The aggregated mean of x over the mask: sum of weight * x / size (aggregation)."""
    weights, size = aggregation(mask)
    return (torch.where(weights > 0, x, 0.0) * weights).sum() / size.clamp(min=1e-12)


def ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """e^log_ratio, clamped to +-20 first as verl does (Decision 15): e^89 overflows float32."""
    return torch.exp(log_ratio.clamp(-20.0, 20.0))


def kl_convex_lambda(t: int, start: int = 50, every: int = 10) -> float:
    """Eq. 5 schedule: 1.0 up to step `start` (50), then 0.1 lower every `every` (10) steps, never
    below 0.5: t = 50 -> 1.0, 51 -> 0.9, 60 -> 0.9, 61 -> 0.8, 91 -> 0.5, 500 -> 0.5."""
    return max(1.0 - 0.1 * math.ceil(max(t - start, 0) / every), 0.5)


def k3_kl(logp: torch.Tensor, anchor_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || anchor) from sampled tokens: e^(q-p) - (q-p) - 1."""
    log_ratio = (anchor_logp - logp).clamp(-20.0, 20.0)  # [N, L], clamped as ratio() is
    return torch.exp(log_ratio) - log_ratio - 1.0  # [N, L]


def kl_convex_loss(logp, ref_logp, prox_logp, lam: float, mask) -> torch.Tensor:
    """Eq. 5: lambda * KL(pi_theta || pi_ref) + (1 - lambda) * KL(pi_theta || pi_k), token mean. The
    paper's "precedent model" is pi_k, whose log-probs the step has already (Decision 5)."""
    per_token = lam * k3_kl(logp, ref_logp) + (1.0 - lam) * k3_kl(logp, prox_logp)  # [N, L]
    return masked_mean(per_token, mask)


def truncated_trace(prox_logp, behaviour_logp, mask, c_bar: float = 1.0) -> torch.Tensor:
    """V-trace's c_t = min(c_bar, pi_k(a_t|s_t) / mu(a_t|s_t)); exactly 1 on fresh samples."""
    c = ratio(prox_logp - behaviour_logp).clamp(max=c_bar)  # [N, L]
    return torch.where(mask.bool(), c, 1.0)  # [N, L]


def vtrace_advantages(rewards, values, trace_c, mask, gamma: float = 1.0, lam: float = 1.0):
    """V-trace-corrected GAE (paper Sec. 3, after GePPO), backward over each response's tokens:
        delta_t    = r_t + gamma * V(s_{t+1}) - V(s_t)          (V after the last token = 0)
        A_t        = delta_t + gamma * lam * c_{t+1} * A_{t+1}
        V_target_t = c_t * A_t + V(s_t)
    The target is V-trace's v_t with rho = c:
    A_t = sum_{j>=t} (gamma lam)^(j-t) (prod_{i=t+1..j} c_i) delta_j,
    so v_t - V(s_t) = sum_j ... (prod_{i=t..j} c_i) delta_j = c_t * A_t.
    Example, one response of 3 tokens, reward 1 at the end, V = (0.5, 0.6, 0.7), c = (1, 0.5, 0.8),
    gamma = lam = 1: A_3 = 1 - 0.7 = 0.3; A_2 = (0.7 - 0.6) + 0.8 * 0.3 = 0.34;
    A_1 = (0.6 - 0.5) + 0.5 * 0.34 = 0.27. With every c = 1 this is GAE(gamma, lam).
    All inputs [N, L]; mask marks response tokens (a prefix of each row). No whitening here."""
    mask = mask.bool()
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)  # [N, L]
    next_adv = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)  # [N]
    next_value = torch.zeros_like(next_adv)  # [N]
    next_c = torch.ones_like(next_adv)  # [N]
    for t in reversed(range(length)):
        live = mask[:, t]  # [N]
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [N]
        adv = delta + gamma * lam * next_c * next_adv  # [N]
        advantages[:, t] = torch.where(live, adv, 0.0)
        # past a response's end the "next" state is terminal: zero value, zero advantage
        next_adv = torch.where(live, adv, 0.0)
        next_value = torch.where(live, values[:, t], 0.0)
        next_c = torch.where(live, trace_c[:, t], 1.0)
    value_targets = torch.where(mask, trace_c * advantages + values, 0.0)  # [N, L]
    return advantages, value_targets


def group_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """GRPO outcome advantage A_hat = (R - mean_group R) / (std_group R + 1e-6), unbiased std:
    scores (1, 0, 0, 1), groups (0, 0, 1, 1) -> (0.7071, -0.7071, -0.7071, 0.7071); alone: 0."""
    advantages = torch.zeros_like(scores)  # [N]
    for gid in torch.unique(group_ids):
        members = group_ids == gid  # [N]
        group = scores[members]
        if group.numel() > 1:
            advantages[members] = (group - group.mean()) / (group.std(unbiased=True) + 1e-6)
    return advantages


def grpo_token_advantages(a_hat, trace_c, mask, product: bool = False) -> torch.Tensor:
    """GRPO's advantage per response token [N, L] from A_hat [N]. Default: A_hat on every token; the
    Mix-PPG ratio is the off-policy correction. product (--grpo-vtrace): the V-trace recursion with
    V = 0, A_t = (prod_{i>t} c_i) * A_hat, which vanishes over long responses (Decision 4)."""
    if not product:
        return torch.where(mask.bool(), a_hat[:, None], 0.0)  # [N, L]
    last = mask.long().sum(-1) - 1  # [N] index of each response's last token
    a_hat = a_hat[:, None].to(trace_c.dtype)  # [N, 1]
    rewards = torch.zeros_like(trace_c).scatter_(1, last[:, None], a_hat)  # [N, L]
    return vtrace_advantages(rewards, torch.zeros_like(trace_c), trace_c, mask)[0]


def whiten(x: torch.Tensor, mask: torch.Tensor, sum_over_ranks=lambda t: t) -> torch.Tensor:
    """Zero mean, unit variance over the masked tokens of the whole batch, all ranks (PPO)."""
    mask = mask.bool()
    total = sum_over_ranks(torch.stack([torch.where(mask, x, 0.0).sum(), mask.sum().to(x.dtype)]))
    mean = total[0] / total[1].clamp(min=1)
    var = sum_over_ranks(torch.where(mask, (x - mean) ** 2, 0.0).sum()) / total[1].clamp(min=1)
    return torch.where(mask, (x - mean) * torch.rsqrt(var + 1e-8), 0.0)


def mix_ppg_loss(logp, behaviour_logp, prox_logp, advantages, mask, eps: float = 0.2, weights=None):
    """Eq. 4, Mix-PPG (GePPO's clipped objective), token mean:
        L = - mean[ min( r * A,  clip(r, c - eps, c + eps) * A ) ],   r = pi_theta / mu,
                                                                      c = pi_k / mu
    The ratio is taken against each sample's behaviour policy mu and the clip interval is centred at
    c, not 1: on fresh samples c = 1 and this is PPO-clip. clipfrac counts the tokens where the clip
    changes the objective, as verl and TRL do. weights [N, L] (--sampler-is-cap) scale each term."""
    r = ratio(logp - behaviour_logp)  # [N, L]
    centre = ratio(prox_logp - behaviour_logp).detach()  # [N, L]  c, a constant of the step
    unclipped = r * advantages  # [N, L]
    clipped = torch.clamp(r, centre - eps, centre + eps) * advantages  # [N, L]
    per_token = torch.minimum(unclipped, clipped)  # [N, L]
    loss = -masked_mean(per_token if weights is None else per_token * weights, mask)
    with torch.no_grad():
        cut = ((advantages > 0) & (r > centre + eps)) | ((advantages < 0) & (r < centre - eps))
        approx_kl = k3_kl(prox_logp, logp)  # [N, L] CleanRL's: (r - 1) - log r, r = pi_theta / pi_k
        stats = {"clipfrac": masked_mean(cut.float(), mask),
                 "approx_kl": masked_mean(approx_kl, mask)}
    return loss, stats


def sampler_is_weight(trainer_logp, sampler_logp, cap: float) -> torch.Tensor:
    """Not in the paper (Decision 18, TRL's vLLM correction): min(pi_trainer / pi_sampler, cap) per
    token: trainer -1.0, sampler -1.5 -> e^0.5 = 1.65; trainer -0.2, cap 2 -> 2."""
    return ratio(trainer_logp - sampler_logp).clamp(max=cap)  # [L]


def clipped_value_loss(values, old_values, value_targets, mask, clip: float = 0.5) -> torch.Tensor:
    """PPO's clipped value loss, 0.5 mean max((V - target)^2, (clip(V, V_old +- c) - target)^2)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)  # [N, L]
    squared = torch.maximum((values - value_targets) ** 2, (clipped - value_targets) ** 2)  # [N, L]
    return 0.5 * masked_mean(squared, mask)


def objective(mb: dict, lam: float, args: Args) -> tuple[dict, dict]:
    """Eq. 6 whole, on one micro-batch: the losses to backpropagate, and the terms to log.
        policy: L_mix (Eq. 4) - ent_coef * H(pi_theta) + beta * L_klc (Eq. 5, lambda(t))
        critic: PPO's clipped value loss against the V-trace targets (PPO only)
    each a token mean over the micro-batch. mb holds update()'s [n, l] fields (logp, entropy and
    new_values with gradients) and historical [n], True on the samples replayed from the deque.
    A fork that adds, drops or reweighs a term edits this function."""
    logp, prox, mask = mb["logp"], mb["prox_logp"], mb["response_mask"]  # [n, l] each
    mix_ppg, clip = mix_ppg_loss(logp, mb["behaviour_logp"], prox, mb["advantages"], mask,
                                 args.clip_eps, mb.get("sampler_weight"))
    entropy = masked_mean(mb["entropy"], mask)
    logged = {"losses/policy_loss": mix_ppg, "losses/entropy": entropy,
              "losses/clipfrac": clip["clipfrac"], "losses/approx_kl": clip["approx_kl"],
              "kl/prox": masked_mean(k3_kl(logp, prox), mask)}
    kl_convex = torch.zeros((), device=logp.device)
    if args.kl_beta:  # no reference model, and no ref_logp, without the term
        ref = mb["ref_logp"]  # [n, l]
        kl_convex = kl_convex_loss(logp, ref, prox, lam, mask)
        logged["losses/kl_convex"] = kl_convex
        logged["kl/ref"] = masked_mean(k3_kl(logp, ref), mask)
    losses = {"policy": mix_ppg - args.ent_coef * entropy + args.kl_beta * kl_convex}
    if "new_values" in mb:  # PPO's critic
        losses["critic"] = clipped_value_loss(mb["new_values"], mb["values"], mb["value_targets"],
                                              mask, args.value_clip)
        logged["losses/value_loss"] = losses["critic"]
    return losses, logged


# ======================================= end of ALGO LOGIC ====================================


# ---- The replay deque, the two stages, reincarnation; log pi(a_t|s_t) and V(s_t) of every token --
def draw_history(replay: collections.deque, n_groups: int) -> list[list[dict]]:
    """n_groups whole groups (Decision 2: a group never mixes fresh and old responses), uniformly
    without replacement from the last N policies' batches pooled; fewer if there are fewer."""
    stored = [group for batch in replay for group in batch]
    return random.sample(stored, min(n_groups, len(stored)))


def stage(step: int, args: Args) -> tuple[bool, float, int]:
    """Mix stage (p, m) through step T; after it, and in --on-policy runs, p = 0, m = 1 (Dec. 6)."""
    mixing = not args.on_policy and (not args.reincarnation or step <= args.reincarnate_step)
    return mixing, (args.off_policy_p if mixing else 0.0), (args.utd if mixing else 1)


def fresh_count(step: int, args: Args) -> int:
    """(1-p)*B, the step's fresh prompts over all ranks; the other p*B: the deque's."""
    return round((1.0 - stage(step, args)[1]) * args.prompts_per_step)


def reincarnate(policy, reference, replay: collections.deque):
    """Reincarnation at T (Eq. 6): pi_ref <- pi_T, the deque emptied; the rest carries on."""
    if reference is not None:  # none without a KL term (--kl-beta 0)
        reference.load_state_dict(policy.state_dict())
    replay.clear()


def policy_forward(model, batch: dict, temperature: float):
    """log pi(a_t|s_t) and the entropy of pi(.|s_t) for every response token, [N, L] each:
    token_logprobs over the output layer, a chunk of tokens at a time (models.chunked_logprobs)."""
    start = batch["prompt_len"]
    tokens = batch["input_ids"][:, start:]  # [N, L] the response tokens
    def forward(input_ids, attention_mask, position_ids):
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, use_cache=False).last_hidden_state
        # [N, P + L, H]; position P + t - 1 predicts response token t
        hidden = hidden[:, start - 1 : -1].reshape(tokens.numel(), -1)  # [N * L, H]
        weight = model.get_output_embeddings().weight  # [V, H]
        return models.chunked_logprobs(token_logprobs, hidden, weight, tokens.reshape(-1),
                                       temperature)  # [N * L, 2]
    # FSDP2 gathers the root's weights for a forward given its inputs
    out = dist.as_forward(model, forward, batch["input_ids"], batch["attention_mask"],
                          batch["position_ids"])
    out = out.view(*tokens.shape, 2)  # [N, L, 2]
    return out[..., 0], out[..., 1]


def critic_forward(critic, batch: dict) -> torch.Tensor:
    """V(s_t) of each response token t, read at the position that predicts t."""
    out = critic(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 position_ids=batch["position_ids"], use_cache=False).logits  # [N, P + L, 1]
    return out[:, batch["prompt_len"] - 1 : -1, 0].float()  # [N, L]


# ==============================================================================================
# ONE TRAINING STEP, phase by phase in the paper's order, each a function a fork can replace, run
# by every rank on its share (dist.all_reduce/all_gather combine). A sample is one response, a dict
# whose fields the phases fill in ([L] = one value per response token):
#   phase            fields                                                       in the deque
#   1 sample         prompt_ids, response_ids, answer, version (its policy's k),  stored
#                    group, truncated, sampler_logp [L] (vLLM's, None with hf)
#   2 score          reward, reward_parts, status, reflects                       stored
#   3 behaviour/ref  behaviour_logp [L] (mu), ref_logp [L], sampler_weight [L]    stored
#   4 prox/values    prox_logp [L] (pi_k), historical (replayed now),             recomputed
#                    values [L] (PPO)
#   5 advantages     advantages [L], value_targets [L] (PPO)                      recomputed
# ==============================================================================================
RECOMPUTED = ("prox_logp", "historical", "values", "advantages", "value_targets")  # 4, 5 anew
# the method's contract, handed to machinery (the Session, the grader's workers, eval.py)
METHOD = runner.Method(finalize=finalize_args, build_prompt=build_prompt, final_answer=final_answer,
                       grade_response=grade_response, warm=parse_boxed, warm_args=("1",),
                       reflection_words=SELF_REFLECTION_WORDS, recomputed=RECOMPUTED)


def sample(llm, policy, tokenizer, prompts: list, step: int, args: Args,
           drawn=None) -> list[list[dict]]:
    """1. group_size responses of pi_k to each of this rank's fresh prompts (a group); each vLLM
    request seeded by the prompt's index in the step, so a resumed run draws the same tokens.
    drawn (--overlap): (version, the step's groups) the sampler drew with pi_version, mu in them."""
    mine, engine, first, offset = dist.prompt_shares(prompts, args.vllm_tp)  # rank's; its engine's
    sampling = (args.temperature, args.top_p, args.max_response_tokens)
    if drawn is not None:  # the whole step's groups: this rank's from its first prompt on
        version, groups = drawn[0], drawn[1][first + offset :]
    elif llm is not None:
        seeds = [engines.request_seed(args.seed, step, first + i, args.group_size)
                 for i in range(len(engine))]
        groups = engines.vllm_generate(llm, [p.ids for p in engine], args.group_size, seeds,
                                       *sampling)[offset:]
    else:
        groups = engines.hf_generate(policy, tokenizer, [p.ids for p in mine], args.group_size,
                                     *sampling, engines.hf_batch(args))
    # a group id unique over the run and the ranks: the prompt's index in the step (under a million)
    return [[{"prompt_ids": prompt.ids, "response_ids": response or [tokenizer.pad_token_id],
              "answer": prompt.answer, "version": version if drawn else step,
              "truncated": finish == "length",
              "group": step * 1_000_000 + first + offset + i,
              "sampler_logp": None if logps is None or not response else logps,
              **({"behaviour_logp": mu[0]} if mu else {})}
             for response, finish, logps, *mu in group]
            for i, (prompt, group) in enumerate(zip(mine, groups))]


def score(fresh: list[dict], tokenizer, args: Args):
    """2. training_reward of each response, in grader workers with a deadline (past it: 0)."""
    texts = [tokenizer.decode(s["response_ids"], skip_special_tokens=True) for s in fresh]
    items = [(text, s["answer"], len(s["response_ids"]), s["truncated"])
             for text, s in zip(texts, fresh)]
    grades = grader.map_with_deadline(training_reward, items, args.grader_workers,
                                      args.grade_timeout, ({}, "timeout"), parse_boxed, ("1",))
    for s, text, (parts, status) in zip(fresh, texts, grades):
        s["reward"], s["reward_parts"], s["status"] = sum(parts.values(), 0.0), parts, status
        s["reflects"] = any(word in text.lower() for word in SELF_REFLECTION_WORDS)


def logp_of(args: Args):
    """models.per_token's function for log pi(a_t|s_t) at the run's temperature."""
    return lambda model, batch: policy_forward(model, batch, args.temperature)[0]


def behaviour_and_reference(fresh: list[dict], policy, reference, args: Args):
    """3. Store with each fresh sample mu, the trainer's log-probs (Decision 1; a batch drawn ahead
    brings its own, Decision 22), and pi_ref's: fixed until reincarnation (Decision 16)."""
    budget = args.max_tokens_per_micro_batch
    for key, model in (("behaviour_logp", policy), ("ref_logp", reference)):
        todo = [s for s in fresh if key not in s]
        if model is not None:  # no reference without a KL term
            for s, logp in zip(todo, models.per_token(logp_of(args), model, todo, budget)):
                s[key] = logp  # [L_i]
    if args.sampler_is_cap is not None:  # stored with the sample: replayed, it keeps its weight
        for s in fresh:
            s["sampler_weight"] = sampler_is_weight(s["behaviour_logp"], s["sampler_logp"],
                                                    args.sampler_is_cap)


def prox_and_values(fresh: list[dict], history: list[dict], policy, critic, step: int, args: Args):
    """4. log pi_k of samples pi_k did not draw (on the rest pi_k = mu), marked; values on all."""
    budget = args.max_tokens_per_micro_batch
    for s in fresh:
        s["prox_logp"], s["historical"] = s["behaviour_logp"], False
    for s in history:
        s["historical"] = True
    older = [s for s in fresh + history if s["version"] != step]  # replayed, or drawn ahead
    for s, logp in zip(older, models.per_token(logp_of(args), policy, older, budget)):
        s["prox_logp"] = logp
    if critic is not None:
        batch = fresh + history
        for s, v in zip(batch, models.per_token(critic_forward, critic, batch, budget)):
            s["values"] = v


def compute_advantages(batch: list[dict], args: Args) -> dict:
    """5. Advantages, anew each step: V-trace GAE whitened over the global batch (PPO), or A_hat."""
    mask = models.response_mask(batch)  # [N, L]
    behaviour = models.padded(batch, "behaviour_logp", "cpu")  # [N, L]
    prox = models.padded(batch, "prox_logp", "cpu")  # [N, L]
    trace_c = truncated_trace(prox, behaviour, mask, args.vtrace_c_bar)  # [N, L]
    scores = torch.tensor([s["reward"] for s in batch])  # [N]
    if args.algo == "ppo":
        values = models.padded(batch, "values", "cpu")  # [N, L]
        last = mask.sum(-1) - 1  # [N] each response's last token carries the outcome reward
        rewards = torch.zeros_like(values).scatter_(1, last[:, None], scores[:, None])  # [N, L]
        advantages, targets = vtrace_advantages(rewards, values, trace_c, mask, args.gamma,
                                                args.gae_lambda)  # [N, L] each
        advantages = whiten(advantages, mask, dist.all_reduce)  # [N, L]
        for s, target in zip(batch, targets):
            s["value_targets"] = target[: len(s["response_ids"])]
    else:
        a_hat = group_advantages(scores, torch.tensor([s["group"] for s in batch]))  # [N]
        advantages = grpo_token_advantages(a_hat, trace_c, mask, args.grpo_vtrace)  # [N, L]
    for s, adv in zip(batch, advantages):
        s["advantages"] = adv[: len(s["response_ids"])]
    historical = torch.tensor([s["historical"] for s in batch], dtype=torch.bool)  # [N]
    return {"mask": mask, "trace_c": trace_c, "log_ratio": prox - behaviour,
            "advantages": advantages, "historical": historical}


def offpolicy_diagnostics(adv: dict, fresh: list[dict], args: Args) -> dict[str, torch.Tensor]:
    """This rank's off-policy diagnostics (docs/metrics.md), on the historical and fresh samples."""
    old, mask = adv["historical"], adv["mask"]  # [N], [N, L]
    abs_adv = adv["advantages"].abs()  # [N, L]
    log_ratio = adv["log_ratio"][old][mask[old]]  # [historical tokens] log(pi_k / mu)
    rewards = torch.tensor([s["reward"] for s in fresh]).view(-1, args.group_size)  # [groups, G]
    no_groups = torch.zeros(0, dtype=torch.bool)
    return {"log_ratio": log_ratio,
            "trace_cut": log_ratio.exp() > args.vtrace_c_bar,  # c_t < pi_k/mu
            "trace_prod": adv["trace_c"][old].log().sum(-1).exp(),  # [historical responses]
            "abs_adv_historical": abs_adv[old][mask[old]],  # [tokens]
            "abs_adv_fresh": abs_adv[~old][mask[~old]],  # [tokens]
            "zero_spread": rewards.std(-1) == 0 if args.group_size > 1 else no_groups}


def update(batch: list[dict], policy, critic, optimizers: list, lam: float, utd: int, step: int,
           args: Args) -> dict:
    """6. utd passes (Decision 13), each a new random order of the batch cut into mini-batches, one
    optimizer step each on objective(). Each term is the token mean over the mini-batch, all ranks:
    a micro-batch's mean times its token share, times the world size (FSDP averages ranks)."""
    nets = [net for net in (policy, critic) if net is not None]
    stats = collections.defaultdict(list)
    stored = ["behaviour_logp", "prox_logp", "advantages"]  # [L] fields objective() reads
    stored += ["ref_logp"] if args.kl_beta else []  # none without a reference model
    stored += ["sampler_weight"] if args.sampler_is_cap is not None else []
    stored += ["values", "value_targets"] if critic is not None else []
    for net in nets:  # training mode: transformers checkpoints activations only then (no dropout)
        net.train()
    responses = args.mini_batch_prompts * args.group_size  # a mini-batch's, over all ranks
    for epoch in range(utd):
        for rows in dist.mini_batches(batch, responses, args.seed, step, epoch):
            size = dist.all_reduce(aggregation(models.response_mask(rows))[1])  # all ranks' rows
            means = collections.defaultdict(float)  # each logged term's mean, share by share
            for micro in dist.micro_batches(rows, args.max_tokens_per_micro_batch):
                # token rows [n, P + l], response_mask [n, l], historical [n]
                mb = models.collate(micro)
                mb.update({key: models.padded(micro, key) for key in stored})  # [n, l] each
                mb["logp"], mb["entropy"] = policy_forward(policy, mb, args.temperature)  # [n, l]
                if critic is not None:
                    mb["new_values"] = critic_forward(critic, mb)  # [n, l] V(s_t) being fitted
                losses, logged = objective(mb, lam, args)
                share = aggregation(mb["response_mask"])[1] / size  # of the mini-batch's token mean
                # the critic's first: its graph is freed before the policy's output layer's backward
                for loss in reversed(losses.values()):
                    (loss * share * dist.world()).backward()  # FSDP averages ranks: times the world
                for name, term in logged.items():
                    means[name] += float(term.detach()) * float(share)  # finite_update sums ranks'
            norms = [dist.clip_grad_norm(net, args.max_grad_norm) for net in nets]  # each model's
            if models.finite_update(means, norms, stats, step):  # else skipped; 3 in a row: stop
                for optim in optimizers:
                    optim.step()
            for optim in optimizers:  # no gradient held through push, generation, no-grad passes
                optim.zero_grad(set_to_none=True)
    for net in nets:
        net.eval()
    return stats


# ---- The training loop -----------------------------------------------------------------------
def train(args: Args, on_step=None) -> dict:
    """The whole run; on_step(step, record, policy, tokenizer, batch) runs after each step."""
    session = runner.Session(args, METHOD)  # every check, before anything is written
    args, tokenizer = session.args, session.tokenizer
    policy, reference, critic = models.load(args, session.checkpoint)  # pi_theta, pi_ref, V
    optimizers = [models.optimizer(net, lr, args.weight_decay, args.offload)  # AdamW
                  for net, lr in ((policy, args.actor_lr), (critic, args.critic_lr)) if net]
    vllm = args.sampler == "vllm" and not args.overlap  # --overlap: the sampler process's engine
    llm = engines.start(args, session.max_model_len) if vllm else None  # vLLM
    sampler = None if not args.overlap else overlap.Sampler(  # draws ahead: an engine, pi for mu
        args, session.max_model_len, policy, policy_forward, tokenizer,
        (args.group_size, args.temperature, args.top_p, args.max_response_tokens))
    replay = collections.deque(maxlen=args.window)  # the last N policies' fresh batches
    session.start(policy, reference, critic, optimizers, replay, llm, sampler)  # --out, a resume
    with session:  # Ctrl-C, SIGTERM: one line naming the last checkpoint
        if args.eval_every and session.step == 0:  # the base policy's Pass@1
            session.log({"step": 0, **session.evaluate(0)})
        for step in session.steps():
            mixing, p, utd = stage(step, args)
            n_fresh = fresh_count(step, args)
            # 1. sample G responses from pi_k to each of (1-p)*B fresh prompts, and 2. score them
            if sampler is None:
                groups = sample(llm, policy, tokenizer, session.next_prompts(n_fresh), step, args)
            else:  # --overlap: pi_{k-1} drew it while step k-1 trained (pi_k at step 1, after T)
                if not sampler.holds(step):
                    sampler.draw(step, session.next_prompts(n_fresh), step)
                prompts, drawn = sampler.take(step)
                after_t = args.reincarnation and step >= args.reincarnate_step  # drained at T
                if step < args.steps and (args.overlap_after_reincarnation or not after_t):
                    # the batch boundary: pi_k's weights go with step k+1's prompts
                    sampler.draw(step + 1, session.next_prompts(fresh_count(step + 1, args)), step)
                groups = sample(None, policy, tokenizer, prompts, step, args, drawn)
            fresh = [s for group in groups for s in group]
            score(fresh, tokenizer, args)
            engines.sleep(llm)  # GPU sleep mode: the engine's memory is the trainer's until push
            session.lap("gen")
            # 3. mu and pi_ref's log-probs; 4. p*B historical prompts' whole groups, pi_k, values
            behaviour_and_reference(fresh, policy, reference, args)
            n_history = dist.per_rank(args.prompts_per_step - n_fresh)  # this rank's groups
            history = [s for group in draw_history(replay, n_history) for s in group]
            if p > 0:  # the deque stores fresh batches while they can be replayed; drops the oldest
                replay.append(groups)
            batch = fresh + history
            prox_and_values(fresh, history, policy, critic, step, args)
            # 5. advantages, 6. utd passes of Mix-PPG + KL-Convex updates
            diagnostics = offpolicy_diagnostics(compute_advantages(batch, args), fresh, args)
            lam = kl_convex_lambda(step, args.kl_convex_start, args.kl_convex_every)  # Eq. 5
            lam = lam if args.kl_convex else 1.0  # --no-kl-convex: KL to the reference alone
            stats = update(batch, policy, critic, optimizers, lam, utd, step, args)
            session.lap("trainer")
            engines.push_weights(llm, policy)  # 7. pi_{k+1} into the sampler; 8. reincarnation
            session.lap("weight_sync")
            if args.reincarnation and step == args.reincarnate_step:
                reincarnate(policy, reference, replay)
            record = {"step": step, "phase": "mix" if mixing else "on-policy", "train/utd": utd,
                      "kl_convex/lambda": lam, "replay/deque_size": len(replay),
                      **report.step_metrics(step, fresh, history, diagnostics, stats)}
            if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
                record.update(session.evaluate(step))  # greedy Pass@1 on the benchmarks
            session.log(record, fresh, history, on_step)  # metrics.jsonl, TensorBoard, on_step
            if step == args.steps or args.save_every and step % args.save_every == 0:
                session.save(step, args.reincarnation and step >= args.reincarnate_step)
    return dict(policy=policy, reference=reference, critic=critic, replay=replay, llm=llm,
                tokenizer=tokenizer)


if __name__ == "__main__":
    runner.main(lambda: train(runner.cli(Args)))
