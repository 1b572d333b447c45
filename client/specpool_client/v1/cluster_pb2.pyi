from . import target_pb2 as _target_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetClusterCapacityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetReplica(_message.Message):
    __slots__ = ("id", "address", "model", "tenant", "max_batch", "running", "queued", "spec_endpoint", "mean_accept_len", "predicted_speedup_draft", "predicted_speedup_ngram", "methods", "heartbeat_age_s", "predicted_speedup_ssd", "format")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    SPEC_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPT_LEN_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SPEEDUP_DRAFT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SPEEDUP_NGRAM_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SPEEDUP_SSD_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    model: str
    tenant: str
    max_batch: int
    running: int
    queued: int
    spec_endpoint: str
    mean_accept_len: float
    predicted_speedup_draft: float
    predicted_speedup_ngram: float
    methods: _containers.RepeatedScalarFieldContainer[_target_pb2.SpeculationMethod]
    heartbeat_age_s: float
    predicted_speedup_ssd: float
    format: str
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., tenant: _Optional[str] = ..., max_batch: _Optional[int] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., spec_endpoint: _Optional[str] = ..., mean_accept_len: _Optional[float] = ..., predicted_speedup_draft: _Optional[float] = ..., predicted_speedup_ngram: _Optional[float] = ..., methods: _Optional[_Iterable[_Union[_target_pb2.SpeculationMethod, str]]] = ..., heartbeat_age_s: _Optional[float] = ..., predicted_speedup_ssd: _Optional[float] = ..., format: _Optional[str] = ...) -> None: ...

class ModelPool(_message.Message):
    __slots__ = ("model", "targets", "capacity", "running", "queued", "utilization", "mean_accept_len", "predicted_speedup_draft", "predicted_speedup_ngram", "predicted_speedup_ssd")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPT_LEN_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SPEEDUP_DRAFT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SPEEDUP_NGRAM_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SPEEDUP_SSD_FIELD_NUMBER: _ClassVar[int]
    model: str
    targets: _containers.RepeatedCompositeFieldContainer[TargetReplica]
    capacity: int
    running: int
    queued: int
    utilization: float
    mean_accept_len: float
    predicted_speedup_draft: float
    predicted_speedup_ngram: float
    predicted_speedup_ssd: float
    def __init__(self, model: _Optional[str] = ..., targets: _Optional[_Iterable[_Union[TargetReplica, _Mapping]]] = ..., capacity: _Optional[int] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., utilization: _Optional[float] = ..., mean_accept_len: _Optional[float] = ..., predicted_speedup_draft: _Optional[float] = ..., predicted_speedup_ngram: _Optional[float] = ..., predicted_speedup_ssd: _Optional[float] = ...) -> None: ...

class TenantLeases(_message.Message):
    __slots__ = ("tenant", "leased", "guaranteed")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    leased: int
    guaranteed: int
    def __init__(self, tenant: _Optional[str] = ..., leased: _Optional[int] = ..., guaranteed: _Optional[int] = ...) -> None: ...

class SpeculationEndpoint(_message.Message):
    __slots__ = ("id", "address", "models", "max_sessions", "active_sessions", "draft_busy_ratio", "acceptance", "hit_ratio", "leased", "tenants", "heartbeat_age_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BUSY_RATIO_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    models: _containers.RepeatedScalarFieldContainer[str]
    max_sessions: int
    active_sessions: int
    draft_busy_ratio: float
    acceptance: float
    hit_ratio: float
    leased: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantLeases]
    heartbeat_age_s: float
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., max_sessions: _Optional[int] = ..., active_sessions: _Optional[int] = ..., draft_busy_ratio: _Optional[float] = ..., acceptance: _Optional[float] = ..., hit_ratio: _Optional[float] = ..., leased: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantLeases, _Mapping]]] = ..., heartbeat_age_s: _Optional[float] = ...) -> None: ...

class DecisionCount(_message.Message):
    __slots__ = ("model", "plan", "reason", "count")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    model: str
    plan: _target_pb2.SpeculationMethod
    reason: str
    count: int
    def __init__(self, model: _Optional[str] = ..., plan: _Optional[_Union[_target_pb2.SpeculationMethod, str]] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class GetClusterCapacityResponse(_message.Message):
    __slots__ = ("pools", "endpoints", "decisions", "registry_reachable", "snapshot_age_s")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_REACHABLE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[ModelPool]
    endpoints: _containers.RepeatedCompositeFieldContainer[SpeculationEndpoint]
    decisions: _containers.RepeatedCompositeFieldContainer[DecisionCount]
    registry_reachable: bool
    snapshot_age_s: float
    def __init__(self, pools: _Optional[_Iterable[_Union[ModelPool, _Mapping]]] = ..., endpoints: _Optional[_Iterable[_Union[SpeculationEndpoint, _Mapping]]] = ..., decisions: _Optional[_Iterable[_Union[DecisionCount, _Mapping]]] = ..., registry_reachable: _Optional[bool] = ..., snapshot_age_s: _Optional[float] = ...) -> None: ...
