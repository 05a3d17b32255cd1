"""The plan before step 1: the disk and memory a run will take, and the flags that make one fit that does not.

From the model's config (built on the meta device), the flags and the machine, by docs/memory.md's arithmetic."""

import contextlib
import dataclasses
import glob
import importlib.util
import json
import os
import shutil

import torch

from machinery import console, dist, engines, models

GB, CLOSE = 1e9, 0.9  # a need above CLOSE (90%) of what is there is warned about
PROCESS_HOST = 0.65e9  # one rank's process before its models: Python, torch, vLLM, the method (0.61 GB measured)
WORKER_HOST = 0.3e9  # each grader worker, a fresh interpreter: torch, the method, math-verify (0.28 GB measured)
CUDA_RUNTIME = 1.5e9  # per GPU: the CUDA context, NCCL's buffers, a sleeping engine's runtime allocations
OUTPUT_BLOCKS = 5  # [chunk, vocab] fp32 blocks alive at once in the output layer's backward (measured: docs/memory.md)
EVAL_RECORD, EVAL_TOKEN_BYTES = 1e3, 8  # allowances: a record's ids, answers, grades; JSON bytes per response token
SIDE_FILES = 20e6  # a model folder's config and tokenizer files, where the source's cannot be measured
STATE_FIXED = 64e3  # trainer_state.pt beside its deque: arguments, counters, RNG states
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".index.json")
DECODE_LOGITS = 4  # fp32 [rows, vocab] blocks of a decode step in transformers 5's _sample: logits, fp32, scores, probs

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
    """A model folder, hub id or config.json file, built on the meta device; raises what transformers raises."""
    from transformers import DynamicCache
    config, policy = models.meta_model(source)
    critic, text, params = models.meta_model(source, True)[1], config.get_text_config(), list(policy.parameters())
    heads, total = text.num_attention_heads, sum(p.numel() for p in params)
    kv = getattr(text, "num_key_value_heads", heads) * (getattr(text, "head_dim", None) or text.hidden_size // heads)
    layer = sum(p.numel() for p in policy.base_model.layers[0].parameters())
    try:
        cache = DynamicCache(config=config).layers  # transformers' own layout for this config; no tensor yet
    except (KeyError, ValueError, TypeError, AttributeError):  # a layout it cannot build here: every layer whole
        cache = [None] * text.num_hidden_layers
    windows = [layer.sliding_window for layer in cache if getattr(layer, "is_sliding", False)]
    side = float(sum(os.path.getsize(p) for p in glob.glob(os.path.join(source, "*"))  # config, tokenizer, template
                     if os.path.isfile(p) and not p.endswith(WEIGHT_SUFFIXES))) if os.path.isdir(source) else SIDE_FILES
    return Shape(total, sum(p.numel() for p in critic.parameters()), len(params), text.hidden_size,
                 text.num_hidden_layers, text.intermediate_size, text.vocab_size, kv, layer,
                 total - layer * text.num_hidden_layers, side, models.weights_dtype(config).itemsize,
                 cache_layers=len(cache), windowed_layers=len(windows), window=max(windows, default=0))

def disk(shape: Shape, args, world: int) -> dict:
    """Bytes of a full checkpoint, an older one's model folder, and a save's peak (beside the newest full one and
    --keep-last - 1 model folders, all of them with --keep-last 0); n: the saves, every --save-every and at the end."""
    ppo = args.algo == "ppo"
    policy = 4 * shape.params + 100 * shape.tensors + shape.side_bytes
    folder = shape.kept_weight_bytes * shape.params + 100 * shape.tensors + shape.side_bytes
    critic = 4 * shape.critic_params + 100 * shape.tensors + 4e3 if ppo else 0
    reincarnated = args.reincarnation and args.kl_beta != 0 and args.steps >= args.reincarnate_step
    reference = (2 if args.precision == "bf16" else 4) * shape.params + 100 * shape.tensors + 4e3 if reincarnated else 0
    optim = 8 * (shape.params + (shape.critic_params if ppo else 0)) + 600 * shape.tensors * (2 if ppo else 1) * world
    # each rank's replay deque in trainer_state.pt at its fullest: N batches of fresh samples, ids and fp32 vectors
    fresh = round((1 - args.off_policy_p) * args.prompts_per_step) * args.group_size / world
    vectors = 1 + (args.kl_beta != 0) + (args.sampler == "vllm") + (args.sampler_is_cap is not None)
    sample = args.max_response_tokens * (4 * vectors + 5) + args.max_prompt_tokens * 5 + 300 * vectors + 400
    state = world * ((args.window * fresh * sample if args.off_policy_p != 0 else 0.0) + STATE_FIXED)
    n = len({s for s in range(1, args.steps + 1) if args.save_every and s % args.save_every == 0} | {args.steps})
    full = policy + critic + reference + optim + state
    folders = min(args.keep_last - 1, n - 1) if args.keep_last else n - 1
    return {"policy": policy, "model_folder": folder, "critic": critic, "reference": reference, "optimizer": optim,
            "trainer_state": state, "full": full, "saves": n, "kept_folders": folders,
            "peak": 2 * full + folders * folder if n > 1 else full}

def layer_activation(shape: Shape, b: int, width: int) -> float:
    """Bytes autograd keeps per token for a Qwen2-style layer on rows `width` wide: RMSNorms (8H + 2bH), q, k, v,
    attention, o_proj (6bH), the MLP (4bI), the mask's bias (b x width), rotary tables (24); see docs/memory.md."""
    return 8 * shape.hidden + 8 * b * shape.hidden + 4 * b * shape.intermediate + b * width + 24

@dataclasses.dataclass
class Lengths:
    """What the run's data says of its lengths, where the run knows it; None: the flags' bounds."""
    prompt: int | None = None  # the longest training prompt the run can draw (--max-prompt-tokens at most)
    eval_prompt: int | None = None  # the longest evaluation prompt
    eval_problems: int | None = None  # problems of one evaluation (None: as many as a generation batch holds)

def micro_batch(args, world: int, prompt: int) -> tuple[int, int]:
    """(tokens, width): the most padded tokens an update micro-batch holds of a mini-batch's rows; its widest row."""
    width = prompt + args.max_response_tokens
    rows = min(args.mini_batch_prompts, -(-args.prompts_per_step // world)) * args.group_size
    return max(width, min(args.max_tokens_per_micro_batch, rows * width)), width

def memory(shape: Shape, args, world: int, offload: bool, gpu: bool, device_bytes: float,
           lengths: Lengths | None = None) -> dict:
    """Each rank's bytes by part, states sharded, and two peaks: the update (states, gradients, the backward's or the
    optimizer step's transients) and generation (states, the engine, the KV cache). device_bytes: the GPU's total."""
    lengths, b, ppo = lengths or Lengths(), 2 if args.precision == "bf16" else 4, args.algo == "ppo"
    trained, vllm = shape.params + (shape.critic_params if ppo else 0), args.sampler == "vllm"
    checkpointing = gpu if args.gradient_checkpointing is None else args.gradient_checkpointing
    tokens, width = micro_batch(args, world, lengths.prompt or args.max_prompt_tokens)
    layer = layer_activation(shape, b, width)
    per_layer = b * shape.hidden if checkpointing else layer  # what a forward keeps of a layer for its backward
    kept = tokens * (shape.layers * per_layer + (4 + 1.5 * b) * shape.hidden + width)  # PPO's critic's as the policy's
    parts = {"weights (fp32 masters)": 4 * trained / world, "gradients (fp32)": 4 * trained / world,
             "AdamW moments (fp32)": 8 * trained / world,
             "reference": b * shape.params / world if args.kl_beta != 0 else 0.0,
             "gathered weights": 2 * b * (shape.root_params + 2 * shape.layer_params),
             # the policy's backward: what its forward kept, a layer recomputed, a layer's gradient
             "activations": kept + tokens * ((layer if checkpointing else 0)
                                             + 2 * b * (shape.hidden + shape.intermediate)),
             "critic activations": kept if ppo else 0.0,
             # OUTPUT_BLOCKS [chunk, vocab] fp32 blocks, the hidden states, their and the head's gradients
             "output layer": OUTPUT_BLOCKS * min(models.LOGPROB_CHUNK, tokens) * shape.vocab * 4
             + 2 * tokens * shape.hidden * b + 4 * shape.vocab * shape.hidden,
             # FSDP2's offload: the largest group's fp32 shards on their way in, its fp32 gradients on their way out
             "offload copies (fp32)": 8 * max(shape.root_params, shape.layer_params) / world if gpu and offload
             else 0.0,
             # AdamW's foreach step: one fp32 tensor over a model's shards, the second moment's square root
             "optimizer step (fp32)": 4 * max(shape.params, shape.critic_params if ppo else 0) / world,
             # vLLM's GPU share (its KV cache in it), or its weights and VLLM_CPU_KVCACHE_SPACE GiB; else the policy
             "engine": args.vllm_gpu_memory_utilization * device_bytes if gpu and vllm
             else b * shape.params + engines.cpu_kv_cache_gib() * 2**30 if vllm else b * shape.params,
             "generation cache": sampler_cache(shape, args, world, b, lengths),
             "runtime": CUDA_RUNTIME if gpu else process_host(args)}
    host = {k: parts[k] for k in ("weights (fp32 masters)", "gradients (fp32)", "AdamW moments (fp32)",
                                  "optimizer step (fp32)")} if offload else {}
    parts.update(dict.fromkeys(host, 0.0))
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
    """A GPU node's host memory: processes, offloaded states, and a save's peak (rank 0's whole fp32 model, then every
    rank's AdamW moments copied off its GPU to be written; a prune casts one tensor at a time); at load, fp32 models."""
    trained = shape.params + (shape.critic_params if args.algo == "ppo" else 0)
    step = 4 * max(shape.params, shape.critic_params if args.algo == "ppo" else 0)
    save = max(4 * max(shape.params, shape.critic_params), 0 if offload else local * 8 * trained / world)
    steady = local * (process_host(args) + ((16 * trained + step) / world if offload else 0)) + save
    return max(steady, local * (process_host(args) + 4 * shape.params))

def process_host(args) -> float:
    """A rank's process and its grader workers, before any model (RSS: docs/bench/grader_workers.md)."""
    return PROCESS_HOST + args.grader_workers * WORKER_HOST

# transformers' KV cache (--sampler hf) as transformers 5's DynamicCache and generate's _sample lay it out
def hf_cache(shape, rows: int, positions: int, b: int) -> float:
    """A DynamicCache's keys and values, rows x positions (a sliding layer's: its window), with a decode's cat copy."""
    whole, kept = shape.cache_layers - shape.windowed_layers, min(positions, shape.window)
    return 2 * shape.kv * b * rows * (whole * positions + shape.windowed_layers * kept + (positions if whole else kept))

def hf_generation(shape, rows: int, prompt: int, new: int, b: int) -> float:
    """The most a generate call holds beside the weights: the last decode step's cache and logits, or the prefill's."""
    logits = DECODE_LOGITS * 4 * rows * shape.vocab
    prefill = rows * prompt * (b * (3 * shape.intermediate + 6 * shape.hidden) + prompt)
    return logits + max(hf_cache(shape, rows, prompt + new, b), hf_cache(shape, rows, prompt, b) + prefill)

def sampler_cache(shape, args, world: int, b: int, lengths) -> float:
    """--sampler hf: the larger generate call, training's or an evaluation's; 0 with vLLM (its cache is its share)."""
    if args.sampler != "hf":
        return 0.0
    batch, prompt = engines.hf_batch(args), lengths.prompt or args.max_prompt_tokens
    rows = min(batch, -(-args.prompts_per_step // world)) * args.group_size
    need = hf_generation(shape, rows, prompt, args.max_response_tokens, b)
    if args.eval_every and lengths.eval_problems != 0:
        problems = batch if lengths.eval_problems is None else -(-lengths.eval_problems // world)
        need = max(need, hf_generation(shape, min(batch, problems), lengths.eval_prompt or args.max_prompt_tokens,
                                       args.eval_max_tokens or args.max_response_tokens, b))
    return need

def nearest(path: str) -> str:
    """The nearest existing folder of a path the run will create (or the path itself)."""
    return path if os.path.exists(path := os.path.abspath(path)) else nearest(os.path.dirname(path))

def free_bytes(path: str) -> int:
    """Free bytes of the file system a path is (or will be) on."""
    return shutil.disk_usage(nearest(path)).free

def file_system(path: str) -> int:
    """Which file system a path is (or will be) on."""
    return os.stat(nearest(path)).st_dev

def host_available(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> float:
    """What a new process can take: MemAvailable, no more than a cgroup v2 limit leaves; inf where neither is known."""
    available = float("inf")
    with contextlib.suppress(OSError, KeyError, ValueError), open(meminfo) as f:
        available = float(dict(line.split(":", 1) for line in f)["MemAvailable"].split()[0]) * 1024
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(cgroup, "memory.max")) as limit, open(os.path.join(cgroup, "memory.current")) as used:
            ceiling, current = limit.read().strip(), used.read().strip()
        available = available if ceiling == "max" else min(available, float(int(ceiling) - int(current)))
    return available

def existing_checkpoints(out: str) -> float:
    """Bytes already on disk in --out's checkpoints (a resume's): free space already excludes them."""
    return float(sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(out)
                     if os.path.relpath(root, out).split(os.sep)[0].startswith("checkpoint-")
                     for f in files if os.path.isfile(os.path.join(root, f))))

def device_memory() -> tuple[float, float] | None:
    """This rank's GPU, (free bytes, total bytes): what other processes hold is not free. None without one."""
    return tuple(float(n) for n in torch.cuda.mem_get_info(dist.device())) if torch.cuda.is_available() else None

def readings(args) -> dict:
    """The machine, read once: each file system written to (--out, OUT/eval) and its free bytes, the host, the GPUs."""
    places, systems = {"checkpoints": args.out, "evaluations": os.path.join(args.out, "eval")}, {}
    for what, path in places.items():
        systems.setdefault(file_system(path), []).append(what)
    disks = [("disk" if "checkpoints" in whats else f"disk of {places[whats[0]]}", free_bytes(places[whats[0]]), whats)
             for whats in systems.values()]
    disks, available = dist.broadcast((disks, host_available()))  # rank 0's, and the least free GPU
    gpus = [g for g in dist.all_gather(device_memory()) if g is not None]
    return {"disks": disks, "host": available, "device": tuple(map(min, zip(*gpus))) if gpus else None}

def evaluation_bytes(args, lengths: Lengths) -> float:
    """OUT/eval's files: a record per problem per evaluation; 0 where the number of problems is not known."""
    if not args.eval_every or not lengths.eval_problems:
        return 0.0
    count = len({0, args.steps, *range(args.eval_every, args.steps + 1, args.eval_every)})
    tokens = args.eval_max_tokens or args.max_response_tokens
    return count * lengths.eval_problems * (EVAL_RECORD + EVAL_TOKEN_BYTES * tokens)

def figures(shape: Shape, args, world: int, gpu: bool, device_bytes: float, offload: bool,
            lengths: Lengths | None = None, local: int | None = None) -> dict:
    """Disk, memory per rank, the node's host memory. device_bytes: the GPU's total; local: this node's processes."""
    lengths, local = lengths or Lengths(), dist.local_world() if local is None else local
    m = memory(shape, args, world, offload, gpu, device_bytes, lengths)
    return {"disk": disk(shape, args, world), "evaluations": evaluation_bytes(args, lengths), "memory": m,
            "host": host(shape, args, world, local, offload) if gpu else local * m["peak"], "local": local}

def judged(shape: Shape, args, world: int, local: int, offload: bool, machine: dict, lengths: Lengths):
    """(figures, [(what, needed, there)]) of a run on this machine: each file system (a resume's checkpoints counted),
    the GPU, the host."""
    gpu = machine["device"] is not None
    plan = figures(shape, args, world, gpu, machine["device"][1] if gpu else 0.0, offload, lengths, local)
    needs = {"checkpoints": max(plan["disk"]["peak"] - machine.get("existing", 0.0), plan["disk"]["full"]),
             "evaluations": plan["evaluations"]}
    rows = [(label, sum(needs[what] for what in whats), free) for label, free, whats in machine["disks"]]
    rows += [("GPU memory per rank", plan["memory"]["peak"], machine["device"][0])] if gpu else []
    return plan, rows + [("host memory", plan["host"], machine["host"])]

def check(args, source: str, lengths: Lengths | None = None, measure_prompt=None) -> dict | None:
    """The plan, printed; one line and exit 2 where the run cannot fit, a warning where close; None if unreadable."""
    try:
        shape = shape_of(source)
    except Exception as error:  # noqa: BLE001 a config transformers cannot use raises anything
        console.say(f"plan: skipped, the config of {source} cannot be read here ({console.reason(error)})")
        return None
    world, local, offload = dist.world(), dist.local_world(), getattr(args, "offload", False)
    machine = {**readings(args), "existing": existing_checkpoints(args.out) if args.resume else 0.0}
    plan, rows = judged(shape, args, world, local, offload, machine, lengths := lengths or Lengths())
    if measure_prompt is not None and any(need > CLOSE * there for what, need, there in rows if what[:4] != "disk"):
        lengths = dataclasses.replace(lengths, prompt=measure_prompt())  # the data's longest prompt, not the flag's
        plan, rows = judged(shape, args, world, local, offload, machine, lengths)
    plan.update(shape=dataclasses.asdict(shape), world=world, machine=machine, lengths=dataclasses.asdict(lengths),
                device_bytes=machine["device"] and machine["device"][1], offload=offload, rows=[list(r) for r in rows])
    for line in table(plan, args):
        console.say(f"plan: {line}")
    if short := [(what, need, there) for what, need, there in rows if need > there]:
        what, need, there = short[0]

        def fits(step: dict) -> bool:  # the run with an advice's flags: every resource fits
            ranks, changed = step.get("ranks", world), dataclasses.replace(args, **step.get("changes", {}))
            return all(n <= t for _, n, t in judged(shape, changed, ranks, ranks if ranks != world else local,
                                                    step.get("offload", offload), machine, lengths)[1])
        console.fail(f"the run does not fit: {what} {size(need)} needed, {size(there)} there ({size(need - there)} "
                     f"short); {remedies(args, plan, what, fits, world, local)}")
    for what, need, there in rows:
        if need > CLOSE * there:
            console.say(f"warning: {what} is close: {size(need)} of {size(there)} ({need / there:.0%}); the run goes "
                        f"on")
    return plan

def size(n: float) -> str:
    """Bytes as GB or MB, one decimal."""
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
    return lines + [f"{what}: {size(need)} needed, {size(there)} there" + (total if what.startswith("GPU") else "")
                    for what, need, there in plan["rows"]]

def write(plan: dict | None, out: str, replace_file):
    """OUT/plan.json by rank 0, rewritten whole (a resume's replaces the last) by replace_file(path, lines)."""
    if plan is not None and dist.rank() == 0:
        safe = json.loads(json.dumps(plan, default=float).replace("Infinity", "null"))
        replace_file(os.path.join(out, "plan.json"), [json.dumps(safe, indent=1) + "\n"])

def remedies(args, plan: dict, what: str, fits, world: int, local: int) -> str:
    """After 'the run does not fit: WHAT': run-level flags alone, then together, by fits(step); none for a resume."""
    disk = what.startswith("disk")
    if args.resume:
        return "a resumed run keeps its saved flags: " + ("free space" if disk else "a larger device")
    run_level = disk_options(args, plan) if disk else memory_options(args, plan, world, local)
    alone = [next((step["text"] for step in steps if fits(step)), None) for steps in run_level + method_options(args)]
    if any(alone):
        return "it fits with " + ", or ".join(text for text in alone if text)
    if together := joint(run_level, fits):
        return "no single flag makes it fit; these together do: " + " ".join(step["text"] for step in together)
    return "no flag makes it fit here: " + ("free space or another --out" if disk else "a larger device")

def step(text: str, ranks: int | None = None, offload: bool | None = None, **changes) -> dict:
    """An advice: {"text", "changes": {field: value}, "ranks": processes, "offload"}, judged by check's fits(step)."""
    return {"text": text, "changes": changes, **({"ranks": ranks} if ranks else {}),
            **({"offload": offload} if offload is not None else {})}

def halvings(n: int) -> list[int]:
    """n // 2, n // 4, ..., 1."""
    return [n >> k for k in range(1, n.bit_length())]

def disk_options(args, plan: dict) -> list[list[dict]]:
    """Each run-level way to write less, mildest first: fewer kept checkpoints, fewer saves, fewer evaluations."""
    options = [[step(f"--keep-last {k}", keep_last=k) for k in (3, 2, 1) if k < (args.keep_last or 10**9)]]
    if args.keep_last == 0 and args.save_every and 4 * args.save_every <= 10**6:  # every save's folder is kept
        options.append([step(f"--save-every {4 * args.save_every}", save_every=4 * args.save_every)])
    if args.eval_every and plan["evaluations"]:
        options.append([step(f"--eval-every {4 * args.eval_every}", eval_every=4 * args.eval_every)]
                       * (4 * args.eval_every <= 10**6) + [step("--eval-every 0", eval_every=0)])
    return [steps for steps in options if steps]

def memory_options(args, plan: dict, world: int, local: int) -> list[list[dict]]:
    """Each run-level way to need less memory per rank, mildest first (a method setting is method_options')."""
    memory, gpu, options = plan["memory"], plan["device_bytes"] is not None, []
    if args.sampler == "hf":
        if importlib.util.find_spec("vllm") is not None:
            options.append([step("--sampler vllm", sampler="vllm")])
        options.append([step(f"--hf-batch-prompts {k}", hf_batch_prompts=k) for k in halvings(engines.hf_batch(args))])
    if gpu and not getattr(args, "offload", False):
        options.append([step("--offload", offload=True)])
    if world == local:  # one node: more processes on it (a GPU each), where the step's prompts split over them
        most = torch.cuda.device_count() if gpu else 8
        options.append([step(f"torchrun --nproc-per-node {n}", ranks=n) for n in (2, 4, 8)
                        if world < n <= most and splits(args, n)])
    tokens, width = memory["tokens"], memory["width"]
    options.append([step(f"--max-tokens-per-micro-batch {t}", max_tokens_per_micro_batch=t)
                    for t in [t for t in halvings(tokens) if t > width] + ([width] if width < tokens else [])])
    if not memory["checkpointing"]:
        options.append([step("--gradient-checkpointing", gradient_checkpointing=True)])
    share = round(args.vllm_gpu_memory_utilization * 0.6, 2)  # the engine's share bounds generation's peak
    if gpu and args.sampler == "vllm" and share > 0:
        options.append([step(f"--vllm-gpu-memory-utilization {share}", vllm_gpu_memory_utilization=share)])
    return [steps for steps in options if steps]

def method_options(args) -> list[list[dict]]:
    """Settings that change the method, named as such: GRPO has no critic (from a PPO run whose groups GRPO takes)."""
    return [[step("--algo grpo (a method setting: GRPO has no critic)", algo="grpo")]] \
        if args.algo == "ppo" and args.group_size >= 2 else []

def splits(args, ranks: int) -> bool:
    """Whether a step's fresh and historical prompts split into whole groups, and its vLLM engines, over `ranks`."""
    fresh = round((1.0 - args.off_policy_p) * args.prompts_per_step)
    return all(n % ranks == 0 for n in (fresh, args.prompts_per_step - fresh)) and ranks % args.vllm_tp == 0

def joint(options: list[list[dict]], fits) -> list[dict]:
    """The strongest step of each option until the run fits, less those it does not need; [] where all do not fit."""
    n = next((n for n in range(1, len(options) + 1) if fits(merge([steps[-1] for steps in options[:n]]))), 0)
    chosen = [steps[-1] for steps in options[:n]]
    for kept in list(chosen):
        fewer = [s for s in chosen if s is not kept]
        chosen = fewer if fewer and fits(merge(fewer)) else chosen
    return chosen

def merge(steps: list[dict]) -> dict:
    """One step of several: their flags, the most processes, offload if any offloads."""
    ranks, changes = [s["ranks"] for s in steps if "ranks" in s], dict(kv for s in steps for kv in s["changes"].items())
    return {"text": " ".join(s["text"] for s in steps), "changes": changes, **({"ranks": max(ranks)} if ranks else {}),
            **({"offload": True} if any(s.get("offload") for s in steps) else {})}
