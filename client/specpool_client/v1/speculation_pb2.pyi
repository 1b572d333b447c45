from . import target_pb2 as _target_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_KIND_UNSPECIFIED: _ClassVar[DrafterKind]
    DRAFTER_KIND_DRAFT_MODEL: _ClassVar[DrafterKind]
    DRAFTER_KIND_NGRAM: _ClassVar[DrafterKind]
    DRAFTER_KIND_SSD: _ClassVar[DrafterKind]
    DRAFTER_KIND_HEAD: _ClassVar[DrafterKind]

class DistributionTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DISTRIBUTION_TRANSPORT_UNSPECIFIED: _ClassVar[DistributionTransport]
    DISTRIBUTION_TRANSPORT_SPARSE: _ClassVar[DistributionTransport]
    DISTRIBUTION_TRANSPORT_DENSE: _ClassVar[DistributionTransport]

class RoundResolution(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_RESOLUTION_UNSPECIFIED: _ClassVar[RoundResolution]
    ROUND_RESOLUTION_TABLE_HIT: _ClassVar[RoundResolution]
    ROUND_RESOLUTION_LOCAL_DRAFTS: _ClassVar[RoundResolution]

class TensorBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_BACKEND_UNSPECIFIED: _ClassVar[TensorBackend]
    TENSOR_BACKEND_GLOO: _ClassVar[TensorBackend]
    TENSOR_BACKEND_NCCL: _ClassVar[TensorBackend]
DRAFTER_KIND_UNSPECIFIED: DrafterKind
DRAFTER_KIND_DRAFT_MODEL: DrafterKind
DRAFTER_KIND_NGRAM: DrafterKind
DRAFTER_KIND_SSD: DrafterKind
DRAFTER_KIND_HEAD: DrafterKind
DISTRIBUTION_TRANSPORT_UNSPECIFIED: DistributionTransport
DISTRIBUTION_TRANSPORT_SPARSE: DistributionTransport
DISTRIBUTION_TRANSPORT_DENSE: DistributionTransport
ROUND_RESOLUTION_UNSPECIFIED: RoundResolution
ROUND_RESOLUTION_TABLE_HIT: RoundResolution
ROUND_RESOLUTION_LOCAL_DRAFTS: RoundResolution
TENSOR_BACKEND_UNSPECIFIED: TensorBackend
TENSOR_BACKEND_GLOO: TensorBackend
TENSOR_BACKEND_NCCL: TensorBackend

class SessionSpec(_message.Message):
    __slots__ = ("request_id", "context", "sampling", "drafter", "transport", "push", "tree")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context: _containers.RepeatedScalarFieldContainer[int]
    sampling: _target_pb2.SamplingParams
    drafter: DrafterKind
    transport: DistributionTransport
    push: bool
    tree: bool
    def __init__(self, request_id: _Optional[str] = ..., context: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_target_pb2.SamplingParams, _Mapping]] = ..., drafter: _Optional[_Union[DrafterKind, str]] = ..., transport: _Optional[_Union[DistributionTransport, str]] = ..., push: _Optional[bool] = ..., tree: _Optional[bool] = ...) -> None: ...

class OpenSessionsRequest(_message.Message):
    __slots__ = ("tenant", "target_model", "lease_s", "sessions")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    target_model: str
    lease_s: float
    sessions: _containers.RepeatedCompositeFieldContainer[SessionSpec]
    def __init__(self, tenant: _Optional[str] = ..., target_model: _Optional[str] = ..., lease_s: _Optional[float] = ..., sessions: _Optional[_Iterable[_Union[SessionSpec, _Mapping]]] = ...) -> None: ...

class OpenedSession(_message.Message):
    __slots__ = ("request_id", "ok", "error", "drafter", "reads_features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    READS_FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ok: bool
    error: str
    drafter: DrafterKind
    reads_features: bool
    def __init__(self, request_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., drafter: _Optional[_Union[DrafterKind, str]] = ..., reads_features: _Optional[bool] = ...) -> None: ...

class OpenSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[OpenedSession]
    def __init__(self, sessions: _Optional[_Iterable[_Union[OpenedSession, _Mapping]]] = ...) -> None: ...

class CloseSessionsRequest(_message.Message):
    __slots__ = ("tenant", "request_ids")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tenant: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CloseSessionsResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: int
    def __init__(self, closed: _Optional[int] = ...) -> None: ...

class SequenceRound(_message.Message):
    __slots__ = ("request_id", "new_tokens", "num_draft_tokens", "resolution", "drafts_in_use", "num_features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESOLUTION_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    NUM_FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    resolution: RoundResolution
    drafts_in_use: _containers.RepeatedScalarFieldContainer[int]
    num_features: int
    def __init__(self, request_id: _Optional[str] = ..., new_tokens: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., resolution: _Optional[_Union[RoundResolution, str]] = ..., drafts_in_use: _Optional[_Iterable[int]] = ..., num_features: _Optional[int] = ...) -> None: ...

class RoundsRequest(_message.Message):
    __slots__ = ("tenant", "round_id", "sequences", "feature_dim")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    round_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceRound]
    feature_dim: int
    def __init__(self, tenant: _Optional[str] = ..., round_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceRound, _Mapping]]] = ..., feature_dim: _Optional[int] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("k", "ids", "probs")
    K_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    k: int
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, k: _Optional[int] = ..., ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class SequenceDrafts(_message.Message):
    __slots__ = ("request_id", "tokens", "sparse", "dense_on_channel", "error", "from_cache", "parents")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_ON_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FROM_CACHE_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sparse: SparseDistribution
    dense_on_channel: bool
    error: str
    from_cache: bool
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., sparse: _Optional[_Union[SparseDistribution, _Mapping]] = ..., dense_on_channel: _Optional[bool] = ..., error: _Optional[str] = ..., from_cache: _Optional[bool] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class OutcomeEntry(_message.Message):
    __slots__ = ("accepted", "bonus", "tokens", "sparse")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    bonus: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sparse: SparseDistribution
    def __init__(self, accepted: _Optional[int] = ..., bonus: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., sparse: _Optional[_Union[SparseDistribution, _Mapping]] = ...) -> None: ...

class OutcomeTable(_message.Message):
    __slots__ = ("request_id", "follows", "entries", "fast_backup")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    FAST_BACKUP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    follows: _containers.RepeatedScalarFieldContainer[int]
    entries: _containers.RepeatedCompositeFieldContainer[OutcomeEntry]
    fast_backup: bool
    def __init__(self, request_id: _Optional[str] = ..., follows: _Optional[_Iterable[int]] = ..., entries: _Optional[_Iterable[_Union[OutcomeEntry, _Mapping]]] = ..., fast_backup: _Optional[bool] = ...) -> None: ...

class RoundsResponse(_message.Message):
    __slots__ = ("round_id", "sequences", "dense_rows", "vocab_size", "draft_seconds", "tables")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    DENSE_ROWS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceDrafts]
    dense_rows: int
    vocab_size: int
    draft_seconds: float
    tables: _containers.RepeatedCompositeFieldContainer[OutcomeTable]
    def __init__(self, round_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceDrafts, _Mapping]]] = ..., dense_rows: _Optional[int] = ..., vocab_size: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., tables: _Optional[_Iterable[_Union[OutcomeTable, _Mapping]]] = ...) -> None: ...

class OpenTensorChannelRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class OpenTensorChannelResponse(_message.Message):
    __slots__ = ("store_host", "store_port", "prefix", "backend", "target_rank", "timeout_s", "secret")
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TARGET_RANK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    store_host: str
    store_port: int
    prefix: str
    backend: TensorBackend
    target_rank: int
    timeout_s: float
    secret: bytes
    def __init__(self, store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., prefix: _Optional[str] = ..., backend: _Optional[_Union[TensorBackend, str]] = ..., target_rank: _Optional[int] = ..., timeout_s: _Optional[float] = ..., secret: _Optional[bytes] = ...) -> None: ...

class GetCapacityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepCostTable(_message.Message):
    __slots__ = ("batch_sizes", "draft_lens", "seconds")
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    draft_lens: _containers.RepeatedScalarFieldContainer[int]
    seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, batch_sizes: _Optional[_Iterable[int]] = ..., draft_lens: _Optional[_Iterable[int]] = ..., seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class ModelDrafters(_message.Message):
    __slots__ = ("target_model", "drafters", "draft_step_costs")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEP_COSTS_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    drafters: _containers.RepeatedScalarFieldContainer[DrafterKind]
    draft_step_costs: StepCostTable
    def __init__(self, target_model: _Optional[str] = ..., drafters: _Optional[_Iterable[_Union[DrafterKind, str]]] = ..., draft_step_costs: _Optional[_Union[StepCostTable, _Mapping]] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "active_sessions", "drafted_tokens", "accepted_tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    active_sessions: int
    drafted_tokens: int
    accepted_tokens: int
    def __init__(self, tenant: _Optional[str] = ..., active_sessions: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class GetCapacityResponse(_message.Message):
    __slots__ = ("endpoint_id", "max_sessions", "active_sessions", "draft_busy_ratio", "models", "tenants", "ssd_hit_ratio")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BUSY_RATIO_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SSD_HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    max_sessions: int
    active_sessions: int
    draft_busy_ratio: float
    models: _containers.RepeatedCompositeFieldContainer[ModelDrafters]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    ssd_hit_ratio: float
    def __init__(self, endpoint_id: _Optional[str] = ..., max_sessions: _Optional[int] = ..., active_sessions: _Optional[int] = ..., draft_busy_ratio: _Optional[float] = ..., models: _Optional[_Iterable[_Union[ModelDrafters, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., ssd_hit_ratio: _Optional[float] = ...) -> None: ...
