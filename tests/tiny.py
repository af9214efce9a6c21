"""Tiny randomly initialised Qwen2 models and a byte-level tokenizer for fast CPU tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens plus Qwen's three special tokens (ids 256..258)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(vocab_size: int, hidden_size: int = 32, layers: int = 2, seed: int = 0,
               init_range: float = 0.2, eos_token_id: int | None = None) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, initializer_range=init_range, tie_word_embeddings=True,
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None,
    )
    return Qwen2ForCausalLM(config).eval()


def save_tiny_pair(root: Path, draft_hidden: int = 16, target_hidden: int = 32) -> tuple[Path, Path]:
    """A draft and a target sharing the byte tokenizer, saved as HF directories."""
    tokenizer = byte_tokenizer()
    vocab, eos = len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>")
    dirs = []
    for name, hidden, layers, seed in (("draft", draft_hidden, 1, 1), ("target", target_hidden, 2, 2)):
        path = root / name
        tiny_model(vocab, hidden, layers, seed, eos_token_id=eos).save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs.append(path)
    return dirs[0], dirs[1]
