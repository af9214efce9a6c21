"""The static KV cache (`--kv-cache static`): every session in a row of one cache allocated once, the
layout a GPU wants (fixed addresses and shapes, what CUDA graphs capture; vLLM and gpt-fast keep
their caches the same way).

Per layer, keys and values [slots, capacity + 1, kv_heads, head_dim] on the layer's device (a sharded
target's span several GPUs; it then runs eagerly) and in the model's dtype, allocated at start. A
session takes a row from the slot pool (models/pool.py: `KVSession.handle`) at its first pass; when
every row is taken the least recently used session outside the pass loses its own and re-prefills
at its next call. Rollback is the session's length: positions past it are scratch, overwritten by
the next pass.

A pass over B sessions is one [B, k] batch, k the most tokens any session feeds: a shorter feed is
padded with token 0, written to the row's last, scratch position (`capacity`), and every query
attends its row's keys up to its own position. Rows are gathered up to the longest position in the
pass. Worked example (capacity 8): session a (row 3) holds 5 tokens and
feeds 2, session b (row 0) holds 2 and feeds 1: input_ids [[a5 a6] [b2 0]], positions [[5 6] [2 8]];
a's keys land in row 3 at 5, 6, b's in row 0 at 2 (the pad at 8, scratch); rows are gathered up to
position 6, and the pad's query attends key 0 alone (its output is never read).

On CUDA with `graphs` on, a pass that fits the largest bucket (by default 64 sessions feeding at
most 16 tokens each: drafting steps, verifications; not prefills) is padded up to a bucket
(sessions, tokens, gathered length: powers of two) and replayed as a CUDA graph captured at the
bucket's first use: one launch instead of hundreds (docs/performance.md, "On a GPU"). Padding
sessions write to a scratch row (`slots`). Eager (`graphs` off, and on the CPU) is the reference the
tests compare against. The cache's settings (rows, capacity, graphs, buckets) are one
`StaticOptions`, given when it is built.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from specdec.models.cache import Feed, KVSession, PassRows, StateReader, no_mask, reading
from specdec.models.pool import SlotPool

STATIC_ATTENTION = "specdec_static"
DEFAULT_SLOTS = 64  # rows: sessions one cache holds
DEFAULT_CAPACITY = 4096  # positions per row
GRAPH_SESSIONS = (1, 2, 4, 8, 16, 32, 64)  # captured batch sizes (a pass is padded up to one)
GRAPH_TOKENS = (1, 2, 4, 8, 16)  # captured tokens per session
MIN_GRAPH_LENGTH = 256  # gathered positions per row, captured in powers of two from here
PREFILL_TOKENS = 8192  # padded tokens one pass of long feeds computes at most


def prefill_groups(indices: list[int], lengths: list[int], most_tokens: int) -> list[list[int]]:
    """The long feeds `indices` (their lengths by index) in as few padded passes as `most_tokens`
    allows: longest first, a pass taking the next feed while its sessions x its longest feed fit
    (a feed longer than that alone is a pass of its own). Worked example, most_tokens 100: lengths
    90, 40, 30, 20 -> [90], [40, 30] (2 x 40 = 80; a third would make 120), [20]."""
    groups: list[list[int]] = []
    for i in sorted(indices, key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= most_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def bucket(value: int, sizes) -> int | None:
    """The smallest of `sizes` holding `value` (None: none does)."""
    return next((size for size in sizes if size >= value), None)


@dataclass(frozen=True)
class StaticOptions:
    """The static cache's settings (`CausalLMRuntime(model, kv="static", static=StaticOptions(...))`)."""

    slots: int = DEFAULT_SLOTS  # rows: sessions one cache holds (and one pass at most)
    capacity: int = DEFAULT_CAPACITY  # positions per row (at most the model's context)
    graphs: bool = False  # on CUDA (one device), replay the passes that fit a bucket as captured graphs
    # with `graphs`, off CUDA too: pad each such pass to its bucket and run it eagerly, what a replay
    # computes (nothing is captured there; the tests and the GPU benchmark's CPU smoke run)
    pad_off_cuda: bool = False
    graph_sessions: tuple[int, ...] = GRAPH_SESSIONS  # the buckets' sessions per pass
    graph_tokens: tuple[int, ...] = GRAPH_TOKENS  # the buckets' tokens per session (a longer feed: a pass of its own)
    min_graph_length: int = MIN_GRAPH_LENGTH  # the buckets' gathered positions: powers of two from here
    # the most tokens one eager pass over long feeds (prefills, catch-ups) computes, padding included
    # (sessions x the longest feed): sessions joining at once share a pass up to it
    prefill_tokens: int = PREFILL_TOKENS


@dataclass
class StaticBatch:
    """One pass's layout over B sessions feeding at most k tokens each (the module docstring's example)."""

    rows: torch.Tensor  # [B] long: each session's row of the cache
    positions: torch.Tensor  # [B, k] long: where each token's keys and values go (pads: the scratch position)
    mask: torch.Tensor  # [B, 1, k, L] bool: query i of session b may attend key j (j <= its position)
    length: int  # L: the positions gathered per row

    @classmethod
    def of(cls, rows: torch.Tensor, positions: torch.Tensor, length: int, capacity: int) -> StaticBatch:
        """The batch of these rows and positions (a pad's at `capacity`): each query attends its row's
        keys up to its own position, a pad's key 0 alone (its output is never read). On the device,
        from the positions: inside a captured pass, part of its graph."""
        keys = torch.arange(length, device=positions.device)
        seen = torch.where(positions < capacity, positions, 0)
        return cls(rows, positions, (keys[None, None, :] <= seen[:, :, None])[:, None], length)


class StaticKV:
    """Every session in a row of one preallocated cache (the module docstring)."""

    def __init__(self, model, options: StaticOptions = StaticOptions()):
        model.set_attn_implementation(STATIC_ATTENTION)
        # a sharded target's layers sit on several GPUs (models/sharding.py)
        self._allocate(model.config, next(model.parameters()).dtype, layer_devices(model), options)

    @classmethod
    def of_layers(cls, config, dtype: torch.dtype, device: torch.device, options: StaticOptions) -> StaticKV:
        """A cache for decoder layers run by hand (the feature draft's one: models/feature_draft.py),
        `config` their transformers config; they call `static_attention` themselves."""
        kv = cls.__new__(cls)
        kv._allocate(config, dtype, [torch.device(device)] * config.num_hidden_layers, options)
        return kv

    def _allocate(self, config, dtype: torch.dtype, devices: list[torch.device], options: StaticOptions) -> None:
        self.options, slots = options, options.slots
        self.capacity = min(options.capacity, config.max_position_embeddings)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # + 1 row and position: the padding sessions' and tokens' scratch
        shape = (slots + 1, self.capacity + 1, config.num_key_value_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for device in devices]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for device in devices]
        self.pool = SlotPool(slots)
        self.max_pass_sessions = slots
        # CUDA on one device only: padding buys nothing without a graph (`pad_off_cuda` pads on the
        # CPU to check the buckets' padding, replayed eagerly), and a sharded model runs eagerly
        on_cuda = devices[0].type == "cuda"
        self.graphs = options.graphs and (len(set(devices)) == 1 if on_cuda else options.pad_off_cuda)
        self._captured: dict[tuple[int, int, int], CapturedPass] = {}
        self._reader: StateReader | None = None
        self._graph_pool = torch.cuda.graph_pool_handle() if self.graphs and on_cuda else None  # shared by every capture

    def new_session(self) -> KVSession:
        return KVSession()  # a row is attached at its first pass

    def rollback(self, session: KVSession, length: int) -> None:
        del session.tokens[length:]  # the row's positions past `length` become scratch

    def hidden_states(self, model, feeds: list[Feed], protected: list[Feed] = ()) -> PassRows:
        """Every feed (at most `max_pass_sessions`) in the passes `in_passes` groups them into
        (`PassRows`). A row is taken from the least recently used session outside `feeds` and
        `protected` (the call's later passes)."""
        self.attach(feeds, protected)
        return self.in_passes(feeds, lambda group: self._pass(model, group), [f.num_outputs for f in feeds])

    def in_passes(self, feeds: list, run, counts: list[int]) -> PassRows:
        """`run(group)` -> `PassRows` of the group ([sum of its counts] rows, its feeds' read states or
        None) over the short feeds padded together into one pass (what a graph replays) and the long
        ones (prefills, catch-ups) padded together into as few eager passes as `prefill_tokens`
        allows, longest first: sessions joining at once are one prefill pass, not one each, and a
        prefill never pads a step's one-token feeds to its length. The rows put back feed by feed."""
        most = self.options.graph_tokens[-1]
        short = [i for i, f in enumerate(feeds) if len(f.tokens) <= most]
        groups = ([short] if short else []) + prefill_groups(
            [i for i, f in enumerate(feeds) if len(f.tokens) > most], [len(f.tokens) for f in feeds],
            self.options.prefill_tokens)
        if len(groups) == 1:
            return run(feeds)
        rows, read = {}, {}
        for group in groups:
            hidden, states = run([feeds[i] for i in group])
            rows.update(zip(group, hidden.split([counts[i] for i in group])))
            read.update(zip(group, states or ()))
        return (torch.cat([rows[i] for i in range(len(feeds))]),
                [read[i] for i in range(len(feeds))] if read else None)

    def attach(self, feeds: list[Feed], protected: list[Feed] = (), steps: int = 0) -> None:
        """A row for each feed's session (taken from the least recently used session outside `feeds`
        and `protected`), checked to hold the feed and `steps` positions more."""
        self.pool.reclaim()
        keep = [f.session for f in feeds] + [f.session for f in protected]
        for feed in feeds:
            if not self.pool.attach(feed.session, keep):
                raise ValueError(f"a pass of {len(feeds)} sessions exceeds the static cache's {self.pool.size} rows")
            if (length := len(feed.session) + len(feed.tokens) + steps) > self.capacity:
                raise ValueError(f"a session of {length} positions does not fit the static cache's "
                                 f"{self.capacity} (raise its capacity)")

    def _pass(self, model, feeds: list[Feed]) -> PassRows:
        """One [B, k] pass over feeds whose sessions hold rows (`PassRows`): what crosses to the device
        is one copy of the pass's inputs and one of the rows to keep."""
        device = model.device
        captured = self.captured_pass(model, len(feeds), max(len(f.tokens) for f in feeds),
                                      max(len(f.session) + len(f.tokens) for f in feeds)) if self.graphs else None
        if captured is not None:
            sessions, tokens = captured.sessions, captured.tokens
            # [B, k, H] and [B, k, reads, H]: a replay's are the graph's own tensors, overwritten by the
            # next replay, so what is kept is gathered (a copy) below
            last_hidden, states = captured.run(self.pack(feeds, sessions, tokens))
        else:
            input_ids, batch = self.layout(feeds, device)
            sessions, tokens = input_ids.shape
            last_hidden, states = self.forward(model, input_ids, batch)
        # the rows kept, flat over [sessions * tokens]: each feed's outputs, then (read) every position it fed
        outputs = [b * tokens + i for b, f in enumerate(feeds) for i in range(len(f.tokens) - f.num_outputs, len(f.tokens))]
        fed = [b * tokens + i for b, f in enumerate(feeds) for i in range(len(f.tokens))] if states is not None else []
        index = torch.tensor(outputs + fed, dtype=torch.long, device=device)
        hidden = last_hidden.reshape(sessions * tokens, -1)[index[:len(outputs)]]  # [sum num_outputs, H]
        if states is None:
            return hidden, None
        read = states.reshape(sessions * tokens, *states.shape[2:])[index[len(outputs):]]  # [sum fed, reads, H]
        return hidden, list(read.split([len(f.tokens) for f in feeds]))

    def pack(self, feeds: list[Feed], sessions: int, tokens: int) -> torch.Tensor:
        """The inputs of a [sessions, tokens] pass over `feeds` (sessions whose rows are attached), in
        one host tensor [2 * sessions * tokens + sessions] long that one copy carries to the device
        (`unpack`): the token ids, their positions, each session's row; padding after each feed and
        after the feeds (token 0 at the scratch position of the scratch row)."""
        ids, positions = [0] * (sessions * tokens), [self.capacity] * (sessions * tokens)
        rows = [self.pool.size] * sessions
        for b, feed in enumerate(feeds):
            at, start, n = b * tokens, len(feed.session), len(feed.tokens)
            ids[at:at + n] = feed.tokens
            positions[at:at + n] = range(start, start + n)
            rows[b] = feed.session.handle
        return torch.tensor(ids + positions + rows, dtype=torch.long)

    def layout(self, feeds: list[Feed], device: torch.device) -> tuple[torch.Tensor, StaticBatch]:
        """(input_ids [B, k], their batch) for one eager pass over feeds whose sessions hold rows (the
        module docstring's example); nothing is written until `forward` runs them."""
        width = max(len(f.tokens) for f in feeds)
        input_ids, rows, positions = unpack(self.pack(feeds, len(feeds), width).to(device), len(feeds), width)
        length = max(len(f.session) + len(f.tokens) for f in feeds)  # from the host: no device sync
        return input_ids, StaticBatch.of(rows, positions, length, self.capacity)

    def forward(self, model, input_ids: torch.Tensor, batch: StaticBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [B, k] -> (the final hidden states [B, k, H], the reader's states [B, k, reads, H]
        or None), writing the tokens' keys and values. Captured, both are the graph's outputs: the
        reader's hooks run while the graph is captured and the stack of what they caught is one of
        its kernels, so a replay hands out the states without running Python."""
        with reading(self.reader):
            hidden = model.model(input_ids=input_ids, position_ids=batch.positions.clamp(max=self.capacity - 1),
                                 attention_mask=no_mask(model, input_ids.device), use_cache=False, static=batch,
                                 static_kv=self).last_hidden_state
        return hidden, None if self.reader is None else self.reader.take()

    @property
    def reader(self) -> StateReader | None:
        return self._reader

    @reader.setter
    def reader(self, reader: StateReader | None) -> None:
        """Set by the runtime (`read_features`); a graph captured before returns no states: dropped."""
        self.close()
        self._reader = reader

    def graph_bucket(self, sessions: int, tokens: int, length: int) -> tuple[int, int, int] | None:
        """The bucket (sessions, tokens, gathered length) a pass of this size is padded to and
        replayed as; None where the pass is larger than every bucket (a prefill: eager)."""
        key = (bucket(sessions, self.options.graph_sessions), bucket(tokens, self.options.graph_tokens),
               bucket(length, self.graph_lengths))
        return None if None in key else key

    @property
    def graph_lengths(self) -> list[int]:
        """The buckets' gathered positions a row: powers of two from `min_graph_length`, up to the row's."""
        return [n for n in (self.options.min_graph_length << i for i in range(32)) if n <= self.capacity + 1]

    def close(self) -> None:
        """Destroy the captured graphs now (their memory stays in the pool until the cache goes)."""
        for captured in self._captured.values():
            captured.close()
        self._captured.clear()

    def captured_pass(self, model, sessions: int, tokens: int, length: int) -> CapturedPass | None:
        """The graph for this pass's bucket, captured at its first use (None: `graph_bucket`'s)."""
        key = self.graph_bucket(sessions, tokens, length)
        if key is None:
            return None
        if key not in self._captured:
            self._captured[key] = CapturedPass(self, model, *key)
        return self._captured[key]


def unpack(packed: torch.Tensor, sessions: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`StaticKV.pack`'s tensor -> (input_ids [sessions, tokens], rows [sessions], positions [sessions, tokens]), views."""
    n = sessions * tokens
    return packed[:n].view(sessions, tokens), packed[2 * n:], packed[n:2 * n].view(sessions, tokens)


def layer_devices(model) -> list[torch.device]:
    """The device of each decoder layer's weights (one for a model on one device)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) != model.config.num_hidden_layers:
        return [model.device] * model.config.num_hidden_layers
    return [next(layer.parameters()).device for layer in layers]


class CapturedPass:
    """`StaticKV.forward` for one bucket (B sessions, k tokens, L gathered positions) captured as a
    CUDA graph over one fixed input tensor (`StaticKV.pack`'s layout; the attention mask is computed
    from it inside the graph); `run` copies a pass padded to the bucket into it and replays. Off CUDA
    nothing is captured and `run` runs the padded pass eagerly."""

    def __init__(self, kv: StaticKV, model, sessions: int, tokens: int, length: int, warmup: int = 2):
        device = model.device
        self.kv, self.model, self.sessions, self.tokens, self.length, self.graph = kv, model, sessions, tokens, length, None
        self.packed = kv.pack([], sessions, tokens).to(device)  # all padding until a pass is copied in
        if device.type == "cuda":  # the outputs: hidden [B, k, H], the reader's states [B, k, reads, H] or None
            self.graph, self.outputs = capture(self._forward, device, kv._graph_pool, warmup)

    def _forward(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_ids, rows, positions = unpack(self.packed, self.sessions, self.tokens)
        return self.kv.forward(self.model, input_ids, StaticBatch.of(rows, positions, self.length, self.kv.capacity))

    def close(self) -> None:
        if self.graph is not None:
            self.graph.reset()
            self.graph = None

    def run(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A pass packed at the bucket's shape (`StaticKV.pack(feeds, B, k)`, on the host: one copy)
        -> `StaticKV.forward`'s outputs [B, k, ...] (replayed: the graph's own tensors, valid until
        the next replay)."""
        self.packed.copy_(packed)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.outputs


_captured = 0  # graphs captured in this process (`graphs_captured`)


def graphs_captured() -> int:
    """How many graphs this process has captured: a pass timed across a change of it paid for a
    capture (its warm-up runs and the capture itself, tens of ms), not what a pass of its size costs."""
    return _captured


def capture(run, device: torch.device, pool, warmup: int = 2):
    """(the CUDA graph of `run()`, its outputs), captured into the memory pool `pool` after `warmup`
    runs on a side stream (cuBLAS and the allocator set up outside the capture, as torch.cuda.graphs asks).

    Nothing may destroy a graph while a stream captures: CUDA refuses the call and invalidates the
    capture. A graph left in a reference cycle (another runtime's, dropped but not yet collected) is
    destroyed whenever Python's collector runs, and it runs at any allocation inside `run()`; so
    the garbage is collected before the capture and the collector paused during it (torch's
    `graph` collects before a capture only when `force_cudagraph_gc` is set). The capture is
    thread-local: CUDA calls of other threads (a server's, the event loop's) cannot invalidate it."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        outputs = run()
    global _captured
    _captured += 1
    return graph, outputs


@contextmanager
def collector_paused():
    """The garbage collected now, and Python's collector paused until the block ends (`capture`)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
    rows = static.rows.to(cache_k.device)  # the same tensor unless the model is sharded over devices
    flat = (rows[:, None] * width + static.positions.to(cache_k.device)).reshape(-1)  # [B * k]
    heads, dim = key.shape[1], key.shape[-1]
    cache_k.view(slots * width, heads, dim).index_copy_(0, flat, key.transpose(1, 2).reshape(-1, heads, dim).to(cache_k.dtype))
    cache_v.view(slots * width, heads, dim).index_copy_(0, flat, value.transpose(1, 2).reshape(-1, heads, dim).to(cache_v.dtype))
    keys = cache_k[rows, :static.length].transpose(1, 2)  # [B, kvh, L, D]
    values = cache_v[rows, :static.length].transpose(1, 2)
    out = F.scaled_dot_product_attention(query, keys.to(query.dtype), values.to(query.dtype),
                                         attn_mask=static.mask.to(query.device), scale=scaling,
                                         enable_gqa=query.shape[1] != heads)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(STATIC_ATTENTION, static_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(STATIC_ATTENTION, sdpa_mask)  # plain forwards build sdpa's masks
