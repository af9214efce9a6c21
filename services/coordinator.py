"""The coordinator: runs the round loop for many concurrent sessions (DESIGN.md section 2).

One round is the paper's MDP step, as in the in-process engine:
    propose -> the draft service syncs its cache to the committed history, drafts y_1..y_K and asks
               the stopping policy after every token;
    verify  -> the verifier service scores history + candidates in one pass (Algorithm 1);
    commit  -> y_1..y_n and the correction/bonus token join the session's history;
    decide  -> stop on EOS, the token budget or a stop string, else the next round.

The coordinator's token history is the truth; the replicas' KV caches are caches. Each call sends
only the tokens a replica has not seen (HistoryDelta); a replica that lacks the session (evicted,
restarted, or a different replica) answers `session_missing` and gets the round again with the
whole history. A replica that dies mid-call costs a retry, not tokens: rounds are deterministic in
(request seed, sample, round), so the retried round draws the same numbers.

Framework-free: `RoundTransport` carries the round calls (Ray Serve handles in services/app.py, plain
gRPC stubs in tests and benchmarks).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from google.protobuf.message import Message

from specdec.errors import InvalidRequestError
from specdec.metrics import RequestStats
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig, resolve_policy
from specdec.rounds import SEED_BITS
from specdec.sequences import RequestRules, SampleState
from specdec.v1 import common_pb2, draft_pb2, generation_pb2, verifier_pb2
from services.convert import delta_for, params_from_request, policy_to_proto, prompt_ids_from_request, \
    sampling_to_proto, stats_to_proto

logger = logging.getLogger(__name__)

Role = Literal["draft", "verifier"]
MS_PER_S = 1000.0
# Most candidates a served round may draft. A sampled round sends each candidate's draft
# distribution (~1 MB on a 152k-token vocabulary), so K bounds a round call's size; the adaptive
# policies' own caps are at most this.
MAX_CANDIDATES_PER_ROUND = 64


class RoundTransport(Protocol):
    """Carries one round call to a replica of `role` chosen for `session_id`."""

    # Exceptions meaning "that replica is gone or unreachable": the call is retried (elsewhere).
    retryable: tuple[type[BaseException], ...]

    async def propose(self, session_id: str, request: draft_pb2.ProposeRequest) -> draft_pb2.Proposal: ...

    async def verify(self, session_id: str, request: verifier_pb2.VerifyRequest) -> verifier_pb2.Verdict: ...

    async def release(self, role: Role, session_id: str) -> None: ...


class RoundObserver(Protocol):
    """Metrics sink (services/metrics.py); every method is optional to implement meaningfully."""

    def on_round(self, num_candidates: int, num_accepted: int, policy: str) -> None: ...

    def on_call(self, role: Role, compute_ms: float, transport_ms: float, num_bytes: int) -> None: ...

    def on_request(self, stats: RequestStats, policy: str, ok: bool) -> None: ...


@dataclass
class RetryPolicy:
    """How long a session waits for a replica to come back (a restart takes seconds)."""

    attempts: int = 30
    first_backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def backoff(self, attempt: int) -> float:
        return min(self.first_backoff_s * 2 ** attempt, self.max_backoff_s)


class Coordinator:
    def __init__(self, transport: RoundTransport, rules: RequestRules, default_policy: PolicyConfig = PolicyConfig(),
                 observer: RoundObserver | None = None, retry: RetryPolicy = RetryPolicy()):
        self.transport, self.rules, self.default_policy = transport, rules, default_policy
        self.observer, self.retry = observer, retry
        self.sessions: set[str] = set()  # samples being decoded (or releasing their replicas' caches)

    # ----------------------------------------------------------------------------------------
    # Requests

    def prepare(self, request: generation_pb2.GenerateRequest) -> tuple[list[int], GenerationParams]:
        """Parse and validate a request before any model work; raises InvalidRequestError."""
        params = params_from_request(request, self.default_policy)
        params = params.model_copy(update={"policy": resolve_policy(params.policy, self.rules.has_head)})
        if params.policy.name == "oracle":
            raise InvalidRequestError("policy 'oracle' needs the target's continuation in advance and runs in "
                                      "process only (specdec generate, benchmarks/)")
        if params.policy.k is not None and params.policy.k > MAX_CANDIDATES_PER_ROUND:
            raise InvalidRequestError(f"k must be at most {MAX_CANDIDATES_PER_ROUND} on this server, got {params.policy.k}")
        if params.max_new_tokens > self.rules.max_context:
            raise InvalidRequestError(f"max-new-tokens {params.max_new_tokens} exceeds the models' context of "
                                      f"{self.rules.max_context} tokens")
        prompt_ids = prompt_ids_from_request(request, self.rules, params)
        self.rules.validate(prompt_ids, params)
        return prompt_ids, params

    async def generate(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse:
        completions: dict[int, generation_pb2.Completion] = {}
        last = None
        async for chunk in self.generate_stream(request):
            completion = completions.setdefault(chunk.index, generation_pb2.Completion(index=chunk.index))
            completion.token_ids.extend(chunk.token_ids)
            completion.text += chunk.text
            if chunk.finish_reason:
                completion.finish_reason = chunk.finish_reason
            last = chunk
        return generation_pb2.GenerateResponse(
            completions=[completions[i] for i in sorted(completions)], stats=last.stats,
            prompt_tokens=last.prompt_tokens, request_id=last.request_id)

    async def generate_stream(self, request: generation_pb2.GenerateRequest) -> AsyncIterator[generation_pb2.GenerateChunk]:
        """Chunks as rounds commit; samples run concurrently and their chunks interleave. The last
        chunk carries the stats. Raises InvalidRequestError before the first chunk."""
        prompt_ids, params = self.prepare(request)
        request_id = request.request_id or uuid.uuid4().hex
        seed = params.sampling.seed if params.sampling.seed is not None else secrets.randbits(SEED_BITS)
        stats, queue = RequestStats(), asyncio.Queue()
        start = time.perf_counter()

        def emit(index: int, ids: list[int], text: str, finish_reason: str | None) -> None:
            queue.put_nowait(generation_pb2.GenerateChunk(index=index, token_ids=ids, text=text,
                                                          finish_reason=finish_reason or "", request_id=request_id))

        # Session ids are ours, not the client's request id: two requests naming the same id must
        # not share the replicas' caches.
        session = uuid.uuid4().hex

        async def run(index: int) -> None:
            await self._decode(prompt_ids, params, seed, index, f"{session}/{index}", stats, emit)

        tasks = [asyncio.create_task(run(i)) for i in range(params.n)]
        done = asyncio.gather(*tasks)
        done.add_done_callback(lambda _: queue.put_nowait(None))
        ok = False
        try:
            while (chunk := await queue.get()) is not None:
                yield chunk
            await done  # raises the first sample's error, if any
            ok = True
        finally:
            for task in tasks:
                task.cancel()
            stats.wall_time_s = time.perf_counter() - start
            if self.observer:
                self.observer.on_request(stats, params.policy.name, ok)
        yield generation_pb2.GenerateChunk(stats=stats_to_proto(stats), prompt_tokens=len(prompt_ids),
                                           request_id=request_id)

    # ----------------------------------------------------------------------------------------
    # The loop

    async def _decode(self, prompt_ids: list[int], params: GenerationParams, seed: int, index: int, session_id: str,
                      stats: RequestStats, emit: Callable[[int, list[int], str, str | None], None]) -> None:
        seq = SampleState(prompt_ids)
        sampling, policy = sampling_to_proto(params.sampling), policy_to_proto(params.policy)
        uses_draft = params.policy.name != "target-only"
        synced: dict[Role, int | None] = {"draft": None, "verifier": None}  # history length each replica holds
        outcomes: list[draft_pb2.RoundOutcome] = []  # every round's (K, n), for a draft that rebuilds
        unsent = 0  # outcomes the draft has not been told about
        self.sessions.add(session_id)
        try:
            while seq.finish_reason is None:
                history = seq.history
                round_seed = common_pb2.RoundSeed(request_seed=seed, sample_index=index, round_index=len(outcomes))
                # propose
                candidates, draft_probs = [], []
                if uses_draft:
                    def propose_request(full: bool) -> draft_pb2.ProposeRequest:
                        return draft_pb2.ProposeRequest(
                            session_id=session_id, history=delta_for(history, None if full else synced["draft"]),
                            policy=policy, sampling=sampling, max_candidates=self.rules.candidate_budget(seq, params),
                            num_generated=len(seq.generated), rounds=outcomes if full else outcomes[len(outcomes) - unsent:],
                            seed=round_seed)
                    proposal = await self._call("draft", session_id, propose_request, synced, stats)
                    unsent = 0
                    candidates, draft_probs = list(proposal.candidates), proposal.draft_probs
                    stats.draft_forward_passes += proposal.forward_passes
                # verify
                def verify_request(full: bool) -> verifier_pb2.VerifyRequest:
                    return verifier_pb2.VerifyRequest(
                        session_id=session_id, history=delta_for(history, None if full else synced["verifier"]),
                        candidates=candidates, draft_probs=draft_probs, sampling=sampling, seed=round_seed)
                verdict = await self._call("verifier", session_id, verify_request, synced, stats)
                # commit
                outcomes.append(draft_pb2.RoundOutcome(num_candidates=len(candidates), num_accepted=verdict.num_accepted))
                unsent += 1
                stats.record_round(len(candidates), verdict.num_accepted)
                if self.observer:
                    self.observer.on_round(len(candidates), verdict.num_accepted, params.policy.name)
                new_ids, new_text = self.rules.commit(seq, [*candidates[:verdict.num_accepted], verdict.next_token], params)
                stats.generated_tokens += len(new_ids)
                # decide (the stop conditions were checked while committing)
                if new_ids or new_text or seq.finish_reason:
                    emit(index, new_ids, new_text, seq.finish_reason)
        finally:
            try:
                await self._release(session_id, uses_draft)
            finally:
                self.sessions.discard(session_id)

    async def _call(self, role: Role, session_id: str, build: Callable[[bool], Message],
                    synced: dict[Role, int | None], stats: RequestStats) -> Message:
        """One round call: as a delta, resent in full on session_missing; retried on a replica that
        is gone (the retry lands on another or a restarted replica, which rebuilds the session)."""
        call = self.transport.propose if role == "draft" else self.transport.verify
        for attempt in range(self.retry.attempts):
            full = synced[role] is None
            request = build(full)
            start = time.perf_counter()
            try:
                reply = await call(session_id, request)
            except self.transport.retryable as exc:
                if attempt == self.retry.attempts - 1:
                    raise
                logger.warning("%s call for session %s failed (%s); retrying", role, session_id, type(exc).__name__)
                synced[role] = None
                await asyncio.sleep(self.retry.backoff(attempt))
                continue
            rpc_ms = (time.perf_counter() - start) * MS_PER_S
            compute_ms = reply.draft_ms if role == "draft" else reply.target_ms
            num_bytes = request.ByteSize() + reply.ByteSize()
            stats.transport_time_s += max(rpc_ms - compute_ms, 0.0) / MS_PER_S
            stats.transport_bytes += num_bytes
            if self.observer:
                self.observer.on_call(role, compute_ms, max(rpc_ms - compute_ms, 0.0), num_bytes)
            if reply.session_missing:
                if full:
                    raise RuntimeError(f"the {role} answered session_missing to a full history")
                synced[role] = None
                continue
            if role == "draft":
                stats.draft_time_s += compute_ms / MS_PER_S
            else:
                stats.target_time_s += compute_ms / MS_PER_S
            synced[role] = request.history.history_length
            return reply
        raise RuntimeError(f"the {role} call for session {session_id} did not complete")

    async def _release(self, session_id: str, uses_draft: bool) -> None:
        """Best effort: a replica that lost the session (or is gone) has nothing to free."""
        for role, used in (("draft", uses_draft), ("verifier", True)):
            if used:
                try:
                    await self.transport.release(role, session_id)
                except Exception:  # noqa: BLE001 - the request's result does not depend on it
                    logger.debug("release of %s on the %s failed", session_id, role, exc_info=True)
