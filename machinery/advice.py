"""The advice a plan that does not fit prints: the flags under which the run fits on this machine.

The advice of a plan that does not fit: the flags under which the run fits, each judged by the plan's own
arithmetic on this machine (machinery.plan hands over a judge of the changed run), so that the run started again
with them is accepted. Run-level settings come first, each alone, then together; a method setting is said to be one.
A resumed run keeps its saved flags, so it gets no flag. A reader of the method may skip this module."""

import importlib.util


def remedies(args, plan: dict, what: str, fits, world: int, local: int) -> str:
    """What to say after 'the run does not fit: WHAT ...'. fits(step) -> whether every resource fits the run with a
    step's flags: {"text": ..., "changes": {field: value}, "ranks": processes, "offload": bool}."""
    disk = what.startswith("disk")
    if args.resume:
        return "a resumed run keeps its saved flags: " + ("free space" if disk else "a larger device")
    run_level = disk_options(args, plan) if disk else memory_options(args, plan, world, local)
    alone = [next((step["text"] for step in steps if fits(step)), None) for steps in run_level + method_options(args)]
    alone = [text for text in alone if text]
    if alone:
        return "it fits with " + ", or ".join(alone)
    together = joint(run_level, fits)
    if together:
        return "no single flag makes it fit; these together do: " + " ".join(step["text"] for step in together)
    return "no flag makes it fit here: " + ("free space or another --out" if disk else "a larger device")


def step(text: str, ranks: int | None = None, offload: bool | None = None, **changes) -> dict:
    return {"text": text, "changes": changes, **({"ranks": ranks} if ranks else {}),
            **({"offload": offload} if offload is not None else {})}


def halvings(n: int) -> list[int]:
    """n // 2, n // 4, ..., 1."""
    return [n >> k for k in range(1, n.bit_length())]


def disk_options(args, plan: dict) -> list[list[dict]]:
    """Each run-level way to write less, its steps from the mildest: fewer kept checkpoints, fewer saves (where every
    save's model folder is kept), fewer evaluations (where they are counted)."""
    options = [[step(f"--keep-last {k}", keep_last=k) for k in (3, 2, 1) if k < (args.keep_last or 10**9)]]
    if args.keep_last == 0 and args.save_every and 4 * args.save_every <= 10**6:
        options.append([step(f"--save-every {4 * args.save_every}", save_every=4 * args.save_every)])
    if args.eval_every and plan["evaluations"]:
        options.append([step(f"--eval-every {4 * args.eval_every}", eval_every=4 * args.eval_every)]
                       * (4 * args.eval_every <= 10**6) + [step("--eval-every 0", eval_every=0)])
    return [steps for steps in options if steps]


def memory_options(args, plan: dict, world: int, local: int) -> list[list[dict]]:
    """Each run-level way to need less memory per rank, its steps from the mildest: for transformers' sampler, vLLM
    (where it is installed) or fewer prompts per generate call; --offload; more processes on this node, where the
    step's prompts split over them; smaller micro-batches; activation checkpointing; a smaller vLLM share."""
    import torch

    from machinery import engines

    memory, gpu = plan["memory"], plan["device_bytes"] is not None
    options = []
    if args.sampler == "hf":
        if importlib.util.find_spec("vllm") is not None:
            options.append([step("--sampler vllm", sampler="vllm")])
        options.append([step(f"--hf-batch-prompts {k}", hf_batch_prompts=k) for k in halvings(engines.hf_batch(args))])
    if gpu and not getattr(args, "offload", False):
        options.append([step("--offload", offload=True)])
    if world == local:  # one node: more processes on it (a GPU each)
        most = torch.cuda.device_count() if gpu else 8
        options.append([step(f"torchrun --nproc-per-node {n}", ranks=n) for n in (2, 4, 8)
                        if world < n <= most and splits(args, n)])
    tokens, width = memory["tokens"], memory["width"]
    options.append([step(f"--max-tokens-per-micro-batch {t}", max_tokens_per_micro_batch=t)
                    for t in [t for t in halvings(tokens) if t > width] + ([width] if width < tokens else [])])
    if not memory["checkpointing"]:
        options.append([step("--gradient-checkpointing", gradient_checkpointing=True)])
    if gpu and args.sampler == "vllm":  # the engine's share bounds generation's peak (docs/memory.md: its KV cache)
        share = round(args.vllm_gpu_memory_utilization * 0.6, 2)
        if share > 0:
            options.append([step(f"--vllm-gpu-memory-utilization {share}", vllm_gpu_memory_utilization=share)])
    return [steps for steps in options if steps]


def method_options(args) -> list[list[dict]]:
    """Settings that change the method, named as such: GRPO has no critic (from a PPO run whose groups GRPO takes)."""
    if args.algo == "ppo" and args.group_size >= 2:
        return [[step("--algo grpo (a method setting: GRPO has no critic)", algo="grpo")]]
    return []


def splits(args, ranks: int) -> bool:
    """Whether a step's fresh and historical prompts split into whole groups over `ranks` processes, and its vLLM
    engines over them (flags.check_args refuses a run where they do not)."""
    fresh = round((1.0 - args.off_policy_p) * args.prompts_per_step)
    return all(n % ranks == 0 for n in (fresh, args.prompts_per_step - fresh, args.prompts_per_step)) \
        and ranks % args.vllm_tp == 0


def joint(options: list[list[dict]], fits) -> list[dict]:
    """The strongest step of each run-level option, added in order until the run fits, then only those it still
    needs; [] where all of them together do not make it fit."""
    chosen, merged = [], {}
    for steps in options:
        chosen.append(steps[-1])
        merged = merge(chosen)
        if fits(merged):
            break
    else:
        return []
    for kept in list(chosen):
        fewer = [s for s in chosen if s is not kept]
        if fewer and fits(merge(fewer)):
            chosen = fewer
    return chosen


def merge(steps: list[dict]) -> dict:
    """One step of several: their flags, the most processes, offload if any offloads."""
    merged = {"text": " ".join(s["text"] for s in steps), "changes": {}}
    for s in steps:
        merged["changes"].update(s["changes"])
        if "ranks" in s:
            merged["ranks"] = max(merged.get("ranks", 0), s["ranks"])
        if s.get("offload"):
            merged["offload"] = True
    return merged
