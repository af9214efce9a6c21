# Generated from protos/specdec/v1/*.proto by protos/generate.py (grpcio-tools 1.85.1).
# Do not edit: change the .proto and run `python protos/generate.py`.
"""Protobuf messages and gRPC stubs of the specdec.v1 contracts (protos/specdec/v1/):

    common_pb2 / common_pb2_grpc
    draft_pb2 / draft_pb2_grpc
    generation_pb2 / generation_pb2_grpc
    verifier_pb2 / verifier_pb2_grpc
"""
