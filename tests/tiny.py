"""Tiny randomly initialised Qwen2 models and a byte-level tokenizer for fast CPU tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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


def tiny_feature_draft(target: Qwen2ForCausalLM, vocab_ids=None, seed: int = 0, lean: float = 3.0):
    """A random feature draft (models/feature_draft.py) on `target`'s first and last layers, its LM head
    scoring `vocab_ids` only (the other ids get q = 0). `lean` scales the reduced input so that the
    fused input leans on the target's states: the draft agrees with the target sometimes."""
    from specdec.models.feature_draft import FeatureDraft, FeatureDraftConfig, layer_config_of

    config = FeatureDraftConfig(target_identity="tiny", layers=[0, target.config.num_hidden_layers - 1],
                                layer_config=layer_config_of(target.config, 24),
                                vocab_size=target.config.vocab_size)
    ids = torch.tensor(vocab_ids if vocab_ids is not None else range(target.config.vocab_size))
    torch.manual_seed(seed)
    draft = FeatureDraft(config, target.model.embed_tokens.weight.detach().clone(),
                         target.lm_head.weight.detach()[ids].clone(), ids)
    with torch.no_grad():
        draft.reduce.weight.mul_(lean)
    return draft.eval()


# -- tiny GGUF files (llama.cpp and the GGUF conversion) ------------------------------------------------

def byte_level_tokens() -> list[str]:
    """The GGUF token list of `byte_tokenizer`: 256 byte tokens, "Ġt", then the special tokens."""
    return sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt"] + SPECIAL_TOKENS


# A 10-token vocabulary (its last three the control tokens): small enough for a chi-squared test over
# a few generated tokens.
SMALL_TOKENS = ["Ċ", "a", "b", "c", "Ġ", "t", "Ġt", *SPECIAL_TOKENS]


def tiny_gguf_weights(vocab: int, hidden: int = 16, layers: int = 1, heads: int = 4, kv_heads: int = 2,
                      ffn: int = 32, seed: int = 0, scale: float = 0.2) -> dict[str, np.ndarray]:
    """Random qwen2 weights under their GGUF tensor names (numpy shapes are [out, in])."""
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return rng.normal(0, scale, shape).astype(np.float32)

    kv = kv_heads * (hidden // heads)
    weights = {"token_embd.weight": rand(vocab, hidden), "output_norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        block = f"blk.{i}."
        weights[block + "attn_norm.weight"] = np.ones(hidden, np.float32)
        for name, rows in (("attn_q", hidden), ("attn_k", kv), ("attn_v", kv)):
            weights[f"{block}{name}.weight"] = rand(rows, hidden)
            weights[f"{block}{name}.bias"] = rand(rows)
        weights[block + "attn_output.weight"] = rand(hidden, hidden)
        weights[block + "ffn_norm.weight"] = np.ones(hidden, np.float32)
        weights[block + "ffn_gate.weight"] = rand(ffn, hidden)
        weights[block + "ffn_up.weight"] = rand(ffn, hidden)
        weights[block + "ffn_down.weight"] = rand(hidden, ffn)
    return weights


def noisy_weights(weights: dict[str, np.ndarray], scale: float, seed: int) -> dict[str, np.ndarray]:
    """Every matrix with N(0, scale^2) noise added: a draft that mostly agrees (norms stay)."""
    rng = np.random.default_rng(seed)
    return {name: w if name.endswith("norm.weight") else (w + rng.normal(0, scale, w.shape)).astype(np.float32)
            for name, w in weights.items()}


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], tokens: list[str] | None = None,
                    heads: int = 4, kv_heads: int = 2, context: int = 256) -> Path:
    """A qwen2 GGUF (F32 tensors, tied output) that transformers and llama.cpp load. `tokens` default to
    the byte-level vocabulary; its last three are the control tokens <|endoftext|> <|im_start|> <|im_end|>.
    Embedding rows past them are padding (`finish_gguf`)."""
    import gguf

    tokens = tokens or byte_level_tokens()
    vocab, hidden = weights["token_embd.weight"].shape
    layers = sum(1 for name in weights if name.endswith("attn_norm.weight"))
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(weights["blk.0.ffn_gate.weight"].shape[0])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_bos_token_id(len(tokens) - 3)
    writer.add_pad_token_id(len(tokens) - 3)
    assert vocab >= len(tokens), (vocab, len(tokens))
    return finish_gguf(writer, tokens, weights, path)


def finish_gguf(writer, tokens: list[str], weights: dict[str, np.ndarray], path: Path) -> Path:
    """A tiny GGUF's byte-level BPE tokenizer (its last three tokens control ones, the last EOS) and
    tensors, written to `path`. Embedding rows past the tokens are padding, listed as
    convert_hf_to_gguf.py lists a real one's (Qwen2.5's): unused tokens "[PAD<id>]"."""
    import gguf

    padding = [f"[PAD{i}]" for i in range(len(tokens), weights["token_embd.weight"].shape[0])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens + padding)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 3) + [gguf.TokenType.CONTROL] * 3
                           + [gguf.TokenType.UNUSED] * len(padding))
    writer.add_token_merges(["Ġ t"] if "Ġt" in tokens else [])  # BPE needs a merge whose result is in the vocab
    writer.add_eos_token_id(len(tokens) - 1)
    for name, tensor in weights.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
