"""The static KV cache (`--kv-cache static`): every session in a row of one cache allocated once, the
layout a GPU wants (fixed addresses and shapes, what CUDA graphs capture; vLLM and gpt-fast keep
their caches the same way).

Per layer, keys and values [slots, capacity + 1, kv_heads, head_dim] on the model's device and in
its dtype, allocated at start. A session takes a row from the slot pool (models/pool.py:
`KVSession.seq`) at its first pass; when every row is taken the least recently used session outside
the pass loses its own and re-prefills at its next call. Rollback is the session's length: positions
past it are scratch, overwritten by the next pass.

A pass over B sessions is one [B, k] batch, k the most tokens any session feeds: a shorter feed is
padded with token 0, written to the row's last, scratch position (`capacity`), and every query
attends its row's keys up to its own position. Rows are gathered up to the longest position in the
pass. Worked example (capacity 8): session a (row 3) holds 5 tokens and
feeds 2, session b (row 0) holds 2 and feeds 1: input_ids [[a5 a6] [b2 0]], positions [[5 6] [2 8]];
a's keys land in row 3 at 5, 6, b's in row 0 at 2 (the pad at 8, scratch); rows are gathered up to
position 6, and the pad's query attends key 0 alone (its output is never read).

Eager here; on CUDA the same pass is what a graph captures (benchmarks/gpu/static_pass.py measured
it: a 0.5B draft step at batch 1 in 2.72 ms captured).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from specdec.models.cache import Feed, KVSession
from specdec.models.pool import SlotPool

STATIC_ATTENTION = "specdec_static"
DEFAULT_SLOTS = 64  # rows: sessions one cache holds
DEFAULT_CAPACITY = 4096  # positions per row


@dataclass
class StaticBatch:
    """One pass's layout over B sessions feeding at most k tokens each (the module docstring's example)."""

    rows: torch.Tensor  # [B] long: each session's row of the cache
    positions: torch.Tensor  # [B, k] long: where each token's keys and values go (pads: the scratch position)
    mask: torch.Tensor  # [B, 1, k, L] bool: query i of session b may attend key j (j <= its position)
    length: int  # L: the positions gathered per row


class StaticKV:
    """Every session in a row of one preallocated cache (the module docstring)."""

    def __init__(self, model, slots: int = DEFAULT_SLOTS, capacity: int = DEFAULT_CAPACITY):
        config = model.config
        model.set_attn_implementation(STATIC_ATTENTION)
        self.capacity = min(capacity, config.max_position_embeddings)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (slots, self.capacity + 1, config.num_key_value_heads, head_dim)  # + 1: the pads' scratch position
        dtype = next(model.parameters()).dtype
        self.keys = [torch.zeros(shape, dtype=dtype, device=model.device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=model.device) for _ in range(config.num_hidden_layers)]
        self.pool = SlotPool(slots)
        self.max_pass_sessions = slots

    def new_session(self) -> KVSession:
        return KVSession()  # a row is attached at its first pass

    def rollback(self, session: KVSession, length: int) -> None:
        del session.tokens[length:]  # the row's positions past `length` become scratch

    def hidden_states(self, model, feeds: list[Feed], protected: list[Feed] = ()) -> torch.Tensor:
        """One pass over every feed (at most `max_pass_sessions`); returns the final hidden states
        [sum num_outputs, H] of each feed's last num_outputs positions, feed by feed. A row is taken
        from the least recently used session outside `feeds` and `protected` (the call's later passes)."""
        self.pool.reclaim()
        keep = [f.session for f in feeds] + [f.session for f in protected]
        for feed in feeds:
            if not self.pool.attach(feed.session, keep):
                raise ValueError(f"a pass of {len(feeds)} sessions exceeds the static cache's {self.pool.size} rows")
            if len(feed.session) + len(feed.tokens) > self.capacity:
                raise ValueError(f"a session of {len(feed.session) + len(feed.tokens)} positions does not fit the "
                                 f"static cache's {self.capacity} (raise its capacity)")
        device, width = model.device, max(len(f.tokens) for f in feeds)
        starts = torch.tensor([len(f.session) for f in feeds], device=device)  # [B]
        counts = torch.tensor([len(f.tokens) for f in feeds], device=device)  # [B]
        steps = torch.arange(width, device=device)
        real = steps[None, :] < counts[:, None]  # [B, k]
        positions = torch.where(real, starts[:, None] + steps[None, :], self.capacity)  # [B, k]
        length = int((starts + counts).max())
        keys = torch.arange(length, device=device)
        seen = torch.where(real, positions, 0)  # a pad's query attends key 0 alone (its output is never read)
        mask = (keys[None, None, :] <= seen[:, :, None])[:, None]  # [B, 1, k, L]
        batch = StaticBatch(torch.tensor([f.session.seq for f in feeds], device=device), positions, mask, length)
        input_ids = torch.tensor([f.tokens + [0] * (width - len(f.tokens)) for f in feeds], dtype=torch.long,
                                 device=device)  # [B, k]
        out = model.model(input_ids=input_ids, position_ids=positions.clamp(max=self.capacity - 1),
                          attention_mask={"full_attention": None}, use_cache=False, static=batch, static_kv=self)
        rows = [(b, i) for b, f in enumerate(feeds) for i in range(len(f.tokens) - f.num_outputs, len(f.tokens))]
        index_b = torch.tensor([b for b, _ in rows], device=device)
        index_i = torch.tensor([i for _, i in rows], device=device)
        return out.last_hidden_state[index_b, index_i]  # [sum num_outputs, H]


def static_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     static: StaticBatch | None = None, static_kv: StaticKV | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, heads, k, D], key/value [B, kv_heads, k, D] -> [B, k, heads, D]: the pass's keys and
    values written into their rows, each query against its row. Without a batch (a plain forward:
    teacher forcing, HF generate) this is transformers' sdpa."""
    if static is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    layer = module.layer_idx
    cache_k, cache_v = static_kv.keys[layer], static_kv.values[layer]  # [S, capacity + 1, kvh, D]
    slots, width = cache_k.shape[:2]
    flat = (static.rows[:, None] * width + static.positions).reshape(-1)  # [B * k]
    heads, dim = key.shape[1], key.shape[-1]
    cache_k.view(slots * width, heads, dim).index_copy_(0, flat, key.transpose(1, 2).reshape(-1, heads, dim).to(cache_k.dtype))
    cache_v.view(slots * width, heads, dim).index_copy_(0, flat, value.transpose(1, 2).reshape(-1, heads, dim).to(cache_v.dtype))
    keys = cache_k[static.rows, :static.length].transpose(1, 2)  # [B, kvh, L, D]
    values = cache_v[static.rows, :static.length].transpose(1, 2)
    out = F.scaled_dot_product_attention(query, keys.to(query.dtype), values.to(query.dtype), attn_mask=static.mask,
                                         scale=scaling, enable_gqa=query.shape[1] != heads)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(STATIC_ATTENTION, static_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(STATIC_ATTENTION, sdpa_mask)  # plain forwards build sdpa's masks
