"""What a sampler holds while it generates, for the plan (machinery.plan): transformers' KV cache under --sampler hf,
laid out as transformers 5's DynamicCache lays it out, with a generate call's prefill and a decode step's logits
beside it; vLLM's is its --vllm-gpu-memory-utilization share, a flag. Its own module because it follows another
library's layout (DynamicCache, generate's _sample) and changes when that does. A reader of the method may skip it."""

from machinery import engines

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
    batch, prompt = engines.hf_batch(args), lengths.prompt or args.max_prompt_tokens
    rows = min(batch, -(-args.prompts_per_step // world)) * args.group_size
    need = hf_generation(shape, rows, prompt, args.max_response_tokens, b)
    if args.eval_every and lengths.eval_problems != 0:
        problems = batch if lengths.eval_problems is None else -(-lengths.eval_problems // world)
        need = max(need, hf_generation(shape, min(batch, problems), lengths.eval_prompt or args.max_prompt_tokens,
                                       args.eval_max_tokens or args.max_response_tokens, b))
    return need
