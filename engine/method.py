"""How a request speculates, and the limits every method shares: the engine's own vocabulary, free of
protobuf and of any service (specpool/common/speculation.py maps it to and from the wire's enums).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

MAX_DRAFT_TOKENS = 32  # per sequence and round
# A target's policy speculates only where the best length is predicted this much faster than plain
# decoding: the cost table is a synthetic forward (no sampling or bookkeeping, uniform contexts), and near
# break-even its error decides. Without a margin a draft model ran 0.97x AR at batch 16 (measured on an
# AVX-512 AMD EPYC only; benchmarks record the margin they ran with). Routers plan a method only past it.
MIN_GAIN = 1.1
# The predicted speedup of a target with no policy to ask (a draft length forced with --draft-tokens, or a
# registration without the figure): no estimate, so routers plan as they would from a bare 1.0, margin aside.
NO_ESTIMATE = 1.0


class Method(StrEnum):
    """How a request speculates. The values label metrics, plans and registrations."""

    NONE = "none"  # plain decoding
    DRAFT_MODEL = "draft_model"  # the endpoint's trained draft model
    NGRAM = "ngram"  # n-gram drafting (SSSD), on the endpoint or the target's own
    SSD = "ssd"  # pre-speculating the likely outcomes while the target verifies (the head's, where one is)
    HEAD = "head"  # the endpoint's feature-fed draft head, fed the target's hidden states

    @property
    def row(self) -> MethodRow:
        return _ROWS[self]


@dataclass(frozen=True, slots=True)
class MethodRow:
    """What every tier knows of a method: how its drafter is built, what it can draft, where it runs, and
    what routers plan and heartbeats carry for it. Adding a method is a row here and a drafter module."""

    method: Method
    # The module of specpool.engine.drafters whose `build(sources)` makes its drafter (None: it drafts nothing).
    # A name, not the function: routers read this table and never load torch.
    drafter: str | None = None
    local: bool = False  # a target drafts it itself, endpoint or none (the method it falls back to)
    leases_slot: bool = False  # drafts with a model on the endpoint: routers lease a slot for it
    reads_features: bool = False  # its endpoint drafter may read the target's hidden states (a head)
    prespeculates: bool = False  # drafts while the target verifies: rounds may resolve from outcome tables
    dense_q: bool = False  # sampled drafts carry a full-vocabulary q (else a sparse one, or none: point masses)
    trees: bool = True  # may draft token trees, not chains only
    max_draft: int = 8  # the longest draft a target's policy chooses for it
    # What a target's policy charges its rounds: "free" (nothing measurable), "model" (the draft model's
    # step costs), "misses" (those, for the rounds whose drafts were not ready).
    charges: str = "free"
    # The registration field of the target's predicted speedup (None: routers never plan it), and whether
    # routers plan it only where the target's heartbeat lists it (registrations before SSD listed none).
    speedup_field: str | None = None
    listed_only: bool = False
    endpoint_cost: int = 0  # ties between equal predicted speedups go to the cheapest for the endpoint
    bench_modes: tuple[str, ...] = ()  # `specpool bench` modes that measure it; the first runs in process
    # The method whose drafter its drafter falls back to (SSD: a miss it would not draft now), built with it.
    backup: Method | None = None


# In the order the endpoint offers them: the first it builds is what a session that names none gets.
METHODS = (
    MethodRow(Method.DRAFT_MODEL, "model", leases_slot=True, dense_q=True, charges="model",
              speedup_field="predicted_speedup_draft", endpoint_cost=1, bench_modes=("sd",)),
    MethodRow(Method.HEAD, "head", leases_slot=True, reads_features=True, dense_q=True, charges="model",
              endpoint_cost=1, bench_modes=("head", "head-tree")),
    # SSD's forks are chains; it runs on the head where the endpoint has one.
    MethodRow(Method.SSD, "ssd", leases_slot=True, reads_features=True, prespeculates=True, trees=False,
              charges="misses", speedup_field="predicted_speedup_ssd", listed_only=True, endpoint_cost=2,
              bench_modes=("ssd", "ssd-shared"), backup=Method.NGRAM),
    MethodRow(Method.NGRAM, "ngram", local=True, max_draft=16, speedup_field="predicted_speedup_ngram",
              bench_modes=("ngram",)),
    MethodRow(Method.NONE),
)
_ROWS = {row.method: row for row in METHODS}
assert set(_ROWS) == set(Method), "every Method has one row"
LOCAL_METHOD = next(row.method for row in METHODS if row.local)
