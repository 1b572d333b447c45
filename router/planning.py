"""How a placed request speculates: draft model (or SSD), n-gram, or not at all.

The target's own hardware-aware policy predicts the speedup of each method at its current batch size
plus this request (its heartbeat carries both figures); the endpoint's registration says whether it
has room. A draft-model plan holds a slot leased atomically in Redis for the request's tenant; when
none is free the request still runs, with n-gram drafting or none, and the reason is counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specpool.common.registry import EndpointRegistration, TargetRegistration
from specpool.v1 import target_pb2 as pb

# Plans, as labelled in metrics and the capacity API, and what the target is asked for.
DRAFT_MODEL, SSD, NGRAM, NONE = "draft_model", "ssd", "ngram", "none"
METHOD = {
    DRAFT_MODEL: pb.SPECULATION_METHOD_DRAFT_MODEL,
    SSD: pb.SPECULATION_METHOD_SSD,
    NGRAM: pb.SPECULATION_METHOD_NGRAM,
    NONE: pb.SPECULATION_METHOD_NONE,
}
REQUESTED_PLAN = {
    pb.SPECULATION_METHOD_DRAFT_MODEL: DRAFT_MODEL,
    pb.SPECULATION_METHOD_SSD: SSD,
    pb.SPECULATION_METHOD_NGRAM: NGRAM,
    pb.SPECULATION_METHOD_NONE: NONE,
}

# Reasons.
REQUESTED = "requested"  # the request named the method and got it
PREDICTED_SPEEDUP = "predicted_speedup"  # the best predicted method (AUTO)
NO_SPEEDUP = "no_speedup"  # nothing predicted to beat plain decoding: declined to speculate
NO_SLOT = "no_slot"  # a draft model was wanted; the tenant's share of the endpoint is used up
NO_ENDPOINT = "no_endpoint"  # a draft model was wanted; the target has no live endpoint drafting its model
ENDPOINT_BUSY = "endpoint_busy"  # AUTO: the endpoint is saturated, a draft model would wait on it
REGISTRY_UNAVAILABLE = "registry_unavailable"  # a draft model was wanted; Redis could not lease a slot


class LeaseUnavailable(Exception):
    """The slot could not be asked for (Redis down); the request runs without one."""


@dataclass(frozen=True, slots=True)
class Decision:
    plan: str
    reason: str
    leased: bool = False  # a draft slot is held for the request and must be released

    @property
    def method(self) -> int:
        return METHOD[self.plan]


def draft_endpoint(target: TargetRegistration,
                   endpoints: list[EndpointRegistration]) -> EndpointRegistration | None:
    """The live endpoint the target drafts on, if it drafts the target's model."""
    if not target.spec_endpoint:
        return None
    for e in endpoints:
        if target.spec_endpoint in (e.address, e.id):
            return e if not e.models or target.model in e.models else None
    return None


def decide(
    requested: int,
    target: TargetRegistration,
    endpoint: EndpointRegistration | None,
    take_slot: Callable[[EndpointRegistration], bool],
    busy_limit: float = 0.95,
) -> Decision:
    """The plan for one request. take_slot leases a draft slot (True) or finds none (False), and
    raises LeaseUnavailable when it cannot tell."""
    speedup_draft, speedup_ngram = target.predicted_speedup_draft, target.predicted_speedup_ngram
    wanted = REQUESTED_PLAN.get(requested)
    if wanted in (NGRAM, NONE):
        return Decision(wanted, REQUESTED)
    if wanted is None:  # AUTO: the best predicted, if it beats plain decoding
        if speedup_draft > speedup_ngram and speedup_draft >= 1.0:
            wanted = SSD if "ssd" in target.methods else DRAFT_MODEL
            if endpoint is not None and _saturated(endpoint, busy_limit):
                return _without_draft(speedup_ngram, ENDPOINT_BUSY)
        elif speedup_ngram >= 1.0:
            return Decision(NGRAM, PREDICTED_SPEEDUP)
        else:
            return Decision(NONE, NO_SPEEDUP)
        granted_reason = PREDICTED_SPEEDUP
    else:
        granted_reason = REQUESTED
    if endpoint is None:
        return _without_draft(speedup_ngram, NO_ENDPOINT)
    try:
        if not take_slot(endpoint):
            return _without_draft(speedup_ngram, NO_SLOT)
    except LeaseUnavailable:
        return _without_draft(speedup_ngram, REGISTRY_UNAVAILABLE)
    return Decision(wanted, granted_reason, leased=True)


def _without_draft(speedup_ngram: float, reason: str) -> Decision:
    return Decision(NGRAM if speedup_ngram >= 1.0 else NONE, reason)


def _saturated(endpoint: EndpointRegistration, busy_limit: float) -> bool:
    full = endpoint.max_sessions > 0 and endpoint.active_sessions >= endpoint.max_sessions
    return full or endpoint.draft_busy_ratio >= busy_limit
