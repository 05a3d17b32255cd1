"""The plan: before anything is loaded or written, what a run will take of the machine it runs on, from the model's
config (built on the meta device: no weight read, no code run), the flags and the machine. The disk its checkpoints
take at the peak of a save, against the free space of --out's file system; each rank's memory (GPU, or the host on a
CPU), against the device; the host's share (offloaded optimizer state, the whole model a save gathers). A run that
cannot fit stops in one line naming the flags that make it fit; a close one is warned about. A reader of the method
may skip this module. The arithmetic is docs/memory.md's; `python benchmarks/plan_figures.py CONFIG ...` prints it for a
model's config and any flags (and, without arguments, makes the docs' tables with it)."""

import dataclasses
import glob
import json
import os
import shutil

import torch

from machinery import dist
from machinery.messages import fail, say

GB = 1e9
CLOSE = 0.9  # a need above 90% of what is there is warned about
PROCESS_HOST = 2.0e9  # one rank's process before its models: Python, torch, vLLM, grader workers (2.1 GB measured)
CUDA_RUNTIME = 1.5e9  # per GPU: the CUDA context, NCCL's buffers, a sleeping engine's runtime allocations
OUTPUT_BLOCKS = 5  # [chunk, vocab] fp32 blocks alive at once in the output layer's backward (measured: docs/memory.md)
SIDE_FILES = 20e6  # a model folder's config and tokenizer files, where the source's cannot be measured
STATE_FIXED = 64e3  # trainer_state.pt beside its deque: arguments, counters, RNG states
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".index.json")


@dataclasses.dataclass
class Shape:
    """What the arithmetic needs of a model, read off its config and its meta-device build."""
    params: int  # the causal LM's parameters (tied weights once)
    critic_params: int  # the same trunk with a one-output token-classification head (PPO's critic)
    tensors: int  # the causal LM's parameter tensors (each is a safetensors entry and an optimizer state)
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    kv: int  # key/value width: KV heads x head size
    layer_params: int  # one decoder layer's
    root_params: int  # what FSDP2 keeps whole at the root: embeddings, output layer, final norm
    side_bytes: float  # the config and tokenizer files of a model folder
    kept_weight_bytes: int = 4  # a weight's bytes in an older checkpoint's model folder: the base model's dtype


def shape_of(source: str) -> Shape:
    """A model folder, hub id or config.json file, built on the meta device; raises ValueError when unreadable."""
    from machinery import safeload, weightcast

    config, policy = safeload.meta_model(source)  # never code from the folder
    critic = safeload.meta_model(source, critic=True)[1]
    text = config.get_text_config()
    params = list(policy.parameters())
    heads = text.num_attention_heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
    layer = sum(p.numel() for p in policy.base_model.layers[0].parameters())
    return Shape(sum(p.numel() for p in params), sum(p.numel() for p in critic.parameters()), len(params),
                 text.hidden_size, text.num_hidden_layers, text.intermediate_size, text.vocab_size,
                 getattr(text, "num_key_value_heads", heads) * head_size, layer,
                 sum(p.numel() for p in params) - layer * text.num_hidden_layers, side_files(source),
                 weightcast.weights_dtype(config).itemsize)


def side_files(source: str) -> float:
    """The bytes of a local model folder's files other than weights (config, tokenizer, chat template)."""
    if not os.path.isdir(source):
        return SIDE_FILES
    return float(sum(os.path.getsize(p) for p in glob.glob(os.path.join(source, "*"))
                     if os.path.isfile(p) and not p.endswith(WEIGHT_SUFFIXES)))


def dtype_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


# ----------------------------------------------------------------------------------------------
# Disk: a full checkpoint, a model folder, the peak of a save
# ----------------------------------------------------------------------------------------------
def saves(args) -> int:
    """How many checkpoints the run writes: every --save-every steps and at the end."""
    every = [s for s in range(1, args.steps + 1) if args.save_every and s % args.save_every == 0]
    return len(set(every) | {args.steps})


def replay_bytes(args, world: int) -> float:
    """One rank's replay deque in trainer_state.pt, at its fullest and longest: N batches of that rank's fresh
    samples, each with its token ids (pickled, up to 5 bytes each) and per-token fp32 vectors."""
    if args.off_policy_p == 0:
        return 0.0
    fresh = round((1 - args.off_policy_p) * args.prompts_per_step) * args.group_size / world
    vectors = 1 + (args.kl_beta != 0) + (args.sampler == "vllm") + (args.sampler_is_cap is not None)
    sample = args.max_response_tokens * (4 * vectors + 5) + args.max_prompt_tokens * 5 + 300 * vectors + 400
    return args.window * fresh * sample


def disk(shape: Shape, args, world: int) -> dict:
    """Bytes of a full checkpoint (the policy's folder in fp32, critic/, reference/ once reincarnated,
    optim/rank-R.pt, trainer_state.pt), of a model folder (an older checkpoint reduced, its weights in the base
    model's dtype) and of the peak during a save: the new checkpoint beside the newest full one and the
    --keep-last - 1 model folders (all the run's with --keep-last 0)."""
    policy = 4 * shape.params + 100 * shape.tensors + shape.side_bytes
    folder = shape.kept_weight_bytes * shape.params + 100 * shape.tensors + shape.side_bytes
    critic = 4 * shape.critic_params + 100 * shape.tensors + 4e3 if args.algo == "ppo" else 0
    reincarnated = args.reincarnation and args.kl_beta != 0 and args.steps >= args.reincarnate_step
    reference = dtype_bytes(args.precision) * shape.params + 100 * shape.tensors + 4e3 if reincarnated else 0
    trained = shape.params + (shape.critic_params if args.algo == "ppo" else 0)
    optim = 8 * trained + 600 * shape.tensors * (2 if args.algo == "ppo" else 1) * world
    state = world * (replay_bytes(args, world) + STATE_FIXED)
    full = policy + critic + reference + optim + state
    n = saves(args)
    folders = min(args.keep_last - 1, n - 1) if args.keep_last else n - 1
    return {"policy": policy, "model_folder": folder, "critic": critic, "reference": reference, "optimizer": optim,
            "trainer_state": state, "full": full, "saves": n, "kept_folders": folders,
            "peak": 2 * full + folders * folder if n > 1 else full}


# ----------------------------------------------------------------------------------------------
# Memory: each rank's, in the update (the peak) and while the engine generates
# ----------------------------------------------------------------------------------------------
def layer_activation(shape: Shape, b: int, width: int) -> float:
    """Bytes autograd keeps per token for one Qwen2-style decoder layer computing in b-byte floats, on padded rows
    `width` tokens wide (an attention mask, so the KV heads are repeated to all heads): each RMSNorm's fp32 input and
    its output (8H + 2bH), q, k, v, the attention's output and o_proj's input (6bH), the MLP's gate, SiLU, up and
    product (4bI), the mask as an additive bias of the row's width (b x width), 24 bytes of rotary tables. Counted
    with saved-tensor hooks on layers of three shapes in fp32 and bf16 (docs/memory.md); exact there."""
    return 8 * shape.hidden + 8 * b * shape.hidden + 4 * b * shape.intermediate + b * width + 24


def activations(shape: Shape, tokens: int, width: int, b: int, checkpointing: bool) -> float:
    """One micro-batch's activations in the policy's backward: every layer's (checkpointed: each layer's input, and
    one layer recomputed), the embeddings and final norm ((4 + 1.5b)H), the boolean mask (width bytes), and the
    gradient flowing back through one layer (2b(H + I))."""
    layer = layer_activation(shape, b, width)
    per_token = shape.layers * b * shape.hidden + layer if checkpointing else shape.layers * layer
    per_token += (4 + 1.5 * b) * shape.hidden + width + 2 * b * (shape.hidden + shape.intermediate)
    return tokens * per_token


def output_layer(shape: Shape, tokens: int, b: int) -> float:
    """The chunked output layer (models.chunked_logprobs): OUTPUT_BLOCKS [chunk, vocab] fp32 blocks, the response's
    hidden states and their gradient, and the head's gradient accumulated in fp32."""
    from machinery.models import LOGPROB_CHUNK

    return OUTPUT_BLOCKS * min(LOGPROB_CHUNK, tokens) * shape.vocab * 4 + 2 * tokens * shape.hidden * b \
        + 4 * shape.vocab * shape.hidden


def memory(shape: Shape, args, world: int, offload: bool, gpu: bool, device_bytes: float) -> dict:
    """Each rank's bytes by part, and the two peaks: the update (states, gradients, gathered weights, activations;
    the engine asleep) and generation (states and the engine's share). FSDP2 shards every state over the ranks."""
    b = dtype_bytes(args.precision)
    ppo = args.algo == "ppo"
    trained = shape.params + (shape.critic_params if ppo else 0)
    checkpointing = gpu if args.gradient_checkpointing is None else args.gradient_checkpointing
    longest = args.max_prompt_tokens + args.max_response_tokens  # a longer sample runs alone
    tokens, width = max(args.max_tokens_per_micro_batch, longest), longest  # a micro-batch's tokens; its widest row
    parts = {"weights (fp32 masters)": 4 * trained / world, "gradients (fp32)": 4 * trained / world,
             "AdamW moments (fp32)": 8 * trained / world,
             "reference": b * shape.params / world if args.kl_beta != 0 else 0.0,
             "gathered weights": 2 * b * (shape.root_params + 2 * shape.layer_params),
             "activations": activations(shape, tokens, width, b, checkpointing),
             "output layer": output_layer(shape, tokens, b)}
    host = {k: parts[k] for k in ("weights (fp32 masters)", "gradients (fp32)", "AdamW moments (fp32)")} \
        if offload else {}
    for key in host:
        parts[key] = 0.0
    vllm = args.sampler == "vllm"
    if gpu:
        parts["engine"] = args.vllm_gpu_memory_utilization * device_bytes if vllm else b * shape.params
        parts["runtime"] = CUDA_RUNTIME
    else:  # the CPU engine keeps its own copy of the weights and a KV cache of VLLM_CPU_KVCACHE_SPACE GiB
        space = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1") or 1) * 2**30
        parts["engine"] = b * shape.params + space if vllm else 0.0
        parts["runtime"] = PROCESS_HOST
    resident = parts["weights (fp32 masters)"] + parts["AdamW moments (fp32)"] + parts["reference"] + parts["runtime"]
    asleep = gpu and vllm and args.vllm_sleep
    update = resident + parts["gradients (fp32)"] + parts["gathered weights"] + parts["activations"] \
        + parts["output layer"] + (0 if asleep else parts["engine"])
    generation = resident + parts["engine"]
    return {"parts": parts, "peak": max(update, generation), "update": update, "generation": generation,
            "checkpointing": checkpointing, "tokens": tokens, "host_parts": host}


def host(shape: Shape, args, world: int, local: int, offload: bool) -> float:
    """One node's host memory on a GPU machine: each of its ranks' process and offloaded state, and a save's whole
    fp32 model on rank 0; at load, each rank holds its model whole in fp32 before sharding it."""
    trained = shape.params + (shape.critic_params if args.algo == "ppo" else 0)
    steady = local * (PROCESS_HOST + (16 * trained / world if offload else 0)) + 4 * max(shape.params,
                                                                                      shape.critic_params)
    return max(steady, local * (PROCESS_HOST + 4 * shape.params))


# ----------------------------------------------------------------------------------------------
# The machine, and the verdict
# ----------------------------------------------------------------------------------------------
def free_bytes(path: str) -> int:
    """Free bytes of the file system --out is (or will be) on: that of its nearest existing folder."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def host_available() -> float:
    """MemAvailable of /proc/meminfo: what a new process can take without swapping (inf where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return float(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return float("inf")


def existing_checkpoints(out: str) -> float:
    """Bytes already on disk in --out's checkpoints (a resume's): free space already excludes them."""
    total = 0
    for root, _, files in os.walk(out):
        if os.path.relpath(root, out).split(os.sep)[0].startswith("checkpoint-"):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files if os.path.isfile(os.path.join(root, f)))
    return float(total)


def device_memory() -> float | None:
    """This rank's GPU memory in bytes; None on a machine without one (the host is the device then)."""
    return float(torch.cuda.get_device_properties(dist.device()).total_memory) if torch.cuda.is_available() else None


def figures(shape: Shape, args, world: int, gpu: bool, device_bytes: float, offload: bool) -> dict:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    m = memory(shape, args, world, offload, gpu, device_bytes)
    return {"disk": disk(shape, args, world), "memory": m,
            "host": host(shape, args, world, local, offload) if gpu else local * m["peak"]}


def verdicts(plan: dict, gpu: bool, free: float, existing: float, available: float, device_bytes: float) -> list:
    """(what, needed, there) for each resource the run needs: a resume's checkpoints on disk count toward the peak,
    and the new checkpoint is written whole whatever is there."""
    rows = [("disk", max(plan["disk"]["peak"] - existing, plan["disk"]["full"]), free)]
    if gpu:
        rows.append(("GPU memory per rank", plan["memory"]["peak"], device_bytes))
    return rows + [("host memory", plan["host"], available)]


def check(args, source: str, prog: str = "remix") -> dict | None:
    """The plan for this run, printed as a short table; one line and exit 2 where it cannot fit (nothing written),
    a warning where it is close. Every rank judges by rank 0's readings. None, saying so, where the model's config
    cannot be read here (loading it will say why)."""
    try:
        shape = shape_of(source)
    except ValueError as error:
        say(f"plan: skipped, the config of {source} cannot be read here ({error})", prog)
        return None
    world, device_bytes = dist.world(), device_memory()
    gpu, offload = device_bytes is not None, getattr(args, "offload", False)
    plan = figures(shape, args, world, gpu, device_bytes or 0.0, offload)
    free, available = dist.broadcast((free_bytes(args.out), host_available()))
    existing = existing_checkpoints(args.out) if args.resume else 0.0
    rows = verdicts(plan, gpu, free, existing, available, device_bytes or 0.0)
    plan.update(shape=dataclasses.asdict(shape), world=world, free=free, existing=existing, host_available=available,
                device_bytes=device_bytes, offload=offload, rows=[list(r) for r in rows])
    for line in table(plan, args):
        say(f"plan: {line}", prog)
    short = [(what, need, there) for what, need, there in rows if need > there]
    if short:
        what, need, there = short[0]
        fail(f"the run does not fit: {what} {size(need)} needed, {size(there)} there ({size(need - there)} short); "
             f"{remedies(shape, args, world, gpu, device_bytes or 0.0, what, there)}", prog)
    for what, need, there in rows:
        if need > CLOSE * there:
            say(f"warning: {what} is close: {size(need)} of {size(there)} ({need / there:.0%}); the run goes on", prog)
    return plan


def size(n: float) -> str:
    return f"{n / GB:.1f} GB" if abs(n) >= GB else f"{n / 1e6:.1f} MB"


def remedies(shape: Shape, args, world: int, gpu: bool, device_bytes: float, what: str, there: float) -> str:
    """The flags (each alone) under which the short resource fits, by the same arithmetic."""
    def need(changes: dict, ranks: int = world, offload: bool = getattr(args, "offload", False)) -> float:
        plan = figures(shape, dataclasses.replace(args, **changes), ranks, gpu, device_bytes, offload)
        return {"disk": plan["disk"]["peak"], "host memory": plan["host"]}.get(what, plan["memory"]["peak"])

    options = []
    if what == "disk":
        options += [(f"--keep-last {k}", need({"keep_last": k})) for k in (3, 2, 1) if k < (args.keep_last or 10**9)]
        if args.keep_last == 0 and args.save_every:  # every save's model folder is kept: fewer saves, fewer folders
            options.append((f"--save-every {4 * args.save_every}", need({"save_every": 4 * args.save_every})))
        if args.algo == "ppo":
            options.append(("--algo grpo (no critic)", need({"algo": "grpo"})))
    else:
        if not getattr(args, "offload", False) and gpu:
            options.append(("--offload", need({}, offload=True)))
        if args.algo == "ppo":
            options.append(("--algo grpo (no critic)", need({"algo": "grpo"})))
        options += [(f"torchrun --nproc-per-node {n}", need({}, ranks=n)) for n in (2, 4, 8) if n > world]
        tokens = args.max_tokens_per_micro_batch // 2
        if args.max_prompt_tokens + args.max_response_tokens <= tokens:
            options.append((f"--max-tokens-per-micro-batch {tokens}", need({"max_tokens_per_micro_batch": tokens})))
        if gpu and not args.gradient_checkpointing and args.gradient_checkpointing is not None:
            options.append(("--gradient-checkpointing", need({"gradient_checkpointing": True})))
        if gpu and args.sampler == "vllm":  # the engine's share bounds generation's peak (docs/memory.md: its KV cache)
            share = round(args.vllm_gpu_memory_utilization * 0.6, 2)
            options.append((f"--vllm-gpu-memory-utilization {share}", need({"vllm_gpu_memory_utilization": share})))
    fits = [name for name, needed in options if needed <= there]
    return ("it fits with " + ", or ".join(fits)) if fits else "no single flag makes it fit: " + \
        ("free space or another --out" if what == "disk" else "a larger device, or several of " + ", ".join(
            name for name, _ in options))


def table(plan: dict, args) -> list[str]:
    """The lines printed at start: the checkpoints, the memory by part, each need against what is there."""
    d, m = plan["disk"], plan["memory"]
    lines = [f"checkpoints: {size(d['full'])} full, {size(d['model_folder'])} as a model folder; {d['saves']} saves, "
             f"--keep-last {args.keep_last}: {size(d['peak'])} at the peak of a save"]
    parts = ", ".join(f"{k} {size(v)}" for k, v in m["parts"].items() if v)
    ranks = f"{plan['world']} rank{'s' if plan['world'] > 1 else ''}{', --offload' if plan['offload'] else ''}"
    lines.append(f"memory per {'GPU' if plan['device_bytes'] else 'process'} ({ranks}, {m['tokens']} tokens a "
                 f"micro-batch, checkpointing {'on' if m['checkpointing'] else 'off'}): {parts}; "
                 f"update {size(m['update'])}, generation {size(m['generation'])}")
    lines += [f"{what}: {size(need)} needed, {size(there)} there" for what, need, there in plan["rows"]]
    return lines


def write(plan: dict | None, out: str):
    """OUT/plan.json, by rank 0, after the lock (rewritten whole: a resume's plan replaces the last)."""
    if plan is not None and dist.rank() == 0:
        from machinery import runfolder

        safe = json.loads(json.dumps(plan, default=float).replace("Infinity", "null"))
        runfolder.replace_file(os.path.join(out, "plan.json"), [json.dumps(safe, indent=1) + "\n"])
