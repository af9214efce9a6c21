"""KV caches for many sessions, and the ragged forward pass that feeds them.

A pass feeds several sessions' tokens at once, flattened into one row as vLLM v1 does: no padding,
so every linear layer sees exactly the tokens sent (a draft step of 8 sessions is M = 8, a
verification pass of sessions with K = 3 and K = 9 is M = 4 + 10). Only attention needs to know
which session a token belongs to. `RaggedBatch` says it (segment bounds and start positions), the
cache's layers (`SlotLayer`, transformers' public `CacheLayerMixin`) write each segment's keys and
values into its session's slot, and `ragged_attention` (registered in transformers'
`AttentionInterface`) runs each segment against its own slot. Rollback is bookkeeping: a slot's
length is the number of tokens its session holds, and positions past it are overwritten by the
next pass.

Worked example: session a holds 5 tokens, session b holds 2; a feeds [a5 a6], b feeds [b2].
input_ids [[a5 a6 b2]], position_ids [[5 6 2]], bounds [0 2 3]. In every layer the keys and values
of a5, a6 land in a's slot at positions 5..6 and those of b2 in b's slot at 2; a's two queries
attend a's positions 0..5 and 0..6 (a causal mask over 7 keys), b's query attends b's 0..2.

Why not transformers' continuous-batching classes: they are private, return one logit per request
(verification needs K + 1) and have no rollback. Why not one padded [B, T] batch: padding a
prefill of hundreds of tokens beside one-token steps multiplies the rows every linear computes,
and on a CPU a pass grows with its rows (docs/performance.md).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

RAGGED_ATTENTION = "specdec_ragged"
MIN_SLOT_CAPACITY = 64  # positions a slot reserves at first; it doubles when full


@dataclass
class SlotBuffers:
    """One session's keys and values in a slot cache: per layer [kv_heads, capacity, head_dim];
    positions at or past the session's length are scratch. Owned by the session, so a session
    dropped anywhere (released, evicted, failed) frees its memory with it."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def reserve(self, layer: int, like: torch.Tensor, length: int, keep: int) -> None:
        """Make room for `length` positions in `layer`, keeping the first `keep`; like [kvh, T, D]."""
        while len(self.keys) <= layer:
            empty = like.new_empty((like.shape[0], 0, like.shape[-1]))
            self.keys.append(empty)
            self.values.append(empty)
        capacity = self.keys[layer].shape[1]
        if length <= capacity:
            return
        capacity = max(length, 2 * capacity, MIN_SLOT_CAPACITY)
        for buffers in (self.keys, self.values):
            grown = like.new_empty((like.shape[0], capacity, like.shape[-1]))
            grown[:, :keep] = buffers[layer][:, :keep]
            buffers[layer] = grown


@dataclass
class RaggedBatch:
    """The layout of one ragged pass over B sessions feeding T tokens in all.

    Worked example (the module docstring's): slots [a, b], starts [5, 2], counts [2, 1] ->
    bounds [0, 2, 3], positions [5, 6, 2], masks [[2, 7] causal, None].
    """

    slots: list[SlotBuffers]  # [B]
    starts: list[int]  # [B] tokens each session holds before the pass (where its segment is written)
    counts: list[int]  # [B] tokens each session feeds (>= 1)
    bounds: list[int] = field(init=False)  # [B + 1] segment b is tokens bounds[b]:bounds[b + 1] of the row
    _masks: dict = field(init=False, default_factory=dict)

    def __post_init__(self):
        self.bounds = [0]
        for count in self.counts:
            self.bounds.append(self.bounds[-1] + count)

    @property
    def positions(self) -> list[int]:  # [T]
        return [start + i for start, count in zip(self.starts, self.counts) for i in range(count)]

    def mask(self, b: int, device: torch.device) -> torch.Tensor | None:
        """[count, start + count] bool, True where query i (position start + i) may attend key j: j <= start + i.
        None for a single query, which attends every key it is given."""
        start, count = self.starts[b], self.counts[b]
        if count == 1:
            return None
        key = (b, device)
        if key not in self._masks:
            keys = torch.arange(start + count, device=device)
            self._masks[key] = keys[None, :] <= (start + torch.arange(count, device=device))[:, None]
        return self._masks[key]


class SlotLayer(CacheLayerMixin):
    """One layer of a `SlotCache`: writes each segment's new keys and values into its session's
    slot. The attention function reads them back (keys and values are not concatenated here:
    every session attends only its own)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states [1, kv_heads, T, head_dim]; the pass's RaggedBatch comes with the
        model call's keyword arguments (transformers 5.x hands them over as `kwargs=`)."""
        batch: RaggedBatch = kwargs.get("ragged") or kwargs["kwargs"]["ragged"]
        layer = self.layer_index
        for b, slot in enumerate(batch.slots):
            lo, hi = batch.bounds[b], batch.bounds[b + 1]
            start = batch.starts[b]
            slot.reserve(layer, key_states[0], start + hi - lo, keep=start)
            slot.keys[layer][:, start:start + hi - lo] = key_states[0, :, lo:hi]
            slot.values[layer][:, start:start + hi - lo] = value_states[0, :, lo:hi]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return 0, query_length  # unused: a ragged pass brings its own masks

    def get_seq_length(self) -> int:
        return 0  # sessions differ; positions always come with the pass

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """The transformers `Cache` of a slot runtime: one `SlotLayer` per model layer."""

    def __init__(self, num_layers: int):
        layers = [SlotLayer() for _ in range(num_layers)]
        for index, layer in enumerate(layers):
            layer.layer_index = index
        super().__init__(layers=layers)


def ragged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     ragged: RaggedBatch | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, D] -> [1, T, heads, D]: each segment attends its own slot. Without a
    `ragged` batch (a plain forward: teacher forcing, HF generate) this is transformers' sdpa."""
    if ragged is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    layer = module.layer_idx
    outputs = []
    for b, slot in enumerate(ragged.slots):
        lo, hi = ragged.bounds[b], ragged.bounds[b + 1]
        end = ragged.starts[b] + hi - lo
        outputs.append(F.scaled_dot_product_attention(
            query[:, :, lo:hi], slot.keys[layer][None, :, :end], slot.values[layer][None, :, :end],
            attn_mask=ragged.mask(b, query.device), scale=scaling,
            enable_gqa=query.shape[1] != slot.keys[layer].shape[0]))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # [1, heads, T, D]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(RAGGED_ATTENTION, sdpa_mask)  # plain forwards build sdpa's masks


def no_mask(model, device: torch.device) -> dict | torch.Tensor:
    """The attention mask a ragged or static pass hands the model, so that transformers builds none:
    the pass's attention function brings its own and never reads it. A model with `layer_types`
    (Qwen2, Qwen3) takes the mapping {"full_attention": None} as its masks, built; every other
    (Llama, Mistral, Phi-3) hands what it gets to the mask builder, which fails on a mapping and
    gives a 4D tensor back as it is."""
    if getattr(model.config, "layer_types", None):
        return {"full_attention": None}
    return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)


def supports_slots(model) -> bool:
    """Slots need full attention in every layer and attention through transformers' interface.
    A model names its sliding layers in `layer_types` (Qwen2, Gemma); one without them (Mistral,
    Phi-3, Starcoder2) slides in every layer when its config has a `sliding_window` shorter than its
    context: the slot and static attention ignore the window and would attend every position."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    slides = ("sliding_attention" in layer_types if layer_types
              else window is not None and window < config.max_position_embeddings)
    return not slides and getattr(model, "_can_set_attn_implementation", lambda: True)()


@dataclass
class Feed:
    """One session's part of a pass."""

    session: "KVSession"
    tokens: list[int]  # fed this pass, after the session's cached tokens
    num_outputs: int  # the last positions whose hidden states the caller needs


@dataclass
class KVSession:
    """A session's cache: `tokens` are the ids whose keys and values it holds, in order."""

    tokens: list[int] = field(default_factory=list)
    # the backend's handle on the cache: the slot cache's SlotBuffers, the reference runtime's
    # DynamicCache, a pooled cache's slot (models/pool.py: llama.cpp's sequence, the static cache's
    # row; None until the session's first pass and after an eviction)
    handle: SlotBuffers | DynamicCache | int | None = None
    # a fused draft's suffix session beside the model's cache (models/suffix.py `SuffixSession`,
    # made at its first round by proposers.py `FusedProposer`)
    suffix: object | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class StateReader:
    """The outputs of some of a model's modules (decoder layers, the final norm) at every position a
    pass feeds: what a feature draft reads from its target (models/feature_draft.py). Forward hooks
    keep each module's output while `reading`, so transformers' layers stay as they are, a pass that
    reads nothing pays nothing, and a forward of the model outside the runtime's passes (teacher
    forcing) is not caught. Every KV cache below runs its passes inside `reading(kv.reader)` and
    hands the caught states back with its hidden states."""

    def __init__(self, modules):
        self._caught: list[list[torch.Tensor]] = [[] for _ in modules]
        self._on = False
        for i, module in enumerate(modules):
            module.register_forward_hook(lambda _module, _args, out, i=i: self._catch(i, out))

    def _catch(self, i: int, out) -> None:
        if self._on:
            self._caught[i].append(out[0] if isinstance(out, tuple) else out)

    @contextmanager
    def on(self):
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def take(self) -> torch.Tensor:
        """The modules' outputs since the last `take`, joined along the tokens and stacked:
        [..., T, reads, H] (a ragged pass's [1, T, ...], a static pass's [B, k, ...])."""
        states = torch.stack([torch.cat(outs, dim=-2) for outs in self._caught], dim=-2)
        for outs in self._caught:
            outs.clear()
        return states


def reading(reader: StateReader | None):
    """`reader.on()`, or nothing where nothing is read."""
    return nullcontext() if reader is None else reader.on()


# What every KV cache's `hidden_states` returns: the final hidden states [sum num_outputs, H] of each
# feed's last num_outputs positions, feed by feed, and, where the cache has a reader, each feed's read
# states [len(feed.tokens), reads, H] at every position it fed (None without one).
PassRows = tuple[torch.Tensor, "list[torch.Tensor] | None"]


class SlotKV:
    """Every session in slots of one `SlotCache`: one ragged pass for any number of sessions."""

    reader: StateReader | None = None  # set by the runtime (`read_features`)

    def __init__(self, model):
        model.set_attn_implementation(RAGGED_ATTENTION)
        self.cache = SlotCache(model.config.num_hidden_layers)

    def new_session(self) -> KVSession:
        return KVSession(handle=SlotBuffers())

    def rollback(self, session: KVSession, length: int) -> None:
        del session.tokens[length:]  # the slot's positions past `length` become scratch

    def hidden_states(self, model, feeds: list[Feed], protected: list[Feed] = ()) -> PassRows:
        """One pass over every feed (`PassRows`). (`protected`: the sessions a pooled cache must not
        evict; none here.)"""
        counts = [len(f.tokens) for f in feeds]
        batch = RaggedBatch([f.session.handle for f in feeds], [len(f.session) for f in feeds], counts)
        device = model.device
        input_ids = torch.tensor([[t for f in feeds for t in f.tokens]], dtype=torch.long, device=device)  # [1, T]
        positions = torch.tensor([batch.positions], dtype=torch.long, device=device)  # [1, T]
        with reading(self.reader):
            out = model.model(input_ids=input_ids, position_ids=positions, cache=self.cache, use_cache=True,
                              attention_mask=no_mask(model, device), ragged=batch)
        rows = [i for b, f in enumerate(feeds) for i in range(batch.bounds[b + 1] - f.num_outputs, batch.bounds[b + 1])]
        read = None if self.reader is None else list(self.reader.take()[0].split(counts))
        return out.last_hidden_state[0, rows], read  # [sum num_outputs, H]


class ReferenceKV:
    """Today's batch-1 path, kept as the reference the tests compare against: a DynamicCache per
    session and one forward pass per session."""

    reader: StateReader | None = None

    def __init__(self, model):  # as SlotKV's; a DynamicCache needs nothing from the model
        pass

    def new_session(self) -> KVSession:
        return KVSession(handle=DynamicCache())

    def rollback(self, session: KVSession, length: int) -> None:
        if length < len(session.tokens):
            session.handle.crop(length - len(session.tokens))  # a negative count removes that many positions
            del session.tokens[length:]

    def hidden_states(self, model, feeds: list[Feed], protected: list[Feed] = ()) -> PassRows:
        rows = []
        with reading(self.reader):
            for f in feeds:
                input_ids = torch.tensor([f.tokens], dtype=torch.long, device=model.device)
                out = model.model(input_ids=input_ids, cache=f.session.handle, use_cache=True)
                rows.append(out.last_hidden_state[0, len(f.tokens) - f.num_outputs:])
        read = None if self.reader is None else list(self.reader.take()[0].split([len(f.tokens) for f in feeds]))
        return torch.cat(rows), read

