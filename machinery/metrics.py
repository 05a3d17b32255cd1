"""The step's metrics record, over the samples of every rank (docs/metrics.md): what the method hands over,
combined. A reader of the method may skip this module."""

import collections
import math

import numpy as np
import torch

from machinery import dist


def step_metrics(step: int, fresh: list[dict], history: list[dict], diagnostics: dict, stats: dict) -> dict:
    """Each rank condenses its samples and the method's off-policy diagnostics (remix.offpolicy_diagnostics) into
    sums and lists; rank-order concatenation and sums combine them."""
    log_ratio, cut = diagnostics["log_ratio"], diagnostics["trace_cut"]  # [historical tokens]
    hist_adv, fresh_adv = diagnostics["abs_adv_historical"], diagnostics["abs_adv_fresh"]  # [tokens]
    raw = {"reward": [s["reward"] for s in fresh], "reward_parts": [s.get("reward_parts", {}) for s in fresh],
           "length": [len(s["response_ids"]) for s in fresh],
           "truncated": [s["truncated"] for s in fresh], "reflects": [s["reflects"] for s in fresh],
           "zero_spread": diagnostics["zero_spread"].tolist(),
           "grader": [s.get("status", "ok") for s in fresh], "age": [step - s["version"] for s in history],
           "ratio_min": [log_ratio.min().exp().item()] if len(log_ratio) else [],
           "ratio_max": [log_ratio.max().exp().item()] if len(log_ratio) else [],
           "trace_prod": diagnostics["trace_prod"].tolist()}
    sums = {"log_ratio": [log_ratio.sum().item(), (log_ratio ** 2).sum().item(), log_ratio.exp().sum().item(),
                          cut.sum().item(), len(log_ratio)],
            "adv": [hist_adv.sum().item(), len(hist_adv), fresh_adv.sum().item(), len(fresh_adv)],
            "work": [dist.padding["tokens"], dist.padding["slots"]], "critic": critic_sums(fresh + history)}
    mismatch = sampler_mismatch(fresh)
    sums["mismatch"], raw["mismatch_max"] = mismatch[:-1], [mismatch[-1]]
    dist.padding.clear()
    every = dist.all_gather((raw, sums))
    merged = {k: [v for r, _ in every for v in r[k]] for k in raw}
    lr_sum, lr_sq, exp_sum, cut, count = np.sum([s["log_ratio"] for _, s in every], axis=0)
    hist_adv, hist_tokens, fresh_adv, fresh_tokens = np.sum([s["adv"] for _, s in every], axis=0)
    tokens, slots = np.sum([s["work"] for _, s in every], axis=0)
    y_sum, y_sq, gap_sum_v, gap_sq, value_count = np.sum([s["critic"] for _, s in every], axis=0)
    y_var = y_sq / max(value_count, 1) - (y_sum / max(value_count, 1)) ** 2
    gap_var = gap_sq / max(value_count, 1) - (gap_sum_v / max(value_count, 1)) ** 2
    gap_sum, k3_sum, outside, weight_sum, gap_count = np.sum([s["mismatch"] for _, s in every], axis=0)
    rewards, counts = merged["reward"], collections.Counter(merged["grader"])
    mean = lambda xs, empty=0.0: float(np.mean(xs)) if len(xs) else empty  # noqa: E731
    lr_mean = lr_sum / max(count, 1)
    return {
        "reward/mean": mean(rewards), "reward/std": float(np.std(rewards, ddof=1)) if len(rewards) > 1 else 0.0,
        "reward/zero_std_groups": mean(merged["zero_spread"]),
        "response/length_mean": mean(merged["length"]), "response/length_max": max(merged["length"]),
        "response/truncated": mean(merged["truncated"]), "response/self_reflection": mean(merged["reflects"]),
        **{k: float(np.mean(v)) for k, v in stats.items() if not k.startswith("train/")},
        "train/optimizer_steps": len(stats.get("train/optimizer_steps", [])),
        "train/skipped_updates": len(stats.get("train/skipped_updates", [])),
        "batch/fresh": len(rewards), "batch/historical": len(merged["trace_prod"]),
        "offpolicy/ratio_min": min(merged["ratio_min"], default=1.0),  # pi_k/mu on historical tokens; 1 without
        "offpolicy/ratio_mean": exp_sum / count if count else 1.0,
        "offpolicy/ratio_max": max(merged["ratio_max"], default=1.0),
        "offpolicy/log_ratio_mean": lr_mean,
        "offpolicy/log_ratio_std": math.sqrt(max(lr_sq / max(count, 1) - lr_mean ** 2, 0.0)),
        "offpolicy/trace_truncated": cut / count if count else 0.0,
        "offpolicy/adv_scale": (hist_adv / hist_tokens) / max(fresh_adv / fresh_tokens, 1e-12) if hist_tokens else 1.0,
        "offpolicy/trace_prod_mean": mean(merged["trace_prod"], 1.0),
        "replay/mean_age": mean(merged["age"]),
        **({"losses/explained_variance": 1.0 - gap_var / y_var if y_var > 0 else None} if value_count else {}),
        "perf/padding": 1.0 - tokens / max(slots, 1),
        "grader/failures": counts["error"] + counts["unparsable"] + counts["timeout"],
        "grader/no_boxed": counts["no_boxed"],
        **{f"reward/{name}": mean([parts.get(name, 0.0) for parts in merged["reward_parts"]])
           for name in sorted({name for parts in merged["reward_parts"] for name in parts})},
        **({"mismatch/abs_log_ratio_mean": gap_sum / gap_count, "mismatch/abs_log_ratio_max": max(merged["mismatch_max"]),
            "mismatch/k3_kl": k3_sum / gap_count, "mismatch/ratio_outside_0.5_2": outside / gap_count,
            "mismatch/is_weight_mean": weight_sum / gap_count} if gap_count else {}),
    }


def critic_sums(samples: list[dict]) -> list[float]:
    """Sums for the critic's explained variance over this rank's response tokens (PPO), CleanRL's diagnostic,
    1 - Var(target - V) / Var(target) with V the values before the update: of the targets, their squares, the
    residuals, their squares, and the token count. Empty (zeros) without a critic."""
    pairs = [(s["value_targets"], s["values"]) for s in samples if "value_targets" in s]
    if not pairs:
        return [0.0] * 5
    y, v = (torch.cat([x[k].cpu() for x in pairs]).double() for k in (0, 1))  # [tokens]
    return [y.sum().item(), (y ** 2).sum().item(), (y - v).sum().item(), ((y - v) ** 2).sum().item(), float(len(y))]


def sampler_mismatch(fresh: list[dict]) -> list[float]:
    """How far the sampler's probabilities of its own tokens are from the trainer's (pi_k recomputed), over this
    rank's fresh tokens: sums of |log pi_trainer - log pi_sampler|, of the k3 estimate of KL(sampler || trainer)
    (r - 1 - log r with r = pi_trainer / pi_sampler, on the sampler's tokens), of tokens whose r leaves [0.5, 2],
    of the correction weights, the token count, and the largest |log r|, last (not summed over ranks)."""
    pairs = [(s["behaviour_logp"], s["sampler_logp"], s.get("sampler_weight")) for s in fresh
             if s.get("sampler_logp") is not None]
    if not pairs:
        return [0.0] * 6
    log_r = torch.cat([trainer - sampler for trainer, sampler, _ in pairs]).double()  # [fresh tokens], fp64 for r-1-log r
    weights = torch.cat([w if w is not None else torch.ones_like(t) for t, _, w in pairs])  # [fresh tokens]
    return [log_r.abs().sum().item(), (log_r.exp() - 1 - log_r).sum().item(),
            (log_r.abs() > math.log(2)).sum().item(), weights.sum().item(), float(len(log_r)), log_r.abs().max().item()]
