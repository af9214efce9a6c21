"""A draft that reads the target's own hidden features: one decoder layer of the target's
architecture on top of what the target has already computed (docs/feature-draft.md).

At position t the draft is fed g_t, the target's features at t, and the embedding of the token at
t + 1, and predicts the token at t + 2:

    g_t = W_reduce [rms(h_t^low); rms(h_t^mid); rms(h_t^high)]    (or the target's output state)
    x_t = W_fuse [norm_e(E x_{t+1}); norm_g(g_t)]
    s_t = Layer(x_t; its keys and values at 0..t)                   one decoder layer, causal
    q(x_{t+2}) = softmax(U_trim norm(s_t))                          U: the target's LM head rows

A later draft position feeds the draft's own output state forward (g_{t+1} := s_t) with the
embedding of the token it just drafted. E (the target's embeddings) and U (the target's LM head,
only the rows of a trimmed vocabulary) are the target's, frozen and read from its files, never
copied into ours; ids outside the trimmed vocabulary get q = 0, which verification handles like
any draft that never proposes them (lossless either way).

Training unrolls several draft steps (`unroll`, "training-time test"): step j at position p sees
the step-1 keys of positions <= p - j + 1 (those made from the target's features) and the keys of
its own chain (steps 2..j at p - j + 2 .. p), exactly what a session's cache holds when it drafts
(`chain_attention`). Serving keeps one cache per session in the slot layout of models/cache.py, or a
row of a static cache (models/static.py). Its runtime in the round loop is models/feature_runtime.py,
its files models/feature_files.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch import nn

from specdec.errors import IncompatibleModelsError, ModelSourceError
from specdec.models.cache import KVSession, RaggedBatch, SlotBuffers, SlotCache, ragged_attention
from specdec.models.static import StaticKV, static_attention

FORMAT_VERSION = 1
# Decoder layers whose attention is q/k/v/o projections with rotary positions and an MLP beside
# it (their transformers classes are built from the target's config with one layer).
SUPPORTED_TYPES = ("qwen2", "llama", "mistral")
OUTPUT_STATE = "output"  # `inputs`: the target's output state alone (the one-layer variant)
FUSED = "fused"  # `inputs`: the target's low, middle and high layers, reduced to one width


class FeatureDraftConfig(BaseModel):
    """What `config.json` holds: the target it reads and the layer's shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = FORMAT_VERSION
    target_identity: str  # models/sources.py model_identity of the target it was trained on
    target_name: str = ""  # how it was named when trained ("default", a path), for messages
    inputs: Literal["fused", "output"] = FUSED  # FUSED or OUTPUT_STATE
    layers: list[int] = []  # the target's decoder layers read when FUSED (0-based)
    layer_config: dict  # the target's transformers config with one layer and the draft's MLP width
    vocab_size: int  # the target's full vocabulary (q is scattered into it)
    dtype: str = "float32"  # of the saved weights

    @property
    def reads(self) -> int:
        """How many target states a position needs (the output state is always stored last)."""
        return len(self.layers) if self.inputs == FUSED else 1


def layer_config_of(target_config, intermediate_size: int | None = None) -> dict:
    """The target's config as a one-layer model's (vocabulary of 1: the embeddings are the target's)."""
    if target_config.model_type not in SUPPORTED_TYPES:
        raise IncompatibleModelsError(f"a feature draft needs a target of type {', '.join(SUPPORTED_TYPES)}, "
                                      f"not {target_config.model_type!r}")
    config = target_config.to_dict()
    config.update(num_hidden_layers=1, vocab_size=1, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
                  eos_token_id=None,
                  intermediate_size=intermediate_size or target_config.intermediate_size)
    config.pop("layer_types", None)
    for key in ("_name_or_path", "_model_name_or_path", "architectures", "transformers_version", "dtype",
                "torch_dtype"):
        config.pop(key, None)
    return config


def stored_inputs(states: torch.Tensor, inputs: str, layers: int) -> torch.Tensor:
    """What g_t reads from states stored as [..., layers + 1, H] (training/data.py: the chosen layers,
    then the output state) -> [..., reads, H]."""
    return states[..., :layers, :] if inputs == FUSED else states[..., -1:, :]


def target_layers_of(config: FeatureDraftConfig) -> list[int] | None:
    """The target's decoder layers whose states the draft reads (None: the target's output state)."""
    return list(config.layers) if config.inputs == FUSED else None


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / its root mean square over the last dim: the target's layers differ in scale by 1000s."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kv_heads, T, D] -> [B, kv_heads * groups, T, D] (grouped-query attention's sharing)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def shift_right(x: torch.Tensor, by: int, dim: int) -> torch.Tensor:
    """x moved `by` places along `dim`, zeros in front: out[p] = x[p - by]."""
    if by == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, by))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - by)], dim=dim)


def chain_attention(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                    scale: float) -> torch.Tensor:
    """Attention of draft step j = len(keys) over all positions at once (training-time test).

    query [B, heads, T, D]; keys[i], values[i] [B, kv_heads, T, D] of step i + 1. The query of step j
    at position p attends step 1's keys at positions 0..p - j + 1 and step i's key at p - j + i for
    i = 2..j: the cache of a session that holds the target's features up to t = p - j + 1 and has
    drafted j - 1 tokens since. Step 1 is plain causal attention. Returns [B, heads, T, D].

    Worked example, j = 2, p = 5: step-1 keys 0..4 and the step-2 key at 5 (its own)."""
    groups = query.shape[1] // keys[0].shape[1]
    j = len(keys)
    if j == 1:
        return F.scaled_dot_product_attention(query, repeat_kv(keys[0], groups), repeat_kv(values[0], groups),
                                              is_causal=True, scale=scale)
    T = query.shape[2]
    positions = torch.arange(T, device=query.device)
    first = (query @ repeat_kv(keys[0], groups).transpose(-1, -2)) * scale  # [B, h, T, T]
    first = first.masked_fill(positions[None, :] > positions[:, None] - (j - 1), float("-inf"))
    chain_keys = [shift_right(repeat_kv(k, groups), j - i, dim=2) for i, k in enumerate(keys[1:], start=2)]
    chain_values = [shift_right(repeat_kv(v, groups), j - i, dim=2) for i, v in enumerate(values[1:], start=2)]
    own = torch.stack([(query * k).sum(-1) * scale for k in chain_keys], dim=-1)  # [B, h, T, j - 1]
    valid = torch.stack([positions >= j - i for i in range(2, j + 1)], dim=-1)  # [T, j - 1]
    own = own.masked_fill(~valid, float("-inf"))  # the step-j key (shift 0) is always valid: no empty row
    weights = torch.softmax(torch.cat([first, own], dim=-1).float(), dim=-1).to(query.dtype)
    out = weights[..., :T] @ repeat_kv(values[0], groups)
    for i, v in enumerate(chain_values):
        out = out + weights[..., T + i:T + i + 1] * v
    return out


@dataclass
class DraftFeed:
    """One session's part of a ragged draft pass: n positions after those its cache holds."""

    session: KVSession
    features: torch.Tensor  # [n, H] g at each position: the target's (reduced) or the draft's own state
    tokens: list[int]  # [n] the token after each position (x_{t+1})


class FeatureDraft(nn.Module):
    """The draft's trainable part plus the target's frozen embeddings (a buffer) and LM head rows (a
    frozen Linear, so that a weight format converts it with the rest); neither is saved (`own_state`)."""

    FROZEN = ("lm_head.weight",)

    def __init__(self, config: FeatureDraftConfig, embed: torch.Tensor, head: torch.Tensor,
                 vocab_ids: torch.Tensor):
        """embed [V, H] and head [V_trim, H]: the target's, rows of `vocab_ids` [V_trim] for the head."""
        from transformers import AutoConfig, AutoModel
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        super().__init__()
        self.config = config
        self.layer_config = layer_config = AutoConfig.for_model(**config.layer_config)
        base = AutoModel.from_config(layer_config)
        hidden = layer_config.hidden_size
        self.layer, self.rotary = base.layers[0], base.rotary_emb
        self.head_dim = getattr(layer_config, "head_dim", None) or hidden // layer_config.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self._rotate = apply_rotary_pos_emb
        norm = type(base.norm)
        eps = layer_config.rms_norm_eps
        self.reduce = nn.Linear(config.reads * hidden, hidden, bias=False) if config.reads > 1 else None
        self.fuse = nn.Linear(2 * hidden, hidden, bias=False)
        self.embed_norm, self.feature_norm, self.norm = norm(hidden, eps=eps), norm(hidden, eps=eps), norm(hidden, eps=eps)
        self.register_buffer("embed", embed, persistent=False)  # [V, H] frozen
        self.lm_head = nn.Linear(hidden, head.shape[0], bias=False)  # U_trim [V_trim, H], frozen
        self.lm_head.weight = nn.Parameter(head, requires_grad=False)
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=True)  # [V_trim]
        self._cache = SlotCache(1)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its layer computes in (bfloat16 on a GPU; float32 on the CPU, an int8 format's too)."""
        return self.norm.weight.dtype

    # -- the equations of the module docstring --------------------------------------------------

    def feature(self, states: torch.Tensor) -> torch.Tensor:
        """g from the target's states [..., reads, H] (the columns the config reads) -> [..., H]."""
        if self.reduce is None:
            return states[..., 0, :]
        return self.reduce(rms(states).flatten(-2))

    def fused_input(self, g: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """x = W_fuse [norm_e(E x_{t+1}); norm_g(g)]; g [..., H], tokens [...] -> [..., H]."""
        e = self.embed[tokens].to(g.dtype)
        return self.fuse(torch.cat([self.embed_norm(e), self.feature_norm(g)], dim=-1))

    def block(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The decoder layer on x [B, T, H] at positions [B, T]; `attend(q, k, v)` with q [B, heads, T, D],
        k and v [B, kv_heads, T, D] -> [B, heads, T, D] (causal over whatever cache it keeps)."""
        layer, (B, T, _) = self.layer, x.shape
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(B, T, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, positions)
        q, k = self._rotate(q, k, cos, sin)
        out = attend(q, k, v).transpose(1, 2).reshape(B, T, -1)
        x = x + attn.o_proj(out)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V_trim] scores of the trimmed vocabulary."""
        normed = self.norm(state)
        flat = normed.reshape(-1, normed.shape[-1])  # an int8 Linear takes 2-D input only
        return self.lm_head(flat).reshape(*normed.shape[:-1], -1)

    def full_logits(self, state: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]: the trimmed scores scattered into the target's vocabulary, -inf elsewhere (q = 0)."""
        return self.scatter(self.logits(state))

    def scatter(self, trimmed: torch.Tensor) -> torch.Tensor:
        """Scores [..., V_trim] -> [..., V] float, -inf outside the trimmed vocabulary."""
        trimmed = trimmed.float()
        out = trimmed.new_full((*trimmed.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.vocab_ids, trimmed)

    def argmax(self, trimmed: torch.Tensor) -> torch.Tensor:
        """The argmax of `scatter(trimmed)` [..., V] without it: the smallest id among the best scores."""
        best = trimmed == trimmed.amax(dim=-1, keepdim=True)
        return torch.where(best, self.vocab_ids, self.config.vocab_size).amin(dim=-1)

    # -- training: several draft steps over whole sequences ---------------------------------------

    def unroll(self, states: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Output states [B, T, H] of draft steps 1..steps at every position.

        states [B, T, reads, H]: the target's at each position; tokens [B, T]: x_{t+1} at position t
        (the sequence shifted left by one). Every step's state at p drafts the token at p + 2; step j's
        is the j-th draft of a round whose target features end at p - j + 1 (`chain_attention`)."""
        B, T = tokens.shape
        positions = torch.arange(T, device=tokens.device).expand(B, T)
        g = self.feature(states)
        keys, values, outs = [], [], []

        def attend(q, k, v):
            keys.append(k)
            values.append(v)
            return chain_attention(q, keys, values, self.scale)

        for step in range(steps):
            if step:  # position p continues from the draft's own state at p - 1, one step earlier
                g = shift_right(outs[-1], 1, dim=1)
            outs.append(self.block(self.fused_input(g, tokens), positions, attend))
        return outs

    # -- serving: a ragged pass over sessions' caches ---------------------------------------------

    def new_session(self) -> KVSession:
        return KVSession(handle=SlotBuffers())

    @staticmethod
    def rollback(session: KVSession, length: int) -> None:
        del session.tokens[length:]  # the slot's positions past `length` become scratch

    def forward_feeds(self, feeds: list[DraftFeed]) -> torch.Tensor:
        """One pass over every feed, each appended to its session's cache; returns the output states
        [sum n, H], feed by feed."""
        batch = RaggedBatch([f.session.handle for f in feeds], [len(f.session) for f in feeds],
                            [len(f.tokens) for f in feeds])
        device = self.embed.device
        tokens = torch.tensor([t for f in feeds for t in f.tokens], dtype=torch.long, device=device)
        g = torch.cat([f.features for f in feeds]).to(self.dtype)
        positions = torch.tensor([batch.positions], dtype=torch.long, device=device)
        layer = self._cache.layers[0]

        def attend(q, k, v):
            layer.update(k, v, ragged=batch)
            out, _ = ragged_attention(self.layer.self_attn, q, k, v, None, scaling=self.scale, ragged=batch)
            return out.transpose(1, 2)  # ragged_attention returns [1, T, heads, D]

        states = self.block(self.fused_input(g, tokens)[None], positions, attend)[0]
        for f in feeds:
            f.session.tokens.extend(f.tokens)
        return states

    def forward_static(self, feeds: list[DraftFeed], kv: StaticKV) -> torch.Tensor:
        """`forward_feeds` on a static cache (models/static.py): the short feeds padded into one
        [B, k] pass, each long one (a catch-up) in a pass of its own; the output states [sum n, H]."""
        kv.attach(feeds)
        states, _ = kv.in_passes(feeds, lambda group: (self._static_pass(group, kv), None), [len(f.tokens) for f in feeds])
        for f in feeds:
            f.session.tokens.extend(f.tokens)
        return states

    def _static_pass(self, feeds: list[DraftFeed], kv: StaticKV) -> torch.Tensor:
        device = self.embed.device
        tokens, batch = kv.layout(feeds, device)  # [B, k]; pads: token 0 at the scratch position
        width, dtype = tokens.shape[1], self.dtype
        g = torch.stack([F.pad(f.features.to(device, dtype), (0, 0, 0, width - len(f.tokens))) for f in feeds])  # [B, k, H]

        def attend(q, k, v):
            out, _ = static_attention(self.layer.self_attn, q, k, v, None, scaling=self.scale, static=batch,
                                      static_kv=kv)
            return out.transpose(1, 2)  # static_attention returns [B, k, heads, D]

        states = self.block(self.fused_input(g, tokens), batch.positions.clamp(max=kv.capacity - 1), attend)
        index_b = torch.tensor([b for b, f in enumerate(feeds) for _ in f.tokens], device=device)
        index_i = torch.tensor([i for f in feeds for i in range(len(f.tokens))], device=device)
        return states[index_b, index_i]  # [sum n, H]

    # -- files ------------------------------------------------------------------------------------

    def own_state(self) -> dict[str, torch.Tensor]:
        """The state that is ours to save: everything but the target's frozen tensors."""
        return {k: v for k, v in self.state_dict().items() if k not in self.FROZEN}

    def load_own_state(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.load_state_dict(state, strict=False)
        if unexpected or set(missing) - set(self.FROZEN):
            raise ModelSourceError(f"feature draft weights do not fit its config (missing "
                                   f"{sorted(set(missing) - set(self.FROZEN))}, unexpected {sorted(unexpected)})")
