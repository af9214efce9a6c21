"""Model runtimes with per-session KV caches.

A session's cache mirrors a token sequence: `KVSession.tokens` are the ids whose keys and values
the cache holds. Each call names the full sequence the caller believes in (the coordinator's
history is the truth); the runtime keeps the longest prefix its cache shares with it, crops the
rest (rollback) and feeds only the tokens it has not seen. The same rule re-prefills a session
from scratch when the cache is gone, so a cache is only ever a cache.

Worked example: the cache holds [a b c y1 y2 y3] after a round that drafted y1..y3; verification
accepted y1 and replaced y2 by z. The next call names [a b c y1 z]: the common prefix is
[a b c y1], the cache is cropped to 4 positions and one forward pass feeds [z].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass
class KVSession:
    cache: DynamicCache = field(default_factory=DynamicCache)
    tokens: list[int] = field(default_factory=list)  # ids whose K/V the cache holds, in order

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class DraftOutput:
    logits: torch.Tensor  # [V] fp32: the draft's next-token logits after the last fed token
    hidden: torch.Tensor  # [H]: the final hidden state at the last fed token (what the head reads)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class CausalLMRuntime:
    """A decoder-only HF model run one session at a time."""

    def __init__(self, model: PreTrainedModel, identity: str = "", name: str = ""):
        self.model = model.eval()
        self.identity = identity
        self.name = name
        self.forward_passes = 0

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def max_context(self) -> int:
        return self.model.config.max_position_embeddings

    def new_session(self) -> KVSession:
        return KVSession()

    def rollback(self, session: KVSession, length: int) -> None:
        """Keep only the first `length` cached positions."""
        if length < len(session.tokens):
            session.cache.crop(length - len(session.tokens))  # a negative count removes that many positions
            del session.tokens[length:]

    def _pending(self, session: KVSession, sequence: list[int]) -> list[int]:
        """Crop the cache to its common prefix with `sequence`; return the tokens still to feed
        (at least one, because the caller needs the outputs at the sequence's last position)."""
        keep = min(common_prefix_length(session.tokens, sequence), len(sequence) - 1)
        self.rollback(session, keep)
        return sequence[keep:]

    @torch.inference_mode()
    def _forward(self, session: KVSession, tokens: list[int], num_outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed `tokens` into the session's cache.

        Returns (logits [num_outputs, V] fp32, hidden [num_outputs, H]) for the last num_outputs
        positions, on the CPU where sampling, verification and the head run; the LM head runs
        only on those positions (a prompt prefill would otherwise compute logits for every prompt
        position).
        """
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.model.device)
        out = self.model.model(input_ids=input_ids, cache=session.cache, use_cache=True)
        hidden = out.last_hidden_state[0, -num_outputs:]  # [num_outputs, H]
        logits = self.model.lm_head(hidden).float()  # [num_outputs, V]
        if logits.device.type != "cpu":
            logits, hidden = logits.cpu(), hidden.float().cpu()
        session.tokens.extend(tokens)
        self.forward_passes += 1
        return logits, hidden


class DraftRuntime(CausalLMRuntime):
    """The draft model: catches up on committed tokens, then drafts one token per step."""

    def start(self, session: KVSession, history: list[int]) -> DraftOutput:
        """Extend the cache with every committed token it lacks (corrections included) before
        drafting; returns the distribution of y_1."""
        return self._draft_output(session, self._pending(session, history))

    def step(self, session: KVSession, token: int) -> DraftOutput:
        """Feed candidate y_i; returns e_i (its hidden state) and the logits of q_{i+1}."""
        return self._draft_output(session, [token])

    def _draft_output(self, session: KVSession, tokens: list[int]) -> DraftOutput:
        logits, hidden = self._forward(session, tokens, num_outputs=1)
        return DraftOutput(logits=logits[0], hidden=hidden[0])


class TargetRuntime(CausalLMRuntime):
    """The target model: scores the committed-but-unseen tokens plus K candidates in one pass."""

    def score(self, session: KVSession, history: list[int], candidates: list[int]) -> torch.Tensor:
        """Returns logits [K+1, V] fp32: row i is the target's next-token logits after
        history + y_1..y_i (row 0 scores y_1, row K gives the bonus distribution)."""
        pending = self._pending(session, history)
        logits, _ = self._forward(session, pending + candidates, num_outputs=len(candidates) + 1)
        return logits
