"""Build a tiny random-weight Qwen2 chat model offline, for tests and CPU smoke runs.

    python tests/tiny_model.py runs/tiny-qwen2

The folder loads with transformers' `from_pretrained` and with vLLM, like any hub checkpoint.
The tokenizer is byte level (256 byte tokens, no merges) plus three ChatML special tokens, so it
needs no download and can spell any string. Head size 32, because vLLM's CPU attention does not
support 16.
"""

import json
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_short_problems(source, dest, max_chars: int, limit: int) -> str:
    """The first `limit` problems of a .jsonl shorter than max_chars characters, written to dest: the byte-level
    tokenizer spends a token per character, so short problems keep the tiny model's prompts small."""
    rows = [json.loads(line) for line in open(source)]
    short = [r for r in rows if len(r["problem"]) < max_chars][:limit]
    with open(dest, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in short)
    return str(dest)


def build_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(path: str, seed: int = 0, hidden_size: int = 128, layers: int = 2, chat: bool = True) -> str:
    """Write a random Qwen2ForCausalLM (hidden 128, 4 heads of 32, 2 KV heads) and its tokenizer (without a chat
    template when chat is False, as a base model's)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    if not chat:
        tokenizer.chat_template = None
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=max(1, hidden_size // 64),
        max_position_embeddings=16384,  # room for the longest benchmark prompt in bytes plus a response
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen2"))
