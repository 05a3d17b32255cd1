"""The models: loading checked against the config, precision, the chunked output layer, collation, the guard."""

import glob
import json
import math
import os
import sys

import torch
from torch.nn.utils.rnn import pad_sequence

from machinery import console, dist

NO_CODE = {"trust_remote_code": False, "use_safetensors": True}  # every load: no folder code, no prompt, no pickle
LOGPROB_CHUNK = 1024  # response tokens per slice of the output layer: a [1024, vocab] fp32 block is its peak
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_seq_length", "seq_len")  # the config fields vLLM reads a model's context from, smallest wins
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16"}  # the dtypes an older checkpoint is cast to

def load(args, checkpoint: str | None = None):
    """(policy, reference, critic): fp32 masters computing in --precision (Decision 7), the frozen reference in it; a
    resumed run's from its checkpoint (the reference once reincarnated). Each is sharded before the next loads."""
    device, dtype = dist.device(), compute_dtype(args.precision)
    checkpointing = device.type == "cuda" if args.gradient_checkpointing is None else args.gradient_checkpointing
    if device.type == "cuda":  # the trainer's padded micro-batches must stay off cuDNN's attention kernel
        use_safe_attention()

    def trainable(model):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        without_dropout(model)  # updates run in training mode (Decision 12)
        return dist.shard(model, device, dtype, args.offload)  # --offload: trained models only
    policy = trainable(savable_generation_config(pretrained(checkpoint or args.model, torch.float32)))
    reference = critic = None
    if args.kl_beta != 0:
        reincarnated = checkpoint and os.path.isdir(os.path.join(checkpoint, "reference"))
        frozen = pretrained(os.path.join(checkpoint, "reference") if reincarnated else args.model,
                            dtype).eval().requires_grad_(False)
        reference = dist.shard(savable_generation_config(frozen, quiet=True), device, dtype)
    if args.algo == "ppo":  # the paper's critic: the base model with a scalar head
        critic = trainable(pretrained(os.path.join(checkpoint, "critic") if checkpoint else args.model,
                                      torch.float32, critic=True, new_head=not checkpoint))
        if not checkpoint:
            console.say("critic: the base model with a new scalar value head (score.*), initialised at random")
    return policy, reference, critic

def pretrained(source: str, dtype: torch.dtype, critic: bool = False, new_head: bool = False):
    """The causal LM (or the critic: one output a token), safetensors, no folder code, once check_weights passes it."""
    import transformers
    check_weights(source, critic, new_head)  # a config it cannot build, a damaged or truncated file too
    cls = transformers.AutoModelForTokenClassification if critic else transformers.AutoModelForCausalLM
    transformers.utils.logging.disable_progress_bar()
    with console.quiet(transformers):  # its load report (a new head's weights): check_weights has said what it would
        return cls.from_pretrained(source, dtype=dtype, **({"num_labels": 1} if critic else {}), **NO_CODE)

def check_weights(source: str, critic: bool = False, new_head: bool = False):
    """Each weight the config's model needs, of its shape, and no other, in the safetensors headers, before an engine
    loads it (vLLM's loader leaves one the files lack unset, silently); a new head (a base model's critic) is new."""
    from huggingface_hub import snapshot_download
    from safetensors import safe_open
    try:  # a hub id: its snapshot's, in the cache vLLM and transformers load from
        model = meta_model(source, critic)[1]  # its named_parameters hold a tied copy once, its state_dict twice
        folder = source if os.path.isdir(source) else snapshot_download(source, allow_patterns="*.safetensors")
        files = [safe_open(path, "pt") for path in glob.glob(os.path.join(folder, "*.safetensors"))]
        if not files:  # weights as a pickle alone (pytorch_model.bin) are never opened
            raise FileNotFoundError(f"no *.safetensors file in {folder}: remix reads weights from safetensors only")
        held = {name: weights.get_slice(name).get_shape() for weights in files for name in weights.keys()}
    except Exception as error:  # noqa: BLE001 a config transformers cannot build, a damaged header, the hub
        console.fail(f"cannot load model {source!r}: {console.reason(error)}"
                     f"{'' if os.path.isdir(source) else console.offline_hint()}")
    need = {n: list(t.shape) for n, t in sorted(model.named_parameters()) if not (new_head and n.startswith("score."))}
    problems = [f"its weights lack {name} (it would start at random)" if name not in held else
                f"config.json makes {name} {shape}, its weights hold {held[name]}"
                for name, shape in need.items() if held.get(name) != shape]
    problems += [] if new_head else [f"its weights hold {name}, which the model its config.json describes does not have"
                                     for name in sorted(set(held) - set(model.state_dict()))]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        console.fail(f"cannot load model {source!r}: {problems[0]}{more}: the config and weights disagree; restore "
                     f"config.json and the *.safetensors files as they were saved together")

def meta_model(source: str, critic: bool = False) -> tuple:
    """(config, policy or critic) on the meta device, trust_remote_code=False; raises whatever transformers raises."""
    from transformers import AutoConfig, AutoModelForCausalLM as Policy, AutoModelForTokenClassification as Critic
    config = AutoConfig.from_pretrained(source, trust_remote_code=False, **({"num_labels": 1} if critic else {}))
    with torch.device("meta"):
        return config, (Critic if critic else Policy).from_config(config, trust_remote_code=False)

def optimizer(model, lr: float, weight_decay: float, offload: bool = False):
    """AdamW; foreach for offloaded host shards, which torch would step one at a time (the plan counts its buffer)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=True if offload else None)

def savable_generation_config(model, quiet: bool = False):
    """The model, its generation config savable: sampling values without do_sample get it; else one line and exit 2."""
    config = model.generation_config
    try:
        config.validate(strict=True)
        return model
    except ValueError:
        config.do_sample = True
    try:
        config.validate(strict=True)
    except ValueError as error:
        console.fail(f"{model.name_or_path}: its generation_config.json could not be saved with a checkpoint "
                     f"({' '.join(str(error).split())[:300]}); fix it")
    if not quiet:
        console.say(f"{model.name_or_path}: generation_config.json sets sampling values without do_sample; "
                    f"checkpoints save it with do_sample true")
    return model

def context_length(source: str, tokenizer) -> tuple[int, str] | None:
    """(the longest sequence a model takes as vLLM derives it, where from): the smallest context field, times a linear
    or dynamic RoPE factor (YaRN's and Llama 3's are scaled), at most model_max_length. None if the config has none."""
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
    length, key = lengths[0][0], f"{lengths[0][1]} in config.json"
    if isinstance(factor, (int, float)) and factor > 1:
        length, key = int(length * factor), f"{key} times its RoPE factor {factor:g}"
    if tokenizer.model_max_length < length:
        return tokenizer.model_max_length, "model_max_length in tokenizer_config.json"
    return length, key

def weights_dtype(config) -> torch.dtype:
    """The dtype an older checkpoint's weights are kept in: the config's bf16 or fp16, else fp32 (the newest: fp32)."""
    dtype = getattr(config, "dtype", None)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dtype if dtype in SAFETENSORS_DTYPES else torch.float32

def write_cast(weights, f, dtype: torch.dtype):
    """Into f (a new binary file), weights (an open safe_open) cast to dtype as safetensors, one tensor in memory at a
    time (the whole cast model would be 14 GB on the host at 7B): the JSON header's length (8 bytes, little-endian),
    the header (each tensor's dtype, shape and byte range; spaces pad it to 8 bytes), then each tensor's bytes."""
    header, offset = {"__metadata__": weights.metadata()} if weights.metadata() else {}, 0
    for name in weights.keys():
        shape = weights.get_slice(name).get_shape()
        end = offset + torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write(len(text).to_bytes(8, "little") + text)
    for name in weights.keys():
        f.write(weights.get_tensor(name).to(dtype).reshape(-1).view(torch.uint8).numpy())

def compute_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32

def use_safe_attention():
    """The trainer's attention off cuDNN's SDPA (torch 2.9+ on H100/H200): its masked backward NaNs (pytorch 196678)."""
    torch.backends.cuda.enable_cudnn_sdp(False)

def without_dropout(model):
    """Every dropout off (a new critic head's too): pi_theta/mu compares a training-mode forward with no-grad ones."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0

def collate(samples: list[dict], device=None) -> dict:
    """Left-padded prompts, right-padded responses (token j at column P + j; padding and a stand-in's response masked):
    input_ids/attention_mask/position_ids [N, P + L], response_mask [N, L], prompt_len P, historical [N] (replayed)."""
    prompt_len, resp_len = (max(len(s[key]) for s in samples) for key in ("prompt_ids", "response_ids"))
    rows, masks = [], []
    for s in samples:
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        rows.append([0] * (prompt_len - p) + s["prompt_ids"] + s["response_ids"] + [0] * (resp_len - r))
        masks.append([0] * (prompt_len - p) + [1] * (p + r) + [0] * (resp_len - r))
    input_ids, attention_mask = (torch.tensor(x, device=device or dist.device()) for x in (rows, masks))  # [N, P + L]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, P + L] left padding shifts positions
    response_mask = attention_mask[:, prompt_len:].bool()  # [N, L]
    response_mask[[bool(s.get("stand_in")) for s in samples]] = False
    historical = torch.tensor([bool(s.get("historical")) for s in samples], device=input_ids.device)  # [N]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "response_mask": response_mask, "prompt_len": prompt_len, "historical": historical}

def padded(samples: list[dict], key: str, device=None) -> torch.Tensor:
    """A per-token vector stored with each sample, right-padded into [N, L] (on the trainer's device)."""
    return pad_sequence([s[key] for s in samples], batch_first=True).to(device or dist.device())

def response_mask(samples: list[dict]) -> torch.Tensor:
    """[N, L], True on each sample's response tokens (right-padded, as padded() lays them out)."""
    return pad_sequence([torch.ones(len(s["response_ids"]), dtype=torch.bool) for s in samples], batch_first=True) \
        if samples else torch.zeros(0, 0, dtype=torch.bool)

@torch.no_grad()
def per_token(fn, model, samples: list[dict], max_tokens: int) -> list[torch.Tensor]:
    """No-grad fn(model, micro-batch) -> [n, l] by micro-batches: one unpadded [L_i] CPU vector per sample; reshards."""
    results = {}  # by id(): micro_batches reorders the samples, and a dict is not hashable
    for micro in dist.micro_batches(samples, max_tokens):
        out = fn(model, collate(micro))  # [n, l]
        results.update({id(s): out[j, : len(s["response_ids"])].float().cpu() for j, s in enumerate(micro)})
    dist.reshard(model)
    return [results[id(s)] for s in samples]

def chunked_logprobs(per_token_fn, hidden, weight, tokens, temperature: float, chunk: int | None = None):
    """per_token_fn(logits [c, V], tokens [c], temperature) -> [c, 2] over hidden [N, H], weight [V, H], tokens [N],
    `chunk` tokens at a time: no [N, V] logits (the backward recomputes each chunk's); the weight's gradient in fp32."""
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

_guard = {"in_a_row": 0, "out": ""}

def reset(in_a_row: int, out: str):
    """A run's start: the skipped updates in a row its checkpoint ended with, and the folder its line names."""
    _guard.update(in_a_row=in_a_row, out=out)

def in_a_row() -> int:
    return _guard["in_a_row"]

def finite_update(terms: dict, norms: list[float], stats: dict, step: int) -> bool:
    """Whether to step: terms summed over ranks into stats if all finite; else skipped in one line (a third: exit 2)."""
    values = dist.all_reduce(torch.tensor(list(terms.values()), dtype=torch.float64))
    if not torch.isfinite(values).all() or not all(map(math.isfinite, norms)):
        _guard["in_a_row"] += 1
        stats["train/skipped_updates"].append(1)
        console.say(f"step {step}: non-finite loss or gradient, update skipped", stream=sys.stderr)
        if _guard["in_a_row"] >= 3:
            console.fail(f"3 non-finite updates in a row at step {step}; stopping. The last good checkpoint is the "
                         f"newest checkpoint-* in {_guard['out']}")
        return False
    _guard["in_a_row"] = 0
    for name, value in zip(terms, values.tolist()):
        stats[name].append(value)
    stats["losses/grad_norm"].append(norms[0])
    stats["train/optimizer_steps"].append(1)
    return True
