"""Tests of remix.py's method, in the file's order: each formula against an independent reference (a naive loop,
a hand-worked example, an exact expectation), and the training loop checked step by step against independent
recomputation, on a tiny offline Qwen2 model with real transformers and math-verify. tests/test_runs.py runs the whole
program: the command line, crashes, several processes, vLLM, the GPU's numerics on the CPU and the forks.

    pytest -q test_remix.py

Where each piece of the paper is tested:
    Sec. 7 reward, answer check              test_math_reward, test_grade_response_reports_status
    Decision 14 responses cut at the limit   test_a_response_cut_at_the_length_limit_is_graded_like_any_other_...
    log pi(a|s), entropy (token_logprobs)    test_chunked_logprobs_and_gradients_equal_the_plain_computation
    Decision 3 aggregation                   test_logged_losses_are_the_optimised_token_means, test_token_budgets_...
    Eq. 5 KL-Convex, lambda(t), k3           test_kl_convex_lambda*, test_k3_kl_*, test_kl_convex_loss_mixes_...
    Sec. 3 V-trace (PPO)                     test_vtrace_matches_naive_double_loop, test_vtrace_three_tokens_by_hand
    Sec. 3 GRPO advantage (Decision 4)       test_group_advantages_by_hand, test_grpo_advantage_survives_a_4000_...
    Eq. 4 Mix-PPG                            test_mix_ppg_is_ppo_clip_on_fresh_samples, test_mix_ppg_clip_is_centred_...
    the log-ratio clamp (verl's)             test_the_log_ratio_clamp_changes_nothing_in_the_normal_range, test_a_...
    Eq. 6 objective, UTD m, reincarnation    test_objective_is_eq6_and_the_value_loss_by_hand,
                                             test_a_fork_zeroing_every_loss_of_the_objective_zeroes_every_gradient,
                                             test_ppo_hf_batch_mix_and_utd, test_grpo_reincarnation,
                                             test_more_update_passes_move_the_weights_further
    replay deque, p and N                    test_draw_history_*, test_the_loop_replays_exactly_what_draw_history_drew_...
    behaviour log-probs (Decision 1), pi_k   test_spied_steps_match_independent_recomputation
    per-request seeds, sampler correction    test_request_seeds_*, test_sampler_is_weight_by_hand
"""

import collections
import dataclasses
import json
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import remix  # noqa: E402
from machinery import console, dist, engines, grader, models, report  # noqa: E402
from tests.common import (DATA, ROOT, TRAIN, full_state, math_reward, plain_copy, read_metrics, tiny_args,  # noqa: E402, F401
                          wait_into_step_3)
from tests.tiny_model import build_tiny_model  # noqa: E402


# ----------------------------------------------------------------------------------------------
# Sec. 7, the reward: answer verification (the answer check) and the training reward
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("response, answer, expected", [
    ("so the answer is \\boxed{204}.", "204", 1.0),
    ("so the answer is \\boxed{205}.", "204", 0.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # nested braces, equivalent forms
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("first \\boxed{3}, then \\boxed{4}", "4", 1.0),  # the last box wins
    ("first \\boxed{4}, then \\boxed{3}", "4", 0.0),
    ("<think>maybe \\boxed{7}</think> final: \\boxed{8}", "8", 1.0),  # after </think>
    ("<think>it is \\boxed{8}</think> so the answer is 9", "8", 0.0),  # boxed only inside the thought
    ("no box here: 204", "204", 0.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("unbalanced \\boxed{\\frac{1}{2}", "0.5", 0.0),
])
def test_math_reward(response, answer, expected):
    """The answer check as eval.py and the evaluation during training run it: in a grader worker, 4 s deadline."""
    assert math_reward(remix.METHOD, response, answer) == expected


def test_unbalanced_boxes_empty_answers_and_grader_errors_score_zero(monkeypatch):
    assert grader.last_boxed("so \\boxed{\\frac{1}{2}") is None  # unbalanced: no answer
    assert remix.grade_response("\\boxed{}", "1") == (0.0, "unparsable")

    def broken(expression):
        raise RuntimeError("math-verify failed")

    monkeypatch.setattr(remix, "parse_boxed", broken)
    assert remix.grade_response("\\boxed{1}", "1") == (0.0, "error")  # counted as a grader failure, never raised


def test_grade_response_reports_status():
    assert remix.grade_response("\\boxed{1}", "1") == (1.0, "ok")
    assert remix.grade_response("nothing", "1") == (0.0, "no_boxed")
    assert grader.last_boxed("a \\boxed{x^{2}} b") == "x^{2}"


def test_a_response_cut_at_the_length_limit_is_graded_like_any_other_and_is_terminal(tiny_model):
    """Decision 14, the authors' reward: a response cut inside its thinking that has boxed the right answer scores 1,
    one cut with no box 0; the cut changes neither the reward nor the advantages (V after the last token is 0)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    texts = ["<think>\nSo x = 4, that is \\boxed{4}. But wait, let me check", "<think>\nSo x is either 4 or"]
    fresh = [{"response_ids": tokenizer(t, add_special_tokens=False).input_ids, "answer": "4", "truncated": True}
             for t in texts]
    remix.score(fresh, tokenizer, console.settings(remix.Args, grader_workers=1))
    assert [(s["reward"], s["status"]) for s in fresh] == [(1.0, "ok"), (0.0, "no_boxed")]
    for s, values in zip(fresh, ([0.2, 0.5, 0.9], [0.1, 0.3, 0.4])):
        s.update(response_ids=s["response_ids"][:3], behaviour_logp=torch.full((3,), -1.0),
                 prox_logp=torch.full((3,), -1.0), values=torch.tensor(values), historical=False)
    cut = remix.compute_advantages(fresh, remix.Args(algo="ppo"))["advantages"]
    finished = remix.compute_advantages([{**s, "truncated": False} for s in fresh], remix.Args(algo="ppo"))
    assert torch.equal(cut, finished["advantages"])
    # by hand, gamma = lambda = 1 and c = 1: A_t = R - V(s_t) before whitening; V after the last token is 0
    raw = torch.tensor([[0.8, 0.5, 0.1], [-0.1, -0.3, -0.4]])
    mean, std = raw.mean(), raw.std(unbiased=False)
    assert torch.allclose(cut, (raw - mean) / torch.sqrt(std ** 2 + 1e-8), atol=1e-6)
    assert fresh[0]["value_targets"].tolist() == pytest.approx([1.0, 1.0, 1.0])


# ----------------------------------------------------------------------------------------------
# log pi(a_t|s_t) and the entropy: token_logprobs, computed in chunks of the output layer
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 5, 7, 64])
def test_chunked_logprobs_and_gradients_equal_the_plain_computation(chunk):

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)  # 23 tokens: ragged against every chunk size
    weight = torch.randn(300, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 300, (23,), generator=g)
    upstream = torch.randn(23, 2, generator=g)  # d loss / d (log-prob, entropy)
    out = models.chunked_logprobs(remix.token_logprobs, hidden, weight, targets, 0.8, chunk)
    (out * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    log_probs = torch.log_softmax(hidden @ weight.T / 0.8, -1)  # [23, 300], whole
    plain = torch.stack([log_probs.gather(-1, targets[:, None])[:, 0], -(log_probs.exp() * log_probs).sum(-1)], -1)
    (plain * upstream).sum().backward()
    torch.testing.assert_close(out, plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, rtol=0, atol=1e-5)


class CastCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts dtype casts of tensors of one shape or its transpose (the output layer's weight)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.casts = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in (self.shape, self.shape[::-1]):
            self.casts += 1
        return func(*args, **(kwargs or {}))


def test_the_output_layer_is_cast_once_per_forward_under_autocast(tiny_model, monkeypatch):
    """A caller's bf16 autocast over fp32 weights: one cast of the [V, H] weight for five chunks, forward and
    recompute (autocast's cache misses the chunks' w.T views: it used to cast ten times, and ten gradients back).
    The gradient is summed in fp32 over the chunks straight into the fp32 weight's: no cast back."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(models, "LOGPROB_CHUNK", 8)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model)
    mb = models.collate([{"prompt_ids": [1, 2, 3], "response_ids": list(range(10, 50))}], "cpu")  # 5 chunks of 8
    counter = CastCounter(policy.get_output_embeddings().weight.shape)
    with counter, torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = remix.policy_forward(policy, mb, 1.0)
        forward_casts = counter.casts
        (logp.sum() + entropy.sum()).backward()
    assert forward_casts == 1 and counter.casts == 1
    plain = remix.policy_forward(policy, mb, 1.0)[0]  # and the chunks compute what one piece does, in bf16
    assert (logp.float() - plain).abs().max().item() < 0.1


def test_a_bf16_output_layers_gradient_is_rounded_once_not_at_every_chunk():
    """A bf16 weight (FSDP2's mixed precision): its gradient over 8 chunks equals the exact sum of the chunks'
    bf16 products rounded once to bf16. Summing the chunks in bf16, as autograd does for a bf16 leaf, rounds at
    every chunk and lands further away."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 16, generator=g).bfloat16().requires_grad_(True)
    weight = torch.randn(300, 16, generator=g).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 300, (64,), generator=g)
    upstream = torch.randn(64, 2, generator=g)
    (models.chunked_logprobs(remix.token_logprobs, hidden, weight, targets, 1.0, 8) * upstream).sum().backward()
    exact, naive = torch.zeros(300, 16, dtype=torch.float64), torch.zeros(300, 16, dtype=torch.bfloat16)
    for i in range(0, 64, 8):  # each chunk's bf16 gradient of the logits, as the chunked backward computes it
        h = hidden[i : i + 8].detach()
        logits = (h @ weight.detach().T).requires_grad_(True)  # [8, 300] bf16
        (grad_logits,) = torch.autograd.grad(remix.token_logprobs(logits, targets[i : i + 8], 1.0), logits,
                                             upstream[i : i + 8])
        exact += grad_logits.double().T @ h.double()
        naive += grad_logits.T @ h  # a bf16 running sum
    once = exact.to(torch.bfloat16)
    assert weight.grad.dtype == torch.bfloat16
    assert (weight.grad != once).float().mean().item() < 0.01  # fp32 accumulation order aside: the exact sum, rounded
    assert (weight.grad.double() - exact).abs().sum() < 0.7 * (naive.double() - exact).abs().sum()


# ----------------------------------------------------------------------------------------------
# Decision 3, the loss aggregation: one place, the same mean however a mini-batch is split
# ----------------------------------------------------------------------------------------------
def test_pure_functions_take_float_masks():
    g = torch.Generator().manual_seed(1)
    x, y, z, w = (torch.randn(3, 5, generator=g) for _ in range(4))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    calls = [lambda m: remix.masked_mean(x, m), lambda m: remix.kl_convex_loss(x, y, z, 0.7, m),
             lambda m: remix.truncated_trace(x, y, m), lambda m: remix.vtrace_advantages(x, y, z.abs(), m, 0.9, 0.8)[0],
             lambda m: remix.vtrace_advantages(x, y, z.abs(), m)[1], lambda m: remix.whiten(x, m),
             lambda m: remix.mix_ppg_loss(x, y, z, w, m)[0], lambda m: remix.mix_ppg_loss(x, y, z, w, m)[1]["clipfrac"],
             lambda m: remix.clipped_value_loss(x, y, z, m), lambda m: remix.grpo_token_advantages(x[:, 0], z.abs(), m),
             lambda m: remix.grpo_token_advantages(x[:, 0], z.abs(), m, product=True)]
    for call in calls:
        torch.testing.assert_close(call(mask.float()), call(mask), rtol=0, atol=0)


def test_logged_losses_are_the_optimised_token_means(tiny_model, train_file, tmp_path, monkeypatch):
    """One mini-batch holding the whole batch, split into micro-batches of one response or all of them:
    the logged losses equal the token mean over the mini-batch computed in one piece."""
    captured = {}
    real = remix.update

    def spy(batch, policy, *rest, **kw):
        captured["batch"], captured["policy"] = [dict(s) for s in batch], plain_copy(policy)
        return real(batch, policy, *rest, **kw)

    monkeypatch.setattr(remix, "update", spy)
    rows = {}
    for budget in (1, 100_000):
        remix.train(tiny_args(tiny_model, train_file, tmp_path / str(budget), algo="grpo", steps=1, group_size=2,
                              prompts_per_step=5, mini_batch_prompts=8, utd=1, max_tokens_per_micro_batch=budget))
        rows[budget] = read_metrics(tmp_path / str(budget))[0]
    batch, policy = captured["batch"], captured["policy"]
    mb = models.collate(batch, "cpu")
    mask = mb["response_mask"]
    logp, entropy = remix.policy_forward(policy, mb, 1.0)
    adv, behaviour = models.padded(batch, "advantages"), models.padded(batch, "behaviour_logp")
    pg, _ = remix.mix_ppg_loss(logp, behaviour, behaviour, adv, mask)
    for budget in rows:
        assert rows[budget]["losses/policy_loss"] == pytest.approx(pg.item(), rel=1e-4, abs=1e-7)
        assert rows[budget]["losses/entropy"] == pytest.approx(remix.masked_mean(entropy, mask).item(), rel=1e-5)


# ----------------------------------------------------------------------------------------------
# Eq. 5, KL-Convex: the lambda(t) schedule, the k3 estimator, the mixed anchors
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t, expected", [(1, 1.0), (50, 1.0), (51, 0.9), (60, 0.9), (61, 0.8),
                                         (90, 0.6), (91, 0.5), (500, 0.5)])
def test_kl_convex_lambda(t, expected):
    assert remix.kl_convex_lambda(t) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("t, expected", [(8, 1.0), (9, 0.9), (10, 0.9), (11, 0.8), (16, 0.6), (17, 0.5), (60, 0.5)])
def test_kl_convex_lambda_rescaled(t, expected):
    assert remix.kl_convex_lambda(t, start=8, every=2) == pytest.approx(expected, abs=1e-12)


def test_k3_kl_zero_when_equal_positive_otherwise_and_unbiased():
    logp = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    assert torch.all(remix.k3_kl(logp, logp) == 0)
    assert torch.all(remix.k3_kl(logp, logp + torch.tensor([[0.3, -0.2, 0.1]])) > 0)
    # E_{x~p}[k3] = KL(p || q) exactly: check with many samples against the closed form
    torch.manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    x = torch.multinomial(p, 400_000, replacement=True)
    estimate = remix.k3_kl(p.log()[x], q.log()[x]).mean().item()
    exact = (p * (p.log() - q.log())).sum().item()
    assert estimate == pytest.approx(exact, rel=0.02)


def test_kl_convex_loss_mixes_the_two_anchors():
    logp = torch.tensor([[-1.0, -2.0]])
    ref, prox = torch.tensor([[-1.5, -1.0]]), torch.tensor([[-0.5, -2.5]])
    mask = torch.tensor([[True, True]])
    lam = 0.7
    expected = sum(lam * (math.exp(r - p) - (r - p) - 1) + (1 - lam) * (math.exp(q - p) - (q - p) - 1)
                   for p, r, q in [(-1.0, -1.5, -0.5), (-2.0, -1.0, -2.5)]) / 2
    assert remix.kl_convex_loss(logp, ref, prox, lam, mask).item() == pytest.approx(expected, rel=1e-6)


# ----------------------------------------------------------------------------------------------
# Sec. 3, V-trace advantages for PPO: truncated traces, the recursion, value targets, whitening
# ----------------------------------------------------------------------------------------------
def naive_vtrace(rewards, values, trace_c, lengths, gamma, lam):
    """A_t as an explicit sum: sum_{j>=t} (gamma lam)^(j-t) (prod_{i=t+1..j} c_i) delta_j."""
    batch, width = rewards.shape
    adv = torch.zeros(batch, width, dtype=torch.float64)
    targets = torch.zeros(batch, width, dtype=torch.float64)
    for b in range(batch):
        n = lengths[b]
        for t in range(n):
            total = 0.0
            for j in range(t, n):
                next_value = values[b, j + 1].item() if j + 1 < n else 0.0
                delta = rewards[b, j].item() + gamma * next_value - values[b, j].item()
                weight = (gamma * lam) ** (j - t)
                for i in range(t + 1, j + 1):
                    weight *= trace_c[b, i].item()
                total += weight * delta
            adv[b, t] = total
            targets[b, t] = trace_c[b, t].item() * total + values[b, t].item()
    return adv, targets


def random_batch(seed, batch=5, width=7):
    g = torch.Generator().manual_seed(seed)
    lengths = [width, 1, 3, 6, 4][:batch]
    mask = torch.tensor([[t < n for t in range(width)] for n in lengths])
    rewards = torch.randn(batch, width, generator=g, dtype=torch.float64)
    values = torch.randn(batch, width, generator=g, dtype=torch.float64)
    trace_c = torch.rand(batch, width, generator=g, dtype=torch.float64).clamp(max=1.0)
    return rewards, values, trace_c, mask, lengths


@pytest.mark.parametrize("seed, gamma, lam", [(0, 1.0, 1.0), (1, 0.9, 0.95), (2, 1.0, 0.5)])
def test_vtrace_matches_naive_double_loop(seed, gamma, lam):
    rewards, values, trace_c, mask, lengths = random_batch(seed)
    adv, targets = remix.vtrace_advantages(rewards, values, trace_c, mask, gamma, lam)
    ref_adv, ref_targets = naive_vtrace(rewards, values, trace_c, lengths, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(targets, ref_targets, rtol=1e-10, atol=1e-10)


def test_vtrace_with_unit_traces_is_gae():
    rewards, values, _, mask, lengths = random_batch(3)
    gamma, lam = 0.99, 0.9
    adv, targets = remix.vtrace_advantages(rewards, values, torch.ones_like(values), mask, gamma, lam)
    for b, n in enumerate(lengths):  # textbook GAE, backwards
        running = 0.0
        for t in reversed(range(n)):
            next_value = values[b, t + 1].item() if t + 1 < n else 0.0
            running = rewards[b, t].item() + gamma * next_value - values[b, t].item() + gamma * lam * running
            assert adv[b, t].item() == pytest.approx(running, abs=1e-10)
            assert targets[b, t].item() == pytest.approx(running + values[b, t].item(), abs=1e-10)
    assert torch.all(adv[~mask] == 0)


def test_vtrace_three_tokens_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    trace_c = torch.tensor([[1.0, 0.5, 0.8]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, targets = remix.vtrace_advantages(rewards, values, trace_c, mask)
    # A3 = 1 - 0.7; A2 = (0.7 - 0.6) + 0.8 * 0.3; A1 = (0.6 - 0.5) + 0.5 * 0.34
    torch.testing.assert_close(adv, torch.tensor([[0.27, 0.34, 0.3]]))
    torch.testing.assert_close(targets, torch.tensor([[0.77, 0.77, 0.94]]))


def test_truncated_trace():
    prox = torch.tensor([[-1.0, -1.0, -3.0]])
    behaviour = torch.tensor([[-2.0, -1.0, -2.0]])
    mask = torch.tensor([[True, True, False]])
    c = remix.truncated_trace(prox, behaviour, mask, c_bar=1.0)
    torch.testing.assert_close(c, torch.tensor([[1.0, 1.0, 1.0]]))  # e^1 truncated to 1; pad is 1
    c = remix.truncated_trace(behaviour, prox, mask, c_bar=1.0)
    assert c[0, 0].item() == pytest.approx(math.exp(-1.0))


@pytest.mark.parametrize("c_bar", [0.5, 2.0])
def test_truncated_trace_with_other_c_bars(c_bar):
    prox = torch.tensor([[0.0, math.log(1.5), math.log(3.0), math.log(0.2)]])
    behaviour = torch.zeros(1, 4)
    c = remix.truncated_trace(prox, behaviour, torch.ones(1, 4, dtype=torch.bool), c_bar)
    torch.testing.assert_close(c, torch.tensor([[min(c_bar, 1.0), min(c_bar, 1.5), min(c_bar, 3.0), 0.2]]))


def test_whiten():
    x = torch.tensor([[1.0, 2.0, 9.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    w = remix.whiten(x, mask)
    vals = w[mask]
    assert vals.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert (vals ** 2).mean().item() == pytest.approx(1.0, rel=1e-4)
    assert w[~mask].abs().sum() == 0


# ----------------------------------------------------------------------------------------------
# Sec. 3, GRPO: the group advantage, plain on every token or in V-trace product form (Decision 4)
# ----------------------------------------------------------------------------------------------
def test_group_advantages_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3])
    adv = remix.group_advantages(scores, groups)
    s = 1 / (math.sqrt(0.5) + 1e-6)  # unbiased std of (1, 0) is sqrt(0.5); mean 0.5
    expected = torch.tensor([0.5 * s, -0.5 * s, -0.5 * s, 0.5 * s, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected)
    # three members (1, 2, 4): mean 7/3, unbiased std sqrt(7/3)
    adv = remix.group_advantages(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([5, 5, 5]))
    mean, std = 7 / 3, math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    torch.testing.assert_close(adv, torch.tensor([(x - mean) / (std + 1e-6) for x in (1.0, 2.0, 4.0)]))


def test_grpo_vtrace_product_form():
    g = torch.Generator().manual_seed(7)
    lengths = [5, 2, 4]
    mask = torch.tensor([[t < n for t in range(5)] for n in lengths])
    trace_c = torch.rand(3, 5, generator=g, dtype=torch.float64)
    a_hat = torch.tensor([0.7, -1.2, 0.4], dtype=torch.float64)
    rewards = torch.zeros(3, 5, dtype=torch.float64)
    for b, n in enumerate(lengths):
        rewards[b, n - 1] = a_hat[b]
    adv, _ = remix.vtrace_advantages(rewards, torch.zeros_like(rewards), trace_c, mask)
    for b, n in enumerate(lengths):
        for t in range(n):
            product = math.prod(trace_c[b, i].item() for i in range(t + 1, n))
            assert adv[b, t].item() == pytest.approx(product * a_hat[b].item(), rel=1e-12)


def long_grpo_batch(length=4000, sigma=0.02, seed=0):
    """One group of two: a right 4,000-token response whose per-token log(pi_k/mu) ~ N(0, sigma^2), and a
    wrong 5-token one."""
    g = torch.Generator().manual_seed(seed)
    behaviour = -3.0 * torch.rand(length, generator=g)
    samples = [{"response_ids": [0] * length, "behaviour_logp": behaviour,
                "prox_logp": behaviour + sigma * torch.randn(length, generator=g), "reward": 1.0, "group": 1,
                "historical": True},
               {"response_ids": [0] * 5, "behaviour_logp": torch.zeros(5), "prox_logp": torch.zeros(5),
                "reward": 0.0, "group": 1, "historical": True}]
    return samples, 0.5 / (math.sqrt(0.5) + 1e-6)  # A_hat of the right one: (1 - 0.5) / (unbiased std + 1e-6)


def test_grpo_advantage_survives_a_4000_token_response_by_default():
    batch, a_hat = long_grpo_batch()
    remix.compute_advantages(batch, remix.Args(algo="grpo"))
    assert torch.equal(batch[0]["advantages"], torch.full((4000,), a_hat, dtype=torch.float32))  # exactly A_hat
    assert torch.equal(batch[1]["advantages"], torch.full((5,), -a_hat, dtype=torch.float32))


def test_grpo_vtrace_product_vanishes_on_a_4000_token_response():
    batch, a_hat = long_grpo_batch()
    remix.compute_advantages(batch, remix.Args(algo="grpo", grpo_vtrace=True))
    adv = batch[0]["advantages"]
    assert abs(adv[0].item()) < 1e-3 * a_hat  # expected e^(-4000 * 0.02 / sqrt(2 pi)) = 1e-14
    assert adv[-1].item() == pytest.approx(a_hat)  # the last token keeps A_hat


# ----------------------------------------------------------------------------------------------
# Eq. 4, Mix-PPG: the ratio against mu, the clip centred at pi_k/mu, clipfrac; the critic's clipped loss
# ----------------------------------------------------------------------------------------------
def test_mix_ppg_is_ppo_clip_on_fresh_samples():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) * 3
    new = old + 0.4 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    loss, stats = remix.mix_ppg_loss(new, old, old, adv, mask, eps=0.2)
    total, count, clipped = 0.0, 0, 0
    for b in range(4):
        for t in range(6):
            if mask[b, t]:
                ratio = math.exp(new[b, t] - old[b, t])
                a = adv[b, t].item()
                total += min(ratio * a, min(max(ratio, 0.8), 1.2) * a)
                count += 1
                clipped += (a > 0 and ratio > 1.2) or (a < 0 and ratio < 0.8)  # the clip changes the objective
    assert loss.item() == pytest.approx(-total / count, rel=1e-5)
    assert stats["clipfrac"] == pytest.approx(clipped / count)


def grad_of_mix_ppg(ratio: float, centre: float, advantage: float) -> float:
    behaviour = torch.tensor([[-1.0]])
    prox = behaviour + math.log(centre)
    logp = (behaviour + math.log(ratio)).requires_grad_(True)
    loss, _ = remix.mix_ppg_loss(logp, behaviour, prox, torch.tensor([[advantage]]), torch.tensor([[True]]), 0.2)
    loss.backward()
    return logp.grad.item()


def test_mix_ppg_clip_is_centred_at_prox_over_behaviour():
    # c = pi_k / mu = 0.5: the trust region is [0.3, 0.7], not PPO's [0.8, 1.2]
    assert grad_of_mix_ppg(ratio=0.6, centre=0.5, advantage=1.0) == pytest.approx(-0.6)  # inside: -r A
    assert grad_of_mix_ppg(ratio=0.8, centre=0.5, advantage=1.0) == 0.0  # above c + eps, A pushes up
    assert grad_of_mix_ppg(ratio=1.0, centre=0.5, advantage=1.0) == 0.0  # inside PPO's, outside ours
    assert grad_of_mix_ppg(ratio=0.2, centre=0.5, advantage=-1.0) == 0.0  # below c - eps, A pushes down
    assert grad_of_mix_ppg(ratio=0.8, centre=0.5, advantage=-1.0) == pytest.approx(0.8)  # pessimistic side
    assert grad_of_mix_ppg(ratio=0.2, centre=0.5, advantage=1.0) == pytest.approx(-0.2)


def test_clip_centre_is_a_constant():
    behaviour = torch.tensor([[-1.0, -2.0]])
    prox = torch.tensor([[-1.2, -1.5]], requires_grad=True)
    logp = torch.tensor([[-0.5, -2.5]], requires_grad=True)
    loss, _ = remix.mix_ppg_loss(logp, behaviour, prox, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert prox.grad is None and logp.grad is not None


def test_clipfrac_counts_only_tokens_where_the_clip_changes_the_objective():
    # c = 1 (fresh): (r, A) = (1.3, +1) clipped; (1.3, -1) not (the min keeps r A); (0.7, -1) clipped;
    # (0.7, +1) not; (1.1, +1) inside the interval
    ratio = torch.tensor([[1.3, 1.3, 0.7, 0.7, 1.1]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0]])
    _, stats = remix.mix_ppg_loss(ratio.log(), torch.zeros(1, 5), torch.zeros(1, 5), adv, torch.ones(1, 5, dtype=torch.bool))
    assert stats["clipfrac"].item() == pytest.approx(2 / 5)


def test_clipfrac_is_measured_around_the_centre():
    # c = pi_k / mu = 0.5: r = 0.8 with A > 0 is clipped (above 0.7), r = 1.05 with A > 0 too; r = 0.6 is inside
    behaviour = torch.zeros(1, 3)
    prox = torch.full((1, 3), math.log(0.5))
    logp = torch.log(torch.tensor([[0.8, 1.05, 0.6]]))
    _, stats = remix.mix_ppg_loss(logp, behaviour, prox, torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool))
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)


def test_weights_scale_each_token_of_mix_ppg():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    behaviour = logp - torch.tensor([[0.1, -0.1, 0.0]])
    adv, mask = torch.tensor([[1.0, -2.0, 0.5]]), torch.ones(1, 3)
    weights = torch.tensor([[0.5, 2.0, 1.0]])
    ratio = torch.exp(logp - behaviour)
    # no clipping at eps = 0.5 here: min(r A, clip(r) A) = r A, token mean of -w r A
    expected = -(weights * ratio * adv).mean()
    loss, _ = remix.mix_ppg_loss(logp, behaviour, behaviour, adv, mask, 0.5, weights)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert remix.mix_ppg_loss(logp, behaviour, behaviour, adv, mask, 0.5)[0].item() == \
        pytest.approx(-(ratio * adv).mean().item(), rel=1e-6)


def naive_mix_ppg(logp, behaviour, prox, adv, eps):
    """Eq. 4 token by token in plain Python floats, no clamp: the reference for the normal range."""
    terms = []
    for lp, b, p, a in zip(logp.tolist(), behaviour.tolist(), prox.tolist(), adv.tolist()):
        r, c = math.exp(lp - b), math.exp(p - b)
        terms.append(min(r * a, min(max(r, c - eps), c + eps) * a))
    return -sum(terms) / len(terms)


def test_the_log_ratio_clamp_changes_nothing_in_the_normal_range():
    gen = torch.Generator().manual_seed(0)
    logp, behaviour, prox = (torch.randn(64, generator=gen) * 3 - 5 for _ in range(3))  # |log r| up to ~20
    adv = torch.randn(64, generator=gen)
    keep = ((logp - behaviour).abs() < 19) & ((prox - behaviour).abs() < 19)
    logp, behaviour, prox, adv = (x[keep][None] for x in (logp, behaviour, prox, adv))
    loss, _ = remix.mix_ppg_loss(logp, behaviour, prox, adv, torch.ones_like(adv), 0.2)
    assert loss.item() == pytest.approx(naive_mix_ppg(logp[0], behaviour[0], prox[0], adv[0], 0.2), rel=1e-5)
    k3 = remix.k3_kl(logp, prox)[0]
    assert k3.tolist() == pytest.approx([math.exp(q - p) - (q - p) - 1 for p, q in zip(logp[0].tolist(),
                                                                                         prox[0].tolist())], rel=1e-4)


def test_a_historical_token_whose_ratio_overflows_float32_gives_a_finite_loss_and_gradient():
    """pi/mu = e^100 (a token mu sampled at e^-100): unclamped, e^100 is inf in float32 and the loss inf or NaN."""
    behaviour = torch.tensor([[-100.0, -1.0]])
    logp = torch.tensor([[0.0, -1.2]], requires_grad=True)
    prox, adv, mask = torch.tensor([[-0.5, -1.1]]), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    assert not torch.isfinite(torch.exp(logp - behaviour)).all()  # what the clamp guards against
    loss, stats = remix.mix_ppg_loss(logp, behaviour, prox, adv, mask, 0.2)
    kl = remix.kl_convex_loss(logp, torch.tensor([[90.0, -1.0]]), prox, 0.5, mask)
    (loss + kl).backward()
    assert torch.isfinite(loss) and torch.isfinite(kl) and torch.isfinite(logp.grad).all()
    assert torch.isfinite(stats["approx_kl"]) and torch.isfinite(stats["clipfrac"])
    c = remix.truncated_trace(prox, behaviour, mask)
    assert c[0].tolist() == pytest.approx([1.0, math.exp(-0.1)], rel=1e-6)  # min(c_bar, e^99.5) = 1
    # the second token, in range, is exactly its unclamped term: -min(r A, clip(r, c +- eps) A) / 2 tokens
    r, centre = math.exp(-0.2), math.exp(-0.1)
    first = -min(math.exp(20.0) * 1.0, min(max(math.exp(20.0), math.exp(20.0) - 0.2), math.exp(20.0) + 0.2))
    assert loss.item() == pytest.approx((first - min(r * -1.0, min(max(r, centre - 0.2), centre + 0.2) * -1.0)) / 2,
                                        rel=1e-5)


def test_clipped_value_loss_by_hand():
    v, old, target = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 0.4]])
    mask = torch.tensor([[True, True]])
    # token 1: unclipped (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 -> 2.25; token 2: 0.16 both
    assert remix.clipped_value_loss(v, old, target, mask, 0.5).item() == pytest.approx(0.5 * (2.25 + 0.16) / 2)


# ----------------------------------------------------------------------------------------------
# Eq. 6, the objective; the update-to-data passes; policy reincarnation at T
# ----------------------------------------------------------------------------------------------
def hand_worked_micro_batch() -> dict:
    """One response of two tokens and a padded third (its numbers are garbage, masked out): pi_theta = mu = pi_k, so
    r = c = 1; A = (2, -1); entropy (1, 3); pi_ref doubles the first token's probability; under PPO new values (1, 0)
    against values (0, 0) and targets (2, 0.4)."""
    t = lambda *row: torch.tensor([row])  # noqa: E731  [1, 3]
    return {"logp": t(0.0, 0.0, 5.0), "behaviour_logp": t(0.0, 0.0, 0.0), "prox_logp": t(0.0, 0.0, 0.0),
            "advantages": t(2.0, -1.0, 9.0), "entropy": t(1.0, 3.0, 99.0), "ref_logp": t(math.log(2.0), 0.0, 7.0),
            "response_mask": t(True, True, False), "historical": torch.tensor([False]),
            "new_values": t(1.0, 0.0, 4.0), "values": t(0.0, 0.0, 0.0), "value_targets": t(2.0, 0.4, -3.0)}


def test_objective_is_eq6_and_the_value_loss_by_hand():
    """Eq. 6 on the hand-worked micro-batch, lambda 0.7, ent_coef 0.01, beta 0.1: L_mix = -(2 - 1) / 2 = -0.5;
    H = (1 + 3) / 2 = 2; k3 to pi_ref: (2 - ln 2 - 1, 0) -> 0.15343, to pi_k 0, so L_klc = 0.7 * 0.15343; the value
    loss 0.5 * (max(1, 2.25) + 0.16) / 2 = 0.6025 (clip 0.5: V = 1 clipped to 0.5)."""
    args = remix.Args(ent_coef=0.01, kl_beta=0.1, clip_eps=0.2, value_clip=0.5)
    losses, logged = remix.objective(hand_worked_micro_batch(), 0.7, args)
    k3_ref = (2.0 - math.log(2.0) - 1.0) / 2
    assert set(losses) == {"policy", "critic"}
    assert losses["policy"].item() == pytest.approx(-0.5 - 0.01 * 2.0 + 0.1 * 0.7 * k3_ref, rel=1e-6)
    assert losses["critic"].item() == pytest.approx(0.5 * (2.25 + 0.16) / 2, rel=1e-6)
    expected = {"losses/policy_loss": -0.5, "losses/entropy": 2.0, "losses/clipfrac": 0.0, "losses/approx_kl": 0.0,
                "kl/prox": 0.0, "losses/kl_convex": 0.7 * k3_ref, "kl/ref": k3_ref, "losses/value_loss": 0.6025}
    assert {k: v.item() for k, v in logged.items()} == pytest.approx(expected, rel=1e-6, abs=1e-7)
    # GRPO (no new_values) has no critic loss; beta = 0 reads no reference log-probs and logs no KL-Convex
    mb = {k: v for k, v in hand_worked_micro_batch().items() if k not in ("new_values", "ref_logp")}
    losses, logged = remix.objective(mb, 0.7, dataclasses.replace(args, kl_beta=0.0))
    assert set(losses) == {"policy"} and "losses/kl_convex" not in logged and "losses/value_loss" not in logged
    assert losses["policy"].item() == pytest.approx(-0.5 - 0.01 * 2.0, rel=1e-6)


def test_ppo_hf_batch_mix_and_utd(tiny_model, train_file, tmp_path):
    # B = 10, p = 0.4: 6 fresh + 4 historical once history exists; 3 passes -> 3 x ceil(10 / 4) steps
    state = remix.train(tiny_args(tiny_model, train_file, tmp_path / "utd3", algo="ppo", utd=3, window=2, steps=4))
    rows = read_metrics(tmp_path / "utd3")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [(r["batch/fresh"], r["batch/historical"]) for r in rows] == [(6, 0), (6, 4), (6, 4), (6, 4)]
    assert [r["train/optimizer_steps"] for r in rows] == [3 * 2, 3 * 3, 3 * 3, 3 * 3]  # ceil(6/4), ceil(10/4)
    assert [r["rollouts/total"] for r in rows] == [6, 12, 18, 24]
    assert [batch[0][0]["version"] for batch in state["replay"]] == [3, 4]  # the oldest batch evicted
    assert all(1.0 <= r["replay/mean_age"] <= 2.0 for r in rows[1:])
    assert 0 < rows[-1]["offpolicy/ratio_min"] <= rows[-1]["offpolicy/ratio_max"]
    for key in ("losses/value_loss", "losses/policy_loss", "kl/ref", "losses/clipfrac", "perf/step_s"):
        assert all(math.isfinite(r[key]) for r in rows)
    # utd = 1 gives a third of the optimizer steps on the same batches
    remix.train(tiny_args(tiny_model, train_file, tmp_path / "utd1", algo="ppo", utd=1, window=2, steps=4))
    assert [r["train/optimizer_steps"] for r in read_metrics(tmp_path / "utd1")] == [2, 3, 3, 3]


def test_grpo_reincarnation(tiny_model, train_file, tmp_path):
    args = tiny_args(tiny_model, train_file, tmp_path, algo="grpo", prompts_per_step=5, group_size=2,
                     mini_batch_prompts=2, reincarnate_step=2, steps=3, save_every=1, actor_lr=1e-3)
    state = remix.train(args)
    rows = read_metrics(tmp_path)
    # 5 prompts, p = 0.4 -> 3 fresh groups (6 responses) + 2 whole historical groups (4 responses)
    assert [(r["batch/fresh"], r["batch/historical"]) for r in rows] == [(6, 0), (6, 4), (10, 0)]
    assert [r["phase"] for r in rows] == ["mix", "mix", "on-policy"]
    assert [r["train/utd"] for r in rows] == [2, 2, 1]
    assert rows[2]["train/optimizer_steps"] == 3  # ceil(10 / 4), one pass
    assert len(state["replay"]) == 0
    # the reference is pi_T: the policy saved at step T = 2, not the base model nor the final policy
    from transformers import AutoModelForCausalLM

    pi_t = AutoModelForCausalLM.from_pretrained(str(tmp_path / "checkpoint-2")).state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    ref = full_state(state["reference"])
    assert all(torch.equal(ref[k], pi_t[k]) for k in pi_t)
    assert any(not torch.equal(ref[k], base[k]) for k in base)


def test_on_policy_means_no_replay_no_extra_passes_no_switch_and_kl_to_the_base(tiny_model, train_file, tmp_path):
    args = remix.finalize_args(tiny_args(tiny_model, train_file, tmp_path, on_policy=True))
    assert (args.off_policy_p, args.utd, args.reincarnation, args.kl_convex) == (0.0, 1, False, False)
    remix.train(tiny_args(tiny_model, train_file, tmp_path, on_policy=True, steps=2, kl_convex_start=0,
                          kl_convex_every=1))
    rows = read_metrics(tmp_path)
    assert [(r["batch/historical"], r["train/utd"], r["kl_convex/lambda"], r["phase"]) for r in rows] == \
        [(0, 1, 1.0, "on-policy"), (0, 1, 1.0, "on-policy")]


# ----------------------------------------------------------------------------------------------
# The replay deque: whole groups drawn uniformly from the last N batches, as the loop draws them
# ----------------------------------------------------------------------------------------------
def test_draw_history_takes_whole_groups_from_the_window():
    replay = collections.deque(maxlen=2)
    for step in (1, 2, 3):
        replay.append([[{"version": step, "group": 10 * step + g, "i": i} for i in range(4)] for g in range(3)])
    assert [batch[0][0]["version"] for batch in replay] == [2, 3]  # step 1 evicted
    drawn = remix.draw_history(replay, 4)
    assert len(drawn) == 4 and len({id(g) for g in drawn}) == 4  # without replacement
    for group in drawn:
        assert [s["i"] for s in group] == [0, 1, 2, 3] and len({s["group"] for s in group}) == 1
        assert group[0]["version"] in (2, 3)
    assert len(remix.draw_history(replay, 50)) == 6
    assert remix.draw_history(collections.deque(maxlen=2), 3) == []


def test_draw_history_is_uniform_over_the_window():
    import random as stdlib_random

    replay = collections.deque(maxlen=2)
    for step in (1, 2, 3):
        replay.append([[{"version": step, "group": 10 * step + g}] for g in range(4)])
    counts = collections.Counter()
    stdlib_random.seed(0)
    for _ in range(4000):
        counts.update(g[0]["group"] for g in remix.draw_history(replay, 2))
    assert set(counts) == {20, 21, 22, 23, 30, 31, 32, 33}  # the oldest batch was evicted
    expected = 4000 * 2 / 8  # each of the 8 groups is drawn with probability 2/8
    assert all(abs(n - expected) < 5 * math.sqrt(expected) for n in counts.values()), counts


def test_the_loop_replays_exactly_what_draw_history_drew_from_the_whole_window(tiny_model, train_file, tmp_path,
                                                                                monkeypatch):
    """The draw as the loop uses it: every historical sample of a step is one draw_history returned for that
    step, drawn from all N stored batches (so both ages occur), before the step's own groups were stored."""
    drawn, real = {}, remix.draw_history

    def spy(replay, n_groups):
        groups = real(replay, n_groups)
        drawn[len(drawn) + 1] = ([batch[0][0]["version"] for batch in replay], [id(s) for g in groups for s in g])
        return groups

    monkeypatch.setattr(remix, "draw_history", spy)
    ages = collections.Counter()

    def on_step(step, record, policy, tokenizer, batch):
        versions, ids = drawn[step]
        assert versions == list(range(max(1, step - 2), step))  # the last N = 2 batches, not this step's
        assert [id(s) for s in batch if s["version"] < step] == ids
        ages.update(step - s["version"] for s in batch if s["version"] < step)

    remix.train(tiny_args(tiny_model, train_file, tmp_path, algo="ppo", steps=6, utd=1, window=2), on_step=on_step)
    assert set(ages) == {1, 2}


# ----------------------------------------------------------------------------------------------
# The sampler: per-request seeds (Decision 19), the sampler-trainer gap and its correction (Decision 18)
# ----------------------------------------------------------------------------------------------
def test_request_seeds_depend_only_on_seed_step_and_prompt_and_never_overlap():
    seeds = {(seed, step, i): engines.request_seed(seed, step, i, 8)
             for seed in (1, 2) for step in (1, 2, 3) for i in range(200)}
    assert all(value % 8 == 0 and 0 <= value < 2**62 for value in seeds.values())  # children seed + 0..7
    children = [value + j for value in seeds.values() for j in range(8)]
    assert len(set(children)) == len(children)  # no two responses of the run share a seed
    assert engines.request_seed(1, 2, 3, 8) == seeds[(1, 2, 3)]  # a function of its arguments alone


def test_sampler_is_weight_by_hand():
    trainer = torch.tensor([-1.0, -0.2, -3.0])
    sampler = torch.tensor([-1.5, -1.5, -2.0])
    # e^0.5 = 1.6487 under the cap; e^1.3 = 3.669 cut to 2; e^-1 = 0.3679 kept
    expected = torch.tensor([math.exp(0.5), 2.0, math.exp(-1.0)])
    torch.testing.assert_close(remix.sampler_is_weight(trainer, sampler, 2.0), expected)


def test_sampler_mismatch_sums_by_hand():
    fresh = [{"behaviour_logp": torch.tensor([-1.0, -2.0]), "sampler_logp": torch.tensor([-1.0, -1.0])},
             {"behaviour_logp": torch.tensor([-0.5]), "sampler_logp": torch.tensor([-1.5]),
              "sampler_weight": torch.tensor([2.0])},
             {"behaviour_logp": torch.tensor([-0.5]), "sampler_logp": None}]  # the hf sampler: nothing to compare
    gaps = [0.0, -1.0, 1.0]  # log pi_trainer - log pi_sampler on the three vLLM tokens
    abs_sum, k3_sum, outside, weight_sum, count, largest = report.sampler_mismatch(fresh)
    assert abs_sum == pytest.approx(2.0) and largest == pytest.approx(1.0) and count == 3
    assert k3_sum == pytest.approx(sum(math.exp(g) - 1 - g for g in gaps))
    assert outside == 2  # e^-1 = 0.37 and e^1 = 2.72 leave [0.5, 2]
    assert weight_sum == pytest.approx(1.0 + 1.0 + 2.0)  # weight 1 where no correction is stored


def test_sampler_correction_needs_vllm(tiny_model, train_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        console.check_args(remix.finalize_args(tiny_args(tiny_model, train_file, tmp_path, sampler="hf", sampler_is_cap=2.0)), 1)
    assert exit_info.value.code == 2
    assert "--sampler-is-cap needs --sampler vllm" in capsys.readouterr().err


def test_hf_sampler_stops_at_every_eos_id_of_the_generation_config(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model)
    prompts = [remix.build_prompt(tokenizer, "What is 1+1?")]
    torch.manual_seed(0)
    free = engines.hf_generate(policy, tokenizer, prompts, 4, 1.0, 1.0, 12, 4)[0]
    assert all(finish == "length" and len(ids) == 12 for ids, finish, _ in free)  # a random model rarely stops
    policy.generation_config.eos_token_id = [tokenizer.eos_token_id] + list(range(256))  # every byte token ends
    stopped = engines.hf_generate(policy, tokenizer, prompts, 4, 1.0, 1.0, 12, 4)[0]
    assert all(finish == "stop" and len(ids) == 1 for ids, finish, _ in stopped)


# ----------------------------------------------------------------------------------------------
# The training loop under test: one spied run checked against independent recomputation
# ----------------------------------------------------------------------------------------------
def naive_logp(model, sample, temperature=1.0) -> torch.Tensor:
    """log pi(a_t|s_t) of the sample's response from one unpadded forward pass of plain logits."""
    ids = torch.tensor([sample["prompt_ids"] + sample["response_ids"]])
    p = len(sample["prompt_ids"])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, p - 1 : -1].float() / temperature  # [R, V]
    return torch.log_softmax(logits, -1).gather(-1, ids[0, p:, None])[:, 0]


def naive_values(critic, sample) -> torch.Tensor:
    ids = torch.tensor([sample["prompt_ids"] + sample["response_ids"]])
    with torch.no_grad():
        return critic(input_ids=ids).logits[0, len(sample["prompt_ids"]) - 1 : -1, 0].float()


def key_of(sample) -> tuple:
    return tuple(sample["prompt_ids"] + sample["response_ids"])


def rows_of(batch: dict) -> list[tuple]:
    """The unpadded token rows of a collated micro-batch, to find which samples it holds."""
    return [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


class Spy:
    """Runs remix.train with every loss and advantage function wrapped: each call's arguments and result are
    kept with the step it belongs to; the models are copied at the start of every step."""

    NAMES = ("mix_ppg_loss", "kl_convex_loss", "vtrace_advantages", "whiten", "group_advantages",
             "grpo_token_advantages", "clipped_value_loss", "objective", "policy_forward", "critic_forward",
             "kl_convex_lambda")

    def __init__(self, monkeypatch):
        self.calls, self.step, self.models, self.start, self.batches = [], 1, {}, {}, {}
        for name in self.NAMES:
            real = getattr(remix, name)

            def spy(*a, _real=real, _name=name, **k):
                out = _real(*a, **k)
                self.calls.append((_name, self.step, a, k, out))
                return out

            monkeypatch.setattr(remix, name, spy)
        real_load = models.load

        def load(*a, **k):
            out = real_load(*a, **k)
            self.models = dict(zip(("policy", "reference", "critic"), out))
            self.start[1] = {n: plain_copy(self.models[n]) for n in ("policy", "reference", "critic")}
            return out

        monkeypatch.setattr(models, "load", load)

        def on_step(step, record, policy, tokenizer, batch):
            self.models["tokenizer"] = tokenizer
            self.batches[step] = [dict(s) for s in batch]
            self.step = step + 1
            self.start[step + 1] = {n: plain_copy(self.models[n]) for n in ("policy", "reference", "critic")}

        self.on_step = on_step

    def of(self, name: str, step: int) -> list:
        return [c for c in self.calls if c[0] == name and c[1] == step]


def scripted_right_answers(monkeypatch, train_file):
    """The real transformers sampler, with about half of the responses replaced by the gold answer, so that
    rewards are 0 and 1 and every advantage term is exercised (a random tiny model never answers right)."""
    import random as stdlib_random

    answers = {r["problem"]: r["answer"] for r in map(json.loads, open(train_file))}
    real, rng = engines.hf_generate, stdlib_random.Random(0)

    def sampler(policy, tokenizer, prompts, n, *sampling, **kw):
        out = real(policy, tokenizer, prompts, n, *sampling, **kw)
        for prompt, group in zip(prompts, out):
            text = tokenizer.decode(prompt)
            answer = next(a for p, a in answers.items() if p in text)
            right = tokenizer(f"so \\boxed{{{answer}}}", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            for j in range(len(group)):
                if rng.random() < 0.5:
                    group[j] = (right, "stop", None)
        return out

    monkeypatch.setattr(engines, "hf_generate", sampler)


def close(a, b, atol=2e-5) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_spied_steps_match_independent_recomputation(algo, tiny_model, train_file, tmp_path, monkeypatch):
    scripted_right_answers(monkeypatch, train_file)
    spy = Spy(monkeypatch)
    group = 2 if algo == "grpo" else 1
    args = tiny_args(tiny_model, train_file, tmp_path, algo=algo, steps=3, reincarnate_step=2, prompts_per_step=5,
                     group_size=group, mini_batch_prompts=2, actor_lr=1e-3, critic_lr=1e-3, kl_convex_start=0,
                     kl_convex_every=1, vtrace_c_bar=0.95, max_tokens_per_micro_batch=160)
    remix.train(args, on_step=spy.on_step)
    tokenizer, T = spy.models["tokenizer"], args.reincarnate_step
    for step in (1, 2, 3):
        batch, start = spy.batches[step], spy.start[step]
        policy_k, critic_k = start["policy"], start["critic"]
        mu = {key_of(s): naive_logp(spy.start[s["version"]]["policy"], s) for s in batch}  # the policy that sampled it
        # the anchor of a sample is the reference when it was sampled: the base model up to T, pi_T after
        ref = {key_of(s): naive_logp(spy.start[1]["policy"] if s["version"] <= T else spy.start[T + 1]["policy"], s)
               for s in batch}
        prox = {key_of(s): naive_logp(policy_k, s) for s in batch}
        assert (step == 2) == any(s["version"] < step for s in batch)  # history only at step 2 (T = 2)
        for s in batch:
            assert close(s["behaviour_logp"], mu[key_of(s)]) and close(s["ref_logp"], ref[key_of(s)])
            assert close(s["prox_logp"], prox[key_of(s)])
            text = tokenizer.decode(s["response_ids"], skip_special_tokens=True)
            assert s["reward"] == remix.grade_response(text, s["answer"])[0]
        assert len({s["reward"] for s in batch}) == 2  # both rewards occur
        # advantages: a naive recomputation from the recomputed log-probs and values
        c = {k: torch.clamp(torch.exp(prox[k] - mu[k]), max=args.vtrace_c_bar) for k in mu}
        if algo == "ppo":
            values = {key_of(s): naive_values(critic_k, s) for s in batch}
            raw, targets = {}, {}
            for s in batch:
                k, n = key_of(s), len(s["response_ids"])
                rewards = torch.zeros(1, n, dtype=torch.float64)
                rewards[0, -1] = s["reward"]  # the outcome reward on the last token only
                a, t = naive_vtrace(rewards, values[k][None].double(), c[k][None].double(), [n], args.gamma, args.gae_lambda)
                raw[k], targets[k] = a[0], t[0]
                assert close(s["values"], values[k]) and close(s["value_targets"], targets[k].float(), 1e-4)
            tokens = torch.cat(list(raw.values()))
            mean, std = tokens.mean(), tokens.std(unbiased=False)
            for s in batch:
                assert close(s["advantages"], ((raw[key_of(s)] - mean) / std).float(), 1e-4)
            (_, _, a, _, _), = spy.of("vtrace_advantages", step)
            rewards_arg, mask_arg = a[0], a[3].bool()
            last = mask_arg.sum(-1) - 1
            assert torch.equal(rewards_arg[torch.arange(len(batch)), last], torch.tensor([s["reward"] for s in batch]))
            assert rewards_arg.sum() == sum(s["reward"] for s in batch)  # nothing anywhere else
            whitened = torch.cat([s["advantages"] for s in batch])
            assert abs(whitened.mean().item()) < 1e-5 and abs(whitened.std(unbiased=False).item() - 1) < 1e-3
        else:
            for s in batch:
                group_rewards = torch.tensor([x["reward"] for x in batch if x["group"] == s["group"]])
                a_hat = (s["reward"] - group_rewards.mean()) / (group_rewards.std() + 1e-6)
                assert torch.allclose(s["advantages"], torch.full((len(s["response_ids"]),), a_hat.item()))
        # what each micro-batch's losses received
        by_key = {key_of(s): s for s in batch}
        forwards = spy.of("policy_forward", step)
        losses, kls, objectives = spy.of("mix_ppg_loss", step), spy.of("kl_convex_loss", step), spy.of("objective", step)
        assert len(losses) == len(kls) == len(objectives) > 0
        lam = remix.kl_convex_lambda(step, args.kl_convex_start, args.kl_convex_every)
        assert lam < 1.0
        graded = [f for f in forwards if f[4][0].requires_grad]  # the update's forward passes
        assert len(graded) == len(losses)
        for i, ((_, _, fwd, _, (logp, entropy)), loss, kl, objective) in enumerate(zip(graded, losses, kls, objectives)):
            samples = [by_key[row] for row in rows_of(fwd[1])]
            logp_arg, behaviour_arg, prox_arg, adv_arg, mask_arg = loss[2][:5]
            assert logp_arg is logp
            for j, s in enumerate(samples):
                n, k = len(s["response_ids"]), key_of(s)
                assert close(behaviour_arg[j, :n], mu[k]) and close(prox_arg[j, :n], prox[k])
                assert torch.equal(adv_arg[j, :n].cpu(), s["advantages"])
                assert close(kl[2][1][j, :n], ref[k]) and close(kl[2][2][j, :n], prox[k])
                if i == 0:  # the first micro-batch of the step runs pi_k itself
                    assert close(logp[j, :n].detach(), prox[k])
            assert kl[2][3] == pytest.approx(lam) and kl[2][0] is logp
            (mb, lam_arg, _), (backpropagated, logged) = objective[2], objective[4]
            assert mb["logp"] is logp and lam_arg == pytest.approx(lam)
            ent = remix.masked_mean(entropy, mask_arg)  # Eq. 6 from the spied terms and the run's coefficients
            assert backpropagated["policy"].item() == pytest.approx(
                (loss[4][0] - args.ent_coef * ent + args.kl_beta * kl[4]).item(), rel=1e-6, abs=1e-9)
            assert logged["losses/entropy"].item() == pytest.approx(ent.item(), rel=1e-6)
            assert ("critic" in backpropagated) == (algo == "ppo")
        if algo == "ppo":
            for (_, _, fwd, _, new_values), (_, _, v_args, _, v_loss), objective in zip(
                    [f for f in spy.of("critic_forward", step) if f[4].requires_grad],
                    spy.of("clipped_value_loss", step), objectives):
                assert v_args[0] is new_values and objective[4][0]["critic"] is v_loss  # the critic's own pass
                for j, row in enumerate(rows_of(fwd[1])):
                    s, n = by_key[row], len(by_key[row]["response_ids"])
                    assert close(v_args[1][j, :n], values[row]) and close(v_args[2][j, :n], targets[row].float(), 1e-4)


def test_step_metrics_adv_scale_and_trace_product_by_hand():

    fresh = [{"reward": 1.0, "response_ids": [0, 0], "truncated": False, "reflects": False, "version": 3, "status": "ok"},
             {"reward": 0.0, "response_ids": [0], "truncated": True, "reflects": True, "version": 3, "status": "ok"}]
    history = [{"reward": 1.0, "response_ids": [0, 0, 0], "truncated": False, "reflects": False, "version": 1}]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    advantages = torch.tensor([[2.0, -2.0, 0.0], [1.0, 0.0, 0.0], [0.5, -0.5, 1.0]])
    trace_c = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.5, 0.8, 1.0]])
    log_ratio = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [math.log(0.5), math.log(0.8), math.log(1.5)]])
    adv = {"mask": mask, "advantages": advantages, "trace_c": trace_c, "log_ratio": log_ratio,
           "historical": torch.tensor([False, False, True])}
    dist.padding.clear()
    dist.padding.update(tokens=6, slots=8)
    diagnostics = remix.offpolicy_diagnostics(adv, fresh, remix.Args(group_size=1, vtrace_c_bar=1.0))
    record = report.step_metrics(3, fresh, history, diagnostics, {})
    # mean |A| over historical tokens (0.5 + 0.5 + 1) / 3, over fresh ones (2 + 2 + 1) / 3
    assert record["offpolicy/adv_scale"] == pytest.approx((2 / 3) / (5 / 3))
    assert record["offpolicy/trace_prod_mean"] == pytest.approx(0.5 * 0.8 * 1.0)
    assert record["offpolicy/ratio_min"] == pytest.approx(0.5) and record["offpolicy/ratio_max"] == pytest.approx(1.5)
    assert record["offpolicy/ratio_mean"] == pytest.approx((0.5 + 0.8 + 1.5) / 3)
    assert record["offpolicy/trace_truncated"] == pytest.approx(1 / 3)  # 1.5 > c_bar
    assert record["offpolicy/log_ratio_mean"] == pytest.approx((math.log(0.5) + math.log(0.8) + math.log(1.5)) / 3)
    assert record["replay/mean_age"] == 2.0 and record["batch/fresh"] == 2 and record["batch/historical"] == 1
    assert record["perf/padding"] == pytest.approx(0.25)
    assert record["reward/mean"] == 0.5 and record["response/truncated"] == 0.5
    assert "losses/explained_variance" not in record  # no critic: nothing to explain
    # with a critic: targets (1, 2, 3, 4), values (1, 1, 3, 5): residuals (0, 1, 0, -1), Var 0.5 against Var 1.25
    for s, (target, value) in zip(fresh + history, (([1.0, 2.0], [1.0, 1.0]), ([3.0], [3.0]), ([4.0], [5.0]))):
        s["value_targets"], s["values"] = torch.tensor(target), torch.tensor(value)
    record = report.step_metrics(3, fresh, history, diagnostics, {})
    assert record["losses/explained_variance"] == pytest.approx(1 - 0.5 / 1.25)


def test_zero_std_groups_counts_fresh_groups_whose_rewards_all_agree():
    """GRPO's groups with no spread of reward (A_hat = 0 on every response): of the fresh groups (1, 1), (0, 1) and
    (0, 0), two; the historical responses after them are not a group of this step's."""
    fresh = [{"reward": r, "response_ids": [0], "truncated": False, "reflects": False, "version": 2}
             for r in (1.0, 1.0, 0.0, 1.0, 0.0, 0.0)]
    history = [{"reward": 1.0, "response_ids": [0], "truncated": False, "reflects": False, "version": 1}] * 2
    mask = torch.ones(8, 1, dtype=torch.bool)
    adv = {"mask": mask, "advantages": torch.zeros(8, 1), "trace_c": torch.ones(8, 1), "log_ratio": torch.zeros(8, 1),
           "historical": torch.arange(8) >= 6}
    dist.padding.update(tokens=8, slots=8)
    record = report.step_metrics(2, fresh, history, remix.offpolicy_diagnostics(adv, fresh, remix.Args(group_size=2)),
                               {})
    assert record["reward/zero_std_groups"] == pytest.approx(2 / 3)
    assert record["batch/historical"] == 2 and record["offpolicy/ratio_mean"] == 1.0


def test_approx_kl_is_cleanrls_estimate_against_pi_k():
    logp, prox = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.2, -1.9, -0.5]])
    _, stats = remix.mix_ppg_loss(logp, prox, prox, torch.ones(1, 3), torch.tensor([[1, 1, 0]]), 0.2)
    r = [math.exp(0.2), math.exp(-0.1)]  # pi_theta / pi_k on the two response tokens
    assert stats["approx_kl"].item() == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 2, rel=1e-5)


def test_cached_reference_logprobs_equal_a_fresh_computation(tiny_model, train_file, tmp_path):
    """Reference log-probs are computed once, when a sample is fresh, and replayed with it: at every step they
    equal the reference model's forward pass at that step, also on historical samples, until reincarnation
    (T = 2) empties the deque."""
    from transformers import AutoModelForCausalLM

    checked, base = collections.Counter(), AutoModelForCausalLM.from_pretrained(tiny_model)

    def on_step(step, record, policy, tokenizer, batch):
        reference = base if step <= 2 else state["reference"]  # after T the live reference is pi_T
        for s in batch:
            assert close(s["ref_logp"], naive_logp(reference, s))
            checked["historical" if s["version"] < step else "fresh"] += 1

    state = {}
    real = models.load

    def load(*a, **k):
        out = real(*a, **k)
        state["reference"] = out[1]
        return out

    models.load = load
    try:
        remix.train(tiny_args(tiny_model, train_file, tmp_path, algo="grpo", group_size=2, steps=3, reincarnate_step=2,
                              actor_lr=1e-3), on_step=on_step)
    finally:
        models.load = real
    assert checked["historical"] > 0 and checked["fresh"] > 0


# ----------------------------------------------------------------------------------------------
# The loop's parts by their behaviour: update passes, entropy and KL pulls, gradients released
# ----------------------------------------------------------------------------------------------
DERIVED = ("advantages", "value_targets")


def prepared_update_case(model, data, out, algo) -> dict:
    """The batch, models and settings that update() received at step 2 of a real run (history present,
    lambda < 1), before it changed anything."""
    captured, real = {}, remix.update

    def spy(batch, policy, critic, optimizers, lam, utd, step, args, *rest, **kw):
        if step == 2:
            captured.update(batch=[{k: v for k, v in s.items() if k not in DERIVED} for s in batch], lam=lam, utd=utd,
                            step=step, args=dataclasses.asdict(args), model=model,
                            policy={k: v.clone() for k, v in full_state(policy).items()},
                            critic=None if critic is None else {k: v.clone() for k, v in full_state(critic).items()})
        return real(batch, policy, critic, optimizers, lam, utd, step, args, *rest, **kw)

    remix.update = spy
    try:
        group = 2 if algo == "grpo" else 1
        remix.train(tiny_args(model, data, out, algo=algo, steps=2, prompts_per_step=10, group_size=group,
                              mini_batch_prompts=3, actor_lr=1e-3, kl_convex_start=0, kl_convex_every=1))
    finally:
        remix.update = real
    return captured


def run_update(case: dict) -> tuple[dict, dict]:
    """compute_advantages and update on this rank's share of the case's batch (whole groups, in order);
    returns the full parameters after the update (on rank 0) and the logged statistics."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification


    device = dist.init()
    args = console.settings(remix.Args, **case["args"])
    policy = AutoModelForCausalLM.from_pretrained(case["model"])
    policy.load_state_dict(case["policy"])
    critic = None
    if case["critic"] is not None:
        config = AutoConfig.from_pretrained(case["model"], num_labels=1)
        critic = AutoModelForTokenClassification.from_pretrained(case["model"], config=config)
        critic.load_state_dict(case["critic"])
        critic.dropout.p = 0.0  # as models.load does
    policy, critic = dist.shard(policy, device, torch.float32), critic and dist.shard(critic, device,
                                                                                                   torch.float32)
    share = len(case["batch"]) // dist.world()
    batch = case["batch"][dist.rank() * share :][:share]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=args.weight_decay)
                  for m, lr in ((policy, args.actor_lr), (critic, args.critic_lr)) if m is not None]
    remix.compute_advantages(batch, args)
    stats = remix.update(batch, policy, critic, optimizers, case["lam"], case["utd"], case["step"], args)
    full = {name: full_state(m) for name, m in (("policy", policy), ("critic", critic)) if m}
    return full, dict(stats)


@pytest.fixture(scope="module")
def grpo_case(tmp_path_factory):
    """What update() received at step 2 of a real GRPO run (history present), to run it again at will."""
    model = build_tiny_model(str(tmp_path_factory.mktemp("tiny-case") / "qwen2"))
    rows = [json.loads(line) for line in TRAIN.open()]
    data = tmp_path_factory.mktemp("case-data") / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [r for r in rows if len(r["problem"]) < 120][:64]))
    return prepared_update_case(model, str(data), tmp_path_factory.mktemp("case-run"), "grpo")


def rerun_update(case: dict, **overrides) -> tuple:
    """update() once more on the case's batch from the case's policy, with changed settings; returns the
    policy before and after, and the batch."""
    import copy

    from transformers import AutoModelForCausalLM

    zero_advantages, utd = overrides.pop("zero_advantages", False), overrides.pop("utd", case["utd"])
    args = console.settings(remix.Args, **{**case["args"], **overrides})
    before = AutoModelForCausalLM.from_pretrained(case["model"])
    before.load_state_dict(case["policy"])
    policy = copy.deepcopy(before)
    batch = [dict(s) for s in case["batch"]]
    remix.compute_advantages(batch, args)
    if zero_advantages:
        for s in batch:
            s["advantages"] = torch.zeros_like(s["advantages"])
    optim = torch.optim.AdamW(policy.parameters(), lr=args.actor_lr, weight_decay=0.0)
    remix.update(batch, policy, None, [optim], case["lam"], utd, case["step"], args)
    return before, policy, batch


def distance(a, b) -> float:
    return sum((x - y).pow(2).sum().item() for x, y in zip(a.parameters(), b.parameters())) ** 0.5


def token_mean(model, batch, fn) -> float:
    with torch.no_grad():
        mb = models.collate(batch, "cpu")
        return remix.masked_mean(fn(*remix.policy_forward(model, mb, 1.0), mb), mb["response_mask"]).item()


def test_more_update_passes_move_the_weights_further(grpo_case):
    before, once, _ = rerun_update(grpo_case, utd=1)
    _, twice, _ = rerun_update(grpo_case, utd=2)
    assert distance(before, twice) > 1.2 * distance(before, once) > 0  # equal if the second pass never stepped


def test_a_large_entropy_bonus_with_zero_advantages_raises_the_entropy(grpo_case):
    before, after, batch = rerun_update(grpo_case, ent_coef=1.0, kl_beta=0.0, zero_advantages=True, actor_lr=1e-3)
    entropy = lambda model: token_mean(model, batch, lambda logp, ent, mb: ent)  # noqa: E731
    assert entropy(after) > entropy(before) + 1e-3


def test_a_large_kl_coefficient_pulls_the_policy_to_the_reference(grpo_case):
    before, after, batch = rerun_update(grpo_case, ent_coef=0.0, kl_beta=10.0, zero_advantages=True, actor_lr=1e-3)
    ref = models.padded(batch, "ref_logp")
    kl = lambda model: token_mean(model, batch, lambda logp, ent, mb: remix.k3_kl(logp, ref))  # noqa: E731
    assert kl(before) > 1e-4 and kl(after) < 0.5 * kl(before)


def test_update_releases_every_gradient(grpo_case):
    _, policy, _ = rerun_update(grpo_case)
    assert all(p.grad is None for p in policy.parameters())


def gradients_at_each_step(tiny_model, monkeypatch, objective) -> list[dict]:
    """One PPO update pass with KL-Convex on (lambda 0.7, beta 0.1) over four samples, two of them replayed (pi_k
    differs from mu, and pi_ref from both), under `objective`; returns, at each optimizer step, every parameter's
    gradient of the policy and of the critic as it reaches the step (None where a parameter has none)."""
    monkeypatch.setattr(remix, "objective", objective)
    dist.init()
    args = remix.finalize_args(console.settings(remix.Args, model=tiny_model, algo="ppo", sampler="hf", kl_beta=0.1,
                                              ent_coef=0.01, mini_batch_prompts=2, out="unused"))
    policy, reference, critic = models.load(args)
    optimizers = [models.optimizer(net, 1e-3, 0.01, False) for net in (policy, critic)]
    whole = lambda g: None if g is None else g.full_tensor() if hasattr(g, "full_tensor") else g  # noqa: E731
    seen = []

    policy_step = optimizers[0].step  # the policy's step comes first: both models' gradients are complete there

    def step(*a, **k):
        seen.append({name: [whole(q.grad) for q in net.parameters()]
                     for name, net in (("policy", policy), ("critic", critic))})
        return policy_step(*a, **k)

    optimizers[0].step = step
    g = torch.Generator().manual_seed(0)
    batch = []
    for i, n in enumerate((5, 7, 6, 8)):
        ids = torch.randint(3, policy.config.vocab_size, (6 + n,), generator=g).tolist()
        behaviour = -3.0 - torch.rand(n, generator=g)
        batch.append({"prompt_ids": ids[:6], "response_ids": ids[6:], "historical": i >= 2, "group": i, "reward": 1.0,
                      "behaviour_logp": behaviour, "prox_logp": behaviour + (0.3 * torch.randn(n, generator=g)
                                                                             if i >= 2 else 0.0),
                      "ref_logp": -3.0 - torch.rand(n, generator=g), "advantages": torch.randn(n, generator=g),
                      "values": torch.randn(n, generator=g), "value_targets": torch.randn(n, generator=g)})
    remix.update(batch, policy, critic, optimizers, 0.7, 1, 1, args)
    return seen


def test_a_fork_zeroing_every_loss_of_the_objective_zeroes_every_gradient(tiny_model, monkeypatch):
    """Every loss of the update goes through objective(): a fork of it that multiplies each loss it returns by zero
    leaves every gradient of a PPO step zero, the policy's and the critic's, with KL-Convex on; unforked, both
    models' gradients are not zero (the same batch and models)."""
    real = remix.objective

    def times_zero(mb, lam, args):
        losses, logged = real(mb, lam, args)
        return {name: 0.0 * loss for name, loss in losses.items()}, logged

    for fork, zero in ((times_zero, True), (real, False)):
        steps = gradients_at_each_step(tiny_model, monkeypatch, fork)
        assert len(steps) == 2  # four samples, two a mini-batch
        for grads in steps:
            for name in ("policy", "critic"):
                assert all(grad is not None for grad in grads[name]), name  # each parameter reached the backward
                nonzero = sum(int(torch.count_nonzero(grad)) for grad in grads[name])
                assert (nonzero == 0) == zero, (name, nonzero)


# ----------------------------------------------------------------------------------------------
# The models and the trainer's passes: no dropout, forwards against unpadded ones, token budgets, sharding
# ----------------------------------------------------------------------------------------------
def test_models_have_no_dropout_in_training_mode(tiny_model, tmp_path):
    dist.init()
    policy, reference, critic = models.load(remix.finalize_args(console.settings(remix.Args, model=tiny_model,
                                                                               algo="ppo")))
    mb = models.collate([{"prompt_ids": [1, 2, 3], "response_ids": [4, 5]}, {"prompt_ids": [6], "response_ids": [7]}], "cpu")
    for model, fn in ((policy, lambda m: remix.policy_forward(m, mb, 1.0)[0]), (critic, lambda m: remix.critic_forward(m, mb))):
        model.eval()
        with torch.no_grad():
            plain = fn(model)
        model.train()
        with torch.no_grad():
            assert torch.equal(fn(model), plain)


def test_forwards_and_collate_against_unpadded_passes(tiny_model):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    policy = AutoModelForCausalLM.from_pretrained(tiny_model)
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model, config=AutoConfig.from_pretrained(tiny_model, num_labels=1))
    critic.eval()
    g = torch.Generator().manual_seed(0)
    samples = [{"prompt_ids": torch.randint(0, 250, (p,), generator=g).tolist(),
                "response_ids": torch.randint(0, 250, (r,), generator=g).tolist()} for p, r in ((7, 3), (2, 9), (12, 1), (4, 5))]
    mb = models.collate(samples, "cpu")
    assert mb["prompt_len"] == 12 and mb["response_mask"].sum(-1).tolist() == [3, 9, 1, 5]
    with torch.no_grad():
        logp, entropy = remix.policy_forward(policy, mb, 0.7)
        values = remix.critic_forward(critic, mb)
    for j, s in enumerate(samples):
        n = len(s["response_ids"])
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        with torch.no_grad():
            logits = policy(input_ids=ids).logits[0, len(s["prompt_ids"]) - 1 : -1] / 0.7  # [R, V]
            v = critic(input_ids=ids).logits[0, :, 0]  # [P + R]
        log_probs = torch.log_softmax(logits, -1)
        assert close(logp[j, :n], log_probs.gather(-1, ids[0, len(s["prompt_ids"]):, None])[:, 0])
        assert close(entropy[j, :n], -(log_probs.exp() * log_probs).sum(-1), 1e-4)
        # V(s_0) is the value at the last prompt token; V(s_t) at the position that predicts token t
        assert close(values[j, :n], v[len(s["prompt_ids"]) - 1 : -1])


def test_micro_batches_respect_the_budget_and_group_lengths():
    samples = [{"prompt_ids": [0] * 4, "response_ids": [0] * n} for n in (3, 50, 4, 6, 48, 5, 200, 49, 51)]
    dist.padding.clear()
    plans = dist.micro_batches(samples, 120)
    work = dict(dist.padding)
    assert sorted(len(s["response_ids"]) for plan in plans for s in plan) == [3, 4, 5, 6, 48, 49, 50, 51, 200]
    for plan in plans:
        width = max(len(s["prompt_ids"]) for s in plan) + max(len(s["response_ids"]) for s in plan)
        shortest = min(len(s["prompt_ids"]) + len(s["response_ids"]) for s in plan)
        assert len(plan) == 1 or (len(plan) * width <= 120 and width <= 1.1 * shortest)  # a longer one runs alone
    # totals 7, 8, 9, 10: each more than 10% above the one before; 52, 53, 54 together (162 slots > 120 with 55)
    assert [[len(s["response_ids"]) for s in plan] for plan in plans] == [[3], [4], [5], [6], [48, 49], [50, 51], [200]]
    assert work["tokens"] == 9 * 4 + 416 and work["slots"] == 7 + 8 + 9 + 10 + 2 * 53 + 2 * 55 + 204


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_token_budgets_change_no_number(algo, tiny_model, train_file, tmp_path):
    """One response per micro-batch, a few, or all: the same per-token log-probs and values, the same logged
    losses and, after one update, the same parameters."""
    case = prepared_update_case(tiny_model, train_file, tmp_path / "run", algo)
    case["args"].update(actor_lr=1e-4, critic_lr=1e-4)  # see test_two_processes_make_the_same_update_as_one
    results = {}
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    for budget in (1, 120, 100_000):
        case["args"]["max_tokens_per_micro_batch"] = budget
        args = console.settings(remix.Args, **case["args"])
        policy = AutoModelForCausalLM.from_pretrained(case["model"])
        policy.load_state_dict(case["policy"])
        dist.padding.clear()
        passes = models.per_token(remix.logp_of(args), policy, case["batch"], budget)
        if algo == "ppo":
            critic = AutoModelForTokenClassification.from_pretrained(
                case["model"], config=AutoConfig.from_pretrained(case["model"], num_labels=1))
            critic.load_state_dict(case["critic"])
            passes += models.per_token(remix.critic_forward, critic, case["batch"], budget)
        work = dict(dist.padding)
        full, stats = run_update(case)
        results[budget] = (passes, full, stats, work)
    reference = results[100_000]
    assert results[1][3]["slots"] == results[1][3]["tokens"]  # one response each: no padding at all
    assert reference[3]["slots"] > reference[3]["tokens"]  # the batch in one piece is padded
    for budget, (passes, full, stats, _) in results.items():
        for a, b in zip(passes, reference[0]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        for name in full:
            for key in full[name]:
                torch.testing.assert_close(full[name][key], reference[1][name][key], rtol=0, atol=1e-5)
        for key in stats:
            assert stats[key] == pytest.approx(reference[2][key], rel=1e-4, abs=1e-6), (budget, key)


def layer_calls_during_update(monkeypatch, model, data, out, checkpointing) -> collections.Counter:
    """Calls of every decoder layer of the policy and the critic inside update(): twice per micro-batch when
    activations are recomputed in the backward pass, once otherwise. (Pre-hooks: torch stops a recompute as
    soon as it has what the backward needs, before the layer's post-hooks would run.)"""
    calls, real = collections.Counter(), remix.update

    def spy(batch, policy, critic, *rest, **kw):
        hooks = [layer.register_forward_pre_hook(lambda *_, name=name: calls.update([name]))
                 for name, net in (("policy", policy), ("critic", critic)) for layer in net.base_model.layers]
        try:
            return real(batch, policy, critic, *rest, **kw)
        finally:
            for hook in hooks:
                hook.remove()

    with monkeypatch.context() as patch:
        patch.setattr(remix, "update", spy)
        remix.train(tiny_args(model, data, out, algo="ppo", steps=1, gradient_checkpointing=checkpointing))
    return calls


def test_gradient_checkpointing_acts_on_both_models_when_asked(tiny_model, train_file, tmp_path, monkeypatch):
    plain = layer_calls_during_update(monkeypatch, tiny_model, train_file, tmp_path / "plain", False)
    recomputed = layer_calls_during_update(monkeypatch, tiny_model, train_file, tmp_path / "ckpt", True)
    assert plain["policy"] > 0 and plain["critic"] > 0
    assert recomputed == collections.Counter({k: 2 * v for k, v in plain.items()})


def test_critic_forward_builds_no_kv_cache(tiny_model):
    from transformers import AutoConfig, AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(
        tiny_model, config=AutoConfig.from_pretrained(tiny_model, num_labels=1))
    caches = []
    critic.model.register_forward_hook(lambda module, args, out: caches.append(out.past_key_values))
    mb = models.collate([{"prompt_ids": [1, 2, 3], "response_ids": [4, 5]}], "cpu")
    with torch.no_grad():
        remix.critic_forward(critic, mb)
        critic(input_ids=mb["input_ids"])  # the model's own default would keep one
    assert caches[0] is None and caches[1] is not None


def test_unsharded_restores_each_modules_reshard_setting(tiny_model):
    """FSDP2 keeps the root unsharded after forward; generating with whole weights must leave it so."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM

    device = dist.init()
    policy = dist.shard(AutoModelForCausalLM.from_pretrained(tiny_model), device, torch.float32)
    modules = [m for m in policy.modules() if isinstance(m, FSDPModule)]

    def settings():
        return [(m._get_fsdp_state()._auto_reshard_after_forward,
                 [g.post_forward_mesh_info is None for g in m._get_fsdp_state()._fsdp_param_groups]) for m in modules]

    mb = models.collate([{"prompt_ids": [1, 2, 3], "response_ids": [4, 5]}], "cpu")
    for first in (True, False):  # before any forward, and after the root's first forward chose its setting
        before = settings()
        with dist.unsharded(policy):
            pass
        assert settings() == before
        remix.policy_forward(policy, mb, 1.0)[0].sum().backward()
    root, layer = settings()[0], settings()[-1]  # modules() yields the root first
    assert root[1] == [True] and layer[1] == [False]  # the root stays whole after forward, the layers reshard


def test_a_sharded_forward_reaches_fsdp2_with_its_inputs(tiny_model, monkeypatch):
    """policy_forward runs the trunk and the output layer as the sharded model's forward (dist.as_forward). On a GPU,
    torch 2.11's FSDP2 moves a root forward's inputs to the device (torch.distributed.utils._to_kwargs) and takes the
    first of what it moved, with no check: a call without inputs raised IndexError on the lent H200, and a CPU device
    never takes that branch. The spy runs 2.11's branch on what reaches the root's pre-forward, in a pass with
    gradients and one without, and the batch's token ids must be there."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.utils import _to_kwargs
    from transformers import AutoModelForCausalLM

    device = dist.init()
    policy = dist.shard(AutoModelForCausalLM.from_pretrained(tiny_model), device, torch.float32)
    real, seen = FSDPState._root_pre_forward, []

    def as_torch_2_11_on_cuda(state, module, args, kwargs):
        if module is policy and state._state_ctx.iter_forward_root is None:  # the root's entry into a forward
            moved_args, moved_kwargs = _to_kwargs(args, kwargs, device, False)
            seen.append([*moved_args[0], *moved_kwargs[0].values()])  # IndexError when both are empty
        return real(state, module, args, kwargs)

    monkeypatch.setattr(FSDPState, "_root_pre_forward", as_torch_2_11_on_cuda)
    mb = models.collate([{"prompt_ids": [1, 2, 3], "response_ids": [4, 5]}, {"prompt_ids": [6], "response_ids": [7]}],
                        "cpu")
    logp, _ = remix.policy_forward(policy, mb, 1.0)
    logp.sum().backward()
    with torch.no_grad():
        remix.policy_forward(policy, mb, 1.0)
    assert len(seen) == 2 and all(any(x is mb["input_ids"] for x in inputs) for inputs in seen)


def test_a_pass_without_backward_leaves_the_root_sharded(tiny_model):
    """FSDP2 keeps the root's weights (embeddings, final norm, output layer) whole after a forward, for the backward
    that follows; the frozen reference never runs one, so every no-grad pass reshards them (a whole bf16 copy would
    otherwise stay on every GPU for the run, generation included)."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    device = dist.init()
    reference = dist.shard(AutoModelForCausalLM.from_pretrained(tiny_model).eval().requires_grad_(False), device,
                           torch.float32)
    embedding = lambda: reference.get_input_embeddings().weight  # noqa: E731  the root's own parameter
    samples = [{"prompt_ids": [1, 2, 3], "response_ids": [4, 5]}, {"prompt_ids": [6], "response_ids": [7, 8, 9]}]
    with torch.no_grad():
        remix.policy_forward(reference, models.collate(samples, "cpu"), 1.0)
    assert not isinstance(embedding(), DTensor)  # a bare forward: the root stays whole
    logp = models.per_token(remix.logp_of(remix.Args()), reference, samples, 10_000)
    assert isinstance(embedding(), DTensor)  # the reference pass: sharded again
    assert [len(x) for x in logp] == [2, 3]
