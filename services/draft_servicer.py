"""The draft service: the draft model (plus its acceptance head) drafts one round per call, asking
the session's stopping policy after every token (DESIGN.md section 2, step 1).

Thin: convert the request, run `specdec.rounds.propose`, convert the proposal back. A session's
entry (KV cache, stopping policy, committed history) is a cache of the caller's history: a call
the entry cannot serve answers `session_missing` and the caller resends the full history.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from specdec.head import AcceptanceHead
from specdec.errors import InvalidRequestError
from specdec.models.runtime import DraftOutput, DraftRuntime, KVSession
from specdec.policies import StoppingPolicy, make_policy, validate_policy
from specdec.rounds import propose
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from services.convert import (
    dense_to_sparse, generator_from_seed, history_from_delta, invalid_argument, policy_from_proto,
    sampling_from_proto, sparsify_logits)
from services.sessions import SessionStore

MS_PER_S = 1000.0


@dataclass
class DraftSession:
    policy: StoppingPolicy
    kv: KVSession = field(default_factory=KVSession)
    history: list[int] = field(default_factory=list)  # the committed history the last round drafted from


class SparsifyingDraft:
    """A DraftRuntime whose logits are truncated before `propose` samples from them, so the q it
    sends is exactly the one its candidate was drawn from (see services.convert.sparsify_logits)."""

    def __init__(self, draft: DraftRuntime, sampling: SamplingParams, min_prob: float):
        self.draft, self.sampling, self.min_prob = draft, sampling, min_prob

    def __getattr__(self, name: str):  # vocab_size, max_context, new_session, ...
        return getattr(self.draft, name)

    def start(self, session: KVSession, history: list[int]) -> DraftOutput:
        return self._sparsify(self.draft.start(session, history))

    def step(self, session: KVSession, token: int) -> DraftOutput:
        return self._sparsify(self.draft.step(session, token))

    def _sparsify(self, out: DraftOutput) -> DraftOutput:
        return DraftOutput(logits=sparsify_logits(out.logits, self.sampling, self.min_prob), hidden=out.hidden)


class DraftServicer(draft_pb2_grpc.DraftServicer):
    """`sparsify_below` > 0 truncates sampled draft distributions (fewer bytes per round, still
    lossless, but the draws differ from the in-process engine's); 0 sends them exactly."""

    def __init__(self, draft: DraftRuntime, head: AcceptanceHead | None = None,
                 sessions: SessionStore[DraftSession] | None = None, sparsify_below: float = 0.0):
        self.draft, self.head, self.sparsify_below = draft, head, sparsify_below
        self.sessions: SessionStore[DraftSession] = sessions if sessions is not None else SessionStore()

    def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.ServicerContext) -> draft_pb2.Proposal:
        with invalid_argument(context):
            start = time.perf_counter()
            sampling = sampling_from_proto(request.sampling)
            config = policy_from_proto(request.policy)
            validate_policy(config, has_head=self.head is not None)
            entry = self.sessions.get(request.session_id)
            history = history_from_delta(entry.history if entry else None, request.history, self.draft.vocab_size)
            if history is None:
                return draft_pb2.Proposal(session_missing=True)
            if request.max_candidates < 0 or len(history) + request.max_candidates >= self.draft.max_context:
                raise InvalidRequestError(
                    f"max-candidates {request.max_candidates} after {len(history)} tokens exceeds the "
                    f"draft's context of {self.draft.max_context}")
            if request.history.full:  # rebuild: keep the cache (it re-syncs by common prefix), reset the policy
                entry = DraftSession(make_policy(config, head=self.head), entry.kv if entry else KVSession())
            for outcome in request.rounds:  # oldest first: the policy reaches the caller's state
                entry.policy.end_round(outcome.num_candidates, outcome.num_accepted)
            entry.history = history
            self.sessions.put(request.session_id, entry)
            draft = self.draft
            if self.sparsify_below > 0:
                draft = SparsifyingDraft(self.draft, sampling, self.sparsify_below)
            proposal = propose(draft, entry.kv, history, entry.policy, request.max_candidates, request.num_generated,
                               sampling, generator_from_seed(request.seed, "draft"))
            return draft_pb2.Proposal(
                candidates=proposal.candidates,
                draft_probs=[] if sampling.greedy else [dense_to_sparse(q) for q in proposal.draft_probs],
                draft_ms=(time.perf_counter() - start) * MS_PER_S,
                forward_passes=proposal.forward_passes)

    def Release(self, request: common_pb2.SessionRef, context: grpc.ServicerContext) -> common_pb2.ReleaseResponse:
        return common_pb2.ReleaseResponse(released=self.sessions.pop(request.session_id) is not None)
