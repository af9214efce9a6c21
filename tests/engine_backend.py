"""Test-side servers over the in-process engine: `EngineBackend` (the coordinator over the engine's
workers, services.openai_api's GenerationBackend), a real gRPC server for specdec.v1.Generation,
and a real HTTP server (uvicorn)."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import uvicorn

from specdec.engine import SpecDecEngine
from specdec.v1 import generation_pb2_grpc
from services.coordinator import Coordinator
from services.errors import grpc_status


class EngineBackend(Coordinator):
    """The coordinator over the in-process engine's workers (services.openai_api's
    GenerationBackend): the served request path, batching included, without Ray."""

    def __init__(self, engine: SpecDecEngine):
        super().__init__(engine.loop.calls.transport, engine.rules)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """A thin specdec.v1.Generation servicer over a backend, as the Serve ingress maps errors."""

    def __init__(self, backend: EngineBackend):
        self.backend = backend
        self.metadata: dict[str, str] = {}  # the last call's

    async def Generate(self, request, context):
        self.metadata = dict(context.invocation_metadata())
        try:
            return await self.backend.generate(request)
        except Exception as exc:  # noqa: BLE001 - as the ingress: services/errors.py's table
            await context.abort(*grpc_status(exc))

    async def GenerateStream(self, request, context):
        self.metadata = dict(context.invocation_metadata())
        try:
            async for chunk in self.backend.generate_stream(request):
                yield chunk
        except Exception as exc:  # noqa: BLE001
            await context.abort(*grpc_status(exc))


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux: "low high"


def free_ports(n: int) -> list[int]:
    """n distinct free ports for servers a test starts, drawn below the OS's ephemeral range (and above
    Ray's worker ports, 10002-19999). A port drawn by binding port 0 comes from the ephemeral range,
    where Ray's own processes and every outgoing connection also take ports: between the draw and
    Serve's bind, one of them can take it ("Failed to bind to address", seen in CI). Every drawn
    socket stays bound until all n are drawn, so none repeats."""
    low = int(EPHEMERAL_RANGE.read_text().split()[0]) if EPHEMERAL_RANGE.exists() else 32768
    candidates = random.sample(range(20000, low), min(low - 20000, 64 * n))
    family, anywhere = _any_address()
    with ExitStack() as stack:
        ports = []
        for port in candidates:
            if len(ports) == n:
                break
            s = stack.enter_context(socket.socket(family))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            try:
                s.bind((anywhere, port))  # every address, as Serve's gRPC proxy binds
            except OSError:
                continue
            ports.append(port)
        if len(ports) < n:
            raise RuntimeError(f"found only {len(ports)} of {n} free ports in 20000-{low - 1}")
        return ports


def _any_address() -> tuple[socket.AddressFamily, str]:
    """IPv6's any-address where the kernel has IPv6 (it covers IPv4 too), else IPv4's."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::", 0))
        return socket.AF_INET6, "::"
    except OSError:
        return socket.AF_INET, "0.0.0.0"


def free_port() -> int:
    return free_ports(1)[0]


@contextmanager
def local_serve(config, env: dict[str, str] | None = None) -> Iterator[dict]:
    """The Serve app of `config` (services.config.AppConfig) on a fresh local Ray instance of 2 CPUs,
    its addresses; Ray's processes inherit `env` (restored after)."""
    import ray
    from ray import serve

    from services.launch import start

    env = env or {}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        try:
            http_port, grpc_port = free_ports(2)
            yield start(config, http_port=http_port, grpc_port=grpc_port)
        finally:
            serve.shutdown()
            ray.shutdown()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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

    async def stop() -> None:  # the server, then whatever its calls left running (a generation in flight)
        await server.stop(None)
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=10)
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
