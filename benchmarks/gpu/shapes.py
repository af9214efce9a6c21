"""The model shapes the GPU benchmark builds with random weights: the default pair's configs
(Qwen2.5-Coder 0.5B drafting for 1.5B), and 7B and 32B targets of the same family (32B: 65 GB in
bf16, one H200's share of a sharded verifier). Only shapes matter for
a pass's cost; weights are random because the GPU machine cannot fetch models."""

from __future__ import annotations

from transformers import Qwen2Config

_COMMON = dict(hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
               attention_dropout=0.0, use_sliding_window=False, initializer_range=0.02)

# name -> (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings)
SHAPES = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064, False),
}


def shape_config(name: str) -> Qwen2Config:
    hidden, intermediate, layers, heads, kv_heads, vocab, tied = SHAPES[name]
    return Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                       tie_word_embeddings=tied, **_COMMON)
