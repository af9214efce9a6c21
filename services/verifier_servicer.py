"""The verifier service: the target model scores one round's candidates in one forward pass and
runs the acceptance test (DESIGN.md section 2, step 3).

Thin: convert the request, run `specdec.rounds.verify`, convert the verdict back. A session's
entry (KV cache, committed history) is a cache of the caller's history: a call the entry cannot
serve answers `session_missing` and the caller resends the full history.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from specdec.errors import InvalidRequestError
from specdec.models.runtime import KVSession, TargetRuntime
from specdec.rounds import verify
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from services.convert import (
    generator_from_seed, history_from_delta, invalid_argument, sampling_from_proto, sparse_to_dense)
from services.sessions import SessionStore

MS_PER_S = 1000.0


@dataclass
class VerifierSession:
    kv: KVSession = field(default_factory=KVSession)
    # The committed history of the last round. The cache also holds that round's accepted
    # candidates; the caller's next history includes them plus the correction token.
    history: list[int] = field(default_factory=list)


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, target: TargetRuntime, sessions: SessionStore[VerifierSession] | None = None):
        self.target = target
        self.sessions: SessionStore[VerifierSession] = sessions if sessions is not None else SessionStore()

    def Verify(self, request: verifier_pb2.VerifyRequest, context: grpc.ServicerContext) -> verifier_pb2.Verdict:
        with invalid_argument(context):
            start = time.perf_counter()
            sampling = sampling_from_proto(request.sampling)
            vocab = self.target.vocab_size
            entry = self.sessions.get(request.session_id)
            history = history_from_delta(entry.history if entry else None, request.history, vocab)
            if history is None:
                return verifier_pb2.Verdict(session_missing=True)
            candidates = list(request.candidates)
            if any(not 0 <= t < vocab for t in candidates):
                raise InvalidRequestError(f"candidate token ids must be in [0, {vocab})")
            if len(history) + len(candidates) >= self.target.max_context:
                raise InvalidRequestError(
                    f"{len(candidates)} candidates after {len(history)} tokens exceed the target's "
                    f"context of {self.target.max_context}")
            draft_probs = []
            if not sampling.greedy:
                if len(request.draft_probs) != len(candidates):
                    raise InvalidRequestError(
                        f"sampled verification needs one draft distribution per candidate: "
                        f"{len(candidates)} candidates, {len(request.draft_probs)} distributions")
                draft_probs = [sparse_to_dense(q, vocab) for q in request.draft_probs]
            entry = entry or VerifierSession()
            entry.history = history
            self.sessions.put(request.session_id, entry)
            verdict = verify(self.target, entry.kv, history, candidates, draft_probs, sampling,
                             generator_from_seed(request.seed, "target"))
            return verifier_pb2.Verdict(num_accepted=verdict.num_accepted, next_token=verdict.next_token,
                                        target_ms=(time.perf_counter() - start) * MS_PER_S)

    def Release(self, request: common_pb2.SessionRef, context: grpc.ServicerContext) -> common_pb2.ReleaseResponse:
        return common_pb2.ReleaseResponse(released=self.sessions.pop(request.session_id) is not None)
