"""The coordinator: the public request API (specdec.v1.Generation's messages) over the round loop.

Every request's samples join one loop (specdec/loop.py) that advances all the coordinator's
sessions together: one batched propose call and one batched verify call per step, carried by a
RoundTransport (services/transports.py when served, the in-process workers in tests). The loop's
token history is the truth, the replicas' KV caches are caches: a replica that lacks a session
re-prefills it from the history, a replica that dies costs a retry, not tokens.

Framework-free: services/replicas.py hosts it in a Serve deployment.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from specdec.errors import InvalidRequestError
from specdec.calls import RoundTransport
from specdec.loop import BatchConfig, RoundLoop
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig, policy_traits
from specdec.sequences import RequestRules, RoundObserver
from specdec.v1 import generation_pb2
from services.convert import params_from_request, prompt_ids_from_request, stats_to_proto

# Most candidates a served round may draft. A sampled round sends each candidate's draft
# distribution (~1 MB on a 152k-token vocabulary), so K bounds a round call's size; the adaptive
# policies' own caps are at most this.
MAX_CANDIDATES_PER_ROUND = 64
# A request's own id travels in every chunk of its stream: a long one would multiply what the
# server sends (a 1 MB id, 484 chunks: 484 MB).
MAX_REQUEST_ID_CHARS = 128
# A request larger than this is tokenized off the event loop: 1 MB of text takes the default
# tokenizer 0.6-0.7 s here, which stalled every stream of the coordinator (a small one stays inline:
# no thread hop).
PREPARE_INLINE_BYTES = 16 * 1024


def check_served_policy(policy: PolicyConfig) -> None:
    """What a server refuses of a named policy beyond `resolve_policy` (raises InvalidRequestError):
    a request's, and the app's default where the app is built (services/config.py)."""
    if policy.name is not None and not policy_traits(policy.name).servable:  # (None: the default, servable)
        raise InvalidRequestError(f"policy {policy.name!r} needs the target's continuation in advance and "
                                  "runs in process only (specdec generate, benchmarks/)")
    if policy.k is not None and policy.k > MAX_CANDIDATES_PER_ROUND:
        raise InvalidRequestError(f"k must be at most {MAX_CANDIDATES_PER_ROUND} on this server, got {policy.k}")


class Coordinator:
    def __init__(self, transport: RoundTransport, rules: RequestRules, default_policy: PolicyConfig = PolicyConfig(),
                 observer: RoundObserver | None = None, batch: BatchConfig = BatchConfig(),
                 api_key: str | None = None):
        """`api_key`: the server's, whose cache of earlier responses a request may ask for."""
        self.rules, self.default_policy, self.api_key = rules, default_policy, api_key
        self.loop = RoundLoop(transport, rules, batch, observer)

    @property
    def live_sessions(self) -> int:
        """Samples being decoded (or releasing their replicas' caches)."""
        return self.loop.live_sessions

    def prepare(self, request: generation_pb2.GenerateRequest) -> tuple[list[int], GenerationParams]:
        """Parse and validate a request before any model work; raises InvalidRequestError."""
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, "
                                      f"got {len(request.request_id)}")
        params = params_from_request(request, self.default_policy, self.api_key)
        prompt_ids = prompt_ids_from_request(request, self.rules, params)
        check_served_policy(params.policy)  # (its k cap before the context's)
        params = self.rules.validate(prompt_ids, params)  # resolved: the policy is named
        # A length asked for must fit after the prompt (as OpenAI and vLLM refuse it); the default
        # one stops at the context ("length").
        if request.HasField("max_new_tokens") and len(prompt_ids) + params.max_new_tokens > self.rules.max_context:
            raise InvalidRequestError(f"the models' context holds {self.rules.max_context} tokens: the prompt's "
                                      f"{len(prompt_ids)} and max-new-tokens {params.max_new_tokens} do not fit")
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
        """Chunks as rounds commit; the samples' chunks interleave. The last chunk carries the stats.
        Raises InvalidRequestError before the first chunk. A consumer that stops early cancels the
        request: its sessions leave the loop at the next step and their caches are freed."""
        if request.ByteSize() > PREPARE_INLINE_BYTES:  # (the tokenizer lets the GIL go while it encodes)
            prompt_ids, params = await asyncio.to_thread(self.prepare, request)
        else:
            prompt_ids, params = self.prepare(request)
        request_id = request.request_id or uuid.uuid4().hex
        queue: asyncio.Queue[generation_pb2.GenerateChunk | None] = asyncio.Queue()

        def on_update(index: int, ids: list[int], text: str, finish_reason: str | None) -> None:
            queue.put_nowait(generation_pb2.GenerateChunk(index=index, token_ids=ids, text=text,
                                                          finish_reason=finish_reason or "", request_id=request_id))

        task = asyncio.create_task(self.loop.generate(prompt_ids, params, on_update))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (chunk := await queue.get()) is not None:
                yield chunk
            result = await task  # raises the first sample's error, if any
        finally:
            task.cancel()
        yield generation_pb2.GenerateChunk(stats=stats_to_proto(result.stats), prompt_tokens=result.prompt_tokens,
                                           request_id=request_id)
