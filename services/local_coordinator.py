"""A single-request driver of the round services over gRPC, for tests and benchmarks (the Ray
coordinator actor runs the same loop for many sessions).

The loop reads like the engine's: propose -> verify -> commit -> decide. The coordinator's
history is the truth: each call sends only the tokens a servicer has not seen (a HistoryDelta),
and a servicer that answers `session_missing` gets the same round again with the full history.
Every round records its bytes on the wire and its transport time (the RPC's wall time minus the
compute time the servicer reports).
"""

from __future__ import annotations

import contextlib
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from specdec.params import FINISH_LENGTH, FINISH_STOP, GenerationParams
from specdec.rounds import SEED_BITS
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from services.convert import delta_for, policy_to_proto, sampling_to_proto

MS_PER_S = 1000.0


@dataclass
class CallRecord:
    """One logical RPC of a round (a resend after session_missing included)."""

    bytes_sent: int = 0  # serialized request sizes, every attempt
    bytes_received: int = 0  # serialized reply sizes, every attempt
    rpc_ms: float = 0.0  # wall time of every attempt, client side
    compute_ms: float = 0.0  # what the servicer reports for the attempt that served the round
    attempts: int = 0  # 2 when the servicer answered session_missing first
    history_tokens: int = 0  # committed tokens sent (HistoryDelta.tail), every attempt

    @property
    def transport_ms(self) -> float:
        return self.rpc_ms - self.compute_ms


@dataclass
class RoundRecord:
    round_index: int
    num_candidates: int  # K
    num_accepted: int  # n
    draft: CallRecord | None  # None when the policy never calls the draft (target-only)
    verify: CallRecord


@dataclass
class LocalResult:
    token_ids: list[int]
    finish_reason: str
    rounds: list[RoundRecord] = field(default_factory=list)

    @property
    def resends(self) -> int:
        return sum((r.draft.attempts - 1 if r.draft else 0) + r.verify.attempts - 1 for r in self.rounds)


# between_rounds(round_index): called after each round is committed (tests evict sessions there).
RoundHook = Callable[[int], None]


class LocalCoordinator:
    def __init__(self, draft: draft_pb2_grpc.DraftStub, verifier: verifier_pb2_grpc.VerifierStub,
                 max_context: int, eos_token_ids: Sequence[int] = (), timeout_s: float | None = 60.0):
        self.draft, self.verifier = draft, verifier
        self.max_context, self.eos_token_ids, self.timeout_s = max_context, frozenset(eos_token_ids), timeout_s

    def generate_ids(self, prompt_ids: Sequence[int], params: GenerationParams = GenerationParams(),
                     sample_index: int = 0, session_id: str | None = None,
                     between_rounds: RoundHook | None = None) -> LocalResult:
        """One sample of one request. Raises grpc.RpcError (INVALID_ARGUMENT for bad parameters)."""
        prompt = list(prompt_ids)
        session_id = session_id or uuid.uuid4().hex
        seed = params.sampling.seed if params.sampling.seed is not None else secrets.randbits(SEED_BITS)
        sampling = sampling_to_proto(params.sampling)
        policy = policy_to_proto(params.policy)
        uses_draft = params.policy.name != "target-only"  # target-only rounds never call the draft
        synced: dict[str, int | None] = {"draft": None, "verifier": None}  # history length each servicer holds
        outcomes: list[draft_pb2.RoundOutcome] = []  # every round's (K, n), for a draft that rebuilds
        unsent = 0  # how many of `outcomes` the draft has not been told about
        result = LocalResult(token_ids=[], finish_reason="")
        try:
            while not result.finish_reason:
                history = prompt + result.token_ids
                round_seed = common_pb2.RoundSeed(request_seed=seed, sample_index=sample_index,
                                                  round_index=len(result.rounds))
                # propose
                candidates, draft_probs, draft_record = [], [], None
                if uses_draft:
                    def propose_request(full: bool) -> draft_pb2.ProposeRequest:
                        return draft_pb2.ProposeRequest(
                            session_id=session_id, history=delta_for(history, None if full else synced["draft"]),
                            policy=policy, sampling=sampling, max_candidates=self._budget(history, prompt, params),
                            num_generated=len(result.token_ids),
                            rounds=outcomes if full else outcomes[len(outcomes) - unsent:], seed=round_seed)
                    proposal, draft_record = self._call(self.draft.Propose, propose_request, synced["draft"] is None,
                                                        lambda reply: reply.draft_ms)
                    synced["draft"], unsent = len(history), 0
                    candidates, draft_probs = list(proposal.candidates), proposal.draft_probs
                # verify
                def verify_request(full: bool) -> verifier_pb2.VerifyRequest:
                    return verifier_pb2.VerifyRequest(
                        session_id=session_id, history=delta_for(history, None if full else synced["verifier"]),
                        candidates=candidates, draft_probs=draft_probs, sampling=sampling, seed=round_seed)
                verdict, verify_record = self._call(self.verifier.Verify, verify_request, synced["verifier"] is None,
                                                    lambda reply: reply.target_ms)
                synced["verifier"] = len(history)
                # commit
                outcomes.append(draft_pb2.RoundOutcome(num_candidates=len(candidates),
                                                       num_accepted=verdict.num_accepted))
                unsent += 1
                result.rounds.append(RoundRecord(len(result.rounds), len(candidates), verdict.num_accepted,
                                                 draft_record, verify_record))
                self._commit(result, [*candidates[:verdict.num_accepted], verdict.next_token], prompt, params)
                # decide (the stop conditions were checked while committing)
                if between_rounds and not result.finish_reason:
                    between_rounds(len(result.rounds) - 1)
        finally:
            self._release(session_id, uses_draft)
        return result

    def _budget(self, history: list[int], prompt: list[int], params: GenerationParams) -> int:
        """Most candidates worth drafting (as SpecDecEngine._candidate_budget): a round commits K + 1."""
        left = min(params.max_new_tokens - (len(history) - len(prompt)), self.max_context - len(history))
        return max(left - 1, 0)

    def _commit(self, result: LocalResult, tokens: list[int], prompt: list[int], params: GenerationParams) -> None:
        for token in tokens:
            result.token_ids.append(token)
            if token in self.eos_token_ids:
                result.finish_reason = FINISH_STOP
                return
            context_full = len(prompt) + len(result.token_ids) >= self.max_context
            if len(result.token_ids) >= params.max_new_tokens or context_full:
                result.finish_reason = FINISH_LENGTH
                return

    def _call(self, rpc, build: Callable[[bool], object], full: bool, compute_ms: Callable[[object], float]):
        """Send the round (as a delta unless `full`); on session_missing resend it in full once."""
        record = CallRecord()
        for send_full in ((True,) if full else (False, True)):
            request = build(send_full)
            start = time.perf_counter()
            reply = rpc(request, timeout=self.timeout_s)
            record.rpc_ms += (time.perf_counter() - start) * MS_PER_S
            record.bytes_sent += request.ByteSize()
            record.bytes_received += reply.ByteSize()
            record.attempts += 1
            record.history_tokens += len(request.history.tail)
            if not reply.session_missing:
                record.compute_ms = compute_ms(reply)
                return reply, record
        raise RuntimeError("a servicer answered session_missing to a full history")

    def _release(self, session_id: str, uses_draft: bool) -> None:
        """Best effort: a replica that lost the session (or is gone) has nothing to free."""
        ref = common_pb2.SessionRef(session_id=session_id)
        for stub, used in ((self.draft, uses_draft), (self.verifier, True)):
            if used:
                with contextlib.suppress(grpc.RpcError):
                    stub.Release(ref, timeout=self.timeout_s)
