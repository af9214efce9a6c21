"""Model runtimes: one forward pass over many sessions' KV caches.

A session's cache mirrors a token sequence: `KVSession.tokens` are the ids whose keys and values
the cache holds. Each call names, per session, the full sequence the caller believes in (the
coordinator's history is the truth); the runtime keeps the longest prefix the cache shares with it,
crops the rest (rollback) and feeds only the tokens it has not seen. The same rule re-prefills a
session from scratch when the cache is gone, so a cache is only ever a cache.

Worked example: the cache holds [a b c y1 y2 y3] after a round that drafted y1..y3; verification
accepted y1 and replaced y2 by z. The next call names [a b c y1 z]: the common prefix is
[a b c y1], the cache is cropped to 4 positions and the pass feeds [z].

Every method takes a batch (one entry per session) and runs one ragged pass over all of them
(models/cache.py); `kv="reference"` runs one pass per session instead, the unbatched path the tests
compare against. `max_tokens_per_pass` splits a batch whose tokens exceed it into
several passes (a single session's feed is never split).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec.errors import IncompatibleModelsError
from specdec.models.cache import Feed, KVSession, ReferenceKV, SlotKV, StateReader, supports_slots
from specdec.models.static import StaticKV, StaticOptions
from specdec.models.formats import scales_activations_per_pass
from specdec.models.vocab import shared_ids, widen_logits

# The most CPU threads a model may be given (torch's or llama.cpp's): far past any machine's cores,
# and below what their C ints hold (torch.set_num_threads overflowed with a traceback; ctypes cuts
# a larger number down to its low bits).
MAX_THREADS = 4096

__all__ = ["CausalLMRuntime", "DraftOutput", "DraftOutputs", "DraftRole", "DraftRuntime", "Feed", "KVSession",
           "PassOutputs", "Runtime", "Scores", "TargetRole", "TargetRuntime", "common_prefix_length"]


@dataclass(frozen=True)
class PassOutputs:
    """A pass's outputs, flat, feed by feed: feed f's are rows bounds[f]:bounds[f + 1]. Iterating
    gives each feed's (logits, hidden)."""

    logits: torch.Tensor  # [N, V] fp32, N = the feeds' num_outputs summed
    hidden: torch.Tensor  # [N, H] (H = 0 where the runtime reads no hidden states)
    bounds: list[int]  # [F + 1]
    # per feed [len(feed.tokens), reads, H] bfloat16: the states `read_features` asked for at every
    # position the feed fed (a feature draft's inputs); None when nothing asked
    features: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, f: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.bounds[f], self.bounds[f + 1]
        return self.logits[lo:hi], self.hidden[lo:hi]

    def __iter__(self):
        return (self[f] for f in range(len(self)))

    @staticmethod
    def bounds_of(feeds: list[Feed]) -> list[int]:
        bounds = [0]
        for feed in feeds:
            bounds.append(bounds[-1] + feed.num_outputs)
        return bounds


@dataclass(frozen=True)
class DraftOutput:
    logits: torch.Tensor  # [V] fp32: the draft's next-token logits after the last fed token
    hidden: torch.Tensor  # [H]: the final hidden state at the last fed token (what the head reads)


@dataclass(frozen=True)
class DraftOutputs:
    """A drafting pass's outputs, one row per session; indexing gives a session's `DraftOutput`."""

    logits: torch.Tensor  # [B, V] fp32
    hidden: torch.Tensor  # [B, H]

    def __len__(self) -> int:
        return self.logits.shape[0]

    def __getitem__(self, b: int) -> DraftOutput:
        return DraftOutput(self.logits[b], self.hidden[b])

    def __iter__(self):
        return (self[b] for b in range(len(self)))


@dataclass(frozen=True)
class Scores:
    """A verification pass's logits, flat (vLLM's layout): session b's [K_b + 1, V] are rows
    bounds[b]:bounds[b + 1]; indexing gives them."""

    logits: torch.Tensor  # [T, V] fp32, T = sum of K_b + 1
    bounds: list[int]  # [B + 1]
    # with `read_features`: session b's states [fed_b, reads, H] at positions starts[b]..: every
    # position its pass fed (its unseen history, then its candidates)
    features: list[torch.Tensor] | None = None
    starts: list[int] | None = None  # [B] the position of each session's first fed token

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, b: int) -> torch.Tensor:
        return self.logits[self.bounds[b]:self.bounds[b + 1]]

    def __iter__(self):
        return (self[b] for b in range(len(self)))


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share. A cache and the history it is synced to differ, if
    at all, in their last few tokens (a rejected candidate), so the head is compared as slices (at C
    speed) and only the tail token by token: every session pays this every step."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    start = max(0, n - TAIL)
    if a[:start] != b[:start]:
        start = 0
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n


TAIL = 32  # `common_prefix_length`'s tail compared token by token


# The torch runtime's KV caches by name (`--kv-cache`): one ragged pass over per-session slots that
# grow (CPU), one preallocated cache with fixed shapes (static: the GPU's), the batch-1 reference.
KV_KINDS = {"slots": SlotKV, "static": StaticKV, "reference": ReferenceKV}


class Runtime(ABC):
    """The batched runtime interface the rounds call (`DraftRole.start/step`, `TargetRole.score`):
    sessions, rollback and one `_forward` over many sessions' feeds. A backend (torch here,
    llama.cpp in models/llamacpp.py) implements the abstract parts."""

    kind: str  # "torch", "llamacpp"
    identity: str
    name: str
    forward_passes: int
    fed_tokens: int = 0  # tokens fed by the rounds' calls (start, step, score), for timing them
    # A pass of a size not run before pays set-up (on CUDA: kernels loaded on first use, cuBLAS
    # choosing per shape), many times a later pass's cost: a probe runs each size once untimed.
    sets_up_per_shape: bool = False
    # Most sessions one pass holds without taking another's cache (llama.cpp: its sequences); None: any.
    max_pass_sessions: int | None = None
    # Positions its sessions' caches hold in all where they share one (llama.cpp's unified cache);
    # None: each session has its own (the static cache's rows, slots that grow).
    max_cached_positions: int | None = None
    # A target whose passes also return the states a feature draft reads (`read_features`).
    returns_features: bool = False

    @property
    def device(self) -> torch.device:
        """Where `_forward` leaves its outputs (and a head that reads the draft's states runs)."""
        return torch.device("cpu")

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def hidden_size(self) -> int: ...

    @property
    @abstractmethod
    def max_context(self) -> int: ...

    @abstractmethod
    def new_session(self) -> KVSession: ...

    def close(self) -> None:
        """Release now what the runtime holds beyond Python's memory (captured CUDA graphs, llama.cpp's
        model and context), rather than whenever the collector gets to it. The runtime is not used after."""

    @abstractmethod
    def rollback(self, session: KVSession, length: int) -> None:
        """Keep only the first `length` cached positions."""

    @abstractmethod
    def _forward(self, feeds: list[Feed]) -> PassOutputs:
        """Feed every session its tokens (extending `session.tokens`). Returns the logits and hidden
        states of each feed's last num_outputs positions, flat, on `device`: sampling, verification
        and the head run there, and only what they decide (token ids, counts) crosses to the host.
        Returns once they are ready, so whatever times a call times its pass (the live costs, the
        probes, the benchmarks)."""

    def _pending(self, session: KVSession, sequence: list[int]) -> list[int]:
        """Crop the cache to its common prefix with `sequence`; return the tokens still to feed
        (at least one, because the caller needs the outputs at the sequence's last position)."""
        keep = min(common_prefix_length(session.tokens, sequence), len(sequence) - 1)
        self.rollback(session, keep)
        return sequence[keep:]


class CausalLMRuntime(Runtime):
    """A decoder-only HF model in torch serving many sessions per forward pass."""

    kind = "torch"

    def __init__(self, model: PreTrainedModel, identity: str = "", name: str = "", kv: str = "slots",
                 max_tokens_per_pass: int | None = None, static: StaticOptions = StaticOptions()):
        """`static`: the static cache's settings, with `kv="static"` (rows, capacity, and whether
        drafting steps and verifications replay captured CUDA graphs: models/static.py)."""
        self.model = model.eval()
        self.identity, self.name = identity, name
        config = model.config  # read once: every session asks for these every step
        self._vocab_size, self._hidden_size = config.vocab_size, config.hidden_size
        if kv != "reference" and not supports_slots(self.model):
            kv = "reference"  # sliding-window layers: one session per pass
        self.kv = StaticKV(self.model, static) if kv == "static" else KV_KINDS[kv](self.model)
        self.max_pass_sessions = getattr(self.kv, "max_pass_sessions", None)  # the static cache's rows
        self._max_context = min(config.max_position_embeddings, getattr(self.kv, "capacity", float("inf")))
        self.max_tokens_per_pass = max_tokens_per_pass
        self.first_token_alone = scales_activations_per_pass(self.model)
        self.forward_passes = 0

    def read_features(self, layers: list[int] | None) -> None:
        """From now on every pass also returns the states after these decoder layers (0-based; None:
        the output state, after the final norm) at every fed position (`PassOutputs.features`): what
        a feature draft reads (models/feature_draft.py), on every KV cache, a static cache's captured
        passes included (models/cache.py `StateReader`). Asking again for the same is a no-op."""
        if self.returns_features:
            if layers != self._read_layers:
                raise IncompatibleModelsError(f"this target already hands out the states of layers "
                                              f"{self._read_layers}, not {layers}")
            return
        body = self.model.model
        self.kv.reader = StateReader([body.norm] if layers is None else [body.layers[i] for i in layers])
        self._read_layers, self.returns_features = layers, True

    @property
    def sets_up_per_shape(self) -> bool:
        return self.model.device.type == "cuda"

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    @property
    def max_context(self) -> int:
        return self._max_context

    def new_session(self) -> KVSession:
        return self.kv.new_session()

    def rollback(self, session: KVSession, length: int) -> None:
        self.kv.rollback(session, length)

    def close(self) -> None:
        if isinstance(self.kv, StaticKV):
            self.kv.close()

    @torch.inference_mode()
    def _forward(self, feeds: list[Feed]) -> PassOutputs:
        """The LM head runs only on the positions asked for."""
        # with `read_features`: each feed's read states, pass by pass
        fed: dict[int, list[torch.Tensor]] | None = {id(f.session): [] for f in feeds} if self.returns_features else None
        if self.first_token_alone:
            feeds = self._feed_first_tokens(feeds, fed)
        logits, hidden = [], []
        done = 0
        for part in self._passes(feeds):
            states, read = self.kv.hidden_states(self.model, part, protected=feeds[done:])  # [sum num_outputs, H]
            keep_features(part, read, fed)
            done += len(part)
            logits.append(self.model.lm_head(states).float())  # [sum num_outputs, V]
            hidden.append(states.float())
            for feed in part:
                feed.session.tokens.extend(feed.tokens)
            self.forward_passes += 1
        if len(logits) != 1:  # several passes (max_tokens_per_pass), or none
            logits = [torch.cat(logits)] if logits else [torch.empty((0, self.vocab_size), device=self.device)]
            hidden = [torch.cat(hidden)] if hidden else [torch.empty((0, self.hidden_size), device=self.device)]
        if logits[0].device.type == "cuda":  # a sharded model's last device finishes last
            torch.cuda.synchronize(logits[0].device)
        features = [torch.cat(fed[id(f.session)]) for f in feeds] if fed is not None else None
        return PassOutputs(logits[0], hidden[0], PassOutputs.bounds_of(feeds), features)

    def _feed_first_tokens(self, feeds: list[Feed], fed: dict | None = None) -> list[Feed]:
        """Feed the first token of every session that starts in this call in a pass of its own; returns
        the feeds without it.

        For weights that quantize activations with one scale per pass (`int8`): a sequence's first
        token is its attention sink, whose activations in some layers are orders of magnitude above
        every other token's, so in a shared pass it sets the scale and flattens the rest of the
        prompt. Measured on the default draft over 6 prompts + 48 response tokens: next-token
        argmax agreement with fp32 0.90 and KL 0.071 nats with the prompt in one pass, 0.92 and
        0.030 with its first token alone (one token a pass: 0.96 and 0.007). A feed that needs the
        first token's own output keeps it. The sinks' read states go into `fed` first."""
        starting = [i for i, f in enumerate(feeds) if not f.session.tokens and len(f.tokens) > f.num_outputs]
        if not starting:
            return feeds
        sinks = [Feed(feeds[i].session, feeds[i].tokens[:1], 0) for i in starting]
        for part in self._passes(sinks):
            _, read = self.kv.hidden_states(self.model, part, protected=feeds)
            keep_features(part, read, fed)
            for feed in part:
                feed.session.tokens.extend(feed.tokens)
            self.forward_passes += 1
        feeds = list(feeds)
        for i in starting:
            feeds[i] = Feed(feeds[i].session, feeds[i].tokens[1:], feeds[i].num_outputs)
        return feeds

    def _passes(self, feeds: list[Feed]) -> list[list[Feed]]:
        """Feeds grouped into passes of at most max_tokens_per_pass tokens and max_pass_sessions
        sessions, in order."""
        if self.max_tokens_per_pass is None and self.max_pass_sessions is None:
            return [feeds] if feeds else []
        most_tokens, most_sessions = self.max_tokens_per_pass or float("inf"), self.max_pass_sessions or len(feeds)
        passes, tokens = [], 0
        for feed in feeds:
            if not passes or tokens + len(feed.tokens) > most_tokens or len(passes[-1]) == most_sessions:
                passes.append([])
                tokens = 0
            passes[-1].append(feed)
            tokens += len(feed.tokens)
        return passes


def keep_features(part: list[Feed], read: list[torch.Tensor] | None, fed: dict[int, list[torch.Tensor]] | None) -> None:
    """A pass's read states of each feed of `part` ([n, reads, H]) into `fed`, by session, in
    bfloat16: the layout the wire and the training shards carry (models/feature_files.py `pack_states`)."""
    if fed is None:
        return
    for feed, rows in zip(part, read):
        fed[id(feed.session)].append(rows.to(torch.bfloat16))


class DraftRole(Runtime):
    """The draft model: catches up on committed tokens, then drafts one token per session per step."""

    # A feature draft (models/feature_runtime.py) reads the target's states: the verifications hand
    # them over and a session drafts only once they reach its history's end (proposers.py).
    reads_features = False

    # A draft that runs greedy drafting steps as one chain (`chain`): up to this many (0: none).
    chain_steps = 0

    # A draft without a model (models/suffix.py): no passes; its proposer drafts and times it alone.
    model_free = False

    # The suffix draft fused with this one (`--draft suffix+SOURCE`, models/suffix.py `SuffixDraft`),
    # set by the builder: its proposer drafts the suffix first (proposers.py `FusedProposer`).
    suffix = None

    # A draft fitted to a target of another width (`fit_vocabulary`): (the ids both have rows for,
    # the target's rows), and its own rows where the target has more, past which a history's id
    # (one the target alone has) is fed as 0.
    _fitted: tuple[int, int] | None = None
    input_rows: int | None = None

    @property
    def vocab_size(self) -> int:
        """The width of its logits: its target's once fitted."""
        return self._fitted[1] if self._fitted else super().vocab_size

    def fit_vocabulary(self, target_rows: int, tokens: int) -> None:
        """Fit the draft to a target of `target_rows` rows whose tokenizer has `tokens` ids, where their
        padding rows past those ids differ in number (models/vocab.py `shared_ids`; nothing where the
        rows are the same): its logits come out at the target's width with -inf past the ids both
        have (q = 0: it proposes no padding id and none the target lacks, and verification reads the
        q it drew from); a history's ids past its rows are fed as 0 (any q stays lossless). The suffix
        draft fused with it (`suffix`) takes the same width. A draft at the target's width already
        (fitted before, or of the same rows) stays as it is: its width is no longer its own rows."""
        rows = self.vocab_size
        if rows == target_rows:
            return
        shared = shared_ids(rows, target_rows, tokens)
        self.input_rows = rows if rows < target_rows else None
        self._fitted = None if shared is None else (shared, target_rows)
        if self.suffix is not None:
            self.suffix.fit_vocabulary(target_rows, tokens)

    def capture_graphs(self) -> None:
        """Capture what the runtime replays (CUDA graphs) before anything is timed: a replica's start
        (the draft worker's start-up probe). Nothing by default: the rest capture at first use."""

    def chain(self, sessions: list[KVSession], tokens: list[int], steps: int) -> list[DraftOutputs]:
        """Up to `steps` greedy steps at once: what `step` returns for y_1 = `tokens`, then for each step's argmax."""
        raise NotImplementedError("this draft runs its steps one at a time")

    def start(self, sessions: list[KVSession], histories: list[list[int]]) -> DraftOutputs:
        """Extend each cache with every committed token it lacks (corrections included) before
        drafting; returns each session's distribution of y_1."""
        if self.input_rows is not None:
            histories = [h if not h or max(h) < self.input_rows else [t if t < self.input_rows else 0 for t in h]
                         for h in histories]
        feeds = [Feed(s, self._pending(s, h), 1) for s, h in zip(sessions, histories)]
        return self._draft_outputs(feeds)

    def step(self, sessions: list[KVSession], tokens: list[int]) -> DraftOutputs:
        """Feed each session its candidate y_i; returns e_i (its hidden state) and the logits of q_{i+1}."""
        return self._draft_outputs([Feed(s, [t], 1) for s, t in zip(sessions, tokens)])

    def _draft_outputs(self, feeds: list[Feed]) -> DraftOutputs:
        self.fed_tokens += sum(len(f.tokens) for f in feeds)
        out = self._forward(feeds)  # one output per feed
        if self._fitted:
            return DraftOutputs(widen_logits(out.logits, *self._fitted), out.hidden)
        return DraftOutputs(out.logits, out.hidden)


class TargetRole(Runtime):
    """The target model: scores each session's committed-but-unseen tokens plus its K candidates,
    every session in one pass (a different K each)."""

    def score(self, sessions: list[KVSession], histories: list[list[int]],
              candidates: list[list[int]]) -> Scores:
        """Returns per session logits [K+1, V] fp32: row i is the target's next-token logits after
        history + y_1..y_i (row 0 scores y_1, row K gives the bonus distribution)."""
        feeds, starts = [], []
        for s, h, c in zip(sessions, histories, candidates):
            pending = self._pending(s, h)
            starts.append(len(h) - len(pending))
            feeds.append(Feed(s, pending + c, len(c) + 1))
        self.fed_tokens += sum(len(f.tokens) for f in feeds)
        out = self._forward(feeds)
        return Scores(out.logits, out.bounds, out.features, starts)


class DraftRuntime(DraftRole, CausalLMRuntime):
    """The draft on torch."""


class TargetRuntime(TargetRole, CausalLMRuntime):
    """The target on torch."""
