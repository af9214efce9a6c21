"""HandleTransport's round calls on real Ray Serve (`serve-grpc`: Serve's inter-deployment gRPC;
`actor`: Ray actor calls) to a replica stuck in its pass: the call the coordinator gives up on
(no answer within the call timeout, or its caller cancelled) is cancelled on the replica, not left
to run there (with `actor` it was, either way)."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from ray import serve

from services.transports import HandleTransport

from test_round_services import give_up_on_a_call


@serve.deployment(max_ongoing_requests=8)
class Stuck:
    """A draft replica whose Propose never ends unless cancelled: counts those begun and those
    cancelled."""

    def __init__(self):
        self.begun = self.cancelled = 0

    async def address(self) -> str:
        return "stuck:1"

    async def propose(self, payload: bytes) -> bytes:
        self.begun += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return b""

    async def counts(self) -> tuple[int, int]:
        return self.begun, self.cancelled


@pytest.fixture(scope="module")
def stuck():
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        yield serve.run(Stuck.bind(), name="stuck", route_prefix=None)
    finally:
        serve.shutdown()
        ray.shutdown()


def counts(handle) -> tuple[int, int]:
    return handle.counts.remote().result()


@pytest.mark.parametrize("grpc_transport", [True, False], ids=["serve-grpc", "actor"])
@pytest.mark.parametrize("end", ["timeout", "cancelled"])
def test_a_handle_call_given_up_stops_on_its_replica(stuck, grpc_transport, end):
    begun, cancelled = counts(stuck)

    async def begun_here() -> bool:
        return (await stuck.counts.remote())[0] > begun

    async def call():
        transport = HandleTransport(stuck, None, grpc_transport=grpc_transport)
        transport.timeout_s = 10.0 if end == "timeout" else 120.0
        await give_up_on_a_call(transport, end, begun_here)

    asyncio.run(call())
    deadline = time.monotonic() + 60  # (the cancel reaches the replica by Ray's own messages)
    while counts(stuck) != (begun + 1, cancelled + 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counts(stuck) == (begun + 1, cancelled + 1)
