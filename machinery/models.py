"""The models: loading, precision, the chunked output layer, micro-batches, the optimizer and the update's guard.

Loading the policy, the frozen reference and the critic (precision, sharding, no dropout), the output layer computed in
chunks of tokens, and the collation of samples into padded micro-batches. The guard against non-finite updates: a
mini-batch whose loss or gradient is not finite is skipped, and three in a row stop the run (remix.update shows where
it acts). Older checkpoints' weights in the base model's dtype: which dtype that is, and a safetensors file written in
it one tensor at a time (machinery.checkpoints casts an older checkpoint's fp32 weights with it when it reduces one to
a model folder; the newest keeps the fp32 master weights, so a resume is exact).

A reader of the method may skip this module: remix.policy_forward shows what is computed; this holds how it fits in
memory.
"""

import contextlib
import functools
import glob
import json
import math
import os
import struct
import sys

import torch

from machinery import dist, flags, runfolder
from machinery.console import fail, say


# Every weight load: never code from the folder (no prompt, whatever stdin holds), never a pickle (.bin) file
NO_CODE = {"trust_remote_code": False, "use_safetensors": True}
LOGPROB_CHUNK = 1024  # response tokens per slice of the output layer: a [1024, vocab] fp32 block is its peak


def load(args, checkpoint: str | None = None):
    """(policy, reference, critic). Policy and critic keep fp32 master weights: at lr 1e-6 a bf16
    weight would round most updates away (Decision 7); with --precision bf16 they compute with bf16 copies
    (FSDP2's mixed precision, one process too), and the frozen reference is stored in bf16, so before the first
    update it computes exactly as the policy does. A resumed run loads all three from its checkpoint (the
    reference only once reincarnated). Each loads on the CPU and is sharded before the next loads: no host ever
    holds two whole models. No reference without a KL term (--kl-beta 0); no critic for GRPO."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    transformers.utils.logging.disable_progress_bar()
    device, dtype = dist.device(), compute_dtype(args.precision)
    checkpointing = device.type == "cuda" if args.gradient_checkpointing is None else args.gradient_checkpointing
    if device.type == "cuda":  # the trainer's padded micro-batches must stay off cuDNN's attention kernel
        use_safe_attention()

    def trainable(model):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        without_dropout(model)  # updates run in training mode (Decision 12)
        return dist.shard(model, device, dtype, getattr(args, "offload", False))  # --offload: trained models only

    from safetensors import SafetensorError

    source = checkpoint or args.model
    try:
        policy = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **NO_CODE)
    except (OSError, ValueError, SafetensorError) as error:  # a folder without a model, a damaged or refused file
        fail(f"cannot load model {source!r}: {str(error).splitlines()[0]}{flags.offline_hint()}")
    policy = trainable(savable_generation_config(policy))
    reincarnated = checkpoint and os.path.isdir(os.path.join(checkpoint, "reference"))
    reference = None
    if args.kl_beta != 0:
        frozen = AutoModelForCausalLM.from_pretrained(os.path.join(checkpoint, "reference") if reincarnated
                                                      else args.model, dtype=dtype, **NO_CODE)
        reference = dist.shard(savable_generation_config(frozen, quiet=True).eval().requires_grad_(False), device, dtype)
    critic = None
    if args.algo == "ppo":  # the paper's critic: the base model with a scalar head
        critic_source = os.path.join(checkpoint, "critic") if checkpoint else args.model
        config = AutoConfig.from_pretrained(critic_source, num_labels=1, trust_remote_code=False)
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # its load report lists the new head as MISSING
        critic = trainable(AutoModelForTokenClassification.from_pretrained(critic_source, config=config,
                                                                           dtype=torch.float32, **NO_CODE))
        transformers.logging.set_verbosity(verbosity)
        if not checkpoint:
            say("critic: the base model with a new scalar value head (score.*), initialised at random")
    return policy, reference, critic


def optimizer(model, lr: float, weight_decay: float, offload: bool = False):
    """AdamW over a model's parameters. torch steps with its multi-tensor (foreach) implementation by itself only
    where every parameter is on a GPU: an offloaded model's shards (--offload) are host tensors, and it would step
    them one tensor at a time, a Python loop over hundreds of tensors, so they get foreach explicitly. The
    arithmetic is the per-tensor step's (tests/test_plan.py compares them exactly); the cost is one fp32
    intermediate the size of the model's shards during the step, which the plan counts. Elsewhere torch chooses (a
    caller's own AdamW, such as toy.py's pinned fused one, stays possible)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=True if offload else None)


def savable_generation_config(model, quiet: bool = False):
    """The model, with a generation config its checkpoints can save. Many hub models set temperature or top_p in
    generation_config.json without do_sample: transformers loads that with a warning but refuses to save it, so
    every checkpoint would fail. Those values are the authors' sampling settings, and vLLM (which loads the
    checkpoints) applies them whatever do_sample says, so they are kept and do_sample is set. Anything else
    transformers would refuse stops the run here, before step 1, in one line."""
    config = model.generation_config
    try:
        config.validate(strict=True)
        return model
    except ValueError:
        config.do_sample = True
    try:
        config.validate(strict=True)
    except ValueError as error:
        fail(f"{model.name_or_path}: its generation_config.json could not be saved with a checkpoint "
             f"({' '.join(str(error).split())[:300]}); fix it")
    if not quiet:
        say(f"{model.name_or_path}: generation_config.json sets sampling values without do_sample; checkpoints "
            f"save it with do_sample true")
    return model


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_seq_length", "seq_len")  # the config fields vLLM reads a model's context from, smallest wins


def context_length(source: str, tokenizer) -> tuple[int, str] | None:
    """The longest sequence (prompt plus response) a model takes, as vLLM derives it, and where that comes from: the
    smallest of its config's context fields, scaled by a linear or dynamic RoPE factor (YaRN's and Llama 3's fields
    are already scaled), at most the tokenizer's model_max_length. None when the config names no length."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=False).get_text_config()
    except (OSError, ValueError):  # loading the model names what is wrong
        return None
    lengths = sorted((getattr(config, key), key) for key in CONTEXT_KEYS if isinstance(getattr(config, key, None), int))
    if not lengths:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    factor = rope.get("factor") if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) not in (
        None, "default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling") else None
    length, key = lengths[0]
    if isinstance(factor, (int, float)) and factor > 1:
        length, key = int(length * factor), f"{key} in config.json times its RoPE factor {factor:g}"
    else:
        key = f"{key} in config.json"
    if tokenizer.model_max_length < length:
        return tokenizer.model_max_length, "model_max_length in tokenizer_config.json"
    return length, key


def compute_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def use_safe_attention():
    """Keep the trainer's attention off cuDNN's SDPA kernel. From torch 2.9 it is the default on H100/H200
    (SM90/SM100), and its backward returns NaN in the query gradient when an explicit attention mask is passed,
    the key length is 64 modulo 128 and a row's log-sum-exp is below about -88.7 (pytorch issue 196678, fixed
    after the torch 2.14.0 wheels). Every padded micro-batch here has an explicit mask, so some backwards would
    NaN, be skipped as non-finite and, three in a row, stop the run. Flash and memory-efficient SDPA remain.
    (vLLM's attention is its own and does not use this kernel.)"""
    torch.backends.cuda.enable_cudnn_sdp(False)


def without_dropout(model):
    """Every dropout off: the ratio pi_theta/mu compares a training-mode forward with no-grad ones, so they must
    compute the same function. (A new critic head has dropout 0.1: transformers 5 ignores classifier_dropout.)"""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def collate(samples: list[dict], device=None) -> dict:
    """Left-pad prompts and right-pad responses so response token j sits at column P + j in every row.
    Padding is masked out, so its token id does not matter. A stand-in (dist.STAND_IN) has no response token.

    Returns input_ids/attention_mask/position_ids [N, P + L], response_mask [N, L], P, and historical [N]: True on
    the samples replayed from the deque this step (the method's "historical" field; a stand-in's is False).
    """
    prompt_len = max(len(s["prompt_ids"]) for s in samples)
    resp_len = max(len(s["response_ids"]) for s in samples)
    rows, masks = [], []
    for s in samples:
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        rows.append([0] * (prompt_len - p) + s["prompt_ids"] + s["response_ids"] + [0] * (resp_len - r))
        masks.append([0] * (prompt_len - p) + [1] * (p + r) + [0] * (resp_len - r))
    input_ids = torch.tensor(rows, device=device or dist.device())  # [N, P + L]
    attention_mask = torch.tensor(masks, device=device or dist.device())  # [N, P + L]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, P + L] left padding shifts positions
    response_mask = attention_mask[:, prompt_len:].bool()  # [N, L]
    response_mask[[bool(s.get("stand_in")) for s in samples]] = False
    historical = torch.tensor([bool(s.get("historical")) for s in samples], device=input_ids.device)  # [N]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "response_mask": response_mask, "prompt_len": prompt_len, "historical": historical}


def padded(samples: list[dict], key: str, device=None) -> torch.Tensor:
    """A per-token vector stored with each sample, right-padded into [N, L] (on the trainer's device)."""
    from torch.nn.utils.rnn import pad_sequence

    return pad_sequence([s[key] for s in samples], batch_first=True).to(device or dist.device())


def response_mask(samples: list[dict]) -> torch.Tensor:
    """[N, L], True on each sample's response tokens (right-padded, as padded() lays them out)."""
    from torch.nn.utils.rnn import pad_sequence

    return pad_sequence([torch.ones(len(s["response_ids"]), dtype=torch.bool) for s in samples], batch_first=True) \
        if samples else torch.zeros(0, 0, dtype=torch.bool)


@torch.no_grad()
def per_token(fn, model, samples: list[dict], max_tokens: int) -> list[torch.Tensor]:
    """A no-grad pass of fn(model, micro-batch) -> [n, l] (log-probs or values) over the samples in micro-batches
    of at most max_tokens padded tokens; one unpadded [L_i] CPU vector per sample. It ends by resharding the
    model: a pass without backward would otherwise leave its root's weights whole (dist.reshard)."""
    results = {}
    for micro in dist.micro_batches(samples, max_tokens):
        out = fn(model, collate(micro))  # [n, l]
        # keyed by id(): micro_batches reorders the samples by length, and a dict is not hashable
        results.update({id(s): out[j, : len(s["response_ids"])].float().cpu() for j, s in enumerate(micro)})
    dist.reshard(model)
    return [results[id(s)] for s in samples]


# ----------------------------------------------------------------------------------------------
# The output layer in chunks of tokens: log pi(a_t|s_t) and the entropy without [tokens, vocab] logits
# ----------------------------------------------------------------------------------------------
def chunked_logprobs(per_token_fn, hidden, weight, tokens, temperature: float, chunk: int | None = None):
    """per_token_fn(logits [c, V], tokens [c], temperature) -> [c, 2] (remix.token_logprobs: log pi(a_t|s_t) and
    the entropy) for every token, [N, 2], from the last hidden states [N, H], the output layer's weight [V, H] and
    the tokens [N]: the same numbers as per_token_fn over the whole [N, V] logits, `chunk` tokens at a time, so
    those logits never exist whole. The backward pass recomputes each chunk's logits. The output layer's gradient
    is accumulated over the chunks in fp32 and rounded to the weight's dtype once (a bf16 weight's gradient summed
    in bf16 would round at every chunk). Under a caller's autocast the weight is cast once per forward."""
    return _ChunkedLogprobs.apply(hidden, weight, tokens, per_token_fn, temperature, chunk or LOGPROB_CHUNK)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, per_token_fn, temperature, chunk):
        kind = hidden.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype
        cast = weight.to(dtype)  # [V, H]; the weight itself when the dtypes agree
        with torch.autocast(kind, enabled=False):
            out = torch.cat([per_token_fn(hidden[i : i + chunk].to(dtype) @ cast.T, tokens[i : i + chunk], temperature)
                             for i in range(0, len(tokens), chunk)])  # [N, 2]
        ctx.save_for_backward(hidden, cast, tokens)
        ctx.weight_dtype, ctx.per_token_fn, ctx.temperature, ctx.chunk = weight.dtype, per_token_fn, temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):  # grad_out [N, 2]
        hidden, cast, tokens = ctx.saved_tensors
        cast = cast.detach()  # the weight itself when no cast was needed: its gradient is summed here, not by autograd
        grad_hidden = torch.empty_like(hidden)  # [N, H]
        grad_weight = torch.zeros(cast.shape, dtype=torch.float32, device=cast.device)  # [V, H], summed in fp32
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, len(tokens), ctx.chunk):
                h = hidden[i : i + ctx.chunk].detach().to(cast.dtype).requires_grad_()  # [c, H]
                seen = []  # the gradient of this chunk's logits, caught on its way to h
                with torch.enable_grad():
                    logits = h @ cast.T  # [c, V]; freed as soon as the per-token function has used it
                    logits.register_hook(seen.append)
                    out = ctx.per_token_fn(logits, tokens[i : i + ctx.chunk], ctx.temperature)  # [c, 2]
                    del logits
                    out.backward(grad_out[i : i + ctx.chunk])
                grad_hidden[i : i + ctx.chunk] = h.grad.to(hidden.dtype)
                grad_weight += _matmul_fp32(seen.pop().T, h.detach())  # [V, H]
        return grad_hidden, grad_weight.to(ctx.weight_dtype), None, None, None, None


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result, bf16 inputs multiplied exactly: cuBLAS's fp32 output on CUDA, fp32 elsewhere."""
    if a.is_cuda and a.dtype == b.dtype == torch.bfloat16:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


# ----------------------------------------------------------------------------------------------
# The guard: a non-finite loss or gradient skips the update; three in a row stop the run
# ----------------------------------------------------------------------------------------------
_guard = {"in_a_row": 0, "out": ""}


def reset(in_a_row: int, out: str):
    """A run's start: the skipped updates in a row its checkpoint ended with, and the folder its line names."""
    _guard.update(in_a_row=in_a_row, out=out)


def in_a_row() -> int:
    return _guard["in_a_row"]


def finite_update(terms: dict, norms: list[float], stats: dict, step: int) -> bool:
    """The end of a mini-batch: its logged terms summed over the ranks and kept in stats with the gradient norm,
    if the loss and every gradient are finite. Otherwise the optimizer step is skipped (one line on stderr,
    train/skipped_updates), and three skipped in a row stop the run."""
    values = dist.all_reduce(torch.tensor(list(terms.values()), dtype=torch.float64))
    if not torch.isfinite(values).all() or not all(map(math.isfinite, norms)):
        _guard["in_a_row"] += 1
        stats["train/skipped_updates"].append(1)
        say(f"step {step}: non-finite loss or gradient, update skipped", stream=sys.stderr)
        if _guard["in_a_row"] >= 3:
            fail(f"3 non-finite updates in a row at step {step}; stopping. The last good checkpoint is the newest "
                 f"checkpoint-* in {_guard['out']}")
        return False
    _guard["in_a_row"] = 0
    for name, value in zip(terms, values.tolist()):
        stats[name].append(value)
    stats["losses/grad_norm"].append(norms[0])
    stats["train/optimizer_steps"].append(1)
    return True


# ----------------------------------------------------------------------------------------------
# Older checkpoints' weights in the base model's dtype
# ----------------------------------------------------------------------------------------------
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16"}  # the dtypes an older checkpoint is cast to


def weights_dtype(config) -> torch.dtype:
    """The dtype an older checkpoint's weights are kept in: the base model's, as its config states it (bf16 or fp16;
    fp32 for anything else, or nothing stated). The newest checkpoint's are the fp32 master weights, for an exact
    resume."""
    dtype = getattr(config, "dtype", None)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dtype if dtype in SAFETENSORS_DTYPES else torch.float32


@functools.cache
def base_dtype(source: str | None) -> torch.dtype:
    """weights_dtype of the base model (a folder or a hub id), read once; fp32 where its config cannot be read."""
    if not source:
        return torch.float32
    from transformers import AutoConfig

    try:
        return weights_dtype(AutoConfig.from_pretrained(source, trust_remote_code=False))
    except (OSError, ValueError, KeyError, TypeError) as error:
        say(f"cannot read the base model's config ({source}: {(str(error).splitlines() or [''])[0][:160]}); older "
            f"checkpoints keep their fp32 weights")
        return torch.float32


def cast_folder(folder: str, dtype: torch.dtype):
    """A model folder's fp32 weights in dtype: each safetensors file holding only fp32 tensors is written anew, cast,
    into a new .trash-* folder beside the checkpoints, flushed to the disk and renamed over the old one, so a kill
    leaves the fp32 file or the cast one whole (and a .trash-* folder the next save or resume deletes); then
    config.json states the dtype. One tensor is in memory at a time. What is cast already is left alone, so a prune
    that runs again after a kill finishes the job."""
    from safetensors import safe_open

    if dtype not in SAFETENSORS_DTYPES:
        return
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    for path in files:
        if dtypes_in(path) != {"F32"}:
            continue  # cast already, or not the fp32 weights a save writes
        trash = runfolder.fresh_folder(os.path.dirname(folder), ".trash-")
        aside = os.path.join(trash, os.path.basename(path))
        with safe_open(path, "pt") as weights:
            write_cast(weights, aside, dtype)
        runfolder.replace(aside, path)
        runfolder.sync_folder(folder)
        with contextlib.suppress(OSError):  # else the next save or resume deletes it (clear_leftovers)
            runfolder.remove(trash, missing_ok=True)
    if files and all(dtypes_in(path) == {SAFETENSORS_DTYPES[dtype]} for path in files):
        state_dtype(os.path.join(folder, "config.json"), dtype)


def dtypes_in(path: str) -> set[str]:
    """The safetensors dtypes ("F32", "BF16", ...) of a file's tensors, read from its header."""
    from safetensors import safe_open

    with safe_open(path, "pt") as weights:
        return {weights.get_slice(name).get_dtype() for name in weights.keys()}


def state_dtype(config_path: str, dtype: torch.dtype):
    """config.json says the weights' dtype (under the key it uses: dtype, or torch_dtype before transformers 5), as
    the base model's does: a loader that takes the config's dtype (vLLM's "auto") computes in it."""
    with open(config_path) as f:
        config = json.load(f)
    keys, name = [key for key in ("dtype", "torch_dtype") if key in config] or ["dtype"], str(dtype).split(".")[-1]
    if any(config.get(key) != name for key in keys):
        runfolder.replace_file(config_path, [json.dumps({**config, **{key: name for key in keys}}, indent=2,
                                                        sort_keys=True) + "\n"])


def write_cast(weights, path: str, dtype: torch.dtype):
    """A safetensors file at path holding weights' tensors (an open safe_open of fp32 ones) cast to dtype, written
    one tensor at a time and flushed to the disk: the format's 8-byte little-endian header length, its JSON header
    (each tensor's dtype, shape and byte range in the data; padded with spaces to 8 bytes), then the data."""
    names, header, offset = list(weights.keys()), {}, 0
    for name in names:
        shape = weights.get_slice(name).get_shape()
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if weights.metadata():
        header["__metadata__"] = weights.metadata()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with runfolder.open_file(path, "xb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in names:
            tensor = weights.get_tensor(name).to(dtype).contiguous()  # one tensor at a time
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
