"""The floor of one per-step exchange: our gRPC round stream against Ray's channels.

    python -m benchmarks.channels [--calls 2000] [--payload 300]

Each way carries a message of `--payload` bytes to a process of its own and its answer back, one
at a time, timed where the caller waits (median and 10th-90th percentile of the last 90%):

    grpc stream      our Draft servicer's ProposeStream (services/servicers.py): a grpc.aio client, a
                     thread-pool server, the batch handed to the replica's torch thread and back; an
                     empty batch, so the worker does nothing (the stack's floor per step message)
    grpc unary       the same servicer's Propose as a unary call
    ray actor call   a Ray actor method call and ray.get (what handle calls ride on)
    compiled graph   a Ray Compiled Graph (`experimental_compile`) over the same actor: its input and
                     output travel through shared-memory channels, no task submission per call

It answers issue 67's "a stream, or Compiled Graph channels: measure both, choose". docs/performance.md
("Served") reports it.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks.transport import spread
from specdec.metrics import MS_PER_S


def warm(times: list[float]) -> dict:
    """The calls' spread (transport.py `spread`) but for the first tenth: they set the path up."""
    return spread(times[len(times) // 10:])


def grpc_calls(calls: int) -> dict:
    """Our servicer in a process of its own (benchmarks.transport `replicas`)."""
    import grpc

    from benchmarks.transport import replicas, tiny_pair
    from specdec.v1 import draft_pb2, draft_pb2_grpc

    async def run(address: str) -> dict:
        async with grpc.aio.insecure_channel(address) as channel:
            stub, batch = draft_pb2_grpc.DraftStub(channel), draft_pb2.ProposeBatch()
            stream = stub.ProposeStream()
            await stream.initial_metadata()
            streamed, unary = [], []
            for _ in range(calls):
                start = time.perf_counter()
                await stream.write(batch)
                await stream.read()
                streamed.append((time.perf_counter() - start) * MS_PER_S)
            await stream.done_writing()
            for _ in range(calls):
                start = time.perf_counter()
                await stub.Propose(batch)
                unary.append((time.perf_counter() - start) * MS_PER_S)
        return {"grpc stream": warm(streamed), "grpc unary": warm(unary)}

    with replicas(tiny_pair(1024), threads=1) as (addresses, _):
        return asyncio.run(run(addresses["draft"]))


def ray_calls(calls: int, payload: int) -> dict:
    import ray
    from ray.dag import InputNode

    @ray.remote
    class Echo:
        def echo(self, message: bytes) -> bytes:
            return message

    ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        actor, message = Echo.remote(), b"x" * payload
        ray.get(actor.echo.remote(message))
        plain = []
        for _ in range(calls):
            start = time.perf_counter()
            ray.get(actor.echo.remote(message))
            plain.append((time.perf_counter() - start) * MS_PER_S)
        with InputNode() as inp:
            dag = actor.echo.bind(inp)
        compiled = dag.experimental_compile()
        try:
            graph = []
            for _ in range(calls):
                start = time.perf_counter()
                ray.get(compiled.execute(message))
                graph.append((time.perf_counter() - start) * MS_PER_S)
        finally:
            compiled.teardown()
        return {"ray actor call": warm(plain), "compiled graph": warm(graph)}
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--payload", type=int, default=300, help="bytes each way (a greedy step's exchange: ~300)")
    args = parser.parse_args()
    results = grpc_calls(args.calls) | ray_calls(args.calls, args.payload)
    for way, row in results.items():
        print(f"{way:16s} {row['median']:.3f} ms [{row['p10']:.3f}, {row['p90']:.3f}]")


if __name__ == "__main__":
    main()
