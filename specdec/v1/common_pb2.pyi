# Generated from protos/specdec/v1/common.proto by protos/generate.py (grpcio-tools 1.85.1).
# Do not edit: change the .proto and run `python protos/generate.py`.
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SessionRefs(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, released: _Optional[_Iterable[bool]] = ...) -> None: ...

class HistoryDelta(_message.Message):
    __slots__ = ("history_length", "tail", "full", "drop")
    HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    history_length: int
    tail: _containers.RepeatedScalarFieldContainer[int]
    full: bool
    drop: int
    def __init__(self, history_length: _Optional[int] = ..., tail: _Optional[_Iterable[int]] = ..., full: _Optional[bool] = ..., drop: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ...) -> None: ...

class RoundSeed(_message.Message):
    __slots__ = ("request_seed", "sample_index", "round_index")
    REQUEST_SEED_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_seed: int
    sample_index: int
    round_index: int
    def __init__(self, request_seed: _Optional[int] = ..., sample_index: _Optional[int] = ..., round_index: _Optional[int] = ...) -> None: ...

class Distribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    probs: bytes
    def __init__(self, token_ids: _Optional[bytes] = ..., probs: _Optional[bytes] = ...) -> None: ...

class CostProfile(_message.Message):
    __slots__ = ("t_draft_ms", "t_target_ms", "t_draft_rows_ms", "source")
    class TTargetMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class TDraftRowsMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    T_DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    T_TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    T_DRAFT_ROWS_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    t_draft_ms: float
    t_target_ms: _containers.ScalarMap[int, float]
    t_draft_rows_ms: _containers.ScalarMap[int, float]
    source: str
    def __init__(self, t_draft_ms: _Optional[float] = ..., t_target_ms: _Optional[_Mapping[int, float]] = ..., t_draft_rows_ms: _Optional[_Mapping[int, float]] = ..., source: _Optional[str] = ...) -> None: ...

class PassTiming(_message.Message):
    __slots__ = ("role", "tokens", "ms", "probe")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    role: str
    tokens: int
    ms: float
    probe: bool
    def __init__(self, role: _Optional[str] = ..., tokens: _Optional[int] = ..., ms: _Optional[float] = ..., probe: _Optional[bool] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("start", "tokens", "reads", "hidden", "data")
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start: int
    tokens: int
    reads: int
    hidden: int
    data: bytes
    def __init__(self, start: _Optional[int] = ..., tokens: _Optional[int] = ..., reads: _Optional[int] = ..., hidden: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
