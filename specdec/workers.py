"""The draft's and the verifier's sides of the round protocol (specdec/protocol.py): their sessions
and one batched call each. The in-process engine calls them directly; the gRPC servicers
(services/) convert protobuf at the edge and call them the same way.

A session's entry (KV cache, the committed history it was synced to, and on the draft its stopping
policy) is a cache of the caller's history: a delta the entry cannot take answers SessionMissing.
A malformed item is Refused on its own; the other sessions of the batch are served.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.errors import InvalidRequestError
from specdec.head import AcceptanceHead
from specdec.models.runtime import DraftRole, KVSession, TargetRole
from specdec.policies import StoppingPolicy, make_policy, validate_policy
from specdec.protocol import ProposeItem, Refused, SessionMissing, VerifyItem, history_from_delta
from specdec.rounds import DraftRow, Proposal, TargetRow, propose, verify
from specdec.sampling import SamplingParams
from specdec.sessions import SessionStore
from specdec.verification import Verdict

# sampling -> a function applied to the draft's logits before it samples (None: none). The served
# draft truncates what it sends this way (services.convert.sparsify_logits).
LogitsFilterFactory = Callable[[SamplingParams], Callable[[torch.Tensor], torch.Tensor] | None]


@dataclass
class DraftSession:
    policy: StoppingPolicy
    kv: KVSession
    history: list[int] = field(default_factory=list)  # the committed history the last round drafted from


@dataclass
class VerifierSession:
    kv: KVSession
    # The committed history of the last round. The cache also holds that round's accepted
    # candidates; the caller's next history includes them plus the correction token.
    history: list[int] = field(default_factory=list)


def serve_batch(items: list, row_for: Callable, run: Callable[[list], list]) -> list:
    """Answer every item: SessionMissing where `row_for` finds no session (None), Refused where it
    (or a session id repeated in the batch: two rows on one cache would corrupt it) raises
    InvalidRequestError, else what `run` returns for the item's row; `run` gets every row at once."""
    answers: list = [None] * len(items)
    rows, where, seen = [], [], set()
    for i, item in enumerate(items):
        try:
            if item.session_id in seen:
                raise InvalidRequestError(f"session {item.session_id!r} appears twice in one batch")
            seen.add(item.session_id)
            row = row_for(item)
        except InvalidRequestError as exc:
            answers[i] = Refused(str(exc))
            continue
        if row is None:
            answers[i] = SessionMissing()
        else:
            rows.append(row)
            where.append(i)
    for i, result in zip(where, run(rows) if rows else []):
        answers[i] = result
    return answers


class Worker:
    """A role's sessions: `release` drops them (a session never seen is not an error)."""

    sessions: SessionStore

    def release(self, session_ids: list[str]) -> list[bool]:
        return [self.sessions.pop(session_id) is not None for session_id in session_ids]


class DraftWorker(Worker):
    """The draft model (plus its acceptance head): drafts one round for every session of a batch."""

    def __init__(self, draft: DraftRole, head: AcceptanceHead | None = None,
                 sessions: SessionStore[DraftSession] | None = None,
                 logits_filter: LogitsFilterFactory | None = None):
        self.draft, self.head, self.logits_filter = draft, head, logits_filter
        self.sessions: SessionStore[DraftSession] = sessions if sessions is not None else SessionStore()

    def propose(self, items: list[ProposeItem]) -> list[Proposal | SessionMissing | Refused]:
        return serve_batch(items, self._row, lambda rows: propose(self.draft, rows))

    def _row(self, item: ProposeItem) -> DraftRow | None:
        validate_policy(item.policy, has_head=self.head is not None)
        entry = self.sessions.get(item.session_id)
        history = history_from_delta(entry.history if entry else None, item.history, self.draft.vocab_size)
        if history is None:
            return None
        if item.max_candidates < 0 or len(history) + item.max_candidates >= self.draft.max_context:
            raise InvalidRequestError(
                f"max-candidates {item.max_candidates} after {len(history)} tokens exceeds the "
                f"draft's context of {self.draft.max_context}")
        if item.history.full:  # rebuild: keep the cache (it re-syncs by common prefix), reset the policy
            policy = make_policy(item.policy, head=self.head, reference=item.reference, runtime=self.draft.kind)
            entry = DraftSession(policy, entry.kv if entry else self.draft.new_session())
        for num_candidates, num_accepted in item.rounds:  # oldest first: the policy reaches the caller's state
            entry.policy.end_round(num_candidates, num_accepted)
        entry.history = history
        self.sessions.put(item.session_id, entry)
        logits_filter = self.logits_filter(item.sampling) if self.logits_filter else None
        return DraftRow(entry.kv, history, entry.policy, item.max_candidates, item.num_generated, item.sampling,
                        item.seed.generator("draft"), logits_filter)



class VerifierWorker(Worker):
    """The target model: verifies one round for every session of a batch in one pass."""

    def __init__(self, target: TargetRole, sessions: SessionStore[VerifierSession] | None = None):
        self.target = target
        self.sessions: SessionStore[VerifierSession] = sessions if sessions is not None else SessionStore()

    def verify(self, items: list[VerifyItem]) -> list[Verdict | SessionMissing | Refused]:
        return serve_batch(items, self._row, lambda rows: verify(self.target, rows))

    def _row(self, item: VerifyItem) -> TargetRow | None:
        vocab = self.target.vocab_size
        entry = self.sessions.get(item.session_id)
        history = history_from_delta(entry.history if entry else None, item.history, vocab)
        if history is None:
            return None
        if any(not 0 <= t < vocab for t in item.candidates):
            raise InvalidRequestError(f"candidate token ids must be in [0, {vocab})")
        if len(history) + len(item.candidates) >= self.target.max_context:
            raise InvalidRequestError(
                f"{len(item.candidates)} candidates after {len(history)} tokens exceed the target's "
                f"context of {self.target.max_context}")
        if not item.sampling.greedy and len(item.draft_probs) != len(item.candidates):
            raise InvalidRequestError(
                f"sampled verification needs one draft distribution per candidate: "
                f"{len(item.candidates)} candidates, {len(item.draft_probs)} distributions")
        entry = entry or VerifierSession(self.target.new_session())
        entry.history = history
        self.sessions.put(item.session_id, entry)
        return TargetRow(entry.kv, history, item.candidates, item.draft_probs if not item.sampling.greedy else [],
                         item.sampling, item.seed.generator("target"))
