from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculationMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_METHOD_UNSPECIFIED: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_NONE: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_DRAFT_MODEL: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_NGRAM: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_SSD: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_HEAD: _ClassVar[SpeculationMethod]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
SPECULATION_METHOD_UNSPECIFIED: SpeculationMethod
SPECULATION_METHOD_NONE: SpeculationMethod
SPECULATION_METHOD_DRAFT_MODEL: SpeculationMethod
SPECULATION_METHOD_NGRAM: SpeculationMethod
SPECULATION_METHOD_SSD: SpeculationMethod
SPECULATION_METHOD_HEAD: SpeculationMethod
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ...) -> None: ...

class SpeculationPreference(_message.Message):
    __slots__ = ("method", "max_draft_tokens", "tree")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    method: SpeculationMethod
    max_draft_tokens: int
    tree: bool
    def __init__(self, method: _Optional[_Union[SpeculationMethod, str]] = ..., max_draft_tokens: _Optional[int] = ..., tree: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "prompt_ids", "messages", "max_tokens", "sampling", "speculation", "stop_token_ids", "n", "session_id", "ignore_eos", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    prompt_ids: TokenIds
    messages: ChatMessages
    max_tokens: int
    sampling: SamplingParams
    speculation: SpeculationPreference
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    session_id: str
    ignore_eos: bool
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationPreference, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., session_id: _Optional[str] = ..., ignore_eos: _Optional[bool] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("method", "target_steps", "drafted_tokens", "accepted_tokens", "mean_accept_len", "fallback_rounds", "cache_hits", "cache_lookups", "branch_rounds", "local", "plan_drops")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPT_LEN_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    PLAN_DROPS_FIELD_NUMBER: _ClassVar[int]
    method: SpeculationMethod
    target_steps: int
    drafted_tokens: int
    accepted_tokens: int
    mean_accept_len: float
    fallback_rounds: int
    cache_hits: int
    cache_lookups: int
    branch_rounds: int
    local: bool
    plan_drops: int
    def __init__(self, method: _Optional[_Union[SpeculationMethod, str]] = ..., target_steps: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., mean_accept_len: _Optional[float] = ..., fallback_rounds: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_lookups: _Optional[int] = ..., branch_rounds: _Optional[int] = ..., local: _Optional[bool] = ..., plan_drops: _Optional[int] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("index", "token_ids", "text", "finish_reason", "speculation")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    speculation: SpeculationStats
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "delta", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: TokenDelta
    final: GenerateResult
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., final: _Optional[_Union[GenerateResult, _Mapping]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("index", "token_ids", "text")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("request_id", "model", "completions", "usage", "time_to_first_token_s", "elapsed_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    usage: Usage
    time_to_first_token_s: float
    elapsed_s: float
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., time_to_first_token_s: _Optional[float] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("service_id", "model", "vocab_size", "max_batch", "active_sequences", "queued_requests", "spec_endpoint", "spec_endpoint_attached")
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SPEC_ENDPOINT_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    model: str
    vocab_size: int
    max_batch: int
    active_sequences: int
    queued_requests: int
    spec_endpoint: str
    spec_endpoint_attached: bool
    def __init__(self, service_id: _Optional[str] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_batch: _Optional[int] = ..., active_sequences: _Optional[int] = ..., queued_requests: _Optional[int] = ..., spec_endpoint: _Optional[str] = ..., spec_endpoint_attached: _Optional[bool] = ...) -> None: ...
