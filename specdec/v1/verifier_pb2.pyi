# Generated from protos/specdec/v1/verifier.proto by protos/generate.py (grpcio-tools 1.85.1).
# Do not edit: change the .proto and run `python protos/generate.py`.
from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyBatch(_message.Message):
    __slots__ = ("items", "probe_tokens")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PROBE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    probe_tokens: int
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ..., probe_tokens: _Optional[int] = ...) -> None: ...

class VerdictBatch(_message.Message):
    __slots__ = ("verdicts", "target_ms", "passes", "replica")
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    target_ms: float
    passes: _containers.RepeatedCompositeFieldContainer[_common_pb2.PassTiming]
    replica: str
    def __init__(self, verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., target_ms: _Optional[float] = ..., passes: _Optional[_Iterable[_Union[_common_pb2.PassTiming, _Mapping]]] = ..., replica: _Optional[str] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "history", "candidates", "draft_probs", "sampling", "seed", "features_from")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FROM_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    history: _common_pb2.HistoryDelta
    candidates: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Distribution]
    sampling: _common_pb2.SamplingParams
    seed: _common_pb2.RoundSeed
    features_from: int
    def __init__(self, session_id: _Optional[str] = ..., history: _Optional[_Union[_common_pb2.HistoryDelta, _Mapping]] = ..., candidates: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.Distribution, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[_Union[_common_pb2.RoundSeed, _Mapping]] = ..., features_from: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("session_missing", "error", "num_accepted", "next_token", "features")
    SESSION_MISSING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_missing: bool
    error: str
    num_accepted: int
    next_token: int
    features: _common_pb2.Features
    def __init__(self, session_missing: _Optional[bool] = ..., error: _Optional[str] = ..., num_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ...) -> None: ...
