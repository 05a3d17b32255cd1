"""The plan: the disk and memory a run will take, before anything is loaded; one line if it cannot fit.

The plan: before anything is loaded or written, what a run will take of the machine it runs on, from the model's
config (built on the meta device: no weight read, no code run), the flags and the machine. The disk its checkpoints
(at the peak of a save) and evaluations take, against the free space of each file system they go to; each rank's
memory (GPU, or the host on a CPU), against what the device has free; the host's share (offloaded optimizer state,
the whole model a save gathers), against what it has available. A run that
cannot fit stops in one line naming the flags that make it fit; a close one is warned about. A reader of the method
may skip this module. The arithmetic is docs/memory.md's; `python benchmarks/plan_figures.py CONFIG ...` prints it for a
model's config and any flags (and, without arguments, makes the docs' tables with it)."""

import dataclasses
import glob
import json
import os
import shutil

import torch

from machinery import dist, engines
from machinery.console import fail, say

GB = 1e9
CLOSE = 0.9  # a need above 90% of what is there is warned about
PROCESS_HOST = 2.0e9  # one rank's process before its models: Python, torch, vLLM, grader workers (2.1 GB measured)
CUDA_RUNTIME = 1.5e9  # per GPU: the CUDA context, NCCL's buffers, a sleeping engine's runtime allocations
OUTPUT_BLOCKS = 5  # [chunk, vocab] fp32 blocks alive at once in the output layer's backward (measured: docs/memory.md)
EVAL_RECORD = 1e3  # bytes of an evaluation record besides its response text (an allowance: ids, answers, grades)
EVAL_TOKEN_BYTES = 8  # bytes of JSON text per response token (an allowance: about 4 characters, escapes doubled)
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
    cache_layers: int = 0  # layers of transformers' DynamicCache for this config (--sampler hf's KV cache)
    windowed_layers: int = 0  # of them, sliding-window (or chunked) layers: they keep at most `window` positions
    window: int = 0


def shape_of(source: str) -> Shape:
    """A model folder, hub id or config.json file, built on the meta device; raises ValueError when unreadable."""
    from machinery import models, safeload

    config, policy = safeload.meta_model(source)  # never code from the folder
    critic = safeload.meta_model(source, critic=True)[1]
    text = config.get_text_config()
    params = list(policy.parameters())
    heads = text.num_attention_heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
    layer = sum(p.numel() for p in policy.base_model.layers[0].parameters())
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config).layers  # transformers' own layout for this config; no tensor yet
    except (KeyError, ValueError, TypeError, AttributeError):  # a layout it cannot build here: every layer whole
        cache = [None] * text.num_hidden_layers
    windows = [layer.sliding_window for layer in cache if getattr(layer, "is_sliding", False)]
    return Shape(sum(p.numel() for p in params), sum(p.numel() for p in critic.parameters()), len(params),
                 text.hidden_size, text.num_hidden_layers, text.intermediate_size, text.vocab_size,
                 getattr(text, "num_key_value_heads", heads) * head_size, layer,
                 sum(p.numel() for p in params) - layer * text.num_hidden_layers, side_files(source),
                 models.weights_dtype(config).itemsize, cache_layers=len(cache), windowed_layers=len(windows),
                 window=max(windows, default=0))


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
    """One micro-batch's activations in the policy's backward: what its forward kept (retained_activations), one
    layer recomputed when checkpointed, and the gradient flowing back through one layer (2b(H + I))."""
    recomputed = layer_activation(shape, b, width) if checkpointing else 0
    per_token = recomputed + 2 * b * (shape.hidden + shape.intermediate)
    return retained_activations(shape, tokens, width, b, checkpointing) + tokens * per_token


def retained_activations(shape: Shape, tokens: int, width: int, b: int, checkpointing: bool) -> float:
    """What a forward of one micro-batch keeps for its backward: every layer's activations (checkpointed: each
    layer's input), the embeddings and final norm ((4 + 1.5b)H) and the boolean mask (width bytes). The critic's
    forward keeps as much through the policy's backward under PPO: the method's objective takes both models'
    outputs of a micro-batch before either backward runs."""
    per_layer = b * shape.hidden if checkpointing else layer_activation(shape, b, width)
    return tokens * (shape.layers * per_layer + (4 + 1.5 * b) * shape.hidden + width)


def output_layer(shape: Shape, tokens: int, b: int) -> float:
    """The chunked output layer (models.chunked_logprobs): OUTPUT_BLOCKS [chunk, vocab] fp32 blocks, the response's
    hidden states and their gradient, and the head's gradient accumulated in fp32."""
    from machinery.models import LOGPROB_CHUNK

    return OUTPUT_BLOCKS * min(LOGPROB_CHUNK, tokens) * shape.vocab * 4 + 2 * tokens * shape.hidden * b \
        + 4 * shape.vocab * shape.hidden


@dataclasses.dataclass
class Lengths:
    """What the run's data says of its lengths, where the run knows it; None: the flags' bounds."""
    prompt: int | None = None  # the longest training prompt the run can draw (--max-prompt-tokens at most)
    eval_prompt: int | None = None  # the longest evaluation prompt
    eval_problems: int | None = None  # problems of one evaluation (None: as many as a generation batch holds)


def micro_batch(args, world: int, prompt: int) -> tuple[int, int]:
    """(tokens, width): the most padded tokens one update micro-batch holds, and its widest row. dist.micro_batches
    fills one up to --max-tokens-per-micro-batch (a longer sample runs alone) from this rank's rows of one
    mini-batch: at most --mini-batch-prompts x G of them (a rank may hold a whole one), and at most its share of the
    step's batch. E.g. 4 prompts x 4 responses, rows 80 tokens wide: 1,280 tokens, whatever the flag says."""
    width = prompt + args.max_response_tokens
    rows = min(args.mini_batch_prompts, -(-args.prompts_per_step // world)) * args.group_size
    return max(width, min(args.max_tokens_per_micro_batch, rows * width)), width


def memory(shape: Shape, args, world: int, offload: bool, gpu: bool, device_bytes: float,
           lengths: Lengths | None = None) -> dict:
    """Each rank's bytes by part, and the two peaks: the update (states, gradients, and the larger of the backward's
    transients and the optimizer step's; the engine asleep) and generation (states, the engine's share or the
    gathered policy, transformers' KV cache). FSDP2 shards every state over the ranks. device_bytes: the GPU's total
    memory (vLLM's share is of it)."""
    from machinery import engines

    lengths = lengths or Lengths()
    b = dtype_bytes(args.precision)
    ppo = args.algo == "ppo"
    trained = shape.params + (shape.critic_params if ppo else 0)
    checkpointing = gpu if args.gradient_checkpointing is None else args.gradient_checkpointing
    tokens, width = micro_batch(args, world, lengths.prompt or args.max_prompt_tokens)
    parts = {"weights (fp32 masters)": 4 * trained / world, "gradients (fp32)": 4 * trained / world,
             "AdamW moments (fp32)": 8 * trained / world,
             "reference": b * shape.params / world if args.kl_beta != 0 else 0.0,
             "gathered weights": 2 * b * (shape.root_params + 2 * shape.layer_params),
             "activations": activations(shape, tokens, width, b, checkpointing),
             "critic activations": retained_activations(shape, tokens, width, b, checkpointing) if ppo else 0.0,
             "output layer": output_layer(shape, tokens, b),
             # FSDP2's CPU offload: the largest group's (the root's: embeddings, head) shards in fp32 on their way to
             # the GPU, cast there (an upper bound: they go one tensor at a time), and its fp32 gradient shards on
             # their way back to the host
             "offload copies (fp32)": 8 * max(shape.root_params, shape.layer_params) / world if gpu and offload
             else 0.0,
             # AdamW's foreach step (torch's on a GPU, models.optimizer's with --offload): one fp32 tensor over a
             # model's shards, the second moment's square root (a CPU's per-tensor step holds one tensor's: less)
             "optimizer step (fp32)": 4 * max(shape.params, shape.critic_params if ppo else 0) / world}
    host = {k: parts[k] for k in ("weights (fp32 masters)", "gradients (fp32)", "AdamW moments (fp32)",
                                  "optimizer step (fp32)")} if offload else {}
    for key in host:
        parts[key] = 0.0
    vllm = args.sampler == "vllm"
    if gpu and vllm:  # the engine's share of the card, its KV cache within it
        parts["engine"] = args.vllm_gpu_memory_utilization * device_bytes
    elif vllm:  # the CPU engine keeps its own copy of the weights and a KV cache of VLLM_CPU_KVCACHE_SPACE GiB
        parts["engine"] = b * shape.params + engines.cpu_kv_cache_gib() * 2**30
    else:  # transformers' sampler is the policy, gathered whole while it generates, and its KV cache
        parts["engine"] = b * shape.params
    parts["generation cache"] = engines.sampler_cache(shape, args, world, b, lengths)
    parts["runtime"] = CUDA_RUNTIME if gpu else PROCESS_HOST
    resident = parts["weights (fp32 masters)"] + parts["AdamW moments (fp32)"] + parts["reference"] + parts["runtime"]
    awake = vllm and not (gpu and args.vllm_sleep)  # transformers' sampler gathers the policy only to generate
    backward = parts["gathered weights"] + parts["activations"] + parts["critic activations"] + parts["output layer"] \
        + parts["offload copies (fp32)"]
    update = resident + parts["gradients (fp32)"] + max(backward, parts["optimizer step (fp32)"]) \
        + (parts["engine"] if awake else 0.0)
    generation = resident + parts["engine"] + parts["generation cache"]
    return {"parts": parts, "peak": max(update, generation), "update": update, "generation": generation,
            "checkpointing": checkpointing, "tokens": tokens, "width": width, "host_parts": host}


def host(shape: Shape, args, world: int, local: int, offload: bool) -> float:
    """One node's host memory on a GPU machine: each of its ranks' process and offloaded state (with the foreach
    AdamW step's fp32 intermediate there), and a save's whole fp32 model on rank 0; at load, each rank holds its
    model whole in fp32 before sharding it."""
    trained = shape.params + (shape.critic_params if args.algo == "ppo" else 0)
    step = 4 * max(shape.params, shape.critic_params if args.algo == "ppo" else 0)
    steady = local * (PROCESS_HOST + ((16 * trained + step) / world if offload else 0)) \
        + 4 * max(shape.params, shape.critic_params)
    return max(steady, local * (PROCESS_HOST + 4 * shape.params))


# ----------------------------------------------------------------------------------------------
# The machine, and the verdict
# ----------------------------------------------------------------------------------------------
def nearest(path: str) -> str:
    """The nearest existing folder of a path the run will create (or the path itself)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> int:
    """Free bytes of the file system a path is (or will be) on."""
    return shutil.disk_usage(nearest(path)).free


def file_system(path: str) -> int:
    """Which file system a path is (or will be) on."""
    return os.stat(nearest(path)).st_dev


def host_available(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> float:
    """What a new process can take without swapping: MemAvailable of /proc/meminfo, and no more than a cgroup v2
    memory limit (a container's) leaves (memory.max less memory.current); inf where neither is known."""
    available = float("inf")
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f)
        available = float(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    try:
        with open(os.path.join(cgroup, "memory.max")) as limit, open(os.path.join(cgroup, "memory.current")) as used:
            ceiling, current = limit.read().strip(), used.read().strip()
        if ceiling != "max":
            available = min(available, float(int(ceiling) - int(current)))
    except (OSError, ValueError):
        pass
    return available


def existing_checkpoints(out: str) -> float:
    """Bytes already on disk in --out's checkpoints (a resume's): free space already excludes them."""
    total = 0
    for root, _, files in os.walk(out):
        if os.path.relpath(root, out).split(os.sep)[0].startswith("checkpoint-"):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files if os.path.isfile(os.path.join(root, f)))
    return float(total)


def device_memory() -> tuple[float, float] | None:
    """This rank's GPU, (free bytes, total bytes) by torch.cuda.mem_get_info: what other processes hold is not
    free. None on a machine without one (the host is the device then)."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(dist.device())
    return float(free), float(total)


def readings(args) -> dict:
    """The machine, each reading taken once: every file system the run writes to (checkpoints, logs and the plan in
    --out; evaluations in OUT/eval, which a resumed run may have on another) with its free bytes and what goes there,
    and the host's available memory, as rank 0 reads them; every rank's GPU, the least free of them."""
    places = {"checkpoints": args.out, "evaluations": os.path.join(args.out, "eval")}
    systems = {}
    for what, path in places.items():
        systems.setdefault(file_system(path), []).append(what)
    disks = [("disk" if "checkpoints" in whats else f"disk of {places[whats[0]]}", free_bytes(places[whats[0]]), whats)
             for whats in systems.values()]
    disks, available = dist.broadcast((disks, host_available()))
    gpus = [g for g in dist.all_gather(device_memory()) if g is not None]
    return {"disks": disks, "host": available,
            "device": (min(f for f, _ in gpus), min(t for _, t in gpus)) if gpus else None}


def evaluation_bytes(args, lengths: Lengths) -> float:
    """The evaluation files of a run (OUT/eval/step-N.jsonl: at step 0, every --eval-every steps and at the end),
    one record per problem with its response (0 where the number of problems is not known)."""
    if not args.eval_every or not lengths.eval_problems:
        return 0.0
    count = len({0, args.steps, *range(args.eval_every, args.steps + 1, args.eval_every)})
    tokens = args.eval_max_tokens or args.max_response_tokens
    return count * lengths.eval_problems * (EVAL_RECORD + EVAL_TOKEN_BYTES * tokens)


def figures(shape: Shape, args, world: int, gpu: bool, device_bytes: float, offload: bool,
            lengths: Lengths | None = None, local: int | None = None) -> dict:
    """The plan's figures: disk, memory per rank, the node's host memory. device_bytes: the GPU's total; local:
    the processes on this node (dist.local_world() where not given)."""
    lengths = lengths or Lengths()
    local = dist.local_world() if local is None else local
    m = memory(shape, args, world, offload, gpu, device_bytes, lengths)
    return {"disk": disk(shape, args, world), "evaluations": evaluation_bytes(args, lengths), "memory": m,
            "host": host(shape, args, world, local, offload) if gpu else local * m["peak"], "local": local}


def verdicts(plan: dict, machine: dict) -> list:
    """(what, needed, there) for each resource the run needs: each file system it writes to (a resume's checkpoints
    on disk count toward the peak, and the new checkpoint is written whole whatever is there), the GPU's free memory,
    the host's available memory."""
    needs = {"checkpoints": max(plan["disk"]["peak"] - machine.get("existing", 0.0), plan["disk"]["full"]),
             "evaluations": plan["evaluations"]}
    rows = [(label, sum(needs[what] for what in whats), free) for label, free, whats in machine["disks"]]
    if machine["device"] is not None:
        rows.append(("GPU memory per rank", plan["memory"]["peak"], machine["device"][0]))
    return rows + [("host memory", plan["host"], machine["host"])]


def judged(shape: Shape, args, world: int, local: int, offload: bool, machine: dict, lengths: Lengths):
    """(figures, verdicts) of a run on this machine."""
    gpu = machine["device"] is not None
    plan = figures(shape, args, world, gpu, machine["device"][1] if gpu else 0.0, offload, lengths, local)
    return plan, verdicts(plan, machine)


def check(args, source: str, prog: str = "remix", lengths: Lengths | None = None, measure_prompt=None) -> dict | None:
    """The plan for this run, printed as a short table; one line and exit 2 where it cannot fit (nothing written),
    a warning where it is close. Every rank judges by the same readings. lengths: what the run knows of its data;
    measure_prompt() -> the longest training prompt, asked for only where the flags' bound is short or close. None,
    saying so, where the model's config cannot be read here (loading it will say why)."""
    from machinery import advice

    try:
        shape = shape_of(source)
    except ValueError as error:
        say(f"plan: skipped, the config of {source} cannot be read here ({error})", prog)
        return None
    world, local, offload = dist.world(), dist.local_world(prog), getattr(args, "offload", False)
    machine = {**readings(args), "existing": existing_checkpoints(args.out) if args.resume else 0.0}
    lengths = lengths or Lengths()
    plan, rows = judged(shape, args, world, local, offload, machine, lengths)
    if measure_prompt is not None and any(need > CLOSE * there for what, need, there in rows if what[:4] != "disk"):
        lengths = dataclasses.replace(lengths, prompt=measure_prompt())  # the data's longest, not the flag's
        plan, rows = judged(shape, args, world, local, offload, machine, lengths)
    plan.update(shape=dataclasses.asdict(shape), world=world, machine=machine, lengths=dataclasses.asdict(lengths),
                free=machine["disks"][0][1], existing=machine["existing"], host_available=machine["host"],
                device_bytes=machine["device"] and machine["device"][1], offload=offload, rows=[list(r) for r in rows])
    for line in table(plan, args):
        say(f"plan: {line}", prog)
    short = [(what, need, there) for what, need, there in rows if need > there]
    if short:
        what, need, there = short[0]

        def fits(step: dict) -> bool:  # the run with an advice's flags: every resource fits
            ranks = step.get("ranks", world)
            changed = dataclasses.replace(args, **step.get("changes", {}))
            return all(n <= t for _, n, t in judged(shape, changed, ranks, ranks if ranks != world else local,
                                                    step.get("offload", offload), machine, lengths)[1])

        fail(f"the run does not fit: {what} {size(need)} needed, {size(there)} there ({size(need - there)} short); "
             f"{advice.remedies(args, plan, what, fits, world, local)}", prog)
    for what, need, there in rows:
        if need > CLOSE * there:
            say(f"warning: {what} is close: {size(need)} of {size(there)} ({need / there:.0%}); the run goes on", prog)
    return plan


def size(n: float) -> str:
    return f"{n / GB:.1f} GB" if abs(n) >= GB else f"{n / 1e6:.1f} MB"


def table(plan: dict, args) -> list[str]:
    """The lines printed at start: the checkpoints, the memory by part, each need against what is there."""
    d, m = plan["disk"], plan["memory"]
    lines = [f"checkpoints: {size(d['full'])} full, {size(d['model_folder'])} as a model folder; {d['saves']} saves, "
             f"--keep-last {args.keep_last}: {size(d['peak'])} at the peak of a save"
             + (f"; evaluation files {size(plan['evaluations'])}" if plan["evaluations"] else "")]
    parts = ", ".join(f"{k} {size(v)}" for k, v in m["parts"].items() if v)
    ranks = f"{plan['world']} rank{'s' if plan['world'] > 1 else ''}{', --offload' if plan['offload'] else ''}"
    lines.append(f"memory per {'GPU' if plan['device_bytes'] else 'process'} ({ranks}, {m['tokens']} tokens a "
                 f"micro-batch, checkpointing {'on' if m['checkpointing'] else 'off'}): {parts}; "
                 f"update {size(m['update'])}, generation {size(m['generation'])}")
    total = f" (free, of the card's {size(plan['device_bytes'])})" if plan["device_bytes"] else ""
    lines += [f"{what}: {size(need)} needed, {size(there)} there" + (total if what.startswith("GPU") else "")
              for what, need, there in plan["rows"]]
    return lines


def write(plan: dict | None, out: str):
    """OUT/plan.json, by rank 0, after the lock (rewritten whole: a resume's plan replaces the last)."""
    if plan is not None and dist.rank() == 0:
        from machinery import runfolder

        safe = json.loads(json.dumps(plan, default=float).replace("Infinity", "null"))
        runfolder.replace_file(os.path.join(out, "plan.json"), [json.dumps(safe, indent=1) + "\n"])
