"""The benchmarks' random models: the tiny pair with the default pair's vocabulary (CPU figures),
a target of a real shape (the GPU benchmark's), and a feature draft on either's states."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 151_936  # the default pair's
FEATURE_VOCAB = 32768  # a feature draft's trimmed output rows (docs/feature-draft.md)


def tiny_model(hidden: int, layers: int, seed: int, vocab: int = VOCAB) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def random_model(config, device: torch.device, dtype: torch.dtype) -> Qwen2ForCausalLM:
    """A target of shape `config` (benchmarks/gpu/shapes.py), random weights made on `device`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def random_feature_draft(config, device: torch.device, dtype: torch.dtype):
    """A feature draft of target shape `config` (random weights, MLP half the target's)."""
    from specdec.models.feature_draft import FeatureDraft, FeatureDraftConfig, layer_config_of

    hidden, rows, depth = config.hidden_size, min(FEATURE_VOCAB, config.vocab_size), config.num_hidden_layers
    draft_config = FeatureDraftConfig(target_identity="random",
                                      layers=sorted({min(1, depth - 1), depth // 2, max(0, depth - 4)}),
                                      layer_config=layer_config_of(config, config.intermediate_size // 2),
                                      vocab_size=config.vocab_size)
    with device:
        draft = FeatureDraft(draft_config, torch.randn(config.vocab_size, hidden, dtype=dtype),
                             torch.randn(rows, hidden, dtype=dtype), torch.arange(rows))
    return draft.to(device=device, dtype=dtype).eval()


def padded(model: Qwen2ForCausalLM, extra: int) -> Qwen2ForCausalLM:
    """A copy of `model` with `extra` decoder layers after its own that add nothing to the residual
    stream (their output projections are zero): the same function at the cost of a deeper model. A
    target padded so agrees with its unpadded draft on every token, and the draft's step costs a
    chosen share of the target's pass."""
    import copy

    deeper = copy.deepcopy(model)
    layers = deeper.model.layers
    for _ in range(extra):
        layer = copy.deepcopy(layers[-1])
        layer.self_attn.layer_idx = len(layers)
        with torch.no_grad():
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        layers.append(layer)
    deeper.config.num_hidden_layers = len(layers)
    if getattr(deeper.config, "layer_types", None):
        deeper.config.layer_types = list(deeper.config.layer_types) + [deeper.config.layer_types[-1]] * extra
    return deeper
