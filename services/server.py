"""Serving the round services on a plain gRPC server (tests and benchmarks; Ray Serve hosts them
in deployment)."""

from __future__ import annotations

from concurrent import futures

import grpc

from google.protobuf.message import DecodeError

from specdec.errors import InvalidRequestError, one_line
from specdec.v1 import draft_pb2_grpc, verifier_pb2_grpc
from services.auth import ApiKeyInterceptor
from services.errors import grpc_status
from services.servicers import MAX_STREAMS, DraftServicer, VerifierServicer

# The server's threads. A servicer runs its worker on the replica's one torch thread when given one
# (services/servicers.py), so these only wait for it, and a Release is never stuck behind a batch:
# these for unary calls, and one more for each round stream a servicer may keep open.
UNARY_THREADS = 4
# A sampled round carries each candidate's draft distribution: up to 608 KB per candidate on a
# 151,936-token vocabulary, so gRPC's default 4 MiB would fail sampled rounds with K > 6. A batch
# carries many sessions' rounds: 16 sessions (a step's default) of 64 sampled candidates
# (services.coordinator.MAX_CANDIDATES_PER_ROUND) are ~620 MB; gRPC's ceiling (2 GiB) holds them.
MAX_ROUND_MESSAGE_BYTES = 2**31 - 1


def keepalive(time_ms: int, timeout_ms: int) -> tuple[tuple, tuple]:
    """(the coordinator's channel options, the replica's server options) for HTTP/2 keepalive
    pings every `time_ms` without traffic, a peer that leaves one unanswered for `timeout_ms` taken
    for gone. A machine that vanishes without closing its TCP connections is otherwise never
    noticed: a replica kept a gone coordinator's round streams open for good (and refuses streams
    past MAX_STREAMS), a coordinator waited on a gone replica's reply for the whole call timeout.
    gRPC's core (grpcio 1.85) waits for a ping's answer as long as `ping_timeout_ms` says (a minute
    unless set), whatever `keepalive_timeout_ms` does, so both are set. Pings go on while a stream
    is open with nothing to send (`max_pings_without_data` 0: gRPC's default stops after two), and
    the server takes them as often as the client sends them (its default takes one more often than
    every 5 minutes for abuse and closes the connection, GOAWAY "too_many_pings")."""
    both = (("grpc.keepalive_time_ms", time_ms), ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms), ("grpc.http2.max_pings_without_data", 0))
    return both, both + (("grpc.http2.min_ping_interval_without_data_ms", time_ms // 2),)


# A gone peer is noticed within about 40 s, well inside a round call's timeout
# (services/transports.py CALL_TIMEOUT_S), for a ping of a few bytes each 30 s of silence.
CHANNEL_KEEPALIVE, SERVER_KEEPALIVE = keepalive(30_000, 10_000)


class MalformedRequests(grpc.ServerInterceptor):
    """A request that does not parse as its method's message (a peer built on another version of
    protos/, a corrupt frame) is INVALID_ARGUMENT with one line saying so: gRPC's own answer is
    INTERNAL, "Exception deserializing request!", after logging a traceback."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method

        def deserialize(data: bytes):  # (raising here, gRPC answers INTERNAL: the error is handed on)
            try:
                return parse(data)
            except DecodeError as exc:
                return InvalidRequestError(one_line(f"the request to {method} does not parse ({exc})"))

        def checked(request, context):
            if isinstance(request, InvalidRequestError):
                context.abort(*grpc_status(request))
            return request

        kind = ("stream" if handler.request_streaming else "unary") + ("_stream" if handler.response_streaming else "_unary")
        serve = getattr(handler, kind)
        if handler.request_streaming:  # (the round streams) each message checked as it comes
            def behaviour(requests, context):
                return serve((checked(request, context) for request in requests), context)
        else:
            def behaviour(request, context):
                return serve(checked(request, context), context)
        return handler._replace(request_deserializer=deserialize, **{kind: behaviour})


def start_server(draft: DraftServicer | None = None, verifier: VerifierServicer | None = None,
                 address: str = "127.0.0.1:0", max_workers: int | None = None,
                 executor: futures.ThreadPoolExecutor | None = None,
                 api_key: str | None = None) -> tuple[grpc.Server, str]:
    """Start a server hosting the given servicers; returns it and its "host:port" (port 0 in
    `address` picks a free one). `executor` replaces the server's own thread pool (the servicers'
    torch work has its own thread: services/servicers.py). With `api_key` every call must carry it
    (services.auth)."""
    threads = max_workers or UNARY_THREADS + MAX_STREAMS * ((draft is not None) + (verifier is not None))
    server = grpc.server(executor or futures.ThreadPoolExecutor(max_workers=threads),
                         interceptors=([ApiKeyInterceptor(api_key)] if api_key else []) + [MalformedRequests()],
                         options=[("grpc.max_receive_message_length", MAX_ROUND_MESSAGE_BYTES), *SERVER_KEEPALIVE])
    if draft is not None:
        draft_pb2_grpc.add_DraftServicer_to_server(draft, server)
    if verifier is not None:
        verifier_pb2_grpc.add_VerifierServicer_to_server(verifier, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot bind a gRPC server to {address}")
    server.start()
    return server, f"{address.rsplit(':', 1)[0]}:{port}"
