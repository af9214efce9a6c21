"""Test-side servers over the in-process engine: `EngineBackend` (services.openai_api's
GenerationBackend), a real gRPC server for specdec.v1.Generation, and a real HTTP server (uvicorn)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

import grpc
import uvicorn

from specdec.engine import GenerationResult, SpecDecEngine
from specdec.errors import InvalidRequestError
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from specdec.v1 import generation_pb2, generation_pb2_grpc
from services.convert import params_from_request, prompt_ids_from_request, stats_to_proto


class EngineBackend:
    """The engine behind the GenerationBackend protocol; one generation at a time, off the event loop."""

    def __init__(self, engine: SpecDecEngine):
        self.engine = engine
        self._lock = threading.Lock()

    def _prepare(self, request: generation_pb2.GenerateRequest) -> tuple[list[int], GenerationParams]:
        params = params_from_request(request, PolicyConfig())
        prompt_ids = prompt_ids_from_request(request, self.engine.rules, params)
        self.engine.validate(prompt_ids, params)
        return prompt_ids, params

    def _run(self, prompt_ids: list[int], params: GenerationParams,
             on_update: Callable[[int, list[int], str], None] | None = None) -> GenerationResult:
        with self._lock:
            return self.engine.generate_ids(prompt_ids, params, on_update)

    async def generate(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse:
        prompt_ids, params = self._prepare(request)
        result = await asyncio.to_thread(self._run, prompt_ids, params)
        completions = [generation_pb2.Completion(index=i, text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason)
                       for i, c in enumerate(result.completions)]
        return generation_pb2.GenerateResponse(completions=completions, stats=stats_to_proto(result.stats),
                                               prompt_tokens=result.prompt_tokens,
                                               request_id=request.request_id or uuid.uuid4().hex)

    async def generate_stream(self, request: generation_pb2.GenerateRequest) -> AsyncIterator[generation_pb2.GenerateChunk]:
        """Chunks as the engine commits rounds; finish reasons on token-less chunks, then the stats
        chunk (the coordinator puts finish reasons on the last token chunk: the routes take both)."""
        prompt_ids, params = self._prepare(request)
        request_id = request.request_id or uuid.uuid4().hex
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def on_update(index: int, ids: list[int], text: str) -> None:
            chunk = generation_pb2.GenerateChunk(index=index, token_ids=ids, text=text, request_id=request_id)
            loop.call_soon_threadsafe(queue.put_nowait, chunk)

        done = loop.run_in_executor(None, self._run, prompt_ids, params, on_update)
        done.add_done_callback(lambda _: queue.put_nowait(None))
        while (chunk := await queue.get()) is not None:
            yield chunk
        result = await done
        for index, completion in enumerate(result.completions):
            yield generation_pb2.GenerateChunk(index=index, finish_reason=completion.finish_reason, request_id=request_id)
        yield generation_pb2.GenerateChunk(stats=stats_to_proto(result.stats), prompt_tokens=result.prompt_tokens,
                                           request_id=request_id)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """A thin specdec.v1.Generation servicer over a backend, as the Serve ingress maps errors."""

    def __init__(self, backend: EngineBackend):
        self.backend = backend
        self.metadata: dict[str, str] = {}  # the last call's

    async def Generate(self, request, context):
        self.metadata = dict(context.invocation_metadata())
        try:
            return await self.backend.generate(request)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def GenerateStream(self, request, context):
        self.metadata = dict(context.invocation_metadata())
        try:
            async for chunk in self.backend.generate_stream(request):
                yield chunk
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def grpc_server(servicer: GenerationServicer) -> Iterator[str]:
    """A grpc.aio server on a loopback port, its event loop on a background thread; yields HOST:PORT."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@contextmanager
def http_server(app) -> Iterator[str]:
    """uvicorn serving `app` on a loopback port in a background thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
