"""Domain messages of the endpoint: what the servicer decodes requests into and encodes replies from.

No protobuf and no torch here; `wire` converts, `endpoint` and `batcher` act.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specpool.engine.method import Method
    from specpool.engine.policy.costs import StepCosts
    from specpool.engine.verification.sampling import SamplingParams


class Transport(StrEnum):
    """How q travels when a draft model samples: inline top-k pairs, or dense rows on the channel."""

    AUTO = "auto"  # sparse when the sampler is top-k, else dense
    SPARSE = "sparse"
    DENSE = "dense"


@dataclass(frozen=True, slots=True)
class SessionSpec:
    request_id: str
    context: tuple[int, ...]
    params: SamplingParams
    drafter: Method | None = None  # None: the model's best (draft model, else n-gram); never Method.NONE
    transport: Transport = Transport.AUTO
    push: bool = False  # SSD: stream outcome tables to the target as soon as they are built
    tree: bool = False  # drafts are token trees of num_draft_tokens nodes
    refused: str = ""  # why the decoder refused it unread (its context is then empty): the open result's error


def context_too_long(path: str, length: int, max_len: int) -> str:
    return (f"{path}.context: {length} tokens exceed this endpoint's max length {max_len} (--max-len); "
            "draft this sequence locally")


@dataclass(frozen=True, slots=True)
class OpenRequest:
    tenant: str
    target_model: str
    lease_s: float  # 0: the endpoint's default
    sessions: tuple[SessionSpec, ...]


@dataclass(frozen=True, slots=True)
class OpenResult:
    request_id: str
    ok: bool
    error: str = ""
    drafter: Method | None = None
    reads_features: bool = False  # the target sends its features with this session's rounds


RESOLUTIONS = ("ask", "table_hit", "local_drafts")  # SequenceRound.resolution; anything else is refused


@dataclass(frozen=True, slots=True)
class SequenceRound:
    request_id: str
    new_tokens: tuple[int, ...]  # the verification outcome since this session's previous round
    num_draft_tokens: int
    resolution: str = "ask"  # SSD push: "table_hit" / "local_drafts" when the target drafted itself (RESOLUTIONS)
    drafts_in_use: tuple[int, ...] = ()  # with "local_drafts"
    num_features: int = 0  # its rows of the round's feature tensor
    features: Any = None  # torch.Tensor [num_features, feature_dim], once received from the tensor channel


@dataclass(frozen=True, slots=True)
class Round:
    tenant: str
    round_id: int
    sequences: tuple[SequenceRound, ...]
    feature_dim: int = 0  # of the feature tensor that follows on the tensor channel
    features_error: str = ""  # why its features could not be received: the sessions that read them close


@dataclass(slots=True)
class SequenceDrafts:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # a tree's (sessions opened with tree); empty: a chain
    sparse_k: int = 0  # > 0: sparse_ids/sparse_probs hold k pairs per draft
    sparse_ids: list[int] = field(default_factory=list)
    sparse_probs: list[float] = field(default_factory=list)
    dense: bool = False  # its q rows follow on the tensor channel
    error: str = ""
    from_cache: bool = False  # SSD: a hit


@dataclass(frozen=True, slots=True)
class OutcomeTable:
    """SSD push: the next drafts for each likely outcome (k, bonus) of a session's drafts `follows`."""

    request_id: str
    follows: list[int]
    entries: list[tuple[int, int, list[int], list[int], list[float], int]]  # k, bonus, tokens, ids, probs, sparse k
    fast_backup: bool = False


@dataclass(frozen=True, slots=True)
class RoundResult:
    round_id: int
    sequences: list[SequenceDrafts]
    dense_rows: int = 0
    vocab_size: int = 0
    draft_seconds: float = 0.0
    tables: list[OutcomeTable] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelReport:
    target_model: str
    drafters: tuple[Method, ...]
    draft_step_costs: StepCosts | None


@dataclass(frozen=True, slots=True)
class TenantReport:
    tenant: str
    active_sessions: int
    drafted_tokens: int
    accepted_tokens: int


@dataclass(frozen=True, slots=True)
class CapacityReport:
    endpoint_id: str
    max_sessions: int
    active_sessions: int
    draft_busy_ratio: float
    models: tuple[ModelReport, ...]
    tenants: tuple[TenantReport, ...]
    ssd_hit_ratio: float = 0.0
