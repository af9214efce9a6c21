"""Clients of the public gRPC service (specdec.v1.Generation, protos/specdec/v1/generation.proto).

    with GrpcClient("localhost:9000") as client:
        response = client.generate("def fib(n):", policy="fixed", k=4, max_new_tokens=64)
        for chunk in client.generate_stream([{"role": "user", "content": "Hi"}], temperature=0.7, seed=1):
            print(chunk.text, end="")

Parameters are named as `specdec generate`'s flags; unset (or None) = the server's default.
`api_key` (default: the SPECDEC_API_KEY environment variable) goes as `authorization: Bearer` metadata.
Calls that failed retriably are retried (clients/retry.py); a retried stream resumes where it was.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TypedDict, Unpack

import grpc

from clients import ClientError, one_line, resolve_api_key, time_limit
from clients.retry import ChunkReplay, RetryPolicy, pinned_seed, retry_policy
from specdec.errors import InvalidRequestError
from specdec.v1 import generation_pb2, generation_pb2_grpc

DEFAULT_ADDRESS = "localhost:9000"
DEFAULT_TIMEOUT_S = 600.0  # a whole generation: hundreds of tokens on CPU take minutes

# Text (chat template applied unless chat_template=False), token ids, or chat messages ({"role", "content"}).
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
Metadata = tuple[tuple[str, str], ...]
ACTOR_DIED = "The actor died unexpectedly"  # Ray's text, which Serve's gRPC proxy sends when the ingress replica died


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
    draft: str  # which of the server's drafts proposes the rounds (unset: its first)
    request_id: str
    # Sent as gRPC metadata: Ray Serve routes requests with one session id to one replica.
    session_id: str


def build_request(prompt: Prompt,
                  **options: Unpack[GenerationOptions]) -> tuple[generation_pb2.GenerateRequest, Metadata | None]:
    """The request and its call metadata; None values are left unset."""
    fields = {key: value for key, value in options.items() if value is not None}
    session_id = fields.pop("session_id", None)
    if session_id is not None and not (isinstance(session_id, str) and session_id.isascii() and session_id.isprintable()):
        raise InvalidRequestError(f"session_id must be printable ASCII (it travels as gRPC metadata): {ascii(session_id)}")
    stop = fields.pop("stop", ())
    if isinstance(prompt, bytes | bytearray):  # (a sequence of ints: it went as token ids)
        raise InvalidRequestError("the request cannot be sent: a prompt is text, token ids or chat messages, not bytes")
    try:  # a value the message cannot hold (an int past its field's range, a string that is not UTF-8)
        if not isinstance(prompt, str):
            prompt = list(prompt)  # (an iterator is read once)
        request = generation_pb2.GenerateRequest(stop=[stop] if isinstance(stop, str) else list(stop), **fields)
        if isinstance(prompt, str):
            request.text = prompt
        elif prompt and all(isinstance(m, Mapping) for m in prompt):
            if not all(m.keys() >= {"role", "content"} for m in prompt):
                raise ValueError("each chat message needs a role and a content")
            request.messages.messages.extend(generation_pb2.ChatMessage(role=m["role"], content=m["content"])
                                             for m in prompt)
        else:
            request.token_ids.SetInParent()  # an empty list is still a (empty, rejected) token-id prompt
            request.token_ids.ids.extend(prompt)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"the request cannot be sent: {one_line(str(exc))}") from None
    return request, ((("session_id", session_id),) if session_id else None)


def client_error(exc: grpc.RpcError, address: str) -> ClientError:
    code, details = exc.code(), one_line(exc.details() or "")  # type: ignore[attr-defined]
    # (gRPC's words for a server that is not there; "Connection reset" under a call is retried)
    if code == grpc.StatusCode.UNAVAILABLE and any(words in details.lower() for words in (
            "failed to connect", "connection refused", "dns", "resolv")):
        return ClientError(code.name, f"cannot reach {address}: is `specdec serve` running?")
    lost = code == grpc.StatusCode.INTERNAL and details.startswith(ACTOR_DIED)
    return ClientError(code.name, details or code.name, lost=lost)


def retriable(error: ClientError) -> bool:
    """At capacity, or the serving replica died; not: the server is not there, or the message was
    over gRPC's size limit (also RESOURCE_EXHAUSTED)."""
    if error.lost:
        return True
    if error.code == "RESOURCE_EXHAUSTED":
        return "larger than max" not in error.message
    return error.code == "UNAVAILABLE" and not error.message.startswith("cannot reach")


def grpc_address(address: str) -> str:
    """HOST:PORT (or a gRPC target such as `unix:PATH`, `dns:///HOST:PORT`), checked before any
    call: a mistyped one failed at its first call as UNKNOWN or "cannot reach"."""
    try:
        address.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{ascii(address)} is not an address: it is not valid UTF-8") from None
    if not address.isprintable() or " " in address:
        raise InvalidRequestError(f"{ascii(address)} is not an address: it holds spaces or control characters")
    if address.startswith(("http://", "https://")):
        raise InvalidRequestError(f"{address} is an HTTP URL; the gRPC address is HOST:PORT (e.g. localhost:9000)")
    if re.match(r"(unix|unix-abstract|dns|ipv4|ipv6|vsock):", address):
        return address
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequestError(f"{address!r} is not an address: expected HOST:PORT (e.g. localhost:9000)")
    return address


class _Options:
    """What both clients share: the address, the key, the retry policy, building a call."""

    def __init__(self, address: str, timeout_s: float | None, api_key: str | None,
                 retries: int | RetryPolicy | None):
        self.address, self.timeout_s = grpc_address(address), time_limit(timeout_s)
        self.api_key = resolve_api_key(api_key)
        self.retry = retry_policy(retries)

    def _call(self, prompt: Prompt, options: dict) -> tuple[generation_pb2.GenerateRequest, Metadata]:
        request, metadata = build_request(prompt, **pinned_seed(options, self.retry))
        auth = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()
        return request, (metadata or ()) + auth

    def _give_up(self, exc: grpc.RpcError, attempt: int) -> ClientError | None:
        """The error to raise, or None to retry."""
        error = client_error(exc, self.address)
        return error if attempt >= self.retry.retries or not retriable(error) else None


class GrpcClient(_Options):
    """Blocking client; a channel per client (thread-safe, reuse it). `retries`: attempts after
    the first for retriable failures (None: 2)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 api_key: str | None = None, retries: int | RetryPolicy | None = None):
        super().__init__(address, timeout_s, api_key, retries)
        self._channel = grpc.insecure_channel(address)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def generate(self, prompt: Prompt, **options: Unpack[GenerationOptions]) -> generation_pb2.GenerateResponse:
        request, metadata = self._call(prompt, options)
        for attempt in range(self.retry.retries + 1):
            try:
                return self._stub.Generate(request, timeout=self.timeout_s, metadata=metadata)
            except grpc.RpcError as exc:
                if (error := self._give_up(exc, attempt)) is not None:
                    raise error from None
            time.sleep(self.retry.delay(attempt))
        raise AssertionError("unreachable")

    def generate_stream(self, prompt: Prompt, **options: Unpack[GenerationOptions]) -> Iterator[generation_pb2.GenerateChunk]:
        """Chunks as rounds commit; the last carries the stats. Leaving the loop early cancels the call."""
        request, metadata = self._call(prompt, options)
        replay = ChunkReplay()
        for attempt in range(self.retry.retries + 1):
            replay.restart()
            call = self._stub.GenerateStream(request, timeout=self.timeout_s, metadata=metadata)
            try:
                for chunk in call:
                    if (fresh := replay.fresh(chunk)) is not None:
                        yield fresh
                return
            except grpc.RpcError as exc:
                if (error := self._give_up(exc, attempt)) is not None:
                    raise error from None
            finally:
                call.cancel()
            time.sleep(self.retry.delay(attempt))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *_) -> None:
        self.close()


class AsyncGrpcClient(_Options):
    """asyncio client (grpc.aio); create it inside the event loop that uses it."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 api_key: str | None = None, retries: int | RetryPolicy | None = None):
        super().__init__(address, timeout_s, api_key, retries)
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def generate(self, prompt: Prompt, **options: Unpack[GenerationOptions]) -> generation_pb2.GenerateResponse:
        request, metadata = self._call(prompt, options)
        for attempt in range(self.retry.retries + 1):
            try:
                return await self._stub.Generate(request, timeout=self.timeout_s, metadata=metadata)
            except grpc.RpcError as exc:
                if (error := self._give_up(exc, attempt)) is not None:
                    raise error from None
            await asyncio.sleep(self.retry.delay(attempt))
        raise AssertionError("unreachable")

    async def generate_stream(self, prompt: Prompt,
                              **options: Unpack[GenerationOptions]) -> AsyncIterator[generation_pb2.GenerateChunk]:
        request, metadata = self._call(prompt, options)
        replay = ChunkReplay()
        for attempt in range(self.retry.retries + 1):
            replay.restart()
            call = self._stub.GenerateStream(request, timeout=self.timeout_s, metadata=metadata)
            try:
                async for chunk in call:
                    if (fresh := replay.fresh(chunk)) is not None:
                        yield fresh
                return
            except grpc.RpcError as exc:
                if (error := self._give_up(exc, attempt)) is not None:
                    raise error from None
            finally:
                call.cancel()
            await asyncio.sleep(self.retry.delay(attempt))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncGrpcClient:
        return self

    async def __aexit__(self, *_) -> None:
        await self.close()
