"""The public gRPC service as Serve's gRPC proxy registers it (`grpc_options.grpc_servicer_functions`).

Light on purpose: the proxy imports it. The service is specdec.v1.Generation with its requests
left as bytes: the ingress parses them (services/ingress.py), so a malformed request (corrupt wire
format, a string field that is not UTF-8) gets INVALID_ARGUMENT and a reason. With the generated
`add_GenerationServicer_to_server` the proxy itself would fail to parse it and answer UNKNOWN,
naming a Python exception class.
"""

from __future__ import annotations

import grpc

from specdec.v1 import generation_pb2

SERVICE = "specdec.v1.Generation"


def add_generation_servicer(servicer, server) -> None:
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, response_serializer=generation_pb2.GenerateResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, response_serializer=generation_pb2.GenerateChunk.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
