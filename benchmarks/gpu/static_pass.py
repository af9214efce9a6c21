"""A captured pass: B sessions feeding k tokens each against a preallocated KV cache, replayed as one
CUDA graph. The measurement prototype of issue 33's CUDA runtime, kept here until that runtime lands.

The cache is static: per layer keys and values [B, kv_heads, L, head_dim] allocated once, a session's
row written at its own positions (`scatter_`), attention over the whole row with a mask that hides
positions past the session's length. Every tensor the pass touches has a fixed address and shape, so
`torch.cuda.graph` can capture it and a replay costs one launch instead of hundreds.

Worked example (B = 2, k = 2, L = 8): session 0 holds 5 tokens and feeds positions 5, 6; session 1
holds 2 and feeds 2, 3. positions [[5, 6], [2, 3]]; mask row (0, query 0) is True at keys 0..5, row
(1, query 1) at keys 0..3; keys 7 of row 0 and 4..7 of row 1 are scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

STATIC_ATTENTION = "specdec_static_prototype"  # models/static.py registers "specdec_static"


@dataclass
class StaticBatch:
    keys: list[torch.Tensor]  # per layer [B, kv_heads, L, D]
    values: list[torch.Tensor]  # per layer [B, kv_heads, L, D]
    positions: torch.Tensor  # [B, k] long: where each fed token is written
    mask: torch.Tensor  # [B, 1, k, L] bool: True where query i may attend key j (j <= positions[b, i])

    @classmethod
    def allocate(cls, config, batch: int, length: int, device, dtype) -> StaticBatch:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (batch, config.num_key_value_heads, length, head_dim)
        layers = config.num_hidden_layers
        return cls([torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)],
                   [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)],
                   torch.zeros((batch, 1), dtype=torch.long, device=device),
                   torch.zeros((batch, 1, 1, length), dtype=torch.bool, device=device))

    def feed(self, starts: torch.Tensor, k: int) -> None:
        """Point the batch at k tokens per session after `starts` [B] cached ones (new tensors: set
        before capturing a graph, never between its replays)."""
        length = self.keys[0].shape[2]
        self.positions = starts[:, None] + torch.arange(k, device=starts.device)  # [B, k]
        keys = torch.arange(length, device=starts.device)
        self.mask = (keys[None, None, :] <= self.positions[:, :, None])[:, None]  # [B, 1, k, L]


def static_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     static: StaticBatch | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, heads, k, D], key/value [B, kv_heads, k, D] -> [B, k, heads, D]."""
    if static is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    layer = module.layer_idx
    index = static.positions[:, None, :, None].expand_as(key)
    static.keys[layer].scatter_(2, index, key)
    static.values[layer].scatter_(2, index, value)
    out = F.scaled_dot_product_attention(query, static.keys[layer], static.values[layer], attn_mask=static.mask,
                                         scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(STATIC_ATTENTION, static_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(STATIC_ATTENTION, sdpa_mask)


def static_logits(model, static: StaticBatch, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [B, k] -> logits [B, k, V] fp32, writing the tokens' keys and values into `static`."""
    hidden = model.model(input_ids=input_ids, position_ids=static.positions, attention_mask={"full_attention": None},
                         use_cache=False, static=static).last_hidden_state
    return model.lm_head(hidden).float()


class CapturedPass:
    """`static_logits` for one (B, k) captured as a CUDA graph; `run(ids)` copies the ids in and replays."""

    def __init__(self, model, static: StaticBatch, k: int, warmup: int = 3):
        batch = static.positions.shape[0]
        self.model, self.static = model, static
        self.input_ids = torch.zeros((batch, k), dtype=torch.long, device=static.positions.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                static_logits(model, static, self.input_ids)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = static_logits(model, static, self.input_ids)

    def run(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.input_ids.copy_(input_ids)
        self.graph.replay()
        return self.logits
