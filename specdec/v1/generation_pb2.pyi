# Generated from protos/specdec/v1/generation.proto by protos/generate.py (grpcio-tools 1.85.1).
# Do not edit: change the .proto and run `python protos/generate.py`.
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "messages", "chat_template", "policy", "k", "threshold", "temperature", "top_p", "top_k", "seed", "max_new_tokens", "n", "stop", "request_id", "draft", "suffix_cache")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    chat_template: bool
    policy: str
    k: int
    threshold: float
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_new_tokens: int
    n: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    draft: str
    suffix_cache: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., chat_template: _Optional[bool] = ..., policy: _Optional[str] = ..., k: _Optional[int] = ..., threshold: _Optional[float] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., n: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., draft: _Optional[str] = ..., suffix_cache: _Optional[bool] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    index: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("generated_tokens", "draft_forward_passes", "target_forward_passes", "rounds", "draft_tokens", "accepted_tokens", "discarded_tokens", "verification_rate", "discard_rate", "acceptance_rate", "mean_accepted_length", "acceptance_by_position", "drafted_per_position", "accepted_per_position", "k_histogram", "draft_time_s", "target_time_s", "wall_time_s", "tokens_per_s", "transport_time_s", "transport_bytes", "draft_held", "rounds_ahead", "rounds_ahead_used")
    class KHistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class DraftHeldEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_RATE_FIELD_NUMBER: _ClassVar[int]
    DISCARD_RATE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    K_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_TIME_S_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HELD_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_AHEAD_USED_FIELD_NUMBER: _ClassVar[int]
    generated_tokens: int
    draft_forward_passes: int
    target_forward_passes: int
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    discarded_tokens: int
    verification_rate: float
    discard_rate: float
    acceptance_rate: float
    mean_accepted_length: float
    acceptance_by_position: _containers.RepeatedScalarFieldContainer[float]
    drafted_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    k_histogram: _containers.ScalarMap[int, int]
    draft_time_s: float
    target_time_s: float
    wall_time_s: float
    tokens_per_s: float
    transport_time_s: float
    transport_bytes: int
    draft_held: _containers.ScalarMap[str, int]
    rounds_ahead: int
    rounds_ahead_used: int
    def __init__(self, generated_tokens: _Optional[int] = ..., draft_forward_passes: _Optional[int] = ..., target_forward_passes: _Optional[int] = ..., rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., discarded_tokens: _Optional[int] = ..., verification_rate: _Optional[float] = ..., discard_rate: _Optional[float] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., acceptance_by_position: _Optional[_Iterable[float]] = ..., drafted_per_position: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., k_histogram: _Optional[_Mapping[int, int]] = ..., draft_time_s: _Optional[float] = ..., target_time_s: _Optional[float] = ..., wall_time_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., transport_time_s: _Optional[float] = ..., transport_bytes: _Optional[int] = ..., draft_held: _Optional[_Mapping[str, int]] = ..., rounds_ahead: _Optional[int] = ..., rounds_ahead_used: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions", "stats", "prompt_tokens", "request_id")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    stats: Stats
    prompt_tokens: int
    request_id: str
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("index", "token_ids", "text", "finish_reason", "stats", "prompt_tokens", "request_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: Stats
    prompt_tokens: int
    request_id: str
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...
