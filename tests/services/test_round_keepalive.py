"""Keepalive on the round connections (services/server.py `keepalive`): a peer whose machine
vanishes without closing its TCP connections is noticed by both ends, over real gRPC through a
TCP proxy that stops forwarding (`Proxy.freeze`: nothing reaches either side any more, and nothing
is closed). The ping intervals here are short versions of the served ones (`short`), the same
options otherwise."""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time

import grpc
import pytest

from services import server as round_server, transports
from services.server import keepalive, start_server
from services.servicers import DraftServicer
from services.transports import GrpcTransport, ReplicaGone, service
from specdec.v1 import draft_pb2, draft_pb2_grpc

from test_round_services import propose_item

SHORT_MS = 500  # a short ping interval and timeout, for the tests' dead peers to be found quickly


@pytest.fixture
def short(monkeypatch):
    """Both ends' keepalive options, scaled down to SHORT_MS."""
    channel, server = keepalive(SHORT_MS, SHORT_MS)
    monkeypatch.setattr(round_server, "SERVER_KEEPALIVE", server)
    monkeypatch.setattr(transports, "CHANNEL_KEEPALIVE", channel)
    return channel, server


class Proxy:
    """A TCP proxy on a loopback port to `target`; once frozen it forwards nothing either way and
    closes nothing, as if the machine on the far side had vanished."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.frozen = threading.Event()
        self._stopped = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:  # (closed)
                return
            upstream = socket.create_connection(self.target)
            for each in (client, upstream):
                each.settimeout(0.1)
                self._sockets.append(each)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while not self._stopped.is_set():
            try:
                data = source.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:  # (frozen: the far side's close never arrives either)
                if not self.frozen.is_set():
                    sink.shutdown(socket.SHUT_WR)
                return
            if not self.frozen.is_set():
                sink.sendall(data)

    def freeze(self) -> None:
        self.frozen.set()

    def close(self) -> None:
        self._stopped.set()
        self._listener.close()
        for each in self._sockets:
            each.close()


def wait_for(condition, seconds: float = 30.0) -> bool:
    """Whether `condition()` came true within `seconds` (a dead peer is found in about two ping
    intervals; this is only how long a test waits before it fails)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Hanging(DraftServicer):
    """A draft replica whose Propose takes as long as the test says (a long prefill): `entered` once
    one is under way, it answers once `release` is set."""

    def __init__(self):
        super().__init__(worker=None)
        self.entered, self.release = threading.Event(), threading.Event()

    def Propose(self, request, context):
        self.entered.set()
        self.release.wait()
        return draft_pb2.ProposalBatch()


def test_a_coordinator_that_vanished_frees_its_round_stream(short):
    """A coordinator's machine goes away with a round stream open on a replica: the replica's
    keepalive finds the peer dead and the stream's place is freed (without it the stream stayed
    open, and a replica's places are few: services/servicers.py MAX_STREAMS)."""
    servicer = Hanging()
    server, address = start_server(draft=servicer)
    proxy = Proxy(address)
    waiting = queue.Queue()
    channel = grpc.insecure_channel(proxy.address)  # the coordinator: it will not ping, it is gone
    try:
        call = draft_pb2_grpc.DraftStub(channel).ProposeStream(iter(waiting.get, None))
        assert wait_for(lambda: servicer.streams == 1)
        proxy.freeze()
        assert wait_for(lambda: servicer.streams == 0), "the vanished coordinator's stream is still open"
        assert servicer.streams_opened == 1
    finally:
        waiting.put(None)
        call.cancel()
        channel.close()
        proxy.close()
        server.stop(None)


def test_a_replica_that_vanished_under_a_call_is_found_gone(short):
    """A replica's machine goes away while it computes a Propose sent on a round stream: the
    coordinator's keepalive finds it dead and the call's sessions are retried elsewhere at once
    (UNAVAILABLE), not after the call timeout."""
    servicer = Hanging()
    server, address = start_server(draft=servicer)
    proxy = Proxy(address)
    transport = GrpcTransport(proxy.address, timeout_s=60.0)  # without keepalive the call ends here: no answer

    async def call():
        sent = asyncio.create_task(transport._send(service("draft"), proxy.address, "Propose",
                                                   draft_pb2.ProposeBatch(items=[propose_item()]), "s"))
        while not servicer.entered.is_set():
            await asyncio.sleep(0.01)
        proxy.freeze()
        try:
            with pytest.raises(ReplicaGone) as info:
                await sent
        finally:
            await transport.close()
        return str(info.value)

    try:
        gone = asyncio.run(call())
    finally:
        servicer.release.set()
        proxy.close()
        server.stop(None)
    assert gone == f"draft at {proxy.address}: UNAVAILABLE"


def test_an_idle_round_stream_outlives_many_pings(short):
    """The replica accepts the coordinator's pings on a stream with nothing to send between steps
    (a server's default takes a ping more often than every 5 minutes, without data, as abuse and
    closes the connection: GOAWAY "too_many_pings"), and both ends keep pinging it."""

    class Echo(DraftServicer):
        def Propose(self, request, context):
            return draft_pb2.ProposalBatch(draft_ms=len(request.items))

    servicer = Echo(worker=None)
    server, address = start_server(draft=servicer)
    transport = GrpcTransport(address, timeout_s=60.0)
    request = draft_pb2.ProposeBatch(items=[propose_item()])

    async def idle_between_calls():
        try:
            first = await transport._send(service("draft"), address, "Propose", request, "s")
            await asyncio.sleep(10 * SHORT_MS / 1000)  # idle: pings only
            second = await transport._send(service("draft"), address, "Propose", request, "s")
        finally:
            await transport.close()
        return first, second

    try:
        first, second = asyncio.run(idle_between_calls())
    finally:
        server.stop(None)
    assert first.draft_ms == second.draft_ms == 1
    assert servicer.streams_opened == 1  # the one stream, never closed under the calls

