# Generated from protos/specdec/v1/draft.proto by protos/generate.py (grpcio-tools 1.85.1).
# Do not edit: change the .proto and run `python protos/generate.py`.
from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeBatch(_message.Message):
    __slots__ = ("items", "costs", "other_sessions", "acceptance", "target_rows", "target_tokens")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    OTHER_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_ROWS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    costs: _common_pb2.CostProfile
    other_sessions: int
    acceptance: float
    target_rows: int
    target_tokens: int
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ..., costs: _Optional[_Union[_common_pb2.CostProfile, _Mapping]] = ..., other_sessions: _Optional[int] = ..., acceptance: _Optional[float] = ..., target_rows: _Optional[int] = ..., target_tokens: _Optional[int] = ...) -> None: ...

class ProposalBatch(_message.Message):
    __slots__ = ("proposals", "draft_ms", "passes", "replica")
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    draft_ms: float
    passes: _containers.RepeatedCompositeFieldContainer[_common_pb2.PassTiming]
    replica: str
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., draft_ms: _Optional[float] = ..., passes: _Optional[_Iterable[_Union[_common_pb2.PassTiming, _Mapping]]] = ..., replica: _Optional[str] = ...) -> None: ...

class PolicyConfig(_message.Message):
    __slots__ = ("name", "k", "threshold")
    NAME_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    name: str
    k: int
    threshold: float
    def __init__(self, name: _Optional[str] = ..., k: _Optional[int] = ..., threshold: _Optional[float] = ...) -> None: ...

class RoundOutcome(_message.Message):
    __slots__ = ("num_candidates", "num_accepted")
    NUM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    num_candidates: int
    num_accepted: int
    def __init__(self, num_candidates: _Optional[int] = ..., num_accepted: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "history", "policy", "sampling", "max_candidates", "num_generated", "rounds", "seed", "probe", "features", "ahead", "held", "cache_scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    history: _common_pb2.HistoryDelta
    policy: PolicyConfig
    sampling: _common_pb2.SamplingParams
    max_candidates: int
    num_generated: int
    rounds: _containers.RepeatedCompositeFieldContainer[RoundOutcome]
    seed: _common_pb2.RoundSeed
    probe: bool
    features: _common_pb2.Features
    ahead: bool
    held: bool
    cache_scope: str
    def __init__(self, session_id: _Optional[str] = ..., history: _Optional[_Union[_common_pb2.HistoryDelta, _Mapping]] = ..., policy: _Optional[_Union[PolicyConfig, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_candidates: _Optional[int] = ..., num_generated: _Optional[int] = ..., rounds: _Optional[_Iterable[_Union[RoundOutcome, _Mapping]]] = ..., seed: _Optional[_Union[_common_pb2.RoundSeed, _Mapping]] = ..., probe: _Optional[bool] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., ahead: _Optional[bool] = ..., held: _Optional[bool] = ..., cache_scope: _Optional[str] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("session_missing", "error", "candidates", "draft_probs", "forward_passes")
    SESSION_MISSING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    session_missing: bool
    error: str
    candidates: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Distribution]
    forward_passes: int
    def __init__(self, session_missing: _Optional[bool] = ..., error: _Optional[str] = ..., candidates: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.Distribution, _Mapping]]] = ..., forward_passes: _Optional[int] = ...) -> None: ...
