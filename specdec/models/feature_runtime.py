"""The feature draft (models/feature_draft.py) as a draft of the round loop: its sessions, the
target's states it is handed, and its passes: a catch-up pass over each session's committed pairs,
then greedy steps chained on a static cache (models/feature_chain.py)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from specdec.errors import InvalidRequestError
from specdec.models.cache import Feed, KVSession, SlotBuffers
from specdec.models.feature_chain import CapturedChain, ChainInputs, chain, chain_bucket
from specdec.models.feature_draft import DraftFeed, FeatureDraft, target_layers_of
from specdec.models.runtime import DraftOutputs, DraftRole, PassOutputs, common_prefix_length
from specdec.models.static import StaticKV, StaticOptions

CHAIN_STEPS = 8  # most greedy drafting steps one chain runs (FeatureDraftRuntime with a static cache)


@dataclass
class FeatureSession(KVSession):
    """A feature draft's session in the round loop. Cache position t holds the pair (g_t, x_{t+1}), so
    `tokens` are x_1..x_n: a history of n + 1 tokens. Pairs made from the target's states are exact;
    a round's later pairs are made from the draft's own states and are replaced once the target's
    arrive (`exact` marks where they start)."""

    g: torch.Tensor | None = None  # [room, H]: g_t from the target's states at positions 0..held-1, then room
    held: int = 0  # positions whose g the target's states give (some may wait in the runtime's queue)
    exact: int = 0  # cache positions made from the target's states
    state: torch.Tensor | None = None  # [H] s at the last position fed: the next step's g


class FeatureDraftRuntime(DraftRole):
    """The feature draft as a draft of the round loop (models/runtime.py `DraftRole`): a round's first
    pass catches the session up on the pairs of its committed history (the target's states with the
    next token) and drafts y_1 from the last; each later step feeds the draft's own state with the
    token it just drafted. The verifications hand the target's states over (`add_features`); a
    session whose states do not reach its history's end does not draft (`can_draft`): they are
    recomputed by the target, never guessed. Only a probe's scratch session runs on zeros."""

    kind = "torch"
    reads_features = True

    def __init__(self, model: FeatureDraft, identity: str = "", name: str = "", kv: str = "slots",
                 static: StaticOptions = StaticOptions()):
        """`kv`: "slots" (a ragged pass over slots that grow: the CPU's) or "static" (rows of one cache
        allocated at start; greedy drafting steps run as one chain, captured on CUDA with `graphs`:
        models/feature_chain.py), the chain at most CHAIN_STEPS long."""
        # serving never trains it: no autograd graph behind its scores (the policies read them as numbers)
        self.model, self.identity, self.name = model.eval().requires_grad_(False), identity, name
        self.layer_config = model.layer_config
        self.forward_passes = 0
        self.kv = StaticKV.of_layers(model.layer_config, model.dtype, self.device,
                                     static) if kv == "static" else None
        self.max_pass_sessions = None if self.kv is None else self.kv.max_pass_sessions  # the workers group by it
        self.chain_steps = CHAIN_STEPS if self.kv is not None else 0
        self._chains: dict[tuple[int, int, int], CapturedChain] = {}  # by bucket (models/feature_chain.py)
        self._queued: list[tuple[FeatureSession, torch.Tensor, int]] = []  # `add_features`' states, not yet g

    @property
    def target_layers(self) -> list[int] | None:
        return target_layers_of(self.model.config)

    @property
    def device(self) -> torch.device:
        return self.model.embed.device

    @property
    def sets_up_per_shape(self) -> bool:
        return self.device.type == "cuda"  # as the target's runtime: a probe runs each size once untimed first

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.layer_config.hidden_size

    @property
    def max_context(self) -> int:
        return min(self.layer_config.max_position_embeddings, self.kv.capacity if self.kv is not None else float("inf"))

    def new_session(self) -> FeatureSession:
        return FeatureSession(handle=None if self.kv is not None else SlotBuffers())  # a row at its first pass

    def rollback(self, session: FeatureSession, length: int) -> None:
        self.model.rollback(session, length)
        session.exact = min(session.exact, length)

    def close(self) -> None:
        for captured in self._chains.values():
            captured.close()
        self._chains.clear()

    def add_features(self, session: FeatureSession, states: torch.Tensor, start: int) -> None:
        """The target's states [m, reads, H] at positions start..start + m - 1 (replacing what the session
        held from `start` on). They wait in a queue and are reduced to g at the next pass, every
        session's in one call (`_reduce_queued`), where one session at a time would launch a handful
        of small kernels for each session of every step."""
        if start > session.held:
            raise InvalidRequestError(f"features start at position {start}, but the draft holds {session.held}")
        self.check_features(states)
        self._queued.append((session, states, start))
        session.held = start + len(states)
        session.exact = min(session.exact, start)

    def check_features(self, states: torch.Tensor) -> None:
        """Raises InvalidRequestError where `states` are not [tokens, reads, H] of this draft's target."""
        if states.ndim != 3 or states.shape[1:] != (self.model.config.reads, self.hidden_size):
            raise InvalidRequestError(f"features of shape {list(states.shape)}, not [tokens, "
                                      f"{self.model.config.reads}, {self.hidden_size}]")

    def features_held(self, session: FeatureSession) -> int:
        """Positions of the target's states the session holds."""
        return session.held

    def clear_features(self, session: FeatureSession) -> None:
        """Forget the session's target states (it is rebuilt from a full history)."""
        self._queued = [queued for queued in self._queued if queued[0] is not session]
        session.g, session.held, session.exact = None, 0, 0

    def can_draft(self, session: FeatureSession, history: list[int]) -> bool:
        """Whether the session can draft after `history` now: its states reach the history's end."""
        return len(history) >= 2 and session.held >= len(history) - 1

    @torch.inference_mode()
    def _reduce_queued(self) -> None:
        """g of every queued state, in one call of `feature` (in the draft's dtype), written into each
        session's buffer, which grows by doubling (a step appends a few positions without copying
        the history)."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        g = self.model.feature(torch.cat([states.to(self.device) for _, states, _ in queued]).to(self.model.dtype))
        for (session, _, start), part in zip(queued, g.split([len(states) for _, states, _ in queued])):
            end = start + len(part)
            if session.g is None or len(session.g) < end:
                grown = g.new_empty((max(end, 2 * (0 if session.g is None else len(session.g))), g.shape[-1]))
                if start:
                    grown[:start] = session.g[:start]
                session.g = grown
            session.g[start:end] = part

    def start(self, sessions: list[FeatureSession], histories: list[list[int]]) -> DraftOutputs:
        """Feed each session the pairs (g_t, x_{t+1}) its cache lacks up to the history's end; the last
        one's state drafts y_1. A cached pair made from the draft's own state is fed again."""
        self._reduce_queued()
        feeds = []
        for session, history in zip(sessions, histories):
            # pairs 0..end-1: x_1..x_end; a one-token history (only a probe's scratch session has one:
            # `can_draft`) feeds one pair of its token, a pass of the same size
            tokens = history[1:] or history[:1]
            end = len(tokens)
            keep = min(session.exact, common_prefix_length(session.tokens, tokens), end - 1)
            self.rollback(session, keep)
            feeds.append(DraftFeed(session, self._target_features(session, keep, end), tokens[keep:]))
        return self._pass(feeds)

    def step(self, sessions: list[FeatureSession], tokens: list[int]) -> DraftOutputs:
        return self._pass([DraftFeed(s, s.state[None], [t]) for s, t in zip(sessions, tokens)])

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Every chain bucket this runtime can replay (sessions up to its rows, steps up to its chains',
        every gathered length), captured now (models/feature_chain.py)."""
        kv = self.kv
        if kv is None or not kv.graphs:
            return
        for sessions in (n for n in kv.options.graph_sessions if n <= kv.max_pass_sessions):
            for steps in (k for k in kv.options.graph_tokens if k <= self.chain_steps):
                for length in kv.graph_lengths:
                    key = chain_bucket(kv, sessions, steps, length - steps)
                    if key is not None and key not in self._chains:
                        self._chains[key] = CapturedChain(self.model, kv, *key)

    @torch.inference_mode()
    def chain(self, sessions: list[FeatureSession], tokens: list[int], steps: int) -> list[DraftOutputs]:
        """Up to `steps` greedy drafting steps at once (models/feature_chain.py): the outputs of `step`
        for y_1 = `tokens`, then for each step's argmax in turn, one per step; fewer where a session
        would pass the cache's capacity (each still takes the steps its context allows)."""
        longest = max(len(s) for s in sessions)
        steps = max(1, min(steps, self.kv.capacity - longest))
        self.kv.attach([DraftFeed(s, s.state[None], [t]) for s, t in zip(sessions, tokens)], steps=steps - 1)
        device = self.device
        inputs = ChainInputs(torch.tensor([s.handle for s in sessions], device=device),
                             torch.tensor([len(s) for s in sessions], device=device),
                             torch.ones(len(sessions), dtype=torch.bool, device=device),
                             torch.stack([s.state for s in sessions]),
                             torch.tensor(tokens, dtype=torch.long, device=device))
        out = chain(self.model, self.kv, self._chains, inputs, steps, longest)
        drafted = out.tokens[:-1].T.tolist() if steps > 1 else [[] for _ in sessions]  # [B, steps - 1]: y_2..y_steps
        for b, (session, token) in enumerate(zip(sessions, tokens)):
            session.tokens.extend([token] + drafted[b])
            session.state = out.states[-1, b]
        self.forward_passes += 1
        self.fed_tokens += len(sessions) * steps
        logits = self.model.scatter(out.scores)  # [steps, B, V]: one call for the chain
        return [DraftOutputs(logits[j], out.states[j].float()) for j in range(steps)]

    def _target_features(self, session: FeatureSession, start: int, end: int) -> torch.Tensor:
        """g of positions start..end-1 from the target's states [end - start, H]; zeros past those held
        (only a scratch session lacks them: a probe's, a timing's; `can_draft` keeps real ones out).
        The pairs about to be fed from them are exact: `session.exact` moves to the last held."""
        held = min(session.held, end)
        g = session.g[start:held] if held > start else self.model.embed.new_zeros((0, self.hidden_size))
        session.exact = max(held, start)
        if held < end:
            g = torch.cat([g, g.new_zeros((end - max(held, start), self.hidden_size))])
        return g

    def _pass(self, feeds: list[DraftFeed]) -> DraftOutputs:
        last = self._outputs(feeds, [1] * len(feeds))  # [B, H]
        for feed, state in zip(feeds, last):
            feed.session.state = state
        self.fed_tokens += sum(len(f.tokens) for f in feeds)
        return DraftOutputs(self.model.full_logits(last), last.float())

    def _forward(self, feeds: list[Feed]) -> PassOutputs:
        """A pass of pairs after each session's cache, the tokens with the target's states held for
        their positions (zeros past them): what timing a pass of that size needs (bench/forward.py)."""
        self._reduce_queued()
        pairs = [DraftFeed(f.session, self._target_features(f.session, len(f.session), len(f.session) + len(f.tokens)),
                           f.tokens) for f in feeds]
        out = self._outputs(pairs, [f.num_outputs for f in feeds])
        return PassOutputs(self.model.full_logits(out), out.float(), PassOutputs.bounds_of(feeds))

    @torch.inference_mode()
    def _outputs(self, pairs: list[DraftFeed], outputs: list[int]) -> torch.Tensor:
        """One ragged pass over every feed; the output states [sum outputs, H] of each feed's last
        `outputs[f]` positions, feed by feed."""
        states = self.model.forward_feeds(pairs) if self.kv is None else self.model.forward_static(pairs, self.kv)  # [sum n, H]
        self.forward_passes += 1
        ends = accumulate(len(f.tokens) for f in pairs)
        return states[[i for n, end in zip(outputs, ends) for i in range(end - n, end)]]
