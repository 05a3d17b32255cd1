"""Plant one bug at a time in a copy of the code, run the fast tests, and say which test caught it.

    python benchmarks/mutation_check.py            # every mutant; exits 1 if any survives
    python benchmarks/mutation_check.py --list     # the mutants only
    python benchmarks/mutation_check.py NAME ...   # some of them

Each mutant replaces one exact piece of remix.py or a module of machinery/ (the piece must occur exactly once, so a
reshaped loop makes this script fail loudly until its mutant is updated; a slow test checks that every mutant
still applies). The fast tests are test_remix.py and tests/test_runs.py without the `slow` ones (no subprocesses,
vLLM or torchrun): the spied steps and the loop's behaviour tests run first, then the rest; the first failing
test is reported. The sleep sequence's mutants, which only a slow test catches, run that test instead (`-m slow`:
pytest.ini's own selection leaves it out).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPY = ("remix.py", "eval.py", "deepscaler.py", "test_remix.py", "conftest.py", "pytest.ini", "machinery", "tests")
LOOP_TESTS = "spied or further or entropy_bonus or kl_coefficient or unpadded or uniform_over or token_budgets"
FAST_TESTS = ("-m", "not slow", "test_remix.py", "tests/test_runs.py")
SLEEP_TESTS = ("-m", "slow", "tests/test_sleep_mode.py::test_training_with_sleep_mode_runs_every_sequence_and_changes_"
               "nothing")
OVERLAP_TESTS = ("-m", "slow", "tests/test_overlap.py::test_each_fresh_batch_carries_the_version_and_mu_of_the_policy_"
                 "that_drew_it")
BROADCAST_TESTS = ("tests/test_overlap.py::test_a_sampler_process_dying_under_the_weights_broadcast_ends_the_sending",)

# name -> (file, exact original text, mutated text[, the tests that run instead of FAST_TESTS])
MUTANTS = {
    "mu where pi_k belongs in Mix-PPG (the clip centred at 1)": (
        "remix.py", 'mix_ppg_loss(logp, mb["behaviour_logp"], prox, mb["advantages"], mask,',
        'mix_ppg_loss(logp, mb["behaviour_logp"], mb["behaviour_logp"], mb["advantages"], mask,'),
    "ref and prox swapped in KL-Convex": (
        "remix.py", "kl_convex = kl_convex_loss(logp, ref, prox, lam, mask)",
        "kl_convex = kl_convex_loss(logp, prox, ref, lam, mask)"),
    "PPO advantages not whitened": (
        "remix.py", "advantages = whiten(advantages, mask, dist.all_reduce)  # [N, L]", "advantages = advantages  # [N, L]"),
    "entropy bonus with the wrong sign": (
        "remix.py", "mix_ppg - args.ent_coef * entropy + args.kl_beta * kl_convex",
        "mix_ppg + args.ent_coef * entropy + args.kl_beta * kl_convex"),
    "KL-Convex term with the wrong sign": (
        "remix.py", "mix_ppg - args.ent_coef * entropy + args.kl_beta * kl_convex",
        "mix_ppg - args.ent_coef * entropy - args.kl_beta * kl_convex"),
    "entropy read negated by the objective": (
        "remix.py", 'entropy = masked_mean(mb["entropy"], mask)', 'entropy = masked_mean(-mb["entropy"], mask)'),
    "the critic's loss computed beside the objective": (
        "remix.py", "                losses, logged = objective(mb, lam, args)\n",
        "                losses, logged = objective(mb, lam, args)\n                if critic is not None:\n"
        "                    losses[\"critic\"] = clipped_value_loss(mb[\"new_values\"], mb[\"values\"], "
        "mb[\"value_targets\"], mb[\"response_mask\"], args.value_clip)\n"),
    "later UTD passes counted but not stepped": (
        "remix.py", "                for optim in optimizers:\n                    optim.step()",
        "                for optim in optimizers if epoch == 0 else ():\n                    optim.step()"),
    "reference log-probs computed with the policy": (
        "remix.py", '(("behaviour_logp", policy), ("ref_logp", reference))', '(("behaviour_logp", policy), ("ref_logp", policy))'),
    "pi_k on history computed with the reference": (
        "remix.py", "prox_and_values(fresh, history, policy, critic, step, args)",
        "prox_and_values(fresh, history, reference, critic, step, args)"),
    "stored behaviour log-probs ignored in the loss (mu := pi_k)": (
        "remix.py", 'mix_ppg_loss(logp, mb["behaviour_logp"], prox,', 'mix_ppg_loss(logp, prox, prox,'),
    "stored behaviour log-probs ignored in the traces (every c = 1)": (
        "remix.py", 'behaviour = models.padded(batch, "behaviour_logp", "cpu")',
        'behaviour = models.padded(batch, "prox_logp", "cpu")'),
    "outcome reward on the first response token": (
        "remix.py", "last = mask.sum(-1) - 1  # [N] each response's last token", "last = mask.sum(-1) * 0  # [N] each response's last token"),
    "truncated_trace called with its arguments swapped": (
        "remix.py", "trace_c = truncated_trace(prox, behaviour, mask, args.vtrace_c_bar)",
        "trace_c = truncated_trace(behaviour, prox, mask, args.vtrace_c_bar)"),
    "c_bar not passed to truncated_trace": (
        "remix.py", "trace_c = truncated_trace(prox, behaviour, mask, args.vtrace_c_bar)", "trace_c = truncated_trace(prox, behaviour, mask)"),
    "c_bar ignored inside truncated_trace": (
        "remix.py", "ratio(prox_logp - behaviour_logp).clamp(max=c_bar)", "ratio(prox_logp - behaviour_logp)"),
    "critic_forward reads V one position late": (
        "remix.py", 'return out[:, batch["prompt_len"] - 1 : -1, 0].float()', 'return out[:, batch["prompt_len"] :, 0].float()'),
    "critic trained toward its old values": (
        "remix.py", 'clipped_value_loss(mb["new_values"], mb["values"], mb["value_targets"],',
        'clipped_value_loss(mb["new_values"], mb["values"], mb["values"],'),
    "micro-batch token weighting dropped": (
        "remix.py", 'share = aggregation(mb["response_mask"])[1] / size', "share = torch.tensor(1.0)"),
    "draw_history takes the newest groups": (
        "remix.py", "return random.sample(stored, min(n_groups, len(stored)))",
        "return stored[len(stored) - min(n_groups, len(stored)):]"),
    "clipfrac measured around 1 instead of c": (
        "remix.py", "cut = ((advantages > 0) & (r > centre + eps)) | ((advantages < 0) & (r < centre - eps))",
        "cut = ((advantages > 0) & (r > 1 + eps)) | ((advantages < 0) & (r < 1 - eps))"),
    "clip interval centred at 1 (PPO's, not Mix-PPG's)": (
        "remix.py", "torch.clamp(r, centre - eps, centre + eps)", "torch.clamp(r, 1 - eps, 1 + eps)"),
    "KL-Convex weights swapped": (
        "remix.py", "lam * k3_kl(logp, ref_logp) + (1.0 - lam) * k3_kl(logp, prox_logp)",
        "(1.0 - lam) * k3_kl(logp, ref_logp) + lam * k3_kl(logp, prox_logp)"),
    "lambda(t) fixed at 1": (
        "remix.py", "lam = kl_convex_lambda(step, args.kl_convex_start, args.kl_convex_every)  # Eq. 5",
        "lam = 1.0  # Eq. 5"),
    "reincarnation keeps the base model as reference": (
        "remix.py", "    reference.load_state_dict(policy.state_dict())\n", "    pass\n"),
    "value targets without c_t": (
        "remix.py", "value_targets = torch.where(mask, trace_c * advantages + values, 0.0)",
        "value_targets = torch.where(mask, advantages + values, 0.0)"),
    "biased std in the group advantage": (
        "remix.py", "group.std(unbiased=True)", "group.std(unbiased=False)"),
    "trace starts at t instead of t+1": (
        "remix.py", "adv = delta + gamma * lam * next_c * next_adv  # [N]",
        "adv = delta + gamma * lam * trace_c[:, t] * next_adv  # [N]"),
    "deque keeps batches after reincarnation": (
        "remix.py", "    replay.clear()\n", "    pass\n"),
    "gradients kept through generation": (
        "remix.py", "                optim.zero_grad(set_to_none=True)", "                optim.zero_grad(set_to_none=False)"),
    "the critic's value pass builds a KV cache": (
        "remix.py", 'position_ids=batch["position_ids"], use_cache=False).logits',
        'position_ids=batch["position_ids"], use_cache=None).logits'),
    "unsharded() leaves every module resharding after forward": (
        "machinery/dist.py", "            state._auto_reshard_after_forward = auto\n",
        "            state._auto_reshard_after_forward = auto\n            m.set_reshard_after_forward(True)\n"),
    "the output layer cast in every chunk": (
        "machinery/models.py", "torch.cat([per_token_fn(hidden[i : i + chunk].to(dtype) @ cast.T,",
        "torch.cat([per_token_fn(hidden[i : i + chunk].to(dtype) @ weight.to(dtype).T,"),
    "the output layer's gradient summed in its own dtype": (
        "machinery/models.py", "grad_weight = torch.zeros(cast.shape, dtype=torch.float32, device=cast.device)",
        "grad_weight = torch.zeros(cast.shape, dtype=cast.dtype, device=cast.device)"),
    "a no-grad pass leaves the root unsharded": (
        "machinery/models.py", "    dist.reshard(model)\n", "\n"),
    "non-finite updates stepped anyway": (
        "machinery/models.py", "        return False\n    _guard[\"in_a_row\"] = 0", "        return True\n    _guard[\"in_a_row\"] = 0"),
    # the engine's sleep contract: caught only by the sleep-mode stand-in's tests (slow: they start vLLM)
    "an evaluation leaves the engine asleep and the next sample wakes only the KV cache": (
        "machinery/engines.py", '    if llm.llm_engine.is_sleeping():  # vLLM would never schedule the requests, and loop at full CPU\n        console.fail("the vLLM engine is asleep where it must generate (a sleep with no push_weights after it); "\n                     "this is a bug in remix\'s sleep sequence: run with --no-vllm-sleep meanwhile")\n    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=0, seed=seed,\n                             logprobs=0 if logprobs else None, max_tokens=max_tokens) for seed in seeds]\n    with serving_threads():\n        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=use_tqdm)\n',
        '    if llm.llm_engine.is_sleeping():\n        llm.wake_up(tags=["kv_cache"])\n    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=0, seed=seed,\n                             logprobs=0 if logprobs else None, max_tokens=max_tokens) for seed in seeds]\n    with serving_threads():\n        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=use_tqdm)\n    if not logprobs:  # an evaluation\n        sleep(llm)\n', SLEEP_TESTS),
    "the push leaves the KV cache asleep": (
        "machinery/engines.py", '        llm.wake_up(tags=["kv_cache"])  # the last tag: vLLM resumes its scheduler\n',
        "        pass\n", SLEEP_TESTS),
    "overlap: the batch drawn ahead tagged with the step it is for (version off by one)": (
        "remix.py", "sampler.draw(step + 1, session.next_prompts(fresh_count(step + 1, args)), step)",
        "sampler.draw(step + 1, session.next_prompts(fresh_count(step + 1, args)), step + 1)", OVERLAP_TESTS),
    "overlap: mu from the trainer's policy, a step after the one that drew the batch": (
        "remix.py", "        todo = [s for s in fresh if key not in s]\n", "        todo = fresh\n", OVERLAP_TESTS),
    "overlap: the sampler's copy never given the weights that draw": (
        "machinery/engines.py", 'served["group"].broadcast(tensor, 0).wait()',
        'served["group"].broadcast(tensor.clone(), 0).wait()', OVERLAP_TESTS),
    "overlap: the weights' broadcast waited on with the sampler's death unchecked (NCCL waits on)": (
        "machinery/engines.py", "        if not alive():\n", "        if False:\n", BROADCAST_TESTS),
    "overlap: a broadcast that fails raises through the trainer": (
        "machinery/engines.py", "    except RuntimeError:\n        return False\n",
        "    except ZeroDivisionError:\n        return False\n", BROADCAST_TESTS),
    "overlap under torchrun: every rank given the whole batch, not its share": (
        "remix.py", "version, groups = drawn[0], drawn[1][first + offset :]",
        "version, groups = drawn", ("-m", "slow", "tests/test_overlap.py::test_under_torchrun_a_sampler_that_"
                                              "never_runs_ahead_is_the_synchronous_run")),
    "overlap: a tensor-parallel sampler's second process never given the weights": (
        "machinery/engines.py", '    push_tensors(served["llm"], named.items())\n',
        '    push_tensors(served["llm"], named.items()) if dist.rank() == 0 else None\n',
        ("-m", "slow", "tests/test_overlap.py::test_each_fresh_batch_carries_the_version_and_mu_of_the_policy_that_drew_"
                       "it[2]")),
}


def run(work: Path, expression: str, tests: tuple = FAST_TESTS) -> str | None:
    """The first failing test's name, or None."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:logging", "--tb=no", "-rf",
                           "-k", expression, *tests], cwd=work,
                          capture_output=True, text=True,
                          env=dict(os.environ, REMIX_DATA=str(ROOT / "data"), HF_HUB_OFFLINE="1"))
    if done.returncode == 5:  # no test selected
        return None
    failed = re.findall(r"^FAILED (?:tests/)?test_\w+\.py::(\S+)", done.stdout, re.M)
    errors = re.findall(r"^ERROR (?:tests/)?test_\w+\.py::(\S+)", done.stdout, re.M)
    if done.returncode != 0 and not failed and not errors:
        return "(collection error or crash)"
    return (failed or errors or [None])[0]


def main():
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--list" in sys.argv:
        print("\n".join(MUTANTS))
        return
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        sys.exit(f"mutation_check: unknown mutant {unknown}; --list shows them")
    chosen = names or list(MUTANTS)
    print("| mutant | caught by | seconds |\n|---|---|---|", flush=True)
    survivors = []
    for name in chosen:
        path, old, new, *tests = MUTANTS[name]
        with tempfile.TemporaryDirectory(prefix="remix-mutant-") as tmp:
            work = Path(tmp)
            for item in COPY:
                (shutil.copytree if (ROOT / item).is_dir() else shutil.copy)(ROOT / item, work / item)
            text = (work / path).read_text()
            if text.count(old) != 1:
                sys.exit(f"mutation_check: the text of mutant {name!r} occurs {text.count(old)} times in {path}; update it")
            (work / path).write_text(text.replace(old, new))
            start = time.perf_counter()
            caught = run(work, "", tests[0]) if tests else run(work, LOOP_TESTS) or run(work, f"not ({LOOP_TESTS})")
            seconds = time.perf_counter() - start
        print(f"| {name} | {caught or '**survived**'} | {seconds:.0f} |", flush=True)
        if caught is None:
            survivors.append(name)
    print(f"\n{len(chosen) - len(survivors)} of {len(chosen)} mutants caught")
    sys.exit(1 if survivors else 0)


if __name__ == "__main__":
    main()
