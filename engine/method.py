"""How a request speculates, and the limits every method shares: the engine's own vocabulary, free of
protobuf and of any service (specpool/common/speculation.py maps it to and from the wire's enums).
"""

from __future__ import annotations

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
    def drafts_with_model(self) -> bool:
        return self in (Method.DRAFT_MODEL, Method.SSD, Method.HEAD)
