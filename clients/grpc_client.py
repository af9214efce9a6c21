"""Clients of the public gRPC service (specdec.v1.Generation, protos/specdec/v1/generation.proto).

    with GrpcClient("localhost:9000") as client:
        response = client.generate("def fib(n):", policy="fixed", k=4, max_new_tokens=64)
        for chunk in client.generate_stream([{"role": "user", "content": "Hi"}], temperature=0.7, seed=1):
            print(chunk.text, end="")

Parameters are named as `specdec generate`'s flags; unset (or None) = the server's default.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TypedDict, Unpack

import grpc

from clients import ClientError, one_line
from specdec.v1 import generation_pb2, generation_pb2_grpc

DEFAULT_ADDRESS = "localhost:9000"
DEFAULT_TIMEOUT_S = 600.0  # a whole generation: hundreds of tokens on CPU take minutes

# Text (chat template applied unless chat_template=False), token ids, or chat messages ({"role", "content"}).
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
Metadata = tuple[tuple[str, str], ...]


class GenerationOptions(TypedDict, total=False):
    policy: str
    k: int
    threshold: float
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_new_tokens: int
    n: int
    stop: str | Sequence[str]
    chat_template: bool
    request_id: str
    # Sent as gRPC metadata: Ray Serve routes requests with one session id to one replica.
    session_id: str


def build_request(prompt: Prompt,
                  **options: Unpack[GenerationOptions]) -> tuple[generation_pb2.GenerateRequest, Metadata | None]:
    """The request and its call metadata; None values are left unset."""
    fields = {key: value for key, value in options.items() if value is not None}
    session_id = fields.pop("session_id", None)
    stop = fields.pop("stop", ())
    request = generation_pb2.GenerateRequest(stop=[stop] if isinstance(stop, str) else list(stop), **fields)
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and all(isinstance(m, Mapping) for m in prompt):
        request.messages.messages.extend(generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        request.token_ids.SetInParent()  # an empty list is still a (empty, rejected) token-id prompt
        request.token_ids.ids.extend(prompt)
    return request, ((("session_id", session_id),) if session_id else None)


def client_error(exc: grpc.RpcError, address: str) -> ClientError:
    code, details = exc.code(), one_line(exc.details() or "")  # type: ignore[attr-defined]
    if code == grpc.StatusCode.UNAVAILABLE and ("connect" in details.lower() or "dns" in details.lower()):
        return ClientError(code.name, f"cannot reach {address}: is `specdec serve` running?")
    return ClientError(code.name, details or code.name)


class GrpcClient:
    """Blocking client; a channel per client (thread-safe, reuse it)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout_s: float | None = DEFAULT_TIMEOUT_S):
        self.address, self.timeout_s = address, timeout_s
        self._channel = grpc.insecure_channel(address)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def generate(self, prompt: Prompt, **options: Unpack[GenerationOptions]) -> generation_pb2.GenerateResponse:
        request, metadata = build_request(prompt, **options)
        try:
            return self._stub.Generate(request, timeout=self.timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            raise client_error(exc, self.address) from None

    def generate_stream(self, prompt: Prompt, **options: Unpack[GenerationOptions]) -> Iterator[generation_pb2.GenerateChunk]:
        """Chunks as rounds commit; the last carries the stats. Leaving the loop early cancels the call."""
        request, metadata = build_request(prompt, **options)
        call = self._stub.GenerateStream(request, timeout=self.timeout_s, metadata=metadata)
        try:
            yield from call
        except grpc.RpcError as exc:
            raise client_error(exc, self.address) from None
        finally:
            call.cancel()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *_) -> None:
        self.close()


class AsyncGrpcClient:
    """asyncio client (grpc.aio); create it inside the event loop that uses it."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout_s: float | None = DEFAULT_TIMEOUT_S):
        self.address, self.timeout_s = address, timeout_s
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def generate(self, prompt: Prompt, **options: Unpack[GenerationOptions]) -> generation_pb2.GenerateResponse:
        request, metadata = build_request(prompt, **options)
        try:
            return await self._stub.Generate(request, timeout=self.timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            raise client_error(exc, self.address) from None

    async def generate_stream(self, prompt: Prompt,
                              **options: Unpack[GenerationOptions]) -> AsyncIterator[generation_pb2.GenerateChunk]:
        request, metadata = build_request(prompt, **options)
        call = self._stub.GenerateStream(request, timeout=self.timeout_s, metadata=metadata)
        try:
            async for chunk in call:
                yield chunk
        except grpc.RpcError as exc:
            raise client_error(exc, self.address) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncGrpcClient:
        return self

    async def __aexit__(self, *_) -> None:
        await self.close()
